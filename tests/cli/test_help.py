"""pflkit.cli's help: every command list (``pflkit --help``, ``pflkit analyze --help``, ...)
shows each command's first docstring paragraph as one paragraph, rewrapped, not broken where the
source breaks its lines; every command's help shows what its arguments are."""

from __future__ import annotations

import inspect

import pytest
from typer.testing import CliRunner

from pflkit.cli import app
from pflkit.cli.options import ConfigArg


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


@pytest.mark.parametrize(
    ("command", "says"),
    [
        (["run"], ConfigArg.__metadata__[0].help),
        (["compare"], ConfigArg.__metadata__[0].help),
        (["analyze", "privacy"], ConfigArg.__metadata__[0].help),
        (["flower", "local"], ConfigArg.__metadata__[0].help),
        (["report"], "Run folders, or compare / sweep folders"),
        (["examples", "copy"], "The example's name"),
    ],
)
def test_a_command_s_help_says_what_its_arguments_are(command, says):
    """flwr 1.41 holds typer below 0.21, whose help drops argument texts under click 8.5
    (pyproject.toml pins click below it)."""
    out = CliRunner().invoke(app, [*command, "--help"], env={"COLUMNS": "600"}).output
    assert says in " ".join(out.replace("│", " ").split()), out
