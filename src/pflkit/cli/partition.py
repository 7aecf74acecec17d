"""``pflkit partition`` (a partition's class counts and heatmap) and ``pflkit export`` (the
partition written for other libraries)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from pflkit.cli.common import _usable_path, out_console
from pflkit.cli.options import ConfigArg, ImportOpt, SetOpt
from pflkit.errors import PflkitError
from pflkit.experiment import load_config


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
