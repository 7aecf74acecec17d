"""The import structure of src/pflkit: no import cycles, and the layers depend one way only.

The graph is read from the source with ``ast``: every ``import`` and ``from ... import`` in a
module, at module level or inside a function, except those under ``if TYPE_CHECKING:`` (they
never run). ``from pkg import name`` counts as an import of ``pkg.name`` when that is a module;
importing ``pkg.mod`` does not count as importing ``pkg`` (whose ``__init__`` Python runs first).
"""

from __future__ import annotations

import ast
import sys
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

# modules that may import, at run time, only the standard library and what is listed: the
# schema loads anywhere (a Flower node, a worker, the docs build) without torch and computes
# nothing at run time, so it stands on pydantic and yaml (ExperimentConfig.to_yaml) and on
# errors (its one sentence) and strict (the base of its sections) alone; reading a config's
# text stands on the schema's parse_size; the device check on errors and torch
ONLY_IMPORTS = {
    "pflkit.config": ("pydantic", "yaml", "pflkit.errors", "pflkit.strict"),
    "pflkit.config_io": ("yaml", "pflkit.config", "pflkit.errors"),
    "pflkit.devices": ("torch", "pflkit.errors"),
    "pflkit.errors": (),
    "pflkit.strict": ("pydantic",),
}

# the command line is the top: no module outside it imports one of its modules, but the
# console script (pflkit.__main__) its package; inside it, a command module imports no other
# command module (what they share is in common and options), and the package (__init__, which
# builds the app from them) is imported by none of them
CLI = "pflkit.cli"
CLI_ENTRY = {"pflkit.__main__": CLI, "pflkit.cli.__main__": CLI}
CLI_SHARED = ("pflkit.cli.common", "pflkit.cli.options")


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


def imported_names(path: Path, here: str) -> set[str]:
    """Every name the module at ``path`` imports at run time, absolute (``yaml``,
    ``pflkit.errors``; a relative import is resolved against ``here``, its package)."""
    names = set()
    for node in _run_time_imports(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif node.level:
            base = here.split(".")[: len(here.split(".")) - node.level + 1]
            names.add(".".join([*base, node.module] if node.module else base))
        elif node.module != "__future__":
            names.add(node.module or "")
    return names


def only_imports(src: Path, allowed: Mapping[str, tuple[str, ...]]) -> list[tuple[str, str]]:
    """``(module, name)`` for every run-time import of a module of ``allowed`` that is neither
    the standard library nor under one of its listed names."""

    def under(name: str, prefix: str) -> bool:
        return name == prefix or name.startswith(prefix + ".")

    found = []
    for module, ok in allowed.items():
        path = src.joinpath(*module.split("."))
        package = path.is_dir()
        path = path / "__init__.py" if package else path.with_suffix(".py")
        for name in imported_names(path, module if package else module.rpartition(".")[0]):
            std = name.split(".")[0] in sys.stdlib_module_names
            if not std and not any(under(name, p) for p in ok):
                found.append((module, name))
    return sorted(found)


def cli_violations(
    graph: Mapping[str, set[str]],
    cli: str = CLI,
    entry: Mapping[str, str] = CLI_ENTRY,
    shared: tuple[str, ...] = CLI_SHARED,
) -> list[tuple[str, str]]:
    """``(module, imported module)`` for every import against the command line's place (see
    :data:`CLI`): into it from outside but by its entry points, from a command module into
    another, and from a command or shared module into its package."""

    def inside(m: str) -> bool:
        return m == cli or m.startswith(cli + ".")

    found = []
    for m, targets in graph.items():
        for t in sorted(targets):
            if not inside(t) or entry.get(m) == t:
                continue
            if not inside(m) or (m != cli and (t == cli or t not in shared)):
                found.append((m, t))
    return sorted(found)


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


def test_the_schema_and_the_bottom_modules_import_only_what_they_list():
    found = only_imports(SRC, ONLY_IMPORTS)
    assert not found, "imports past the list: " + ", ".join(f"{m} -> {t}" for m, t in found)


def test_the_command_line_is_the_top_and_its_commands_import_no_other():
    graph = import_graph(SRC, "pflkit")
    assert {"pflkit.cli.run", "pflkit.cli.flower"} <= graph["pflkit.cli"]  # it sees them
    found = cli_violations(graph)
    assert not found, "imports against the command line's place: " + ", ".join(
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


def test_an_import_past_the_list_is_named(tmp_path):
    files = {
        "errors.py": "",
        "config.py": "import re\nimport pydantic.fields\nfrom .errors import E\n",
        "io.py": "from fake.config import x\nimport torch\n",
    }
    _fake(tmp_path, files)
    allowed = {"fake.config": ("pydantic", "fake.errors"), "fake.io": ("fake.config",)}
    assert only_imports(tmp_path, allowed) == [("fake.io", "torch")]
    assert only_imports(tmp_path, {"fake.config": ("pydantic",)}) == [
        ("fake.config", "fake.errors")
    ]
    never = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import torch\n"
    (tmp_path / "fake" / "config.py").write_text(never)
    assert only_imports(tmp_path, {"fake.config": ()}) == []  # what never runs does not count


def test_an_import_against_the_command_line_is_named():
    graph = {
        "p.__main__": {"p.cli"},  # the entry point: allowed
        "p.cli": {"p.cli.run", "p.cli.common"},  # the app from its commands: allowed
        "p.cli.run": {"p.cli.common", "p.cli.options", "p.engine"},
        "p.cli.sweep": {"p.cli.compare", "p.cli"},  # another command, and the package
        "p.cli.common": {"p.cli.options"},
        "p.engine": {"p.cli.run"},  # the engine into a command
        "p.report": {"p.cli.common"},  # anything outside into a shared module
    }
    shared = ("p.cli.common", "p.cli.options")
    found = cli_violations(graph, "p.cli", {"p.__main__": "p.cli"}, shared)
    assert found == [
        ("p.cli.sweep", "p.cli"),
        ("p.cli.sweep", "p.cli.compare"),
        ("p.engine", "p.cli.run"),
        ("p.report", "p.cli.common"),
    ]
