"""The ``pflkit`` command line: run, compare, sweep, report, partition, export, analyze, list,
examples, flower.

This module builds the typer app from the command modules of this package, one per command or
command group (:mod:`~pflkit.cli.run`, :mod:`~pflkit.cli.compare`, :mod:`~pflkit.cli.sweep`,
:mod:`~pflkit.cli.report`, :mod:`~pflkit.cli.partition`, :mod:`~pflkit.cli.analyze`,
:mod:`~pflkit.cli.catalog`, :mod:`~pflkit.cli.flower`), and holds the console script's entry
point, :func:`main`. The commands know no app; what they share is in :mod:`~pflkit.cli.common`
and :mod:`~pflkit.cli.options`. User mistakes (:class:`~pflkit.errors.PflkitError`) print one
sentence and exit with code 2.
"""

from __future__ import annotations

import inspect
from typing import Annotated

import typer

from pflkit.cli import analyze, catalog, compare, flower, partition, report, run, sweep
from pflkit.cli.common import run_app

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    help="pflkit: personalized federated learning experiments.",
    pretty_exceptions_enable=False,
)


def _version(value: bool) -> None:
    if value:
        from pflkit import __version__

        print(f"pflkit {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[
        bool,
        typer.Option(
            "--version", callback=_version, is_eager=True, help="Print the version and exit."
        ),
    ] = False,
) -> None:
    """pflkit: personalized federated learning experiments."""


# in the order `pflkit --help` lists them
app.command()(run.run)
app.command()(compare.compare)
app.command()(sweep.sweep)
app.command()(report.report)
app.command()(partition.partition)
app.command(name="export")(partition.export_)
app.add_typer(analyze.analyze, name="analyze")
app.command(name="list")(catalog.list_)
app.add_typer(catalog.examples, name="examples")
app.add_typer(flower.flower, name="flower")


def _listed_in_one_paragraph(*apps: typer.Typer) -> None:
    """A command list shows each command's first paragraph with the docstring's line breaks
    (typer's rich help keeps them): list it as one paragraph, rewrapped to the terminal."""
    for each in apps:
        for info in each.registered_commands:
            doc = info.help or inspect.getdoc(info.callback) or ""
            info.short_help = info.short_help or " ".join(doc.split("\n\n")[0].split())


_listed_in_one_paragraph(app, analyze.analyze, catalog.examples, flower.flower)


def main() -> None:
    """The console script ``pflkit`` (and ``python -m pflkit.cli``): :func:`run_app` on the app."""
    run_app(app)
