"""The ``pflkit`` command line: run, compare, sweep, report, partition, analyze, list, flower.

User mistakes (:class:`~pflkit.errors.PflkitError`) print one sentence and exit with code 2.
"""

from __future__ import annotations

import math
import sys
from datetime import datetime
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from pflkit.errors import PflkitError, RunInterrupted, terminated
from pflkit.experiment import load_config

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    help="pflkit: personalized federated learning experiments.",
    pretty_exceptions_enable=False,
)
# long lines are never wrapped; into a pipe or file, tables keep their natural width
out_console = Console(soft_wrap=True, width=None if sys.stdout.isatty() else 10_000)


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


ConfigArg = Annotated[
    Path | None,
    typer.Argument(
        help="Experiment config (YAML), or the name of a bundled example (`pflkit examples`).",
        show_default=False,
    ),
]
SetOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--set", "-s", help="Override a config key, e.g. --set train.rounds=5 (repeatable)."
    ),
]
OutOpt = Annotated[Path | None, typer.Option("--out", "-o", help="Output folder.")]
QuietOpt = Annotated[
    bool, typer.Option("--quiet", "-q", help="No progress display, no 'downloading' lines.")
]
ImportOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--import",
        help="A module that registers your algorithms, models, datasets or partitioners "
        "(repeatable; looked up on PYTHONPATH and in the current folder; docs/plugins.md).",
    ),
]


AlgorithmsOpt = Annotated[
    str | None,
    typer.Option(
        help="Comma-separated algorithms (default: config's compare.algorithms). A name or label "
        "of the config's own entries runs those entries with their parameters; any other name "
        "runs at its defaults; {name: fedprox, mu: 0.1} gives parameters."
    ),
]
SeedsOpt = Annotated[str | None, typer.Option(help="Comma-separated training seeds, e.g. 0,1,2.")]
JobsOpt = Annotated[
    int,
    typer.Option(
        help="Whole runs at once, one process each (1 torch thread each unless `threads` "
        "is set). Rerunning into the same --out continues it."
    ),
]
KeepGoingOpt = Annotated[
    bool,
    typer.Option(
        "--keep-going",
        help="A failed run (a diverged loss, say) stops only itself; the error naming every "
        "failed run comes at the end. Default: the first failure stops every run.",
    ),
]
ForceOpt = Annotated[
    bool,
    typer.Option(
        "--force",
        help="Run even when the pre-flight check finds the run past this machine (workers or "
        "threads above 4 per core or the process limit, more memory or disk than is free).",
    ),
]
SkipCorruptOpt = Annotated[
    bool,
    typer.Option(
        "--skip-corrupt",
        help="Leave out corrupt lines of the runs' metrics.jsonl (the table's footnote names "
        "them) instead of refusing the run.",
    ),
]
AtOpt = Annotated[
    str | None,
    typer.Option(
        "--at",
        help="Which number of each run: last (round), mean_last (mean of the last eval.last "
        "rounds), val_round (the round chosen on validation) or best_test (the paper protocol, "
        "optimistic: the evaluated round with the best weighted accuracy on test, with the std "
        "and CV over clients there).",
    ),
]
MetricOpt = Annotated[
    str | None,
    typer.Option(
        help="The compared and selected metric: pers_acc_mean, pers_acc_weighted, "
        "pers_acc_worst10 or global_acc; or a metric of eval.metrics by name (loss, f1_macro, "
        "balanced_accuracy, ece, perplexity: its pers_<key>_mean) or field (pers_loss_weighted, "
        "global_ece, ...)."
    ),
]
SelectOpt = Annotated[
    str | None,
    typer.Option(
        help="Per algorithm, choose a setting on: val (the validation split), test (labelled "
        "optimistic) or none."
    ),
]


@app.command()
def run(
    ctx: typer.Context,
    config: ConfigArg = None,
    set_: SetOpt = None,
    imports: ImportOpt = None,
    out: OutOpt = None,
    resume: Annotated[
        Path | None, typer.Option(help="Continue the run in this folder from its last checkpoint.")
    ] = None,
    quiet: QuietOpt = False,
    force: ForceOpt = False,
) -> None:
    """Run one experiment into a run folder (config, metrics.jsonl, summary.json, plots)."""
    _hush(quiet)
    from pflkit.engine.runner import new_run_dir, run_experiment

    if resume is not None:
        if config is not None or out is not None:
            raise PflkitError(
                "--resume takes the config from the run folder: drop CONFIG and --out"
            )
        if not _resumable(resume, set_ or []):
            return
        try:
            res = run_experiment(
                resume=resume,
                overrides=set_ or [],
                progress=False if quiet else None,
                force=force,
            )
        except KeyboardInterrupt:  # outside the round loop (which stops at a round's end)
            raise RunInterrupted(
                f"interrupted (Ctrl-C) outside a round: continue with pflkit run --resume {resume}"
            ) from None
    else:
        if config is None:
            print(ctx.get_help())
            raise PflkitError(
                "pflkit run needs a CONFIG file (e.g. configs/quickstart.yaml) or --resume DIR"
            )
        cfg = load_config(config, set_ or [], imports)
        run_dir = new_run_dir(cfg, out)  # named here, so that an interrupt can say what is left
        existed = run_dir.exists()
        try:
            res = run_experiment(cfg, out=run_dir, progress=False if quiet else None, force=force)
        except KeyboardInterrupt:  # outside the round loop (which stops at a round's end)
            raise _interrupted(run_dir, existed) from None
    _show_summary(res.run_dir, res.summary)


def _hush(quiet: bool) -> None:
    """-q: besides the progress display, no "downloading ..." lines (the data's notices)."""
    from pflkit.data import download

    download.QUIET = quiet


def _interrupted(run_dir: Path, existed: bool) -> RunInterrupted:
    """The sentence for a new run stopped by Ctrl-C outside its round loop. Before its first
    round, what it wrote is removed (the folder is left as it was: absent, or empty)."""
    import shutil

    if (run_dir / "summary.json").exists():
        return RunInterrupted(
            f"interrupted (Ctrl-C) after the last round: the run finished; its metrics and "
            f"summary are in {run_dir} (its curves.png may be missing)"
        )
    metrics = run_dir / "metrics.jsonl"
    rows = len(metrics.read_text().splitlines()) if metrics.is_file() else 0
    if rows:
        return RunInterrupted(
            f"interrupted (Ctrl-C) after round {rows}, outside a round: continue with "
            f"pflkit run --resume {run_dir}"
        )
    if run_dir.is_dir():
        shutil.rmtree(run_dir, ignore_errors=True)
        if existed:
            run_dir.mkdir(exist_ok=True)
    return RunInterrupted("interrupted (Ctrl-C) before the first round: nothing was written")


def _resumable(run_dir: Path, overrides: list[str]) -> bool:
    """Whether ``--resume run_dir`` has rounds to run; False (said on stdout) for a finished
    run without a checkpoint at its rounds. Refused: lowering train.rounds below the rounds
    already run (config.yaml would disagree with the metrics and summary), and more rounds for
    a finished run without a checkpoint (it would start again from round 1)."""
    from pflkit.engine.checkpoint import load_checkpoint
    from pflkit.engine.runner import CHECKPOINT, resume_config
    from pflkit.report.results import read_json

    finished, checkpoint = run_dir / "summary.json", run_dir / CHECKPOINT
    if not finished.is_file() and not checkpoint.is_file():
        return True  # stopped before its first checkpoint: it runs again from round 1
    rounds = resume_config(run_dir, overrides).train.rounds
    if checkpoint.is_file():
        if rounds >= resume_config(run_dir, []).train.rounds:
            return True
        done = int(load_checkpoint(checkpoint)["round"])
        what = f"its checkpoint is at round {done}"
    else:
        done = read_json(finished, "run summary").get("rounds")
        if not isinstance(done, int):
            raise PflkitError(f"'{finished}' does not say how many rounds the run has: rerun it")
        what = f"it finished {done} rounds"
    if rounds < done:
        raise PflkitError(
            f"--set train.rounds={rounds} is below the rounds the run in '{run_dir}' has run "
            f"({what}): its config.yaml would disagree with its metrics; give "
            f"train.rounds >= {done}, or start a new run"
        )
    if checkpoint.is_file():
        return True
    if rounds == done:
        out_console.print(
            f"the run in '{run_dir}' has finished its {done} rounds: nothing to resume (it has "
            "no checkpoint, so it cannot be continued for more rounds)",
            highlight=False,
        )
        return False
    raise PflkitError(
        f"the run in '{run_dir}' finished its {done} rounds without a checkpoint "
        f"(output.checkpoint_every: 0), so it cannot continue to round {rounds}: start a new "
        f"run with --set train.rounds={rounds} (and output.checkpoint_every=N to be able to "
        "continue it later)"
    )


def _usable_path(path: Path, what: str, option: str = "--out") -> None:
    """Refuse, before any work, an output ``path`` (a file or a folder to create) that cannot
    be written: a name the file system refuses, a file where a folder is needed on the way,
    or a place where nothing can be created (e.g. under /proc). Nothing is left behind."""
    import os
    import tempfile

    shown = str(path) if len(str(path)) < 80 else f"{str(path)[:60]}..."
    try:
        place = path.absolute() if path.is_dir() else path.absolute().parent
        while not place.exists():
            place = place.parent
    except OSError as err:  # e.g. a name longer than the file system allows
        raise PflkitError(
            f"{option} '{shown}' is not a usable path ({err.strerror}): choose another {option}"
        ) from None
    if not place.is_dir():
        raise PflkitError(
            f"{option} '{shown}' lies under '{place}', which is a file, not a folder: "
            f"choose another {option}"
        )
    try:
        fd, probe = tempfile.mkstemp(dir=place, prefix=".pflkit-probe-")
        os.close(fd)
        os.unlink(probe)
    except OSError as err:
        raise PflkitError(
            f"cannot write the {what} '{shown}' ({err.strerror or err}): nothing can be "
            f"created in '{place}'; choose another {option}"
        ) from None


def _seconds(option: str, value: float, zero_ok: bool = True) -> float:
    """A number of seconds given on the command line, checked (finite, >= 0 or > 0)."""
    if not math.isfinite(value) or value < 0 or (value == 0 and not zero_ok):
        bound = ">= 0" if zero_ok else "> 0"
        raise PflkitError(f"{option} {value} is not a number of seconds: give seconds {bound}")
    return value


@app.command()
def compare(
    config: ConfigArg = None,
    set_: SetOpt = None,
    imports: ImportOpt = None,
    algorithms: AlgorithmsOpt = None,
    seeds: SeedsOpt = None,
    metric: MetricOpt = None,
    out: OutOpt = None,
    quiet: QuietOpt = False,
    jobs: JobsOpt = 1,
    keep_going: KeepGoingOpt = False,
    force: ForceOpt = False,
    skip_corrupt: SkipCorruptOpt = False,
) -> None:
    """Compare algorithms on one partition over several seeds: markdown table + curves.
    Into an existing compare folder of the same config it continues: finished runs are
    kept, interrupted ones resume from their checkpoints."""
    _hush(quiet)
    from pflkit.engine.compare import run_compare

    cfg = load_config(config, _lists(set_, seeds), imports, algorithms)
    if metric is not None:  # checked before anything runs; the plan keeps it for reports
        import functools

        from pflkit.report.results import compare_options

        run_compare = functools.partial(run_compare, options=compare_options(metric))
    _many(run_compare, "compare", cfg, out, quiet, jobs, keep_going, force, skip_corrupt)


def _lists(set_: list[str] | None, seeds: str | None) -> list[str]:
    """The overrides of compare and sweep: --set, plus --seeds."""
    overrides = list(set_ or [])
    if seeds:
        overrides.append(f"compare.seeds=[{seeds}]")
    return overrides


def _many(
    fn,
    kind: str,
    cfg,
    out: Path | None,
    quiet: bool,
    jobs: int,
    keep_going: bool,
    force: bool,
    skip_corrupt: bool,
) -> None:
    """Run a compare or sweep (``fn``) into ``out`` (default: runs/<kind>-<name>-<time>) and
    print its tables."""
    from pflkit.engine.folder import folder_name, under

    if out is None:
        name = f"{kind}-{folder_name(cfg.name)}-{datetime.now():%Y%m%d-%H%M%S}"
        out = under(Path(cfg.output.dir) / name, cfg.output.dir, f"{kind} folder")
    progress = False if quiet else None
    res = fn(
        cfg,
        out,
        progress=progress,
        jobs=jobs,
        keep_going=keep_going,
        force=force,
        skip_corrupt=skip_corrupt,
    )
    print(res["table"])
    out_console.print(f"written to {res['out']}")


@app.command()
def sweep(
    config: ConfigArg = None,
    grid: Annotated[
        list[str] | None,
        typer.Option(
            help='A config key and its values, e.g. --grid "train.lr=[0.01,0.05]" or '
            '--grid "algorithm.mu=[0.001,0.01]" (repeatable; a product grid).'
        ),
    ] = None,
    set_: SetOpt = None,
    imports: ImportOpt = None,
    algorithms: AlgorithmsOpt = None,
    seeds: SeedsOpt = None,
    select: SelectOpt = None,
    metric: MetricOpt = None,
    at: AtOpt = None,
    out: OutOpt = None,
    quiet: QuietOpt = False,
    jobs: JobsOpt = 1,
    keep_going: KeepGoingOpt = False,
    force: ForceOpt = False,
    skip_corrupt: SkipCorruptOpt = False,
) -> None:
    """Run a grid of settings for each algorithm over several seeds, then choose each
    algorithm's setting on validation accuracy and report its test accuracy (next to the best
    on test, labelled). Into an existing sweep folder of the same config it continues."""
    _hush(quiet)
    import json

    from pflkit.config import parse_value
    from pflkit.engine.compare import run_sweep
    from pflkit.experiment import validate

    overrides = _lists(set_, seeds) + [
        f"sweep.{k}={json.dumps(v)}"  # quoted: an empty value is refused, not read as null
        for k, v in (("select", select), ("metric", metric), ("at", at))
        if v is not None
    ]
    cfg = load_config(config, overrides, imports, algorithms)
    extra = {}
    for item in grid or []:
        key, sep, text = item.partition("=")
        values = parse_value(text, "--grid") if sep else None
        if not key or not isinstance(values, list) or not values:
            raise PflkitError(
                f"invalid --grid '{item}': write a key and a list of values, e.g. "
                '--grid "train.lr=[0.01,0.05]"'
            )
        if key in extra:
            raise PflkitError(
                f"--grid gives '{key}' twice: give each key once, with all its values in one "
                f'list, e.g. --grid "{key}=[...]"'
            )
        extra[key] = values
    if extra:
        raw = cfg.dump()
        raw["sweep"]["grid"] = raw["sweep"]["grid"] | extra
        cfg = validate(raw)
    _many(run_sweep, "sweep", cfg, out, quiet, jobs, keep_going, force, skip_corrupt)


@app.command()
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


@app.command()
def partition(
    config: ConfigArg = None,
    set_: SetOpt = None,
    imports: ImportOpt = None,
    out: Annotated[
        Path | None,
        typer.Option("--out", "-o", help="PNG heatmap path (default: partition-<id>.png)."),
    ] = None,
    train_only: Annotated[
        bool, typer.Option("--train-only", help="Count only the clients' training samples.")
    ] = False,
) -> None:
    """Show a partition: per-client class counts (table) and a PNG heatmap (train + test
    (+ validation) samples, or --train-only). Above 50 clients the table is a summary:
    quantiles of client sizes and classes per client, and their histograms."""
    from rich.table import Table

    from pflkit.data.federated import build_federated
    from pflkit.report.plots import plot_class_heatmap

    cfg = load_config(config, set_ or [], imports)
    if out is not None:
        _heatmap_path(out)  # before the data: a wrong path fails at once
    data = build_federated(cfg.data)
    path = out or Path(f"partition-{data.partition_id}.png")
    if out is None:
        _heatmap_path(path)
    splits = ["train", "test"] + (["val"] if data.has_val else [])
    table = sum(data.class_table(s) for s in (splits[:1] if train_only else splits))
    counted = "training samples" if train_only else f"samples ({' + '.join(splits)})"
    title = f"{cfg.data.dataset} {cfg.data.partition} (id {data.partition_id})"
    if data.num_clients > PARTITION_ROWS_MAX:
        _population_summary(title, table, data, splits, counted)
    else:
        t = Table(title=title)
        t.add_column("client", justify="right")
        for c in range(data.num_classes):
            t.add_column(str(c), justify="right")
        for s in splits:
            t.add_column(s, justify="right")
        for cid, row in enumerate(table):
            c = data.clients[cid]
            sizes = [str(c.size(s)) for s in splits]
            t.add_row(str(cid), *(str(int(v)) if v else "·" for v in row), *sizes)
        out_console.print(t)
    part = dict(cfg.data.partition)
    name = part.pop("name", "?")
    args = ", ".join(f"{k}={v}" for k, v in part.items())
    title = (
        f"{cfg.data.dataset}, {cfg.data.num_clients} clients, {name}({args}): "
        f"{counted} per client and class"
    )
    try:
        plot_class_heatmap(table, path, title=title, class_names=data.class_names)
    except OSError as err:
        raise PflkitError(
            f"cannot write the heatmap '{path}' ({err.strerror or err}): choose another --out"
        ) from None
    out_console.print(f"heatmap: {path}")


PARTITION_ROWS_MAX = 50  # above this many clients `pflkit partition` summarises
QUANTILES = (0.0, 0.01, 0.1, 0.25, 0.5, 0.75, 0.9, 0.99, 1.0)


def _population_summary(title: str, table, data, splits: list[str], counted: str) -> None:
    """A large population's partition: quantiles over the clients of their sizes (per split
    and counted), of their number of classes and of their largest class's share, then
    histograms of the counted sizes (log-spaced bins) and of the classes per client."""
    import numpy as np
    from rich.table import Table

    total = table.sum(axis=1)
    classes = (table > 0).sum(axis=1)
    top = table.max(axis=1) / np.maximum(total, 1)
    rows = [(f"{s} samples", np.array([c.size(s) for c in data.clients])) for s in splits]
    rows += [
        (f"counted {counted}", total),
        ("classes held", classes),
        ("largest class share", top),
    ]
    t = Table(title=f"{title}: {data.num_clients} clients, quantiles over clients")
    t.add_column("per client")
    for q in QUANTILES:
        t.add_column({0.0: "min", 1.0: "max"}.get(q, f"{q:.0%}"), justify="right")
    t.add_column("mean", justify="right")
    for name, values in rows:
        cells = np.quantile(values, QUANTILES, method="lower")
        fmt = "{:.2f}" if values.dtype.kind == "f" else "{:d}"
        t.add_row(name, *(fmt.format(v) for v in cells), f"{values.mean():.2f}")
    out_console.print(t)
    out_console.print(
        f"{int(total.sum())} {counted} over {data.num_clients} clients and "
        f"{data.num_classes} classes; {int((classes == 1).sum())} clients hold a single class"
    )
    hi = max(int(total.max()), 1)
    edges = np.unique(np.round(np.geomspace(1, hi + 1, num=min(16, hi + 1))).astype(np.int64))
    if len(edges) < 2:
        edges = np.array([1, hi + 1])
    counts, _ = np.histogram(total, bins=edges)
    labels = [
        f"{a}-{b - 1}" if b - 1 > a else f"{a}" for a, b in zip(edges[:-1], edges[1:], strict=True)
    ]
    _ascii_histogram(f"{counted} per client", labels, counts)
    counts = np.bincount(classes, minlength=data.num_classes + 1)[1:]
    _ascii_histogram("classes per client", [str(k) for k in range(1, len(counts) + 1)], counts)


def _ascii_histogram(title: str, labels: list[str], counts, width: int = 40) -> None:
    """One line per bin: label, a bar scaled to the largest count, the count."""
    out_console.print(f"{title} (clients):")
    most = max(int(max(counts, default=0)), 1)
    pad = max((len(x) for x in labels), default=0)
    for label, n in zip(labels, counts, strict=True):
        bar = "#" * (round(width * int(n) / most) if n else 0) or ("." if n else "")
        out_console.print(f"  {label:>{pad}} | {bar:<{width}} {int(n)}", highlight=False)


def _heatmap_path(path: Path) -> None:
    """Refuse a heatmap path that is a folder, does not end in .png, or cannot be written."""
    _usable_path(path, "heatmap")
    if path.is_dir():
        raise PflkitError(
            f"--out '{path}' is a folder: give a file name, e.g. {path}/partition.png"
        )
    if path.suffix.lower() != ".png":
        raise PflkitError(
            f"--out '{path}' does not end in .png: the heatmap is a PNG image; give a name "
            f"like {path.stem or 'partition'}.png"
        )


@app.command(name="export")
def export_(
    config: ConfigArg = None,
    fmt: Annotated[
        str,
        typer.Option(
            "--format",
            help="pfllib (PFLlib's dataset folder), flbench (FL-bench's data/<dataset> folder: "
            "fashion_mnist and mnist) or npz (plain NumPy files and partition.json).",
        ),
    ] = "",
    out: Annotated[
        Path | None,
        typer.Option("--out", "-o", help="Folder to write <name>/ into (created if missing)."),
    ] = None,
    set_: SetOpt = None,
    imports: ImportOpt = None,
    name: Annotated[
        str | None,
        typer.Option(
            help="Folder name (default: <dataset>-<partition id>-<format>; flbench: FL-bench's dataset "
            "name, fmnist or mnist)."
        ),
    ] = None,
    force: Annotated[
        bool, typer.Option("--force", help="Replace an existing <out>/<name> folder.")
    ] = False,
) -> None:
    """Write the config's exact federated split (every client's samples, the partition's
    indices) for PFLlib, FL-bench or any NumPy code (docs/guide.md, "Exporting a partition")."""
    from pflkit.data.export import FLBENCH_DATASETS, export_partition

    if config is None:
        raise PflkitError(
            "pflkit export needs a CONFIG file, e.g. pflkit export configs/quickstart.yaml "
            "--format npz --out exports"
        )
    if not fmt:
        raise PflkitError("pflkit export needs --format: pfllib, flbench or npz")
    if out is None:
        raise PflkitError("pflkit export needs --out DIR, the folder to write the export into")
    cfg = load_config(config, set_ or [], imports)
    folder = export_partition(cfg, fmt, out, name=name, force=force)
    k, c = cfg.data.num_clients, folder.name
    out_console.print(f"wrote {folder} ({fmt}, {k} clients)", highlight=False)
    if fmt == "pfllib":
        import json

        classes = json.loads((folder / "config.json").read_text())["num_classes"]
        hint = (
            f"PFLlib: place it as PFLlib/dataset/{c}, then in PFLlib/system: "
            f"python main.py -data {c} -nc {k} -ncl {classes} ..."
        )
    elif fmt == "flbench":
        fl = FLBENCH_DATASETS[cfg.data.dataset][0]
        hint = (
            f"FL-bench: place it as FL-bench/data/{fl}, then: python main.py "
            f"dataset.name={fl} ... (do not rerun generate_data.py for {fl})"
        )
    else:
        hint = "layout: partition.json (docs/guide.md, 'Exporting a partition')"
    out_console.print(hint, highlight=False)


analyze = typer.Typer(
    no_args_is_help=True,
    help="Analyses of a config's federated setting (similarity, privacy) or of a finished "
    "run (features).",
)
app.add_typer(analyze, name="analyze")


@analyze.command()
def similarity(
    config: ConfigArg = None,
    set_: SetOpt = None,
    out: Annotated[
        Path | None,
        typer.Option("--out", "-o", help="Output folder (default: similarity-<name>)."),
    ] = None,
    steps: Annotated[
        int, typer.Option(help="Local SGD steps per client (pFedSim §3: 20 iterations).")
    ] = 20,
    clients: Annotated[
        int | None, typer.Option(help="Use only the first N clients (default: all).")
    ] = None,
) -> None:
    """pFedSim's measurement study (§3, Table 2): classifier similarity and the other metrics
    against the true data similarity, for the config's partition (table + heatmap)."""
    from pflkit.analysis import similarity_study

    if config is None:
        raise PflkitError("give the experiment config: pflkit analyze similarity CONFIG --out DIR")
    cfg = load_config(config, set_ or [])
    folder = out or _named_folder("similarity", cfg.name)
    _usable_path(folder, "output folder")
    res = similarity_study(cfg, folder, steps=steps, clients=clients)
    for m, s in res["scores"].items():
        rho = "n/a" if s["spearman"] is None else f"{s['spearman']:.3f}"
        out_console.print(f"{m}: Spearman {rho} with data similarity")
    out_console.print(f"written to {folder} (similarity.md, similarity.json, similarity.png)")


@analyze.command()
def privacy(
    config: ConfigArg = None,
    set_: SetOpt = None,
    attack: Annotated[
        str,
        typer.Option(
            help="The attack: dlg (Zhu et al. 2019), or mia: membership inference (loss, "
            "calibrated) and label inference; or a comma list of loss, calibrated, label."
        ),
    ] = "dlg",
    round_: Annotated[
        int | None,
        typer.Option(
            "--round",
            help="The attacked round; rounds before it train as a run would (default: dlg 1, "
            "mia the last).",
        ),
    ] = None,
    victims: Annotated[
        str | None,
        typer.Option(
            help="How many clients to attack (the first N that upload in that round), or "
            "their ids: 0,3,7 (one id: 7,) (default: dlg 4, mia every one that uploads)."
        ),
    ] = None,
    iterations: Annotated[
        int, typer.Option(help="L-BFGS iterations per attacked batch (PFLlib: 100).")
    ] = 100,
    batches: Annotated[int, typer.Option(help="Batches attacked per victim (PFLlib: 2).")] = 2,
    batch_size: Annotated[
        int | None,
        typer.Option(help="Samples in an attacked batch (default: train.batch_size)."),
    ] = None,
    seeds: SeedsOpt = None,
    targets: Annotated[
        str | None,
        typer.Option(
            help="Comma-separated: full, fe, sfe, sm for dlg; upload, personal for mia "
            "(default: every one the algorithm allows)."
        ),
    ] = None,
    algorithms: Annotated[
        str | None,
        typer.Option(
            help="Comma-separated algorithms, chosen as compare's --algorithms chooses them "
            "(default: the config's algorithm)."
        ),
    ] = None,
    references: Annotated[
        int,
        typer.Option(help="mia: reference models per victim (the calibrated attack; 2N trained)."),
    ] = 2,
    ref_epochs: Annotated[
        int | None,
        typer.Option(
            help="mia: epochs of each reference model (default: round x train.local_epochs)."
        ),
    ] = None,
    out: Annotated[
        Path | None,
        typer.Option("--out", "-o", help="Output folder (default: privacy-<name>)."),
    ] = None,
    quiet: QuietOpt = False,
) -> None:
    """Attacks of a semi-honest server (CONFIG: a config, or a run folder whose config.yaml
    is retrained): GPFL's DLG study (§4.7, Table 5; --attack dlg, PSNR per target) or
    membership and label inference (--attack mia; AUC and TPR at 1% FPR per target)."""
    _hush(quiet)
    from pflkit.analysis import privacy_study

    if config is None:
        raise PflkitError("give the experiment config: pflkit analyze privacy CONFIG --out DIR")
    if config.is_dir():
        if not (config / "config.yaml").is_file():
            raise PflkitError(
                f"'{config}' is a folder without config.yaml: give a config or a run folder"
            )
        config = config / "config.yaml"
    mia = [a.strip() for a in attack.split(",") if a.strip()]
    if attack != "dlg" and (not mia or not set(mia) <= {"mia", "loss", "calibrated", "label"}):
        raise PflkitError(
            f"unknown --attack '{attack}': use --attack dlg (Deep Leakage from Gradients) or "
            "--attack mia (membership and label inference; or a comma list of loss, "
            "calibrated, label)"
        )
    cfg = load_config(config, _lists(set_, seeds), algorithms=algorithms)
    folder = out or _named_folder("privacy", cfg.name)
    _usable_path(folder, "output folder")
    common = {  # the options both studies take
        "seeds": cfg.compare.seeds if seeds else None,
        "targets": [t.strip() for t in targets.split(",") if t.strip()] if targets else None,
        "algorithms": cfg.compare.algorithms if algorithms else None,
        "progress": None if quiet else lambda line: print(line, file=sys.stderr, flush=True),
    }
    if attack != "dlg":
        from pflkit.analysis.membership import membership_study

        res = membership_study(
            cfg,
            folder,
            attacks=mia,
            rnd=round_,
            victims=None if victims is None else _client_ids(victims, "--victims"),
            references=references,
            ref_epochs=ref_epochs,
            **common,
        )
        for row in res["rows"]:
            out_console.print(
                f"{row['algorithm']}-{row['target']} {row['attack']}: AUC {row['auc']:.3f}, "
                f"TPR {row['tpr_at_1fpr']:.3f} at 1% FPR (members={row['members']})",
                highlight=False,
            )
        for row in res["label_rows"]:
            auc = "n/a" if row["held_auc"] is None else f"{row['held_auc']:.3f}"
            out_console.print(
                f"{row['algorithm']} label inference ({row['source']}): held-class AUC {auc}, "
                f"majority class {row['top1_acc']:.3f} (guess {row['top1_acc_prior']:.3f})",
                highlight=False,
            )
        out_console.print(f"written to {folder} (membership.md, membership.json, membership.png)")
        return
    res = privacy_study(
        cfg,
        folder,
        attack=attack,
        rnd=1 if round_ is None else round_,
        victims=_client_ids("4" if victims is None else victims, "--victims"),
        iterations=iterations,
        batches=batches,
        batch_size=batch_size,
        **common,
    )
    for row in res["rows"]:
        out_console.print(
            f"{row['algorithm']}-{row['target']}: PSNR {row['psnr_mean']:.2f} ± "
            f"{row['psnr_std']:.2f} dB (n={row['n']})",
            highlight=False,
        )
    out_console.print(f"written to {folder} (privacy.md, privacy.json, privacy.png)")


def _named_folder(kind: str, name: str) -> Path:
    """The default output folder of a study, ``<kind>-<name>`` in the current folder, the
    config's name made safe (:func:`~pflkit.engine.folder.folder_name`)."""
    from pflkit.engine.folder import folder_name, under

    return under(Path(f"{kind}-{folder_name(name)}"), Path.cwd(), f"{kind} folder")


def _client_ids(text: str, option: str) -> int | list[int]:
    """``--victims``, ``--clients``: a count (``4``) or client ids (``0,3,7``; one id as
    ``7,``)."""
    parts = [p.strip() for p in text.split(",")]
    try:
        if len(parts) == 1:
            return int(parts[0])
        return [int(p) for p in parts if p]
    except ValueError:
        raise PflkitError(
            f"{option} '{text}' is not a count or a list of client ids: write e.g. "
            f"{option} 4 or {option} 0,3,7"
        ) from None


@analyze.command()
def features(
    run_dir: Annotated[
        Path | None,
        typer.Argument(
            help="A finished run's folder (its final state is kept when "
            "output.checkpoint_every > 0).",
            show_default=False,
        ),
    ] = None,
    clients: Annotated[
        str | None,
        typer.Option(help="How many clients (the first N), or their ids: 0,3,7 (one id: 7,)."),
    ] = None,
    method: Annotated[
        str, typer.Option(help="The projection: tsne (scikit-learn) or umap (umap-learn).")
    ] = "tsne",
    per_client: Annotated[
        int, typer.Option(help="Test samples per client (a seeded choice; all if it has fewer).")
    ] = 200,
    seed: Annotated[int, typer.Option(help="Seeds the choice of samples and the projection.")] = 0,
    out: Annotated[
        Path | None,
        typer.Option("--out", "-o", help="Output folder (default: features-<run folder>)."),
    ] = None,
    quiet: QuietOpt = False,
) -> None:
    """GPFL's feature maps (§4.2, Fig. 2): each client's test features under its own evaluated
    model, projected together to 2-D (colour: class, marker: client), with silhouette scores."""
    _hush(quiet)
    from pflkit.analysis import feature_map
    from pflkit.analysis.features import OUTPUTS

    if run_dir is None:
        raise PflkitError("give a finished run's folder: pflkit analyze features RUN_DIR --out DIR")
    folder = out or Path(f"features-{run_dir.name}")
    _usable_path(folder, "output folder")
    res = feature_map(
        run_dir,
        folder,
        clients=None if clients is None else _client_ids(clients, "--clients"),
        method=method,
        per_client=per_client,
        seed=seed,
        progress=None if quiet else lambda line: print(line, file=sys.stderr, flush=True),
    )
    for space, scores in res["silhouette"].items():
        shown = ", ".join(f"{k} {'n/a' if v is None else f'{v:.3f}'}" for k, v in scores.items())
        out_console.print(f"silhouette on the {space}: {shown}", highlight=False)
    out_console.print(f"written to {folder} ({', '.join(OUTPUTS)})", highlight=False)


@app.command(name="list")
def list_(
    params: Annotated[
        str | None,
        typer.Option(
            "--params",
            help="Show one algorithm's parameters: type, default and where the default comes from.",
        ),
    ] = None,
    imports: ImportOpt = None,
) -> None:
    """List algorithms, datasets, partitioners and models (or one algorithm's parameters)."""
    from pflkit.plugins import load_plugins

    load_plugins(imports or [])
    from pflkit.algorithms import ALGORITHMS
    from pflkit.data.partition import PARTITIONERS
    from pflkit.data.sources import SOURCES
    from pflkit.models import MODELS

    if params is not None:
        _show_params(params)
        return
    for title, items in (
        ("algorithms", ALGORITHMS.descriptions()),
        ("datasets", SOURCES.descriptions()),
        ("partitioners", PARTITIONERS.descriptions()),
        ("models", MODELS.descriptions()),
    ):
        out_console.print(f"[bold]{title}[/bold]")
        width = max(map(len, items))
        for name in sorted(items):
            out_console.print(f"  {name:<{width}}  {items[name]}", highlight=False, markup=False)


examples = typer.Typer(
    help="The example configs bundled with pflkit: list them, copy one to edit.",
    invoke_without_command=True,
    no_args_is_help=False,
)
app.add_typer(examples, name="examples")


@examples.callback()
def examples_list(ctx: typer.Context) -> None:
    """List the example configs bundled with pflkit (name and description). Any command that
    takes a CONFIG takes a name too: pflkit run quickstart_digits."""
    if ctx.invoked_subcommand is not None:
        return
    from pflkit.examples import examples as bundled

    items = bundled()
    width = max(map(len, items))
    for name, description in items.items():
        out_console.print(f"{name:<{width}}  {description}", highlight=False, markup=False)


@examples.command("copy")
def examples_copy(
    name: Annotated[str, typer.Argument(help="The example's name (`pflkit examples`).")],
    directory: Annotated[Path, typer.Argument(help="Folder to copy it into (created if missing).")],
) -> None:
    """Copy one bundled example config into DIRECTORY, to edit and run."""
    from pflkit.examples import copy_example

    out_console.print(f"wrote {copy_example(name, directory)}", highlight=False, markup=False)


def _show_params(name: str) -> None:
    """Print algorithm ``name``'s parameters as a table."""
    from rich.table import Table

    from pflkit.algorithms import ALGORITHMS
    from pflkit.flower import secagg
    from pflkit.privacy import dpsgd
    from pflkit.privacy.client_dp import describe_release

    cls = ALGORITHMS.lookup(name)
    privacy = [*describe_release(cls), dpsgd.describe(cls), secagg.describe(cls)]
    if not cls.Params.model_fields:
        out_console.print(f"algorithm '{name}' takes no parameters")
        out_console.print("\n".join(privacy), highlight=False)
        return
    t = Table(title=f"{name}: {cls.description}", title_justify="left")
    for col in ("parameter", "type", "default", "source of the default"):
        t.add_column(col)
    for key, field in cls.Params.model_fields.items():
        kind = str(field.annotation).replace("typing.", "").replace("<class '", "")
        extra = field.json_schema_extra if isinstance(field.json_schema_extra, dict) else {}
        t.add_row(key, kind.replace("'>", ""), repr(field.default), str(extra.get("source", "")))
    out_console.print(t)
    out_console.print("\n".join(privacy), highlight=False)


# -- Flower --------------------------------------------------------------------------------------

flower = typer.Typer(
    no_args_is_help=True,
    help="Run pflkit on Flower: a local try-out, or a real SuperLink (needs pflkit\\[flower]).",
)
app.add_typer(flower, name="flower")


NodeWaitOpt = Annotated[
    float, typer.Option(help="Seconds to wait for SuperNodes covering every client.")
]
RoundTimeoutOpt = Annotated[
    float,
    typer.Option(help="Seconds to wait for a round's replies before failing a client (0: none)."),
]


SecAggOpt = Annotated[
    bool,
    typer.Option(
        help="Secure aggregation: the server sees only the sum of the SuperNodes' uploads "
        "(Flower's SecAgg+; mean-aggregating algorithms only; docs/flower.md)."
    ),
]
SecAggClipOpt = Annotated[
    float | None,
    typer.Option(help="With --secagg: every summed upload entry lies in [-clip, clip] (8)."),
]
SecAggQuantOpt = Annotated[
    int | None,
    typer.Option(help="With --secagg: the integer range [-clip, clip] is mapped onto (2**22)."),
]


def _secagg(cfg, secagg: bool, clip: float | None, quantization: int | None, nodes=None):
    """The run-config keys of secure aggregation, checked (algorithm, options, and with
    ``nodes``, the SuperNodes' client-id specs, every round's spread) before any process
    starts; {} without --secagg."""
    from pflkit.flower import secagg as sa

    if not secagg:
        given = "--secagg-clip" if clip is not None else "--secagg-quantization"
        if clip is not None or quantization is not None:
            raise PflkitError(f"{given} needs --secagg: add --secagg, or leave {given} out")
        return {}
    options = sa.SecAggOptions(
        sa.DEFAULT_CLIP if clip is None else clip,
        sa.DEFAULT_QUANTIZATION if quantization is None else quantization,
    )
    sa.secure_keys(cfg.algorithm)
    if nodes is not None:
        from pflkit.flower.client import hosted_clients

        node_of = {
            c: i for i, spec in enumerate(nodes) for c in hosted_clients({"client-ids": spec})
        }
        sa.check_rounds(cfg, node_of, options)
    return options.run_config()


def _waits(node_wait: float, round_timeout: float) -> dict[str, float]:
    """The run-config keys of the two waits, checked."""
    for name, value in (("--node-wait", node_wait), ("--round-timeout", round_timeout)):
        _seconds(name, value)
    return {"node-wait": node_wait, "round-timeout": round_timeout}


def _show_row(row: dict) -> None:
    parts = [f"round {row['round']}"]
    for key in ("global_acc", "pers_acc_mean", "pers_acc_selected"):
        if key in row:
            parts.append(f"{key} {100 * row[key]:.2f}%")
    if row.get("failed_clients"):
        parts.append(f"failed clients {row['failed_clients']}")
    out_console.print(", ".join(parts))


def _show_summary(run_dir: Path, summary: dict) -> None:
    """Print the run folder and the accuracies of ``summary``'s last round (its ``final``)."""
    from pflkit.report.results import percent

    final = summary.get("final", {})
    shown = ", ".join(  # eval_*: counts; a loss or perplexity (eval.metrics) as it is
        f"{k} {v:g}" if k.startswith("eval_") or not percent(k) else f"{k} {100 * v:.2f}%"
        for k, v in final.items()
        if k != "round" and v is not None
    )
    out_console.print(f"run folder: {run_dir}\nlast round ({final.get('round')}): {shown}")


@flower.command("local")
def flower_local(
    config: ConfigArg = None,
    set_: SetOpt = None,
    imports: ImportOpt = None,
    out: OutOpt = None,
    nodes: Annotated[
        int, typer.Option(help="SuperNodes to start; clients are split among them.")
    ] = 3,
    tls: Annotated[bool, typer.Option(help="TLS with a fresh self-signed CA.")] = False,
    auth: Annotated[bool, typer.Option(help="SuperNode authentication (implies --tls).")] = False,
    workdir: Annotated[
        Path | None, typer.Option(help="Keep Flower's logs, certificates and keys here.")
    ] = None,
    timeout: Annotated[float, typer.Option(help="Give up after this many seconds.")] = 3600.0,
    node_wait: NodeWaitOpt = 60.0,
    round_timeout: RoundTimeoutOpt = 0.0,
    secagg: SecAggOpt = False,
    secagg_clip: SecAggClipOpt = None,
    secagg_quantization: SecAggQuantOpt = None,
) -> None:
    """Try-out on this machine: start a SuperLink and SuperNodes on 127.0.0.1, run CONFIG on
    them through Flower, write the run folder, stop every process."""
    import json
    import shutil
    import tempfile

    from pflkit.engine.folder import make_folder
    from pflkit.engine.runner import new_run_dir
    from pflkit.engine.simulation import Simulation
    from pflkit.flower import require_flower

    require_flower()
    from pflkit.flower.local import Federation, split_clients

    waits = _waits(node_wait, round_timeout)
    _seconds("--timeout", timeout, zero_ok=False)
    if workdir is not None:
        if workdir.exists() and not workdir.is_dir():
            raise PflkitError(
                f"--workdir '{workdir}' is a file, not a folder: choose another --workdir"
            )
        _usable_path(workdir, "Flower work folder", "--workdir")
    cfg = load_config(config, set_ or [], imports)
    run_dir = new_run_dir(cfg, out).resolve()
    spec = split_clients(cfg.data.num_clients, nodes)
    secure = _secagg(cfg, secagg, secagg_clip, secagg_quantization, spec)
    with Simulation(cfg):  # every config, data and model error now, before a process starts
        pass
    if workdir is not None:
        make_folder(workdir, "Flower work folder")
    work = Path(workdir) if workdir else Path(tempfile.mkdtemp(prefix="pflkit-flower-"))
    try:
        with Federation(spec, work, tls=tls, auth=auth) as fed:
            security = "TLS + SuperNode auth" if fed.auth else "TLS" if fed.tls else "insecure"
            where = f"Flower logs in {work}" if workdir else "--workdir DIR keeps Flower's logs"
            out_console.print(
                f"SuperLink 127.0.0.1:{fed.port} ({security}), SuperNodes hosting clients "
                f"{', '.join(spec)}; {where}"
            )
            fed.run(
                cfg.to_yaml(),
                run_dir,
                timeout=timeout,
                progress=_show_row,
                **waits,
                **secure,
            )
    finally:  # a temporary work folder goes, whether the run finished or not
        if workdir is None:
            shutil.rmtree(work, ignore_errors=True)
    _show_summary(run_dir, json.loads((run_dir / "summary.json").read_text()))


@flower.command("run")
def flower_run(
    config: ConfigArg = None,
    set_: SetOpt = None,
    imports: ImportOpt = None,
    out: Annotated[
        Path, typer.Option("--out", "-o", help="Run folder, on the SuperLink's machine.")
    ] = Path("runs/flower"),
    superlink: Annotated[str, typer.Option(help="The SuperLink's address, host:port.")] = "",
    root_certificates: Annotated[
        Path | None, typer.Option(help="CA certificate of a TLS SuperLink.")
    ] = None,
    insecure: Annotated[bool, typer.Option(help="Connect without TLS.")] = False,
    timeout: Annotated[float, typer.Option(help="Give up after this many seconds.")] = 86400.0,
    node_wait: NodeWaitOpt = 60.0,
    round_timeout: RoundTimeoutOpt = 0.0,
    secagg: SecAggOpt = False,
    secagg_clip: SecAggClipOpt = None,
    secagg_quantization: SecAggQuantOpt = None,
) -> None:
    """Submit CONFIG to a running SuperLink whose SuperNodes host its clients (see
    docs/flower.md); waits for the run to finish."""
    import shutil
    import tempfile

    from pflkit.flower import require_flower

    require_flower()
    from pflkit.flower.local import Connection

    host, _, port = superlink.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise PflkitError(
            f"--superlink '{superlink}' is not host:port with a port from 1 to 65535: e.g. "
            "--superlink 10.0.0.5:9093"
        )
    if insecure == (root_certificates is not None):
        raise PflkitError("give exactly one of --root-certificates CA.pem (TLS) and --insecure")
    if root_certificates is not None and not root_certificates.is_file():
        raise PflkitError(
            f"--root-certificates '{root_certificates}' does not exist: check the path"
        )
    waits = _waits(node_wait, round_timeout)
    _seconds("--timeout", timeout, zero_ok=False)
    cfg = load_config(config, set_ or [], imports)
    secure = _secagg(cfg, secagg, secagg_clip, secagg_quantization)
    home = Path(tempfile.mkdtemp(prefix="pflkit-flwr-"))
    try:
        Connection(superlink, home / "flwr-home", root_certificates).run(
            cfg.to_yaml(),
            out,
            timeout=timeout,
            echo=True,
            **waits,
            **secure,
        )
    finally:
        shutil.rmtree(home, ignore_errors=True)
    out_console.print(f"run completed; run folder on the SuperLink's machine: {out}")


@flower.command("app")
def flower_app(
    directory: Annotated[Path, typer.Argument(help="Folder for the Flower app project.")],
) -> None:
    """Write a Flower app project (pyproject.toml) whose ServerApp and ClientApp are pflkit's."""
    from pflkit.flower.local import write_app

    out_console.print(f"wrote {write_app(directory) / 'pyproject.toml'}")


@flower.command("certs")
def flower_certs(
    directory: Annotated[Path, typer.Argument(help="Folder for ca.pem, server.pem, server.key.")],
    host: Annotated[
        list[str] | None,
        typer.Option(help="Name or IP the SuperNodes use for the SuperLink (repeatable)."),
    ] = None,
) -> None:
    """Make a CA and a SuperLink TLS certificate (self-signed; fine for a private federation)."""
    from pflkit.flower.local import make_certificates

    paths = make_certificates(directory, host or ["localhost", "127.0.0.1"])
    out_console.print("wrote " + ", ".join(str(p) for p in paths))


@flower.command("node-key")
def flower_node_key(
    directory: Annotated[Path, typer.Argument(help="Folder for the key pair.")],
    name: Annotated[str, typer.Argument(help="File name of the private key.")] = "supernode",
) -> None:
    """Make a SuperNode authentication key pair (register the .pub with flwr supernode register)."""
    from pflkit.flower.local import make_node_key

    private, public = make_node_key(directory, name)
    out_console.print(f"wrote {private} and {public}")


def _stopped_at_once() -> None:
    """A Ctrl-C (or SIGTERM, :func:`~pflkit.errors.sigterm_as_interrupt`) that no command
    turned into a sentence of its own (``run``'s round loop stops at a round's end and says
    how to resume; ``compare`` says how to continue)."""
    how = "SIGTERM" if terminated() else "Ctrl-C"
    print(f"error: interrupted ({how}): stopped at once", file=sys.stderr)
    sys.exit(143 if terminated() else 130)


def _is_usage_error(err: Exception) -> bool:
    """Whether ``err`` is a click ``ClickException`` (a usage error with its own message)."""
    return any(c.__name__ == "ClickException" for c in type(err).__mro__) and hasattr(err, "show")


def _usage_sentence(err: Exception) -> str:
    """Click's usage error as one line: its sentences (each once: typer and click both add
    "Did you mean ...?") joined into one, and where the command's help is."""
    import re

    parts = re.split(r"(?<=[.?])\s+", " ".join(err.format_message().split()))
    parts = [p.rstrip(".") for p in dict.fromkeys(parts) if p.rstrip(".")]
    text = ": ".join(p[:1].lower() + p[1:] for p in parts) or type(err).__name__
    ctx = getattr(err, "ctx", None)
    path = ctx.command_path if ctx is not None else "pflkit"
    return f"{path}: {text} (`{path} --help` shows how to call it)"


def main() -> None:
    _hush(False)  # until a command's -q says otherwise
    try:
        # with standalone_mode=False, click returns the code of an Exit instead of exiting;
        # typer turns a KeyboardInterrupt into Exit(130)
        code = app(standalone_mode=False, prog_name="pflkit")
    except RunInterrupted as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(143 if err.signal == "SIGTERM" else 130)
    except PflkitError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        _stopped_at_once()
    except typer.Exit as e:
        sys.exit(e.exit_code)
    except Exception as err:  # click usage errors
        # a ClickException of the click that typer runs on: the click package (typer 0.20)
        # or typer's own copy of it (typer 0.27 installs no click), so not matched by class
        if not _is_usage_error(err):
            raise
        if type(err).__name__ == "NoArgsIsHelpError":  # `pflkit`, `pflkit flower`: the help
            err.show()
        else:  # a misspelt command or option, --jobs two
            print(f"error: {_usage_sentence(err)}", file=sys.stderr)
        sys.exit(err.exit_code)
    if code == 130:
        _stopped_at_once()
    if isinstance(code, int) and code != 0:
        sys.exit(code)


if __name__ == "__main__":  # python -m pflkit.cli: as the console script (pflkit.__main__)
    from pflkit.errors import sigterm_as_interrupt

    sigterm_as_interrupt()
    main()
