"""Issue 56: the accuracy of the vectorised path (``engine.vectorize: true``) against the
per-client path over the cross-check configs, seed by seed.

For each config (default: both cross-check configs, benchmarks/crosscheck/*_xc.yaml), each
algorithm (default: every covered one, ``pflkit.engine.vectorized.covered()``) and each seed,
one run per path, in this process (``engine.workers: 1``), for ``--rounds`` rounds (default 50).
Reported per (config, algorithm): the final pooled accuracy (``pers_acc_weighted``, the
clients' local test splits pooled) per seed and path, the mean over seeds of each path, the
difference of the means, and the seed noise: the standard deviation over seeds of the
per-client path. "within noise" when the difference of the means is at most twice the
standard error of that difference (sqrt(sd_a^2 / n + sd_b^2 / n)) or at most one test sample
of the pooled split (where the seeds agree exactly). ``--subset`` trains on a Fashion-MNIST
subset and ``--clients`` overrides the client count: reduced runs for a small machine.
``--jobs N`` runs N of the (seed, path) runs at a time, each in its own process with one
thread (the accuracies do not change; the seconds are each run's own, taken while N run).

    python benchmarks/vectorize_accuracy.py                             # the full comparison
    python benchmarks/vectorize_accuracy.py --rounds 5 --algorithms fedavg,ditto \\
        --configs fmnist_practical_xc --subset 3000                     # a reduced one
    python benchmarks/vectorize_accuracy.py --jobs 2                    # two runs at a time
    python benchmarks/vectorize_accuracy.py --graphs    # engine.cuda_graphs' masked steps

Writes nothing but its table (stdout), one markdown row per (config, algorithm), and a
progress line per run (stderr).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path

import torch
import yaml

from pflkit.engine.clients import InProcess
from pflkit.engine.simulation import Simulation
from pflkit.engine.vectorized import covered
from pflkit.experiment import validate

HERE = Path(__file__).resolve().parent / "crosscheck"
CONFIGS = ["fmnist_practical_xc", "fmnist_dir01_xc"]
METRIC = "pers_acc_weighted"


def final_accuracy(raw: dict, vectorize: bool, graphs: bool = False) -> tuple[float, float, int]:
    """The last round's pooled personalized accuracy, the run's seconds and the pooled
    test split's size. ``graphs``: the vectorised runner with ``engine.cuda_graphs``' steps
    (captured on cuda, run as written on cpu, where the config option is refused)."""
    cfg = validate({**raw, "engine": {"workers": 1, "vectorize": vectorize}})
    runner = InProcess(vectorize, graphs) if graphs else None
    t0 = time.perf_counter()
    with Simulation(cfg, runner=runner) as sim:
        for rnd in range(1, cfg.train.rounds + 1):
            row = sim.run_round(rnd)
        pooled_test = int(sim.counts["test"].sum())
    return row[METRIC], time.perf_counter() - t0, pooled_test


def within_noise(per_client: list[float], vectorised: list[float], pooled_test: int) -> bool:
    """The difference of the means is at most twice its standard error, or at most one test
    sample of the pooled split."""
    n = len(per_client)
    diff = statistics.mean(vectorised) - statistics.mean(per_client)
    sd_a = statistics.stdev(per_client) if n > 1 else 0.0
    sd_b = statistics.stdev(vectorised) if n > 1 else 0.0
    se = (sd_a**2 / n + sd_b**2 / n) ** 0.5
    return abs(diff) <= max(2 * se, 1 / pooled_test)


def run_all(
    units: list[tuple[dict, bool]], jobs: int, graphs: bool = False
) -> Iterator[tuple[float, float, int]]:
    """``final_accuracy`` of every (config, vectorize) unit, in order: in this process, or in
    ``jobs`` fresh processes with one thread each; ``graphs``: the vectorised units graphed."""
    if jobs == 1:
        yield from (final_accuracy(raw, vec, graphs and vec) for raw, vec in units)
        return
    ctx = get_context("spawn")
    with ProcessPoolExecutor(
        jobs, mp_context=ctx, initializer=torch.set_num_threads, initargs=(1,)
    ) as pool:
        yield from pool.map(
            final_accuracy,
            [r for r, _ in units],
            [v for _, v in units],
            [graphs and v for _, v in units],
        )


def fail(sentence: str) -> int:
    """A bad input: its one sentence on stderr, exit status 2."""
    print(f"error: {sentence}", file=sys.stderr)
    return 2


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--configs", default=",".join(CONFIGS), help="cross-check config names")
    ap.add_argument("--algorithms", default=",".join(covered()), help="covered algorithms")
    ap.add_argument("--seeds", default="0,1,2", help="training seeds")
    ap.add_argument("--rounds", type=int, default=50)
    ap.add_argument("--subset", type=int, help="a Fashion-MNIST subset (reduced runs)")
    ap.add_argument("--clients", type=int, help="data.num_clients (reduced runs)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--jobs", type=int, default=1, help="runs at a time, one process each")
    ap.add_argument(
        "--graphs",
        action="store_true",
        help="the vectorised path with engine.cuda_graphs' steps (uncaptured on cpu)",
    )
    args = ap.parse_args(argv)
    if args.jobs < 1:
        return fail(f"--jobs {args.jobs} is not a positive number of processes: e.g. --jobs 2")
    algorithms = [a for a in args.algorithms.split(",") if a]
    if bad := [a for a in algorithms if a not in covered()]:
        return fail(f"{bad[0]} is not covered by engine.vectorize: choose from {covered()}")
    configs = [c for c in args.configs.split(",") if c]
    if bad := [c for c in configs if not (HERE / f"{c}.yaml").is_file()]:
        return fail(f"{bad[0]} is not a cross-check config: choose from {CONFIGS}")
    try:
        seeds = [int(s) for s in args.seeds.split(",")]
    except ValueError:
        return fail(f"--seeds {args.seeds!r} is not a comma-separated list of integers: e.g. 0,1,2")
    torch.set_num_threads(1)
    other = "graphed" if args.graphs else "vectorised"
    print(
        f"| config | algorithm | per-client ({METRIC}, seeds {args.seeds}) | {other} | "
        f"mean diff | seed sd | within noise | seconds per-client / {other} |"
    )
    print("|---|---|---|---|---|---|---|---|")
    groups = []  # (config, algorithm, the seed-by-seed (raw, vectorize) units)
    for name in configs:
        base = yaml.safe_load((HERE / f"{name}.yaml").read_text())
        base["train"] = {**base["train"], "rounds": args.rounds}
        base["output"] = {"progress": False}
        base["device"] = args.device
        if args.subset:
            base["data"] = {**base["data"], "subset": args.subset}
        if args.clients:
            base["data"] = {**base["data"], "num_clients": args.clients}
        base.pop("compare", None)
        for algo in algorithms:
            raws = [{**base, "seed": seed, "algorithm": {"name": algo}} for seed in seeds]
            groups.append((name, algo, [(raw, vec) for raw in raws for vec in (False, True)]))
    results = run_all([unit for *_, units in groups for unit in units], args.jobs, args.graphs)
    for name, algo, units in groups:
        acc: dict[bool, list[float]] = {False: [], True: []}
        secs: dict[bool, float] = {False: 0.0, True: 0.0}
        for raw, vec in units:
            a, s, pooled = next(results)
            acc[vec].append(a)
            secs[vec] += s
            path = other if vec else "per-client"
            print(f"{name} {algo} seed {raw['seed']} {path}: {a:.4f} in {s:.0f} s", file=sys.stderr)
        diff = statistics.mean(acc[True]) - statistics.mean(acc[False])
        sd = statistics.stdev(acc[False]) if len(seeds) > 1 else 0.0
        ok = within_noise(acc[False], acc[True], pooled)
        fmt = ", ".join
        print(
            f"| {name} | {algo} | {fmt(f'{a:.4f}' for a in acc[False])} | "
            f"{fmt(f'{a:.4f}' for a in acc[True])} | {diff:+.4f} | {sd:.4f} | "
            f"{'yes' if ok else 'NO'} | {secs[False]:.0f} / {secs[True]:.0f} |",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
