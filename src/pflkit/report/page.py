"""The results page (``pflkit report --html DIR``): one self-contained HTML file of finished
runs that a browser opens from disk, with no server and no network.

It holds, for the runs that :func:`pflkit.report.results.find_settings` reads:

- one sortable, searchable table per protocol (the ``at`` of
  :func:`~pflkit.report.results.build_report`: last round, mean of the last rounds, the round
  chosen on validation, best round on test), a mean and a std column per metric, with the
  numbers of :func:`~pflkit.report.results.build_report` (the same as the markdown table);
- per metric, each setting's curve over rounds: the mean over seeds, shaded ± one std over
  seeds (population std, as the tables);
- the config keys whose values differ between settings (and, folded, the shared ones);
- the partition heatmap (clients x classes sample counts, train + test (+ validation) as
  ``pflkit partition`` counts them), rebuilt from the runs' config without downloading.

The tables are DataTables through ``itables`` and the plots Plotly figures; both libraries'
JavaScript is inlined once.
"""

from __future__ import annotations

import html
import json
import math
from pathlib import Path
from typing import Any

import numpy as np

from pflkit.errors import PflkitError
from pflkit.report.results import (
    AT,
    FAIRNESS,
    METRICS,
    Setting,
    build_report,
    canonical_metric,
    metric_title,
    percent,
)

PAGE = "report.html"
_AT_TITLE = {
    "last": "Last round",
    "mean_last": "Mean of the last evaluated rounds (eval.last)",
    "val_round": "Round chosen on validation",
    "best_test": "Best round on test (paper protocol, optimistic)",
}
CURVES = {**METRICS, "train_loss": "train loss"}


def _needs() -> tuple[Any, Any]:
    try:
        import itables
        import plotly
    except ImportError:
        raise PflkitError(
            "pflkit report --html needs plotly and itables: pip install 'pflkit[report]'"
        ) from None
    return plotly, itables


def protocols(settings: list[Setting]) -> list[str]:
    """The ``at`` values every run can report: last and best_test always, mean_last when
    each run has eval.last > 0, val_round when each has a validation split."""
    runs = [r for s in settings for r in s.runs]
    out = []
    for at in AT:
        if at in ("mean_last", "val_round") and not all(at in r.summary for r in runs):
            continue
        out.append(at)
    return out


def protocol_frame(settings: list[Setting], at: str, metric: str) -> Any:
    """A DataFrame of :func:`build_report`'s numbers at ``at``: one row per setting, the mean
    and std over seeds (in %; the CV over clients x 100) of each metric, the p-value against
    the best on ``metric`` (empty for the best), KB per client and round, seconds per round,
    as text with the markdown table's rounding. A number no run of a setting records is an
    empty cell."""
    import pandas as pd

    numbers = build_report(settings, at=at, metric=metric).numbers
    metric = canonical_metric(metric)
    shown = METRICS | {metric: metric_title(metric)} | (FAIRNESS if at == "best_test" else {})
    rows = []
    for label, n in numbers.items():
        cols = n["final" if at == "last" else at]
        row: dict[str, Any] = {"setting": label, "algorithm": n["algorithm"]}
        row["seeds"] = len(n["seeds"])
        for key, name in shown.items():
            shares = key != "pers_acc_cv" and percent(key)
            v = np.asarray(cols.get(key, []), dtype=float) * (100 if shares else 1)
            row[f"{name} mean"] = f"{v.mean():.2f}" if v.size else ""
            row[f"{name} std"] = f"{v.std():.2f}" if v.size else ""
        p = n["p_vs_best"]
        row["p vs best"] = "" if p is None else f"{p:.3f}"
        row["KB / client / round"] = f"{n['bytes_per_client_round'] / 1024:.1f}"
        row["s / round"] = f"{n['seconds_per_round']:.2f}"
        rows.append(row)
    # numbers as text, rounded as the markdown table rounds them: DataTables sorts a column of
    # numeric text (and empty cells) as numbers
    return pd.DataFrame(rows)


def curve_figure(settings: list[Setting], key: str) -> Any:
    """The Plotly figure of ``key`` over rounds: per setting, the mean over seeds (line) and
    mean ± std over seeds (shaded); None when no run records ``key``."""
    import plotly.graph_objects as go
    from plotly.colors import qualitative

    from pflkit.report.plots import _series, seed_stack

    scale = 1 if key == "train_loss" else 100
    fig = go.Figure()
    palette = qualitative.Plotly + qualitative.D3
    for i, s in enumerate(settings):
        grid, stack = seed_stack([_series(r.rows, key) for r in s.runs])
        if grid.size == 0:
            continue
        mean = np.nanmean(stack, axis=0) * scale
        std = np.nanstd(stack, axis=0) * scale
        colour = palette[i % len(palette)]
        group = f"g{i}"
        fig.add_trace(
            go.Scatter(
                x=np.concatenate([grid, grid[::-1]]).tolist(),
                y=np.concatenate([mean + std, (mean - std)[::-1]]).tolist(),
                fill="toself",
                fillcolor=colour,
                opacity=0.2,
                line={"width": 0},
                hoverinfo="skip",
                showlegend=False,
                legendgroup=group,
                name=f"{s.label} ± std",
            )
        )
        fig.add_trace(
            go.Scatter(
                x=grid.tolist(),  # plain lists: the page's data reads as numbers in the browser
                y=mean.tolist(),
                mode="lines",
                line={"color": colour},
                name=f"{s.label} (n={len(s.runs)})",
                legendgroup=group,
            )
        )
    if not fig.data:
        return None
    fig.update_layout(
        title=f"{CURVES[key]}: mean over seeds, band ± std over seeds",
        xaxis_title="round",
        yaxis_title=CURVES[key],
        height=460,
        margin={"t": 50, "l": 60, "r": 20, "b": 50},
        legend={"font": {"size": 11}},
    )
    return fig


def _flat(d: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(d, dict) or not d:
        return {prefix: d} if prefix else {}
    out: dict[str, Any] = {}
    for k, v in d.items():
        out |= _flat(v, f"{prefix}.{k}" if prefix else str(k))
    return out


def config_diff(settings: list[Setting]) -> tuple[list[str], dict[str, dict[str, Any]], dict]:
    """The flattened config keys (``train.lr``, ``algorithm.mu``) whose values differ between
    the settings' runs, each setting's values of them (a key a run lacks: None; a setting
    whose seeds disagree on a key: their values joined by " | "), and the keys all runs share
    with their value. ``seed`` is left out: it tells the runs of one setting apart."""
    flats = {s.label: [_flat(r.config) for r in s.runs] for s in settings}
    keys = list(dict.fromkeys(k for fl in flats.values() for f in fl for k in f if k != "seed"))
    differ, shared = [], {}
    for k in keys:
        seen = {json.dumps(f.get(k), sort_keys=True) for fl in flats.values() for f in fl}
        if len(seen) > 1:
            differ.append(k)
        else:
            shared[k] = next(iter(flats.values()))[0].get(k)
    values = {}
    for label, fl in flats.items():
        row = {}
        for k in differ:
            vals = list(dict.fromkeys(json.dumps(f.get(k), sort_keys=True) for f in fl))
            row[k] = json.loads(vals[0]) if len(vals) == 1 else " | ".join(vals)
        values[label] = row
    return differ, values, shared


def partition_tables(settings: list[Setting]) -> list[tuple[str, Any, str]]:
    """Per distinct partition of the runs (``partition_id``): a title and its clients x
    classes counts rebuilt from the first run's config with ``download: false``, or a title,
    None and the sentence saying why it could not be rebuilt (data not on this machine, a
    plugin that is not importable)."""
    from pflkit.data.federated import build_federated
    from pflkit.experiment import validate

    firsts: dict[str, Any] = {}
    for s in settings:
        for r in s.runs:
            firsts.setdefault(str(r.summary.get("partition_id", "")), r)
    out = []
    for pid, run in firsts.items():
        raw = json.loads(json.dumps(run.config))
        raw.setdefault("data", {})["download"] = False
        d = raw["data"]
        part = dict(d.get("partition") or {})
        args = ", ".join(f"{k}={v}" for k, v in part.items() if k != "name")
        title = (
            f"{d.get('dataset')}, {d.get('num_clients')} clients, {part.get('name')}({args}) "
            f"(id {pid})"
        )
        try:
            data = build_federated(validate(raw).data)
            splits = ["train", "test"] + (["val"] if data.has_val else [])
            table = sum(data.class_table(s) for s in splits)
        except (PflkitError, OSError) as err:
            out.append((title, None, str(err)))
            continue
        note = f"samples ({' + '.join(splits)}) per client and class"
        if pid and data.partition_id != pid:
            note += (
                f"; rebuilt partition id {data.partition_id} differs from the runs' {pid} "
                "(the data or pflkit changed since)"
            )
        out.append((title, (table, data.class_names), note))
    return out


def heatmap_figure(table: np.ndarray, class_names: list[str] | None, title: str) -> Any:
    """The Plotly heatmap of a clients x classes count table."""
    import plotly.graph_objects as go

    n_clients, n_classes = table.shape
    names = class_names if class_names and len(class_names) == n_classes else None
    x = [str(c) if names is None else f"{c}: {names[c]}" for c in range(n_classes)]
    fig = go.Figure(
        go.Heatmap(
            z=table,
            x=x,
            y=[str(c) for c in range(n_clients)],
            colorscale="Viridis",
            colorbar={"title": {"text": "samples"}},
            hovertemplate="client %{y}, class %{x}: %{z} samples<extra></extra>",
        )
    )
    fig.update_layout(
        title=title,
        xaxis_title="class",
        yaxis_title="client",
        yaxis={"autorange": "reversed", "type": "category"},
        xaxis={"type": "category"},
        height=min(max(320, 14 * n_clients + 140), 1400),
        margin={"t": 50, "l": 60, "r": 20, "b": 80},
    )
    return fig


_STYLE = """
body { font-family: system-ui, sans-serif; margin: 0 auto; max-width: 1300px; padding: 0 1.5em 3em;
       color: #222; }
h1 { font-size: 1.6em; } h2 { margin-top: 2em; border-bottom: 1px solid #ddd; }
nav a { margin-right: 1.2em; } p.note { color: #555; } details { margin: 1em 0; }
section.plot { margin: 1em 0; } .dt-container { overflow-x: auto; }
"""


def _table_html(frame: Any, caption: str) -> str:
    from itables import to_html_datatable

    return to_html_datatable(
        frame,
        caption=caption,
        connected=False,
        showIndex=False,
        paging=False,
        layout={"topStart": None, "topEnd": "search", "bottomStart": None, "bottomEnd": None},
        classes="display compact",
        allow_html=False,
        text_in_header_can_be_selected=False,  # a click anywhere on a header sorts
    )


def render(settings: list[Setting], metric: str = "pers_acc_mean") -> str:
    """The page of ``settings`` as one HTML string (module docstring: what it shows)."""
    plotly, itables = _needs()
    import pandas as pd
    from itables.javascript import generate_init_offline_itables_html

    first = build_report(settings, metric=metric)
    head = first.head.split("\n", 2)
    name = head[0].removeprefix("# ")
    body = [f"<h1>{html.escape(name)}</h1>", f"<p>{html.escape(head[2].strip())}</p>"]
    body.append(
        '<nav><a href="#tables">tables</a><a href="#curves">curves</a>'
        '<a href="#config">config diff</a><a href="#partition">partition</a></nav>'
    )
    body.append('<h2 id="tables">Tables</h2>')
    body.append(
        '<p class="note">Click a column header to sort (shift-click: by several columns); the '
        "search box filters rows. Mean and std over seeds, in %; p: two-sided paired t-test "
        f"over seeds against the best setting on {html.escape(metric_title(metric))} (the best "
        "has none); an empty cell: a number the setting does not record.</p>"
    )
    for at in protocols(settings):
        frame = protocol_frame(settings, at, metric)
        body.append(f'<h3 id="at-{at}">{html.escape(_AT_TITLE[at])}</h3>')
        body.append(_table_html(frame, f"at = {at}"))
    body.append('<h2 id="curves">Curves</h2>')
    for key in CURVES:
        fig = curve_figure(settings, key)
        if fig is not None:
            body.append(f'<section class="plot" id="curve-{key}">{_figure_html(fig)}</section>')
    body.append('<h2 id="config">Config diff</h2>')
    differ, values, shared = config_diff(settings)
    if differ:
        frame = pd.DataFrame(
            [
                {"setting": label} | {k: _cell(v) for k, v in row.items()}
                for label, row in values.items()
            ]
        )
        body.append(_table_html(frame, "config keys whose values differ between settings"))
    else:
        body.append("<p>Every setting has the same config (but for the seed).</p>")
    rows = "".join(
        f"<tr><td><code>{html.escape(k)}</code></td><td>{html.escape(_cell(v))}</td></tr>"
        for k, v in shared.items()
    )
    body.append(
        f"<details><summary>{len(shared)} config keys every run shares</summary>"
        f"<table>{rows}</table></details>"
    )
    body.append('<h2 id="partition">Partition</h2>')
    for title, drawn, note in partition_tables(settings):
        if drawn is None:
            body.append(f"<p class='note'>{html.escape(title)}: not drawn, {html.escape(note)}</p>")
            continue
        fig = heatmap_figure(drawn[0], drawn[1], f"{title}: {note}")
        body.append(f'<section class="plot" id="partition-map">{_figure_html(fig)}</section>')
    page = "\n".join(body)
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        f"<title>{html.escape(name)}: pflkit results</title>"
        f"<style>{_STYLE}</style>"
        f'<script type="text/javascript">{plotly.offline.get_plotlyjs()}</script>'
        f"{generate_init_offline_itables_html(itables.options.dt_bundle)}"
        f"</head><body>\n{page}\n</body></html>\n"
    )


def _figure_html(fig: Any) -> str:
    """A figure's div and script; plotly.js itself is inlined once, in the page's head."""
    return fig.to_html(
        full_html=False,
        include_plotlyjs=False,
        config={"displaylogo": False, "responsive": True},
        default_width="100%",
    )


def _cell(v: Any) -> str:
    if isinstance(v, float) and math.isnan(v):
        return "nan"
    return v if isinstance(v, str) else json.dumps(v)


def check_page_folder(folder: Path) -> None:
    """Refuse an ``--html`` path that is a file: the page goes into a folder."""
    if folder.exists() and not folder.is_dir():
        raise PflkitError(
            f"--html '{folder}' is a file, not a folder: give a folder to write {PAGE} into, "
            f"e.g. --html {folder.parent / (folder.stem + '-page')}"
        )


def write_page(settings: list[Setting], folder: Path, metric: str = "pers_acc_mean") -> Path:
    """Write the page of ``settings`` as ``folder/report.html`` (whole or not at all) and
    return its path; ``folder`` is created if needed."""
    from pflkit.engine.folder import make_folder, write_atomic

    check_page_folder(folder)
    text = render(settings, metric)
    make_folder(folder, "results page folder")
    path = folder / PAGE
    write_atomic(path, text, fix="choose another --html folder")
    return path
