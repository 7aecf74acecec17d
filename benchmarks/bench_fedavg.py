"""Engine overhead benchmark: pflkit FedAvg rounds with each client runner vs. a tight PyTorch
loop, interleaved in one run.

Anchor setting (issues 2 and 9): FedAvg, full Fashion-MNIST, 20 clients, Dirichlet(0.1), 75/25
local split, the 4-layer CNN (cnn4), batch 10, 1 local epoch, lr 0.005, all clients every
round, evaluation of every client and of the global model every round.

Three contenders per round, interleaved (in-process, process pool, tight loop, in-process, ...)
so that machine noise hits all alike; the ratios are of the medians:

- **in-process**: :class:`~pflkit.engine.clients.InProcess`, one process with ``--threads``
  torch threads (default 1, pflkit's ``threads`` default);
- **process pool**: :class:`~pflkit.engine.clients.ProcessPool`, ``--workers`` processes with
  ``--threads-per-worker`` torch threads each (``--workers 2,4,8``: one pool contender per
  count; on ``--device cuda`` the workers share the GPU, each with its own CUDA context);
- with ``--vectorize`` (issue 56), also **in-process vectorised** and one **vectorised pool**
  per worker count: the same runners with ``engine.vectorize: true``
  (:mod:`pflkit.engine.vectorized`: each worker trains its share of the cohort as one
  ``torch.func`` computation and scores the clients' models by one ``vmap``); with
  ``--graphs`` too, **in-process graphed** and a **graphed pool** per worker count, those
  runners with ``engine.cuda_graphs: true`` (on cpu, where nothing is captured, "masked": the
  same fixed-shape steps run as written);
- **tight loop**: plain PyTorch in this process, no pflkit code: per client, load the global
  weights, one epoch of SGD over its preloaded training tensors, keep a copy of the result
  (training only: no evaluation).

A pflkit round is the whole round: training and the evaluation of every client's personalized
model and of the global model. Peak memory is the largest sum of proportional set sizes (PSS:
shared pages split between the processes that share them) over this process and its workers,
sampled every 0.2 s during one extra, untimed round per contender after the timed ones
(reading PSS costs CPU, so it never runs while a round is timed; Linux only), over the whole
process tree (a fork server's workers are grandchildren); on cuda also the peak of the GPU
memory those processes hold (``nvidia-smi``'s per-process used memory, summed). The process
pools are measured first and their workers stopped before the others are measured. Both engines share
one dataset in this process, so the in-process figure includes the pool contender's server
state too (a few MiB).

    python benchmarks/bench_fedavg.py [--rounds 3] [--workers 2] [--device cpu]
    python benchmarks/bench_fedavg.py --device cuda --workers 2,4,8   # issue 38: workers per GPU
    python benchmarks/bench_fedavg.py --vectorize --workers 2       # issue 56, side by side
    python benchmarks/bench_fedavg.py --device cuda --vectorize --graphs --workers 8

A contender whose round fails is reported (its error in one line) and left out; the others go
on.

Goals (issue 9): whole round with the process pool <= 0.8x the tight loop on 2 cores;
evaluation <= 10% of the round.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import threading
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from pflkit.data.federated import build_federated
from pflkit.engine.clients import InProcess, ProcessPool
from pflkit.engine.simulation import Simulation
from pflkit.experiment import validate
from pflkit.models import build_model

CONFIG = {
    "name": "bench-fedavg",
    "data": {
        "dataset": "fashion_mnist",
        "num_clients": 20,
        "partition": {"name": "dirichlet", "alpha": 0.1},
        "test_fraction": 0.25,
    },
    "model": {"name": "cnn4"},
    "algorithm": {"name": "fedavg"},
    "train": {"rounds": 1000, "local_epochs": 1, "batch_size": 10, "lr": 0.005},
    "eval": {"every": 1},
    "output": {"progress": False},
}


def pss_mib(pids: list[int]) -> float:
    """Sum of the processes' proportional set sizes, in MiB (0 where unreadable)."""
    total = 0
    for pid in pids:
        try:
            for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
                if line.startswith("Pss:"):
                    total += int(line.split()[1])
        except OSError:
            pass
    return total / 1024


def process_tree(root: int) -> list[int]:
    """``root`` and every process below it (children of its threads, recursively)."""
    pids, todo = [], [root]
    while todo:
        pid = todo.pop()
        pids.append(pid)
        for task in Path(f"/proc/{pid}/task").glob("*"):
            try:
                todo += [int(k) for k in (task / "children").read_text().split()]
            except OSError:
                pass
    return pids


def gpu_mib(pids: list[int]) -> float:
    """GPU memory the processes hold, in MiB (nvidia-smi's per-process used memory)."""
    out = subprocess.run(
        ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
        capture_output=True,
        text=True,
        check=False,
    ).stdout
    used = dict(map(int, line.split(",")) for line in out.splitlines() if line.strip())
    return float(sum(used.get(pid, 0) for pid in pids))


class PeakMemory:
    """Samples the PSS (and with ``gpu`` the GPU memory) of this process and every process
    below it every 0.2 s in a thread."""

    def __init__(self, gpu: bool = False):
        self.peak = 0.0
        self.gpu_peak = 0.0
        self.gpu = gpu
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        while not self._stop.is_set():
            pids = process_tree(os.getpid())
            self.peak = max(self.peak, pss_mib(pids))
            if self.gpu:
                self.gpu_peak = max(self.gpu_peak, gpu_mib(pids))
            time.sleep(0.2)

    def __enter__(self) -> PeakMemory:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def tight_round(sim: Simulation, global_weights: dict) -> float:
    """One round of plain PyTorch training over every client's samples; returns seconds."""
    data = sim.data
    model = build_model("cnn4", data.input_shape, data.num_classes).to(sim.cfg.device)
    t0 = time.perf_counter()
    results = []
    for c in data.clients:
        model.load_state_dict(global_weights)
        opt = torch.optim.SGD(model.parameters(), lr=0.005)
        x, y = c.train_x.to(sim.cfg.device), c.train_y.to(sim.cfg.device)
        perm = torch.randperm(len(y))
        for i in range(0, len(y), 10):
            idx = perm[i : i + 10]
            opt.zero_grad()
            F.cross_entropy(model(x[idx]), y[idx]).backward()
            opt.step()
        results.append({k: v.clone() for k, v in model.state_dict().items()})
    if sim.cfg.device.startswith("cuda"):
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument(
        "--workers", default="2", help="process-pool workers, or a list: one pool per count"
    )
    ap.add_argument("--threads-per-worker", type=int, default=1)
    ap.add_argument(
        "--threads", type=int, default=1, help="torch threads in this process (pflkit's default 1)"
    )
    ap.add_argument("--subset", type=int, default=None, help="use a subset of Fashion-MNIST")
    ap.add_argument("--device", default="cpu", help="cpu or cuda (pools share the GPU)")
    ap.add_argument("--eval-batch", type=int, default=None, help="eval.batch_size (default 1000)")
    ap.add_argument(
        "--vectorize",
        action="store_true",
        help="also the vectorised runners (engine.vectorize: true), in-process and per pool",
    )
    ap.add_argument(
        "--graphs",
        action="store_true",
        help="with --vectorize, also those runners with engine.cuda_graphs (cpu: uncaptured)",
    )
    args = ap.parse_args()
    if args.graphs and not args.vectorize:
        ap.error("--graphs replays the vectorised runners' steps: give --vectorize too")
    try:
        counts = [int(w) for w in args.workers.split(",")]
    except ValueError:
        ap.error(f"--workers {args.workers!r}: give worker counts, e.g. 2 or 2,4,8")
    if min(counts) < 2:
        ap.error(f"--workers {args.workers}: a process pool has at least 2 workers")
    raw = dict(CONFIG, device=args.device, threads=args.threads)
    if args.eval_batch:
        raw["eval"] = {**raw["eval"], "batch_size": args.eval_batch}
    if args.subset:
        raw["data"] = {**raw["data"], "subset": args.subset}
    cfg = validate(raw)
    data = build_federated(cfg.data)
    contenders = {"in-process": Simulation(cfg, data, InProcess())}
    gpu = args.device != "cpu"
    for w in counts:
        pool = ProcessPool(w, args.threads_per_worker, fresh=gpu)
        name = "process pool" if len(counts) == 1 else f"pool x{w}"
        contenders[name] = Simulation(cfg, data, pool)
    kinds = [("vectorised", False)] if args.vectorize else []
    if args.graphs:  # on cpu the same masked steps, uncaptured
        kinds.append(("graphed" if gpu else "masked", True))
    for kind, graphs in kinds:
        contenders[f"in-process {kind}"] = Simulation(cfg, data, InProcess(True, graphs))
        for w in counts:
            pool = ProcessPool(w, args.threads_per_worker, gpu, vectorize=True, graphs=graphs)
            name = f"{kind} pool" if len(counts) == 1 else f"{kind} pool x{w}"
            contenders[name] = Simulation(cfg, data, pool)
    n_train = sum(len(c.train_y) for c in data.clients)
    print(
        f"fashion_mnist, 20 clients, dirichlet 0.1, cnn4, batch 10, device {args.device}: "
        f"{n_train} training samples per round; this process: {torch.get_num_threads()} torch "
        f"threads; pools: {args.workers} workers x {args.threads_per_worker} thread(s); "
        f"{os.cpu_count()} CPUs"
    )
    rounds: dict[str, list[float]] = {k: [] for k in contenders}
    evals: dict[str, list[float]] = {k: [] for k in contenders}
    peak: dict[str, float] = dict.fromkeys([*contenders, "tight loop"], 0.0)
    gpu_peak = dict(peak)
    tight: list[float] = []
    failed: dict[str, str] = {}  # a contender that fails is reported and left out, not fatal
    for rnd in range(1, args.rounds + 1):
        line = []
        for name, sim in list(contenders.items()):
            try:
                row = sim.run_round(rnd)
            except Exception as e:  # noqa: BLE001 (reported below, with its message)
                failed[name] = f"failed in round {rnd}: {type(e).__name__}: {e}"
                print(f"{name} {failed[name]}", flush=True)
                contenders.pop(name).close()
                continue
            rounds[name].append(row["seconds_train"] + row["seconds_eval"])
            evals[name].append(row["seconds_eval"])
            line.append(
                f"{name} {row['seconds_train']:.2f}s + eval {row['seconds_eval']:.2f}s "
                f"(pers {row['pers_acc_mean']:.3f})"
            )
        start = {k: v.clone() for k, v in contenders["in-process"].server["weights"].items()}
        tight.append(tight_round(contenders["in-process"], start))
        print(f"round {rnd}: " + " | ".join(line) + f" | tight loop {tight[-1]:.2f}s", flush=True)
    # memory, untimed: the pool first, then (its workers stopped) in-process and the tight loop
    for name in reversed(contenders):
        with PeakMemory(gpu) as mem:
            contenders[name].run_round(args.rounds + 1)
        contenders[name].close()
        peak[name], gpu_peak[name] = mem.peak, mem.gpu_peak
    with PeakMemory(gpu) as mem:
        tight_round(contenders["in-process"], start)
    peak["tight loop"], gpu_peak["tight loop"] = mem.peak, mem.gpu_peak
    m_tight = statistics.median(tight)
    print(f"\nmedians of {args.rounds} rounds; tight loop {m_tight:.2f} s/round (training only)")
    gpu_col = " peak GPU memory (MiB) |" if gpu else ""
    base = statistics.median(rounds["in-process"])
    print(
        "| runner | whole round (s) | / tight loop | / in-process | eval share | peak PSS (MiB) |"
        + gpu_col
    )
    print("|---|---|---|---|---|---|" + ("---|" if gpu else ""))
    for name in contenders:
        m_round, m_eval = statistics.median(rounds[name]), statistics.median(evals[name])
        print(
            f"| {name} | {m_round:.2f} | {m_round / m_tight:.3f}x | {m_round / base:.3f}x | "
            f"{m_eval / m_round:.1%} | {peak[name]:.0f} |"
            + (f" {gpu_peak[name]:.0f} |" if gpu else "")
        )
    print(
        f"| tight loop | {m_tight:.2f} | 1.000x | {m_tight / base:.3f}x | - | "
        f"{peak['tight loop']:.0f} |" + (f" {gpu_peak['tight loop']:.0f} |" if gpu else "")
    )
    for name, why in failed.items():
        print(f"| {name} | {why} |")
    print("goals: whole round with the process pool <= 0.8x the tight loop; eval share <= 10%")


if __name__ == "__main__":
    main()
