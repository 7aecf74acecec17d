"""``pflkit report``: the tables, curves and results page of finished runs."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer

from pflkit.cli.common import _usable_path
from pflkit.cli.options import AtOpt, MetricOpt, SelectOpt, SkipCorruptOpt
from pflkit.errors import PflkitError


def report(
    paths: Annotated[
        list[Path] | None,
        typer.Argument(
            help="Run folders, or compare / sweep folders (their plan.json says which runs).",
            show_default=False,
        ),
    ] = None,
    select: SelectOpt = None,
    metric: MetricOpt = None,
    at: AtOpt = None,
    fmt: Annotated[
        str, typer.Option("--format", help="What to print: markdown, csv, latex or json.")
    ] = "markdown",
    out: Annotated[
        Path | None,
        typer.Option(
            "--out",
            "-o",
            help="Also write results.md, .csv, .tex, .json and accuracy.png into this folder.",
        ),
    ] = None,
    overhead: Annotated[
        bool,
        typer.Option(
            "--overhead",
            help="Print each setting's overhead instead: seconds per round of client training, "
            "aggregation and evaluation, training seconds per sample, KB per client per round.",
        ),
    ] = False,
    html_dir: Annotated[
        Path | None,
        typer.Option(
            "--html",
            help="Also write a results page, report.html, into this folder: one "
            "self-contained file (sortable tables per protocol, curves with seeds shaded, "
            "config diff, partition heatmap; docs/report.md).",
        ),
    ] = None,
    skip_corrupt: SkipCorruptOpt = False,
) -> None:
    """Rebuild the tables (markdown, CSV, LaTeX) and curves of finished runs. A compare or
    sweep folder is reported with its own options unless --select, --metric or --at is given."""
    import json

    from pflkit.engine.folder import make_folder
    from pflkit.report.results import make_report

    if not paths:
        raise PflkitError("pflkit report needs run folders or compare / sweep folders")
    if overhead:
        from pflkit.report.overhead import overhead_markdown
        from pflkit.report.results import find_settings

        if fmt != "markdown" or out is not None or select or metric or at or html_dir:
            raise PflkitError(
                "--overhead prints one markdown table: drop --format, --out, --html, "
                "--select, --metric and --at"
            )
        print(overhead_markdown(find_settings(list(paths), skip_corrupt)[0]), end="")
        return
    formats = ("markdown", "csv", "latex", "json")
    if fmt not in formats:
        raise PflkitError(f"unknown --format {fmt!r}: use one of {', '.join(formats)}")
    if html_dir is not None:
        from pflkit.report.page import check_page_folder

        check_page_folder(html_dir)
        _usable_path(html_dir, "results page folder", "--html")
    rep = make_report(*paths, skip_corrupt=skip_corrupt, at=at, metric=metric, select=select)
    text = {
        "markdown": rep.markdown,
        "csv": rep.csv,
        "latex": rep.latex,
        "json": lambda: json.dumps(rep.numbers, indent=2) + "\n",
    }[fmt]()
    if html_dir is not None:
        from pflkit.report.page import write_page

        page = write_page(rep.settings, html_dir, rep.metric)
    if out is not None:
        make_folder(out, "report folder")
        rep.write(out)
    print(text, end="")
    if html_dir is not None:
        print(f"results page: {page}", file=sys.stderr)
