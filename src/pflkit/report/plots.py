"""PNG plots for runs and comparisons.

Built on :class:`matplotlib.figure.Figure` directly (Agg canvas, no pyplot), so it never
touches matplotlib's global state or needs a display.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

# Cells at most this many (clients x classes) get their count written in them.
_ANNOTATE_MAX_CELLS = 400

# metrics.jsonl keys drawn by plot_run, with their legend labels.
_ACC_KEYS = {
    "global_acc": "global model, global test set",
    "pers_acc_mean": "personalized, mean over clients",
    "pers_acc_worst10": "personalized, worst 10% of clients",
}
_LOSS_KEYS = {"train_loss": "train loss"}


def _new_figure(width: float, height: float) -> Figure:
    fig = Figure(figsize=(width, height), dpi=100)
    FigureCanvasAgg(fig)
    return fig


def _save(fig: Figure, path: Path) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png", bbox_inches="tight")


def _as_float(values: Iterable[Any]) -> np.ndarray:
    """Values to float, with None (or anything non-numeric) as NaN."""
    out = []
    for v in values:
        try:
            out.append(float(v) if v is not None else np.nan)
        except (TypeError, ValueError):
            out.append(np.nan)
    return np.asarray(out, dtype=float)


def _no_data(ax: Any, what: str) -> None:
    ax.text(0.5, 0.5, f"no {what} recorded", ha="center", va="center", transform=ax.transAxes)
    ax.set_xticks([])
    ax.set_yticks([])


def _round_axes(ax: Any, drawn: Any, ylabel: str, what: str, *entries: Any, **legend: Any) -> None:
    """Label a per-round plot (integer rounds, grid, legend of ``entries``, else of the lines'
    labels), or say it has no ``what``."""
    if not drawn:
        _no_data(ax, what)
        return
    ax.set_xlabel("round")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylabel(ylabel)
    ax.grid(True, alpha=0.3)
    ax.legend(*entries, fontsize=8, **legend)


def plot_class_heatmap(
    table: np.ndarray, path: Path, title: str = "", class_names: Sequence[str] | None = None
) -> None:
    """Heatmap of per-client class counts (rows: clients, columns: classes, labelled with
    ``class_names`` when given).

    Cells are annotated with their counts when the table is small (<= 400 cells).
    """
    table = np.asarray(table)
    if table.ndim != 2:
        raise ValueError(f"table must be 2-D [clients, classes], got shape {table.shape}")
    n_clients, n_classes = table.shape
    width = min(max(4.0, 0.45 * n_classes + 2.0), 20.0)
    height = min(max(3.0, 0.3 * n_clients + 1.5), 20.0)
    fig = _new_figure(width, height)
    ax = fig.add_subplot()
    if table.size == 0:
        _no_data(ax, "clients or classes")
    else:
        im = ax.imshow(table, aspect="auto", cmap="viridis", interpolation="nearest")
        fig.colorbar(im, ax=ax, label="samples")
        ax.set_xlabel("class")
        ax.set_ylabel("client")
        if table.size <= _ANNOTATE_MAX_CELLS:
            hi = float(table.max()) if table.size else 0.0
            for i in range(n_clients):
                for j in range(n_classes):
                    v = table[i, j]
                    colour = "black" if hi and v > 0.6 * hi else "white"
                    ax.text(j, i, f"{v:g}", ha="center", va="center", fontsize=7, color=colour)
        if n_classes <= 30:
            ax.set_xticks(range(n_classes))
            if class_names is not None and len(class_names) == n_classes:
                ax.set_xticklabels(class_names, rotation=45, ha="right", fontsize=8)
        if n_clients <= 40:
            ax.set_yticks(range(n_clients))
    if title:
        ax.set_title(title)
    _save(fig, path)


def seed_stack(runs: Sequence[tuple[np.ndarray, np.ndarray]]) -> tuple[np.ndarray, np.ndarray]:
    """The seeds' ``(rounds, values)`` on the union of their rounds: the rounds where some seed
    has a value, and a [seeds, rounds] array with NaN where a seed has none (NaN/None values
    dropped)."""
    cleaned = []
    for rounds, values in runs:
        r = _as_float(np.ravel(rounds))
        v = _as_float(np.ravel(values))
        if len(r) != len(v):
            raise ValueError(f"rounds and values differ in length ({len(r)} vs {len(v)})")
        ok = np.isfinite(r) & np.isfinite(v)
        cleaned.append((r[ok], v[ok]))
    grid = np.unique(np.concatenate([r for r, _ in cleaned])) if cleaned else np.empty(0)
    stack = np.full((len(cleaned), len(grid)), np.nan)
    for s, (r, v) in enumerate(cleaned):
        stack[s, np.searchsorted(grid, r)] = v
    has = np.isfinite(stack).any(axis=0)
    return grid[has], stack[:, has]


def _aggregate(
    runs: Sequence[tuple[np.ndarray, np.ndarray]],
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Mean, min and max over seeds on the union of rounds (NaN/None ignored)."""
    grid, stack = seed_stack(runs)
    if grid.size == 0:
        empty = np.empty(0)
        return empty, empty, empty, empty
    return grid, np.nanmean(stack, axis=0), np.nanmin(stack, axis=0), np.nanmax(stack, axis=0)


def plot_curves(
    curves: Mapping[str, Sequence[tuple[np.ndarray, np.ndarray]]],
    path: Path,
    ylabel: str,
    title: str = "",
) -> None:
    """One line per label: mean over seeds, with a shaded min..max band over seeds.

    ``curves`` maps a label (e.g. an algorithm) to a list over seeds of ``(rounds, values)``.
    Seeds may have different rounds; the mean and band at a round use the seeds that have a
    value there. None/NaN values are skipped.
    """
    fig = _new_figure(7.0, 4.5)
    ax = fig.add_subplot()
    drawn = 0
    for label, runs in curves.items():
        grid, mean, lo, hi = _aggregate(runs)
        if grid.size == 0:
            continue
        n_seeds = len(runs)
        name = f"{label} (n={n_seeds})" if n_seeds > 1 else str(label)
        marker = "o" if grid.size <= 30 else None
        (line,) = ax.plot(grid, mean, label=name, marker=marker, markersize=3)
        if n_seeds > 1:
            ax.fill_between(grid, lo, hi, color=line.get_color(), alpha=0.2, linewidth=0)
        drawn += 1
    _round_axes(ax, drawn, ylabel, ylabel or "values")
    if title:
        ax.set_title(title + ("\n(line: mean over seeds, band: min..max)" if drawn else ""))
    _save(fig, path)


def setting_title(cfg: Any, seeds: list[int] | None = None) -> str:
    """One line naming a run's setting, for plot titles."""
    d, t = cfg.data, cfg.train
    part = d.partition.get("name", "?") if isinstance(d.partition, dict) else str(d.partition)
    args = ", ".join(f"{k}={v}" for k, v in d.partition.items() if k != "name")
    runs = f", seeds {seeds}" if seeds else f", seed {cfg.seed}"
    return (
        f"{cfg.name}: {d.dataset}, {d.num_clients} clients, {part}({args}), {cfg.model.name}, "
        f"{t.rounds} rounds, fraction {t.client_fraction}, E={t.local_epochs}{runs}"
    )


def _colours(n: int) -> list[Any]:
    """n distinct colours: tab10, then tab20 for more algorithms."""
    from matplotlib import colormaps

    cmap = colormaps["tab10" if n <= 10 else "tab20"]
    return [cmap(i % cmap.N) for i in range(n)]


def plot_compare(
    curves: Mapping[str, Mapping[str, Sequence[tuple[np.ndarray, np.ndarray]]]],
    path: Path,
    title: str = "",
) -> list[str]:
    """A comparison: one colour per algorithm, its personalized accuracy solid and its global
    accuracy dashed, mean over seeds with a min..max band, in percent; the legend outside the
    axes. ``curves[label]`` maps ``"personalized"`` / ``"global"`` to a list over seeds of
    ``(rounds, values)``. A curve equal to one already drawn (e.g. two methods with the same
    global model) is not drawn again: its label joins that curve's legend entry. Returns the
    legend entries."""
    fig = _new_figure(10.0, 5.0)
    ax = fig.add_subplot()
    drawn: list[tuple[np.ndarray, np.ndarray, Any, list[str]]] = []
    for colour, (label, kinds) in zip(_colours(len(curves)), curves.items(), strict=True):
        for kind, style in (("personalized", "-"), ("global", "--")):
            grid, mean, lo, hi = _aggregate(kinds.get(kind, []))
            if grid.size == 0:
                continue
            name = f"{label}, {kind}"
            same = next(
                (d for d in drawn if d[0].shape == grid.shape and np.allclose(d[0], grid)
                 and np.allclose(d[1], mean)),
                None,
            )  # fmt: skip
            if same is not None:
                same[3].append(name)
                continue
            (line,) = ax.plot(grid, 100 * mean, style, color=colour, linewidth=1.6)
            if len(kinds[kind]) > 1:
                ax.fill_between(grid, 100 * lo, 100 * hi, color=colour, alpha=0.15, linewidth=0)
            drawn.append((grid, mean, line, [name]))
    legend = ([d[2] for d in drawn], [" = ".join(d[3]) for d in drawn])
    _round_axes(
        ax,
        drawn,
        "accuracy (%)",
        "accuracy",
        *legend,
        loc="upper left",
        bbox_to_anchor=(1.01, 1.0),
        frameon=False,
    )
    ax.set_title(
        (title + "\n" if title else "")
        + "solid: personalized (mean over clients), dashed: global model; "
        "line: mean over seeds, band: min..max",
        fontsize=9,
    )
    _save(fig, path)
    return [" = ".join(d[3]) for d in drawn]


def _series(metrics: Sequence[Mapping[str, Any]], key: str) -> tuple[np.ndarray, np.ndarray]:
    rows = [m for m in metrics if m.get(key) is not None and m.get("round") is not None]
    r = _as_float(m["round"] for m in rows)
    v = _as_float(m[key] for m in rows)
    ok = np.isfinite(r) & np.isfinite(v)
    return r[ok], v[ok]


def _panel(ax: Any, metrics: Sequence[Mapping[str, Any]], keys: dict[str, str], what: str) -> None:
    drawn = 0
    for key, label in keys.items():
        r, v = _series(metrics, key)
        if r.size == 0:
            continue
        ax.plot(r, v, label=label, marker="o" if r.size <= 30 else None, markersize=3)
        drawn += 1
    _round_axes(ax, drawn, what, what)


def plot_run(metrics: list[dict], path: Path, title: str = "") -> None:
    """One run's ``metrics.jsonl`` rows: accuracy panel in percent (global, personalized mean
    and worst 10%) and train-loss panel, under ``title`` (the run's setting). Keys may be
    missing or None in some rows."""
    fig = _new_figure(11.0, 4.2)
    ax_acc, ax_loss = fig.subplots(1, 2)
    pct = [{**m, **{k: 100 * m[k] for k in _ACC_KEYS if m.get(k) is not None}} for m in metrics]
    _panel(ax_acc, pct, _ACC_KEYS, "accuracy (%)")
    ax_acc.set_title("accuracy")
    _panel(ax_loss, metrics, _LOSS_KEYS, "train loss")
    ax_loss.set_title("train loss (mean over the round's clients)")
    if title:
        fig.suptitle(title, fontsize=10)
    _save(fig, path)


# marker per client in feature maps (filled shapes, told apart at a small size)
_MARKERS = "os^vDP*Xp<>hH8d"


def plot_feature_map(
    points: np.ndarray,
    classes: np.ndarray,
    clients: np.ndarray,
    path: Path,
    title: str = "",
    class_names: Sequence[str] | None = None,
) -> None:
    """2-D points of a feature map (``pflkit analyze features``, GPFL Fig. 2): colour by class,
    marker by client (markers repeat after 15 clients, colours after 20 classes), one legend
    each, outside the axes."""
    from matplotlib.lines import Line2D

    fig = _new_figure(8.5, 6.5)
    ax = fig.subplots()
    labels, owners = sorted(set(classes.tolist())), sorted(set(clients.tolist()))
    colour = dict(zip(labels, _colours(len(labels)), strict=True))
    marker = {c: _MARKERS[i % len(_MARKERS)] for i, c in enumerate(owners)}
    for c in owners:
        for k in labels:
            m = (clients == c) & (classes == k)
            if m.any():
                ax.scatter(*points[m].T, s=12, color=colour[k], marker=marker[c], linewidths=0)

    def handle(m: str, c: Any, label: str) -> Line2D:
        return Line2D([], [], marker=m, linestyle="", color=c, label=label)

    names = list(class_names or [])
    shown = {k: f"{k} {names[k]}" if names[k:] and names[k] != str(k) else str(k) for k in labels}
    by_class = [handle("o", colour[k], shown[k]) for k in labels]
    by_client = [handle(marker[c], "0.35", f"cid {c}") for c in owners]
    first = ax.legend(
        handles=by_class, title="class", fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1)
    )
    ax.add_artist(first)
    ax.legend(
        handles=by_client, title="client", fontsize=7, loc="lower left", bbox_to_anchor=(1.01, 0)
    )
    ax.set_xticks([])
    ax.set_yticks([])
    ax.set_title(title, fontsize=9)
    _save(fig, path)
