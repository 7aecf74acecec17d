"""The overhead of each setting, from its finished runs' metrics (pFedSim's Table 7 and more):
seconds per round of client training, of server aggregation and of evaluation, local training
seconds per training sample (pFedSim's xi_p), and bytes down / up per client per round.

Every number is read from the runs' ``metrics.jsonl`` rows (``seconds_train``,
``seconds_aggregate``, ``seconds_eval``, ``bytes_down``, ``bytes_up``, ``clients``); nothing
is rerun. The clients' training-set sizes come from the run's partition (rebuilt, or read from
the partition cache, once per data config). Timings are wall-clock and only as good as the
machine was quiet: compare settings run side by side on one machine.

- client training = ``seconds_train - seconds_aggregate`` (the training phase without the
  server's ``aggregate`` calls); runs from before ``seconds_aggregate`` was recorded show "–"
  for aggregation and count it in client training (marked "*").
- xi_p = (client training seconds summed over rounds) / (training samples of the round's
  clients summed over rounds): pFedSim's Eq. in App. B.2 averages time / |D_i| over rounds and
  clients, which needs per-client times; this is the sample-weighted version of that mean, the
  same number when every client trains at one speed per sample.
- evaluation = ``seconds_eval`` over the rounds that evaluated.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

from pflkit.report.results import Run, Setting, Table

COLUMNS = [
    "setting",
    "seeds",
    "client training s / round",
    "aggregation s / round",
    "evaluation s / evaluated round",
    "xi_p (1e-4 s / training sample)",
    "KB down / client / round",
    "KB up / client / round",
]


def run_overhead(run: Run, train_sizes: Sequence[int]) -> dict[str, Any]:
    """One run's overhead numbers; ``train_sizes[c]`` is client c's training-set size."""
    rows = run.rows
    has_agg = all("seconds_aggregate" in r for r in rows)
    agg = [r.get("seconds_aggregate", 0.0) for r in rows]
    client = [r["seconds_train"] - a for r, a in zip(rows, agg, strict=True)]
    samples = sum(train_sizes[c] for r in rows for c in r["clients"])
    evals = [r["seconds_eval"] for r in rows if "pers_acc_mean" in r]
    down = [b for r in rows for b in r["bytes_down"]]
    up = [b for r in rows for b in r["bytes_up"]]
    return {
        "client_s": statistics.fmean(client),
        "aggregate_s": statistics.fmean(agg) if has_agg else None,
        "eval_s": statistics.fmean(evals) if evals else None,
        "xi_p": sum(client) / samples if samples else None,
        "kb_down": statistics.fmean(down) / 1024 if down else 0.0,
        "kb_up": statistics.fmean(up) / 1024 if up else 0.0,
    }


def _ms(xs: list[float | None], scale: float = 1.0, digits: int = 3) -> str:
    if not xs or any(x is None for x in xs):
        return "–"
    m = statistics.fmean(xs) * scale
    s = statistics.stdev(xs) * scale if len(xs) > 1 else 0.0
    return f"{m:.{digits}f} ± {s:.{digits}f}"


def overhead_table(settings: list[Setting], train_sizes) -> Table:
    """The overhead table of ``settings``: mean ± std over each setting's runs (seeds).
    ``train_sizes(run)`` gives a run's per-client training-set sizes."""
    rows = []
    for s in settings:
        per_run = [run_overhead(r, train_sizes(r)) for r in s.runs]
        old = any(x["aggregate_s"] is None for x in per_run)
        col = {k: [x[k] for x in per_run] for k in per_run[0]}
        rows.append(
            [
                s.label,
                str(len(s.runs)),
                _ms(col["client_s"]) + (" *" if old else ""),
                _ms(col["aggregate_s"], digits=4),
                _ms(col["eval_s"]),
                _ms(col["xi_p"], scale=1e4, digits=2),
                f"{statistics.fmean(col['kb_down']):.1f}",
                f"{statistics.fmean(col['kb_up']):.1f}",
            ]
        )
    return Table("Overhead", COLUMNS, rows)


def data_train_sizes():
    """``train_sizes(run)`` from each run's own partition (built once per data config)."""
    from pflkit.data.federated import build_federated
    from pflkit.experiment import validate

    built: dict[str, list[int]] = {}

    def sizes(run: Run) -> list[int]:
        cfg = validate(run.config)
        key = cfg.data.model_dump_json()
        if key not in built:
            built[key] = [len(c.train_y) for c in build_federated(cfg.data).clients]
        return built[key]

    return sizes


def overhead_markdown(settings: list[Setting], train_sizes=None) -> str:
    """The overhead table as markdown, with a line saying how each number was measured."""
    table = overhead_table(settings, train_sizes or data_train_sizes())
    return (
        table.markdown() + "\nMean ± std over seeds, wall-clock from the runs' metrics; client "
        "training excludes the server's aggregation (* runs that did not record it: aggregation "
        "included); xi_p: client training seconds per training sample of the round's clients.\n"
    )
