"""The import structure of src/pflkit: no import cycles, and the layers depend one way only.

The graph is read from the source with ``ast``: every ``import`` and ``from ... import`` in a
module, at module level or inside a function, except those under ``if TYPE_CHECKING:`` (they
never run). ``from pkg import name`` counts as an import of ``pkg.name`` when that is a module;
importing ``pkg.mod`` does not count as importing ``pkg`` (whose ``__init__`` Python runs first).
"""

from __future__ import annotations

import ast
from collections.abc import Iterator, Mapping
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
TYPE_CHECKING = ("TYPE_CHECKING", "typing.TYPE_CHECKING")  # imports under these never run

# cycles that may remain; each says what removes it
ALLOWED_CYCLES: list[set[str]] = []  # none: keep it so

# a module under a key may not import, at run time, any module under the listed packages
FORBIDDEN = {
    "pflkit.config": ("pflkit.algorithms", "pflkit.plugins", "pflkit.engine"),
    "pflkit.algorithms": ("pflkit.engine", "pflkit.cli"),
    "pflkit.models": ("pflkit.algorithms", "pflkit.engine"),
    "pflkit.data": ("pflkit.algorithms", "pflkit.engine"),
    # the contract stands on the primitives, the building blocks stand on the contract
    "pflkit.algorithms.base": ("pflkit.algorithms.blocks",),
    "pflkit.algorithms.env": ("pflkit.algorithms.blocks",),
    "pflkit.algorithms.context": ("pflkit.algorithms.blocks",),
    "pflkit.algorithms.records": ("pflkit.algorithms.blocks",),
}
# packages that import nothing of pflkit's but themselves: the bottom layer
SELF_CONTAINED = ("pflkit.primitives",)


def module_names(src: Path, package: str) -> dict[str, Path]:
    """Every module of ``package`` under ``src`` by dotted name (a package by its own name)."""
    names = {}
    for path in sorted((src / package).rglob("*.py")):
        parts = path.relative_to(src).with_suffix("").parts
        names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return names


def _run_time_imports(tree: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and ast.unparse(node.test) in TYPE_CHECKING:
            stack.extend(node.orelse)
        elif isinstance(node, ast.Import | ast.ImportFrom):
            yield node
        else:
            stack.extend(ast.iter_child_nodes(node))


def import_graph(src: Path, package: str) -> dict[str, set[str]]:
    """Module name -> the modules of ``package`` it imports at run time."""
    modules = module_names(src, package)
    graph = {}
    for name, path in modules.items():
        here = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets = set()
        for node in _run_time_imports(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                targets |= {a.name for a in node.names}
                continue
            base = node.module or ""
            if node.level:
                parent = here.split(".")[: len(here.split(".")) - node.level + 1]
                base = ".".join([*parent, base] if base else parent)
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                targets.add(sub if sub in modules else base)
        graph[name] = {t for t in targets if t in modules and t != name}
    return graph


def cycles(graph: Mapping[str, set[str]]) -> list[set[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = {stack.pop()}
            while v not in component:
                component.add(stack.pop())
            if len(component) > 1:
                found.append(component)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def violations(
    graph: Mapping[str, set[str]], forbidden: Mapping[str, tuple[str, ...]]
) -> list[tuple[str, str]]:
    """``(module, imported module)`` for every import ``forbidden`` rules out."""

    def under(module: str, package: str) -> bool:
        return module == package or module.startswith(package + ".")

    return sorted(
        (m, t)
        for m, targets in graph.items()
        for t in targets
        for layer, banned in forbidden.items()
        if under(m, layer) and any(under(t, b) for b in banned)
    )


# -- pflkit ----------------------------------------------------------------------------------


def test_no_import_cycles_but_the_allowed_one():
    found = [c for c in cycles(import_graph(SRC, "pflkit")) if c not in ALLOWED_CYCLES]
    assert not found, "import cycles: " + "; ".join(" <-> ".join(sorted(c)) for c in found)


def test_layers_depend_one_way():
    found = violations(import_graph(SRC, "pflkit"), FORBIDDEN)
    assert not found, "imports against the layering: " + ", ".join(f"{m} -> {t}" for m, t in found)


def test_the_primitives_import_only_themselves():
    graph = import_graph(SRC, "pflkit")
    found = [
        (m, t)
        for m, targets in graph.items()
        for t in targets
        for bottom in SELF_CONTAINED
        if m.startswith(bottom) and not t.startswith(bottom)
    ]
    assert not found, "a primitive imports above itself: " + ", ".join(
        f"{m} -> {t}" for m, t in found
    )


def test_the_graph_sees_the_known_imports():
    graph = import_graph(SRC, "pflkit")
    assert "pflkit.algorithms.base" in graph["pflkit.plugins"]  # from ... import name
    assert "pflkit.data.download" in graph["pflkit.data.sources.idx"]  # from package import module
    assert "pflkit.engine.simulation" in graph["pflkit.engine"]


# -- the checks themselves, on a fake package ----------------------------------------------------


def _fake(tmp_path: Path, files: dict[str, str]) -> dict[str, set[str]]:
    for name, text in {"__init__.py": "", **files}.items():
        (tmp_path / "fake" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "fake" / name).write_text(text)
    return import_graph(tmp_path, "fake")


def test_an_import_added_inside_a_function_closes_a_cycle(tmp_path):
    a = "from fake.b import g\n"
    acyclic = _fake(tmp_path, {"a.py": a, "b.py": "def g():\n    return 1\n"})
    assert acyclic == {"fake": set(), "fake.a": {"fake.b"}, "fake.b": set()}
    assert cycles(acyclic) == []

    cyclic = _fake(tmp_path, {"a.py": a, "b.py": "def g():\n    from . import a\n"})
    assert cycles(cyclic) == [{"fake.a", "fake.b"}]


def test_type_checking_imports_do_not_count(tmp_path):
    b = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from fake import a\n"
    graph = _fake(tmp_path, {"a.py": "import fake.b\n", "b.py": b})
    assert graph["fake.b"] == set() and cycles(graph) == []


def test_an_import_against_the_layers_is_named():
    graph = {"p.low.x": {"p.high.y", "p.low.z"}, "p.high.y": {"p.low.x"}, "p.highest": set()}
    assert violations(graph, {"p.low": ("p.high",)}) == [("p.low.x", "p.high.y")]
    assert violations(graph, {"p.low": ("p.highest",)}) == []
