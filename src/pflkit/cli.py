"""The ``pflkit`` command line: run, compare, partition, list.

User mistakes (:class:`~pflkit.errors.PflkitError`) print one sentence and exit with code 2.
"""

from __future__ import annotations

import sys
from datetime import datetime
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from pflkit.config import load_config
from pflkit.errors import PflkitError

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    help="pflkit: personalized federated learning experiments.",
    pretty_exceptions_enable=False,
)
out_console = Console()

ConfigArg = Annotated[
    Path | None, typer.Argument(help="Experiment config (YAML).", show_default=False)
]
SetOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--set", "-s", help="Override a config key, e.g. --set train.rounds=5 (repeatable)."
    ),
]
OutOpt = Annotated[Path | None, typer.Option("--out", "-o", help="Output folder.")]
QuietOpt = Annotated[bool, typer.Option("--quiet", "-q", help="No progress display.")]


@app.command()
def run(
    config: ConfigArg = None,
    set_: SetOpt = None,
    out: OutOpt = None,
    resume: Annotated[
        Path | None, typer.Option(help="Continue the run in this folder from its last checkpoint.")
    ] = None,
    quiet: QuietOpt = False,
) -> None:
    """Run one experiment into a run folder (config, metrics.jsonl, summary.json, plots)."""
    from pflkit.engine.runner import run_experiment

    if resume is not None:
        if config is not None or out is not None:
            raise PflkitError(
                "--resume takes the config from the run folder: drop CONFIG and --out"
            )
        res = run_experiment(resume=resume, overrides=set_ or [], progress=False if quiet else None)
    else:
        cfg = load_config(config, set_ or [])
        res = run_experiment(cfg, out=out, progress=False if quiet else None)
    final = res.summary.get("final", {})
    shown = ", ".join(f"{k} {100 * v:.2f}%" for k, v in final.items() if k != "round")
    out_console.print(f"run folder: {res.run_dir}\nlast round ({final.get('round')}): {shown}")


@app.command()
def compare(
    config: ConfigArg = None,
    set_: SetOpt = None,
    algorithms: Annotated[
        str | None,
        typer.Option(
            help="Comma-separated algorithm names (default: config's compare.algorithms)."
        ),
    ] = None,
    seeds: Annotated[
        str | None, typer.Option(help="Comma-separated training seeds, e.g. 0,1,2.")
    ] = None,
    out: OutOpt = None,
    quiet: QuietOpt = False,
) -> None:
    """Compare algorithms on one partition over several seeds: markdown table + curves."""
    from pflkit.engine.compare import run_compare

    overrides = list(set_ or [])
    if algorithms:
        overrides.append(f"compare.algorithms=[{algorithms}]")
    if seeds:
        overrides.append(f"compare.seeds=[{seeds}]")
    cfg = load_config(config, overrides)
    if out is None:
        out = Path(cfg.output.dir) / f"compare-{cfg.name}-{datetime.now():%Y%m%d-%H%M%S}"
    res = run_compare(cfg, out, progress=False if quiet else None)
    print(res["table"])
    out_console.print(f"written to {res['out']}")


@app.command()
def partition(
    config: ConfigArg = None,
    set_: SetOpt = None,
    out: Annotated[
        Path | None,
        typer.Option("--out", "-o", help="PNG heatmap path (default: partition-<id>.png)."),
    ] = None,
) -> None:
    """Show a partition: per-client class counts (table) and a PNG heatmap."""
    from rich.table import Table

    from pflkit.data.federated import build_federated
    from pflkit.report.plots import plot_class_heatmap

    cfg = load_config(config, set_ or [])
    data = build_federated(cfg.data)
    table = data.class_table("train") + data.class_table("test")
    t = Table(title=f"{cfg.data.dataset} {cfg.data.partition} (id {data.partition_id})")
    t.add_column("client", justify="right")
    for c in range(data.num_classes):
        t.add_column(str(c), justify="right")
    t.add_column("train", justify="right")
    t.add_column("test", justify="right")
    for cid, row in enumerate(table):
        c = data.clients[cid]
        t.add_row(
            str(cid),
            *(str(int(v)) if v else "·" for v in row),
            str(len(c.train_y)),
            str(len(c.test_y)),
        )
    out_console.print(t)
    path = out or Path(f"partition-{data.partition_id}.png")
    plot_class_heatmap(table, path, title=f"{cfg.data.dataset}: {cfg.data.partition}")
    out_console.print(f"heatmap: {path}")


@app.command(name="list")
def list_() -> None:
    """List algorithms, datasets, partitioners and models."""
    from pflkit.algorithms import ALGORITHMS
    from pflkit.data.partition import PARTITIONERS
    from pflkit.data.sources import SOURCES
    from pflkit.models import MODELS

    for title, items in (
        ("algorithms", {k: v.description for k, v in ALGORITHMS.items()}),
        ("datasets", {k: v.description for k, v in SOURCES.items()}),
        ("partitioners", {k: v.description for k, v in PARTITIONERS.items()}),
        ("models", {k: v.description for k, v in MODELS.items()}),
    ):
        out_console.print(f"[bold]{title}[/bold]")
        width = max(map(len, items))
        for name in sorted(items):
            out_console.print(f"  {name:<{width}}  {items[name]}", highlight=False)


def main() -> None:
    try:
        app(standalone_mode=False)
    except PflkitError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        sys.exit(130)
    except typer.Exit as e:
        sys.exit(e.exit_code)
    except Exception as err:  # click usage errors
        import click

        if isinstance(err, click.ClickException):
            err.show()
            sys.exit(err.exit_code)
        raise


if __name__ == "__main__":
    main()
