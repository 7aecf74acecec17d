"""pflkit.cli.options: :func:`many_runs` gives a command the options of :class:`ManyRuns` after its
own parameters, as typer reads them, and gathers them into ``runs`` on the call."""

from __future__ import annotations

import inspect
from pathlib import Path

import typer
from typer.testing import CliRunner

from pflkit.cli.options import DEFAULTS, ManyRuns, many_runs

SEEN: dict = {}


@many_runs
def command(config: str = "c", runs: ManyRuns = DEFAULTS) -> None:
    """A command of many runs."""
    SEEN.update(config=config, runs=runs)


def test_the_options_follow_the_command_s_own_and_are_gathered():
    names = list(inspect.signature(command).parameters)
    assert names == ["config", "out", "quiet", "jobs", "keep_going", "force", "skip_corrupt"]
    assert command.__name__ == "command" and command.__doc__ == "A command of many runs."
    SEEN.clear()
    command(config="x", out=Path("o"), quiet=True, jobs=3, keep_going=True, force=False,
            skip_corrupt=True)  # fmt: skip
    assert SEEN == {"config": "x", "runs": ManyRuns(Path("o"), True, 3, True, False, True)}


def test_typer_reads_each_option_with_its_name_and_default():
    app = typer.Typer()
    app.command()(command)
    SEEN.clear()
    r = CliRunner().invoke(app, ["--config", "y", "--jobs", "2", "--keep-going", "-o", "d"])
    assert r.exit_code == 0, r.output
    assert SEEN == {"config": "y", "runs": ManyRuns(out=Path("d"), jobs=2, keep_going=True)}
    SEEN.clear()
    assert CliRunner().invoke(app, []).exit_code == 0
    assert SEEN["runs"] == DEFAULTS == ManyRuns(None, False, 1, False, False, False)
    assert "--skip-corrupt" in CliRunner().invoke(app, ["--help"]).output
