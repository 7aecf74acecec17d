"""The griffe extension of pflkit's API site (mkdocs.yml), and the checks it runs.

pflkit's docstrings cross-reference with Sphinx roles (``:func:`load_config```,
``:class:`~pflkit.algorithms.ClientEnv```). mkdocstrings renders Markdown, so this extension,
run by mkdocstrings when it loads the package:

- turns each role into an autorefs cross-reference to the object's canonical path: a link
  where that object has a page in the site, its name in code font where it has none;
- warns when a role names no object of the package (a renamed or misspelt name): a broken
  cross-reference;
- warns when an object that an API page documents (a ``::: identifier`` line of docs/api/*.md,
  with its public members unless the page says ``members: false``) has no docstring:
  mkdocstrings would leave an undocumented member out of the page silently.

mkdocstrings passes griffe's warnings to mkdocs, and ``mkdocs build --strict`` (``make docs``)
fails on any warning. tests/test_docs.py runs the same checks without building the site.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import griffe

API_PAGES = Path(__file__).resolve().parent / "api"
ROLE = re.compile(r":(?:py:)?(class|func|meth|mod|data|attr|exc|obj):`(~?)([\w.]+)(\(\))?`")
# an API page's `::: identifier` line, and the `members: false` option under it
DIRECTIVE = re.compile(r"^::: ([\w.]+)\s*\n((?:[ \t]+.*\n?)*)", re.MULTILINE)


def _walk(obj: griffe.Object) -> Iterator[griffe.Object]:
    """``obj`` and every object defined under it (aliases, i.e. imports, left out)."""
    yield obj
    for member in obj.members.values():
        if not member.is_alias:
            yield from _walk(member)


def lookup(pkg: griffe.Module, path: str) -> griffe.Object | None:
    """The object at the absolute dotted ``path`` inside ``pkg`` (an import followed to what
    it imports), or None."""
    if path == pkg.path:
        return pkg
    if not path.startswith(pkg.path + "."):
        return None
    try:
        found = pkg[path[len(pkg.path) + 1 :]]
        return found.final_target if found.is_alias else found
    except (KeyError, griffe.AliasResolutionError, griffe.CyclicAliasError):
        return None


def resolve_role(pkg: griffe.Module, where: griffe.Object, target: str) -> str | None:
    """The path a role's ``target`` names when written in the docstring of ``where``: an
    absolute path, or a name seen from ``where`` (its members, its class, its module, as
    Sphinx reads it) followed by more dotted parts. Inside the package it is the object's
    canonical path, or None when the package has no such object; a name of another package
    (``torch.nn.Module``, or ``nn.Module`` where ``nn`` is imported) is returned as written."""
    if target == pkg.path or target.startswith(pkg.path + "."):
        found = lookup(pkg, target)
        return None if found is None else found.canonical_path
    head, _, rest = target.partition(".")
    try:
        base = where.resolve(head)
    except (griffe.NameResolutionError, KeyError):
        return target if rest else None  # a dotted name of another package, or nothing
    path = base + ("." + rest if rest else "")
    return resolve_role(pkg, where, path) if base.startswith(pkg.path + ".") else path


def convert_roles(pkg: griffe.Module, where: griffe.Object, text: str) -> tuple[str, list[str]]:
    """``text`` with each role naming an object of the package turned into an optional
    autorefs reference (a link where the object has a page), a role naming another package's
    object into code font, and the roles that name nothing (in code font, and listed)."""
    broken: list[str] = []

    def replace(m: re.Match[str]) -> str:
        _kind, short, target, call = m.groups()
        shown = (target.rsplit(".", 1)[-1] if short else target) + (call or "")
        path = resolve_role(pkg, where, target)
        if path is None:
            broken.append(m.group(0))
        if path is None or not path.startswith(pkg.path):
            return f"`{shown}`"
        return f'<autoref identifier="{path}" optional><code>{shown}</code></autoref>'

    text = ROLE.sub(replace, text)
    text = re.sub(r"(\S)::$", r"\1:", text, flags=re.MULTILINE)  # reST literal-block marker
    return text, broken


def documented(pages: Path = API_PAGES) -> list[tuple[str, bool]]:
    """Each ``::: identifier`` of the API pages, with whether its members are shown."""
    out = []
    for page in sorted(pages.glob("*.md")):
        for m in DIRECTIVE.finditer(page.read_text(encoding="utf-8")):
            out.append((m.group(1), not re.search(r"members:\s*false", m.group(2))))
    return out


def _public_members(obj: griffe.Object) -> Iterator[griffe.Object]:
    """The members mkdocstrings shows by default: for a module, its public names (its
    ``__all__`` when it has one); for a class, its own names without a leading underscore."""
    for name, member in obj.members.items():
        if obj.is_module and not member.is_public:
            continue
        if obj.is_class and (name.startswith("_") or member.is_alias):
            continue
        yield member.final_target if member.is_alias else member


def missing_docstrings(pkg: griffe.Module, pages: Path = API_PAGES) -> list[str]:
    """The API pages' objects (and their public members) without a docstring, and the
    ``::: identifier`` lines that name no object of the package."""
    problems = []
    for ident, with_members in documented(pages):
        obj = lookup(pkg, ident)
        if obj is None:
            if ident.split(".")[0] == pkg.path:
                problems.append(f"{ident} (named on an API page): no such object")
            continue
        todo = [obj]
        if with_members and (obj.is_class or obj.is_module):
            todo += list(_public_members(obj))
        problems += [
            f"{o.path}: no docstring"
            for o in todo
            if not (o.docstring and o.docstring.value.strip())
        ]
    return problems


class PflkitDocs(griffe.Extension):
    """Converts the package's roles to cross-references and warns about broken ones and about
    documented objects without a docstring (module docstring above)."""

    def on_package(self, *, pkg: griffe.Module, loader: Any, **kwargs: Any) -> None:
        if pkg.path != "pflkit":
            return
        for obj in _walk(pkg):
            if obj.docstring is None:
                continue
            obj.docstring.value, broken = convert_roles(pkg, obj, obj.docstring.value)
            for role in broken:
                griffe.logger.warning(f"{obj.path}: {role} names no object of pflkit")
        for problem in missing_docstrings(pkg):
            griffe.logger.warning(problem)
