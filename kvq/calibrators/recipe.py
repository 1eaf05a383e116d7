"""Recipe files: a chain of calibration passes, in the spirit of llm-compressor recipes.

    # kvq recipe: passes run in order, each on the model as the ones before left it
    model: gemma3-270m
    dataset: ../shared/data/calibration/groups_merged.txt
    samples: 16
    seqlen: 512
    passes:
      - smoothattention: {alpha: 0.5}
      - channel-scales: {bits: 4, key_stage: post-rope}

Every key but `passes` is optional (the command line's --model, --dataset... override
them); a pass's options are its options dataclass's fields, by name. Read with a
bounded `yaml.SafeLoader` (no tags, no code, no alias bombs) and checked field by field,
no torch needed.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvq.calibrators.registry import PASSES
from kvq.errors import KvqError, shown

SETTINGS = {"model": str, "dataset": str, "samples": int, "seqlen": int, "seed": int}
_MAX_BYTES = 1 << 20
# a recipe is a few dozen nodes; aliases may not expand it past these (billion laughs)
_MAX_NODES = 10_000
_MAX_DEPTH = 64


class _TooLarge(Exception):
    pass


_DEEP = f"nested more than {_MAX_DEPTH} levels deep once its aliases are expanded"
_BIG = f"more than {_MAX_NODES} values once its aliases are expanded"


def _loader():
    """yaml.SafeLoader that refuses, before constructing anything, a document nested more
    than _MAX_DEPTH deep or larger than _MAX_NODES nodes once its aliases are expanded."""
    import yaml

    class Loader(yaml.SafeLoader):
        depth = nodes = 0

        def compose_node(self, parent, index):
            # the composer recurses per level: bound it before Python's stack does
            self.depth += 1
            self.nodes += 1
            try:
                if self.depth > _MAX_DEPTH:
                    raise _TooLarge(_DEEP)
                if self.nodes > _MAX_NODES:
                    raise _TooLarge(_BIG)
                return super().compose_node(parent, index)
            finally:
                self.depth -= 1

        def construct_document(self, node):
            _expanded(node, 0, {})
            return super().construct_document(node)

    return Loader


def _expanded(node, depth: int, seen: dict) -> tuple[int, int]:
    """(nodes, height) of `node` with every alias expanded; an alias is a shared node, so
    each is measured once (seen), and a recursive one exceeds the depth."""
    import yaml

    if id(node) in seen:
        size, height = seen[id(node)]
    else:
        if depth > _MAX_DEPTH:
            raise _TooLarge(_DEEP)  # a recursive alias ends here too
        size, height = 1, 0
        if isinstance(node, yaml.MappingNode):
            children = [n for pair in node.value for n in pair]
        else:
            children = node.value if isinstance(node, yaml.SequenceNode) else []
        for child in children:
            n, h = _expanded(child, depth + 1, seen)
            size, height = size + n, max(height, h + 1)
            if size > _MAX_NODES:
                raise _TooLarge(_BIG)
        seen[id(node)] = size, height
    if depth + height > _MAX_DEPTH:
        raise _TooLarge(_DEEP)
    return size, height


@dataclass(frozen=True)
class Recipe:
    settings: dict[str, Any]  # the keys of SETTINGS the file gives
    passes: list[tuple[str, dict[str, Any]]]  # (pass name, its options as written)


def read_recipe(path: Path) -> Recipe:
    import yaml

    path = Path(path)
    if not path.is_file():
        raise KvqError(f"recipe {path} does not exist")
    if path.stat().st_size > _MAX_BYTES:
        raise KvqError(f"recipe {path} is larger than {_MAX_BYTES} bytes")
    try:
        doc = yaml.load(path.read_text(encoding="utf-8"), Loader=_loader())
    except _TooLarge as e:
        raise KvqError(f"recipe {path}: {e}") from None
    # ValueError: a value the constructors cannot build (an int of 5000 digits, a 13th month)
    except (yaml.YAMLError, UnicodeDecodeError, RecursionError, ValueError) as e:
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise KvqError(f"recipe {path}: not a YAML document ({reason[:200]})") from None
    where = f"recipe {path.name}"
    if not isinstance(doc, dict):
        raise KvqError(f"{where}: expected a mapping with a 'passes' list")
    unknown = sorted(set(doc) - {*SETTINGS, "passes"}, key=str)
    if unknown:
        known = ", ".join([*SETTINGS, "passes"])
        raise KvqError(f"{where}: unknown key {shown(unknown[0])} (known: {known})")
    settings = {}
    for key, tp in SETTINGS.items():
        if key in doc:
            if type(doc[key]) is not tp:
                raise KvqError(f"{where}: {key} must be a {tp.__name__}, got {shown(doc[key])}")
            settings[key] = doc[key]
    items = doc.get("passes")
    if not isinstance(items, list) or not items:
        raise KvqError(f"{where}: 'passes' must be a non-empty list")
    return Recipe(settings, [_pass(item, i, where) for i, item in enumerate(items)])


def _pass(item: Any, i: int, where: str) -> tuple[str, dict[str, Any]]:
    if isinstance(item, str):
        name, values = item, {}
    elif isinstance(item, dict) and len(item) == 1:
        name, values = next(iter(item.items()))
        values = {} if values is None else values
    else:
        raise KvqError(f"{where}: passes[{i}] must be a pass name or {{name: {{options}}}}")
    if name not in PASSES:
        raise KvqError(
            f"{where}: passes[{i}]: unknown pass {shown(name)}; known: {', '.join(PASSES)}"
        )
    if not isinstance(values, dict):
        raise KvqError(f"{where}: passes[{i}] ({name}): options must be a mapping")
    return name, values
