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
them); a pass's options are its options dataclass's fields, by name. Read with
`yaml.safe_load` (no tags, no code) and checked field by field, no torch needed.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvq.calibrators.registry import PASSES
from kvq.errors import KvqError

SETTINGS = {"model": str, "dataset": str, "samples": int, "seqlen": int, "seed": int}
_MAX_BYTES = 1 << 20


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
        doc = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (yaml.YAMLError, UnicodeDecodeError, RecursionError) as e:
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise KvqError(f"recipe {path}: not a YAML document ({reason})") from None
    where = f"recipe {path.name}"
    if not isinstance(doc, dict):
        raise KvqError(f"{where}: expected a mapping with a 'passes' list")
    unknown = sorted(set(doc) - {*SETTINGS, "passes"}, key=str)
    if unknown:
        known = ", ".join([*SETTINGS, "passes"])
        raise KvqError(f"{where}: unknown key {unknown[0]!r} (known: {known})")
    settings = {}
    for key, tp in SETTINGS.items():
        if key in doc:
            if type(doc[key]) is not tp:
                raise KvqError(f"{where}: {key} must be a {tp.__name__}, got {doc[key]!r}")
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
        raise KvqError(f"{where}: passes[{i}]: unknown pass {name!r}; known: {', '.join(PASSES)}")
    if not isinstance(values, dict):
        raise KvqError(f"{where}: passes[{i}] ({name}): options must be a mapping")
    return name, values
