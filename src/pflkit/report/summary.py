"""Run summaries: the last-round numbers (the reported result), the mean over the last rounds,
the round chosen on validation, labelled best-on-test numbers (among them the paper protocol
of GPFL and many pFL papers: every number at the round of best pooled test accuracy),
communication totals and timing, all derived from the rows of ``metrics.jsonl``. Runs that
sample their evaluation, have untrained or held-out clients carry those numbers too
(:data:`POPULATION_KEYS`: estimates' standard errors, ``pers_acc_trained`` /
``pers_acc_untrained``, ``holdout_acc_*`` and the counts)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np

from pflkit.errors import PflkitError

ACC_KEYS = (
    "global_acc",
    "pers_acc_mean",
    "pers_acc_weighted",
    "pers_acc_std",
    "pers_acc_cv",
    "pers_acc_worst10",
    "pers_acc_selected",
)
# a run with a validation split (data.val_fraction) records these too: "val_" + a test metric
VAL_KEYS = tuple(f"val_{k}" for k in ACC_KEYS if k not in ("pers_acc_selected", "pers_acc_cv"))
# what sampled evaluation (eval.clients: n), the trained / untrained split and held-out clients
# (data.holdout_clients) add to a row (docs/guide.md, "Evaluation"); absent from runs that
# scored every client, all of them trained, without held-out clients
POPULATION_KEYS = (
    "eval_clients",
    "pers_acc_mean_se",
    "pers_acc_weighted_se",
    "pers_acc_trained",
    "pers_acc_untrained",
    "eval_trained",
    "eval_untrained",
    "holdout_acc_mean",
    "holdout_acc_weighted",
    "holdout_acc_std",
    "holdout_acc_cv",
    "holdout_acc_worst10",
    "holdout_acc_mean_se",
    "holdout_acc_weighted_se",
    "eval_holdout",
)
REPORTED_KEYS = (*ACC_KEYS, *VAL_KEYS, *POPULATION_KEYS)


def read_metrics(
    path: Path, skip_corrupt: bool = False, skipped: list[int] | None = None
) -> list[dict[str, Any]]:
    """The rows of a metrics.jsonl. A line that is not a JSON object with an integer
    ``round`` (a torn write, a damaged file) is refused in one sentence naming the file and
    the line number; with ``skip_corrupt`` it is left out and its number appended to
    ``skipped``. Blank lines are ignored. A partial last line counts as corrupt too: the
    readers of finished runs call this (a run being written, or killed mid-write, has its
    torn line cut by ``pflkit run --resume``, :func:`pflkit.engine.folder.keep_rows`)."""
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError as err:
        raise PflkitError(
            f"cannot read metrics file '{path}' ({err.strerror or err}): restore it"
        ) from None
    rows = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError:
            row = None
        if isinstance(row, dict) and isinstance(row.get("round"), int):
            rows.append(row)
        elif skip_corrupt:
            if skipped is not None:
                skipped.append(number)
        else:
            raise PflkitError(
                f"metrics file '{path}' has a corrupt line {number} (not a JSON metrics row): "
                "restore the file from a copy, rerun the run, or pass --skip-corrupt to leave "
                "such lines out (the table's footnote then says so)"
            )
    return rows


def _finite(v: Any) -> bool:
    return isinstance(v, int | float) and math.isfinite(v)


def _window_mean(window: list[dict[str, Any]], key: str) -> float | None:
    """The mean of ``key`` over the rows of ``window`` that record a number for it (a row
    without untrained clients has no ``pers_acc_untrained``; a standard error from one sampled
    client is null); None when none does. A mean of standard errors bounds the standard error
    of the mean of the rounds' estimates from above, not equal to it."""
    got = [r[key] for r in window if r.get(key) is not None]
    return float(np.mean(got)) if got else None


def best_test(rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The paper protocol (GPFL, ICCV 2023, and most pFL papers), optimistic: the evaluated
    round with the highest pooled personalized test accuracy (``pers_acc_weighted``: all
    clients' correct predictions over all their test samples; the first of tied best rounds)
    and every accuracy of that round, so ``pers_acc_std`` and ``pers_acc_cv`` are GPFL's
    Table 3 fairness numbers "at the round of best average accuracy". Only evaluated rounds
    count: with ``eval.every`` > 1 it is the best of those (GPFL evaluates every round). None
    when no row has a finite pooled accuracy."""
    scored = [r for r in rows if _finite(r.get("pers_acc_weighted"))]
    if not scored:
        return None
    best = max(scored, key=lambda r: r["pers_acc_weighted"])  # the first of the best
    return {"round": best["round"]} | {k: best[k] for k in reported(best)}


def reported(row: dict[str, Any]) -> list[str]:
    """The fields of ``row`` a summary reports: :data:`REPORTED_KEYS` and those of the metrics
    that ``eval.metrics`` added (:func:`pflkit.eval.metrics.fields_in`, their per-client lists
    aside)."""
    from pflkit.eval.metrics import fields_in

    return [k for k in REPORTED_KEYS if k in row] + list(fields_in(row))


def summarize(rows: list[dict[str, Any]], last: int = 0) -> dict[str, Any]:
    """Summary of one run. ``final`` is the last evaluated round (what papers should report);
    ``mean_last`` (when ``last`` > 0, ``eval.last``) the mean over the evaluated rounds among the
    last ``last`` rounds; ``val_round`` (runs with a validation split), for each test metric
    with a validation twin, the evaluated round with the highest validation value (the first on
    ties) and the test value there; ``best_on_test`` picks the best round *on the test data*
    and is labelled as such, as does ``best_test`` (:func:`best_test`). The metrics of
    ``eval.metrics`` beyond accuracy are reported the same way (lower is better for loss,
    perplexity and ECE: ``val_round`` takes their lowest validation value)."""
    from pflkit.eval.metrics import fields_in

    evaluated = [r for r in rows if "pers_acc_mean" in r]
    out: dict[str, Any] = {"rounds": rows[-1]["round"] if rows else 0}
    if evaluated:
        last_row = evaluated[-1]
        keys = reported(last_row)
        out["final"] = {"round": last_row["round"]} | {k: last_row[k] for k in keys}
        if last:
            window = [r for r in evaluated if r["round"] > out["rounds"] - last]
            out["mean_last"] = {"rounds": [window[0]["round"], window[-1]["round"]]} | {
                k: _window_mean(window, k) for k in keys
            }
        val_round = {}
        chosen_metrics = fields_in(last_row)
        lower = {k for k, m in chosen_metrics.items() if not m.higher_is_better}
        for k in (*ACC_KEYS, *chosen_metrics):
            scored = [r for r in evaluated if f"val_{k}" in r and k in r]
            if scored:
                sign = -1 if k in lower else 1  # the lowest loss, the highest accuracy
                # the first of the best
                chosen = max(scored, key=lambda r, k=k: sign * r[f"val_{k}"])
                val_round[k] = {
                    "round": chosen["round"],
                    "value": chosen[k],
                    "val": chosen[f"val_{k}"],
                }
        if val_round:
            out["val_round"] = val_round
        out["best_on_test"] = {
            k: {
                "value": max(r[k] for r in evaluated),
                "round": max(evaluated, key=lambda r: r[k])["round"],
            }
            for k in ("global_acc", "pers_acc_mean")
            if k in last_row
        }
        best = best_test(evaluated)
        if best is not None:
            out["best_test"] = best
    private = [r for r in rows if "dp_epsilon" in r]
    if private:  # client-level DP: the budget the whole run spent (privacy.client_dp)
        out["privacy"] = {
            k.removeprefix("dp_"): v for k, v in private[-1].items() if k.startswith("dp_")
        }
    down = [b for r in rows for b in r["bytes_down"]]
    up = [b for r in rows for b in r["bytes_up"]]
    out["comm"] = {
        "bytes_down_total": int(sum(down)),
        "bytes_up_total": int(sum(up)),
        "bytes_down_per_client_round": float(np.mean(down)) if down else 0.0,
        "bytes_up_per_client_round": float(np.mean(up)) if up else 0.0,
    }
    if rows:
        out["seconds"] = {
            "train_per_round": float(np.mean([r["seconds_train"] for r in rows])),
            "eval_per_round": float(
                np.mean([r["seconds_eval"] for r in rows if "pers_acc_mean" in r] or [0.0])
            ),
            "total": float(sum(r["seconds_train"] + r["seconds_eval"] for r in rows)),
        }
    return out
