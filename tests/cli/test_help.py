"""pflkit.cli: every command list (``pflkit --help``, ``pflkit analyze --help``, ...) shows each
command's first docstring paragraph as one paragraph, rewrapped, not broken where the source
breaks its lines."""

from __future__ import annotations

import inspect

import pytest
from typer.testing import CliRunner

from pflkit.cli import app


@pytest.mark.parametrize("group", [[], ["analyze"], ["flower"], ["examples"]])
def test_a_command_list_shows_each_first_paragraph_on_one_line(group):
    groups = {g.name: g.typer_instance for g in app.registered_groups}
    each = groups[group[0]] if group else app
    out = CliRunner().invoke(app, [*group, "--help"], env={"COLUMNS": "600"}).output
    lines = [" ".join(line.strip("│ ").split()) for line in out.splitlines()]
    for info in each.registered_commands:
        first = " ".join(inspect.getdoc(info.callback).split("\n\n")[0].split())
        name = info.name or info.callback.__name__.replace("_", "-")
        assert f"{name} {first}".replace("\\[", "[") in lines, (first, out)
