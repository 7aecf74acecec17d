"""``pflkit compare``: several algorithms on the same partition and client-sampling sequence,
over several training seeds; a markdown table (mean ± std over seeds, last round) and curves.

Output folder::

    <out>/<label>-s<seed>/     one run folder per algorithm and seed
    <out>/results.md           the table
    <out>/results.json         the same numbers, machine-readable
    <out>/accuracy.png         personalized (and global) accuracy curves, mean and band over seeds
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from pflkit.algorithms.base import resolve_params
from pflkit.config import ExperimentConfig
from pflkit.data.federated import build_federated
from pflkit.engine.runner import run_experiment
from pflkit.errors import PflkitError

COLUMNS = [
    ("pers_acc_mean", "personalized acc (%)"),
    ("pers_acc_weighted", "weighted (%)"),
    ("pers_acc_worst10", "worst 10% (%)"),
    ("global_acc", "global acc (%)"),
]


def _label(algo: dict[str, Any]) -> str:
    extra = ",".join(f"{k}={v}" for k, v in algo.items() if k != "name")
    return f"{algo['name']}({extra})" if extra else algo["name"]


def _normalise(
    algorithms: list[str | dict[str, Any]], weighting: str | None
) -> list[dict[str, Any]]:
    out = [{"name": a} if isinstance(a, str) else dict(a) for a in algorithms]
    for a in out:
        if "name" not in a:
            raise PflkitError(
                f"compare algorithm entry {a} has no 'name': write {{name: fedavg, ...}}"
            )
        # unknown names, bad parameters and a clash with train.weighting fail before anything runs
        resolve_params(a, weighting)
    labels = [_label(a) for a in out]
    if len(set(labels)) != len(labels):
        raise PflkitError(
            f"compare lists the same algorithm twice ({labels}): remove the duplicate"
        )
    return out


def _fmt(values: list[float]) -> str:
    if not values:
        return "–"
    v = 100 * np.asarray(values)
    return f"{v.mean():.2f} ± {v.std():.2f}"


def run_compare(
    cfg: ExperimentConfig, out: str | Path, progress: bool | None = None
) -> dict[str, Any]:
    out = Path(out)
    algorithms = _normalise(cfg.compare.algorithms, cfg.train.weighting)
    seeds = cfg.compare.seeds
    if out.exists() and any(out.iterdir()):
        raise PflkitError(
            f"compare folder '{out}' already exists and is not empty: choose another --out"
        )
    data = build_federated(cfg.data)  # one partition for every run

    results: dict[str, dict[str, Any]] = {}
    for algo in algorithms:
        label = _label(algo)
        runs = []
        for seed in seeds:
            run_cfg = cfg.model_copy(
                update={"algorithm": resolve_params(algo, cfg.train.weighting), "seed": seed}
            )
            res = run_experiment(
                run_cfg, out=out / f"{label}-s{seed}", data=data, progress=progress
            )
            runs.append(res)
        finals = [r.summary.get("final", {}) for r in runs]
        comm = [r.summary["comm"] for r in runs]
        results[label] = {
            "final": {k: [f[k] for f in finals if k in f] for k, _ in COLUMNS},
            "bytes_per_client_round": float(
                np.mean(
                    [
                        c["bytes_down_per_client_round"] + c["bytes_up_per_client_round"]
                        for c in comm
                    ]
                )
            ),
            "seconds_per_round": float(
                np.mean(
                    [
                        r.summary["seconds"]["train_per_round"]
                        + r.summary["seconds"]["eval_per_round"]
                        for r in runs
                    ]
                )
            ),
            "curves": {
                k: [
                    (
                        np.array([row["round"] for row in r.rows if k in row]),
                        np.array([row[k] for row in r.rows if k in row]),
                    )
                    for r in runs
                ]
                for k in ("pers_acc_mean", "global_acc")
            },
        }

    table = _markdown(cfg, results, seeds, data.partition_id)
    (out / "results.md").write_text(table)
    serial = {lab: {k: v for k, v in r.items() if k != "curves"} for lab, r in results.items()}
    (out / "results.json").write_text(json.dumps(serial, indent=2) + "\n")
    from pflkit.report.plots import plot_curves

    curves = {f"{lab} (pers)": r["curves"]["pers_acc_mean"] for lab, r in results.items()}
    curves |= {
        f"{lab} (global)": r["curves"]["global_acc"]
        for lab, r in results.items()
        if any(len(x) for x, _ in r["curves"]["global_acc"])
    }
    plot_curves(curves, out / "accuracy.png", ylabel="accuracy", title=cfg.name)
    return {"table": table, "results": serial, "out": out}


def _markdown(cfg: ExperimentConfig, results: dict[str, Any], seeds: list[int], pid: str) -> str:
    d, t = cfg.data, cfg.train
    head = (
        f"# {cfg.name}\n\n"
        f"{d.dataset}, {d.num_clients} clients, partition {d.partition} (id {pid}), "
        f"model {cfg.model.name}, {t.rounds} rounds, client fraction {t.client_fraction}, "
        f"{t.local_epochs} local epoch(s), batch {t.batch_size}, lr {t.lr}; "
        f"seeds {seeds}. Last-round accuracy, mean ± std over seeds.\n\n"
    )
    cols = [c for _, c in COLUMNS] + ["KB / client / round", "s / round"]
    lines = ["| algorithm | " + " | ".join(cols) + " |", "|" + "---|" * (len(cols) + 1)]
    for label, r in results.items():
        cells = [_fmt(r["final"][k]) for k, _ in COLUMNS]
        cells += [f"{r['bytes_per_client_round'] / 1024:.1f}", f"{r['seconds_per_round']:.2f}"]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return head + "\n".join(lines) + "\n"
