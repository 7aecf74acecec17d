"""The API site's checks (docs/griffe_pflkit.py), run without building the site: every role in
a docstring names an object of pflkit, and every object an API page documents has a
docstring. ``make docs`` runs the same checks inside ``mkdocs build --strict``."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

griffe = pytest.importorskip("griffe")
ROOT = Path(__file__).resolve().parents[1]


def _extension():
    spec = importlib.util.spec_from_file_location("griffe_pflkit", ROOT / "docs/griffe_pflkit.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


ext = _extension()


@pytest.fixture(scope="module")
def pkg():
    return griffe.load("pflkit", search_paths=[str(ROOT / "src")], try_relative_path=False)


def test_every_role_names_an_object(pkg):
    broken = []
    for obj in ext._walk(pkg):
        if obj.docstring is not None:
            _, bad = ext.convert_roles(pkg, obj, obj.docstring.value)
            broken += [f"{obj.path}: {role}" for role in bad]
    assert broken == []


def test_every_documented_object_has_a_docstring(pkg):
    assert ext.missing_docstrings(pkg) == []
    # the pages do document the public API the brief names
    names = {ident for ident, _ in ext.documented()}
    assert {
        "pflkit.experiment.load_config",
        "pflkit.engine.runner.run_experiment",
        "pflkit.engine.compare.run_compare",
        "pflkit.algorithms.base.Algorithm",
        "pflkit.algorithms.context.RoundContext",
        "pflkit.registry.Registry",
        "pflkit.plugins",
        "pflkit.testing",
    } <= names


def _toy(tmp_path: Path, source: str) -> griffe.Module:
    (tmp_path / "toy").mkdir()
    (tmp_path / "toy" / "__init__.py").write_text(source)
    return griffe.load("toy", search_paths=[str(tmp_path)], try_relative_path=False)


def test_roles_resolve_like_sphinx_and_broken_ones_are_listed(tmp_path):
    toy = _toy(
        tmp_path,
        '"""Module."""\nimport torch\n\n'
        "class A:\n"
        '    """See :meth:`run`, :func:`helper`, :class:`~toy.A`, :class:`torch.nn.Module` '
        'and :func:`gone`."""\n'
        '    def run(self):\n        """Run."""\n\n'
        'def helper():\n    """Help."""\n',
    )
    text, broken = ext.convert_roles(toy, toy["A"], toy["A"].docstring.value)
    assert '<autoref identifier="toy.A.run" optional><code>run</code></autoref>' in text
    assert '<autoref identifier="toy.helper" optional><code>helper</code></autoref>' in text
    assert '<autoref identifier="toy.A" optional><code>A</code></autoref>' in text
    assert "`torch.nn.Module`" in text  # another package: code font, not a broken reference
    assert broken == [":func:`gone`"]


def test_a_missing_docstring_and_an_unknown_page_name_are_found(tmp_path):
    toy = _toy(
        tmp_path,
        '"""Module."""\n\nclass A:\n    """A."""\n    def ok(self):\n        """Ok."""\n'
        "    def bare(self):\n        pass\n    def _private(self):\n        pass\n\n"
        "def lonely():\n    pass\n",
    )
    pages = tmp_path / "api"
    pages.mkdir()
    (pages / "a.md").write_text(
        "# A\n\n::: toy.A\n\n::: toy.lonely\n    options:\n      members: false\n\n::: toy.nope\n"
    )
    assert ext.missing_docstrings(toy, pages) == [
        "toy.A.bare: no docstring",
        "toy.lonely: no docstring",
        "toy.nope (named on an API page): no such object",
    ]
