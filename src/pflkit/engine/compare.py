"""``pflkit compare``: several algorithms on the same partition and client-sampling sequence,
over several training seeds; a markdown table (mean ± std over seeds, last round) and curves.

Output folder::

    <out>/compare.yaml         the config the compare was started with (its identity)
    <out>/<label>-s<seed>/     one run folder per algorithm and seed
    <out>/results.md           the table
    <out>/results.json         the same numbers, machine-readable
    <out>/accuracy.png         personalized (and global) accuracy curves, mean and band over seeds

Resumable: running the same compare into the same folder again skips every finished run
(``summary.json``), resumes every interrupted one from its checkpoint and starts the rest; a
folder started with another config is refused. ``jobs`` > 1 runs that many whole runs at
once, each in its own process with one client runner in-process (``engine.workers: 1``) and
``threads`` torch threads (default 1): the numbers equal a one-job compare at the same
thread count.
"""

from __future__ import annotations

import json
import multiprocessing
from concurrent.futures import FIRST_EXCEPTION, ProcessPoolExecutor, wait
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from pflkit.algorithms.base import resolve_params
from pflkit.config import ExperimentConfig, validate
from pflkit.data.federated import FederatedDataset, build_federated
from pflkit.engine.folder import make_folder, write_atomic
from pflkit.engine.runner import RunResult, run_experiment
from pflkit.errors import PflkitError, RunInterrupted
from pflkit.report.summary import read_metrics

MANIFEST = "compare.yaml"
# keys that may differ when a compare is continued: they do not change a run's numbers
_FREE = ("engine", "output", "threads", "compare")

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


def _claim(out: Path, cfg: ExperimentConfig) -> None:
    """Start ``out`` as a compare of ``cfg``, or accept it as one already started with the same
    config."""
    identity = {k: v for k, v in cfg.model_dump(mode="json").items() if k not in _FREE}
    text = yaml.safe_dump(identity, sort_keys=True)
    manifest = out / MANIFEST
    if manifest.exists():
        if manifest.read_text() != text:
            raise PflkitError(
                f"compare folder '{out}' holds a compare of another config (only engine, "
                "output, threads and compare may change when continuing one): choose another --out"
            )
        return
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise PflkitError(
            f"'{out}' already exists and is not an empty folder or a pflkit compare folder: "
            "choose another --out"
        )
    make_folder(out, "compare folder")
    write_atomic(manifest, text)


def _run_one(
    cfg: ExperimentConfig, folder: Path, data: FederatedDataset | None, progress: bool | None
) -> None:
    """Run ``cfg`` into ``folder``, or continue the run there (from its checkpoint, or from
    round 1 when it stopped before the first one)."""
    if (folder / "config.yaml").exists():
        run_experiment(resume=folder, data=data, progress=progress)
    else:
        run_experiment(cfg, out=folder, data=data, progress=progress)


def _job(cfg_json: dict[str, Any], folder: str) -> str:
    """One whole run in a ``jobs`` worker process."""
    _run_one(validate(cfg_json), Path(folder), None, progress=False)
    return Path(folder).name


def _load(folder: Path) -> RunResult:
    summary = json.loads((folder / "summary.json").read_text())
    return RunResult(folder, summary, read_metrics(folder / "metrics.jsonl"))


def _run_all(tasks: list[tuple[ExperimentConfig, Path]], cfg, jobs: int, progress) -> None:
    todo = [(c, f) for c, f in tasks if not (f / "summary.json").exists()]
    if jobs == 1:
        data = build_federated(cfg.data) if todo else None  # one partition for every run
        for run_cfg, folder in todo:
            _run_one(run_cfg, folder, data, progress)
        return
    from rich.console import Console

    console = Console(stderr=True)
    ctx = multiprocessing.get_context("spawn")  # a fresh interpreter: safe after torch threads
    done = len(tasks) - len(todo)
    with ProcessPoolExecutor(min(jobs, max(len(todo), 1)), mp_context=ctx) as pool:
        futures = []
        for run_cfg, folder in todo:
            solo = run_cfg.model_copy(
                update={
                    "threads": run_cfg.threads or 1,
                    "engine": run_cfg.engine.model_copy(update={"workers": 1}),
                }
            )
            futures.append(pool.submit(_job, solo.model_dump(mode="json"), str(folder)))
        try:
            pending = set(futures)
            while pending:
                finished, pending = wait(pending, return_when=FIRST_EXCEPTION)
                for f in finished:
                    name = f.result()  # re-raises a run's error here
                    done += 1
                    if progress is not False:
                        console.print(f"[{done}/{len(tasks)}] {name} finished")
        except BaseException:
            for f in futures:
                f.cancel()
            raise


def run_compare(
    cfg: ExperimentConfig, out: str | Path, progress: bool | None = None, jobs: int = 1
) -> dict[str, Any]:
    out = Path(out)
    if jobs < 1:
        raise PflkitError(f"jobs must be at least 1 (got {jobs}): pass --jobs 1 or more")
    algorithms = _normalise(cfg.compare.algorithms, cfg.train.weighting)
    seeds = cfg.compare.seeds
    _claim(out, cfg)
    tasks = [
        (
            cfg.model_copy(
                update={"algorithm": resolve_params(a, cfg.train.weighting), "seed": seed}
            ),
            out / f"{_label(a)}-s{seed}",
        )
        for a in algorithms
        for seed in seeds
    ]
    try:
        _run_all(tasks, cfg, jobs, progress)
    except (KeyboardInterrupt, RunInterrupted):
        raise RunInterrupted(
            f"compare interrupted: run the same command with --out {out} to continue it "
            "(finished runs are kept, interrupted ones resume from their checkpoints)"
        ) from None

    results: dict[str, dict[str, Any]] = {}
    partition_id = ""
    for algo in algorithms:
        label = _label(algo)
        runs = [_load(out / f"{label}-s{seed}") for seed in seeds]
        partition_id = runs[0].summary.get("partition_id", "")
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

    table = _markdown(cfg, results, seeds, partition_id)
    (out / "results.md").write_text(table)
    serial = {lab: {k: v for k, v in r.items() if k != "curves"} for lab, r in results.items()}
    (out / "results.json").write_text(json.dumps(serial, indent=2) + "\n")
    from pflkit.report.plots import plot_compare, setting_title

    curves = {
        lab: {"personalized": r["curves"]["pers_acc_mean"], "global": r["curves"]["global_acc"]}
        for lab, r in results.items()
    }
    plot_compare(curves, out / "accuracy.png", title=setting_title(cfg, seeds))
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
