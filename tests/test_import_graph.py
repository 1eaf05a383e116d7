"""kvq's modules import each other without circles, lazy (function-level) imports included:
a reader can follow the layers from the bottom up, and a new format is one new module."""

import ast
from pathlib import Path

import kvq

ROOT = Path(kvq.__file__).parent


def _modules() -> dict[str, Path]:
    out = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def _type_checking_only(node: ast.AST) -> bool:
    test = getattr(node, "test", None)
    return isinstance(node, ast.If) and getattr(test, "id", getattr(test, "attr", "")) == (
        "TYPE_CHECKING"
    )


def _imported(tree: ast.AST) -> list[str]:
    """Every absolute module name imported anywhere in `tree` (a `from m import x` yields m
    and m.x: x may be a submodule), outside `if TYPE_CHECKING:` blocks."""
    names, todo = [], [tree]
    while todo:
        node = todo.pop()
        if _type_checking_only(node):
            continue
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names += [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        todo.extend(ast.iter_child_nodes(node))
    return names


def import_graph() -> dict[str, set[str]]:
    """kvq module -> the kvq modules it imports (a package's own __init__ left out: Python
    runs it before any of its modules, whoever imports them)."""
    modules = _modules()

    def resolve(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph = {}
    for name, path in modules.items():
        targets = {
            resolve(t) for t in _imported(ast.parse(path.read_text())) if t.startswith("kvq")
        }
        graph[name] = {t for t in targets if t and t != name and not name.startswith(t + ".")}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_kvq_has_no_import_cycles():
    assert cycles(import_graph()) == []


def test_the_cycle_finder_sees_a_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c"]]


def test_codecs_are_found_by_format_not_imported_by_the_cache():
    """make_codec looks formats up (`FORMATS`): the package imports no format module."""
    graph = import_graph()
    formats = {f"kvq.runtime.codecs.{m}" for m in ("integer", "fp8", "nuq", "vq", "trellis")}
    assert not graph["kvq.runtime.codecs"] & formats
    assert not graph["kvq.runtime.cache"] & formats
    assert "kvq.api" not in graph["kvq.runtime.cache"]
