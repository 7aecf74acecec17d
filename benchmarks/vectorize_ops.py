"""Operations a training round dispatches, per-client against vectorised (issue 56): a measure of
the GPU's launch cost that a CPU can take.

On a GPU the anchor setting is launch-bound (docs/benchmarks.md): a round costs about what its
kernel launches cost, whatever their size. This script counts, on the CPU, the operations that
reach torch's backend in one training round (a ``TorchDispatchMode``: below autograd and
``torch.func``'s transforms, after composite operations are decomposed, so ``linear`` counts
as the ``addmm`` it runs and a ``vmap``-ed convolution as the batched one), except views and
bare allocations, which launch no kernel. Each counted operation is one kernel launch or more
on a GPU. Both paths run in this process with one torch thread, the per-client path and
``engine.vectorize: true``, after one uncounted round; evaluation is off (``eval.every`` past
the round), so the count is the training's: the clients' steps and their updates' checks.
A third path, ``engine.cuda_graphs``' (:func:`~pflkit.engine.vectorized.train_graphed`), runs
its fixed-shape steps uncaptured here and counts each step a CUDA graph would replay as one
launch (``graph replay``), the operations of the other steps as they are.

    python benchmarks/vectorize_ops.py                  # the anchor (bench_fedavg.py's CONFIG)
    python benchmarks/vectorize_ops.py --subset 5000    # quicker
"""

from __future__ import annotations

import argparse
import collections
import sys
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_fedavg import CONFIG  # noqa: E402

from pflkit.data.federated import build_federated  # noqa: E402
from pflkit.engine import vectorized  # noqa: E402
from pflkit.engine.clients import InProcess  # noqa: E402
from pflkit.engine.simulation import Simulation  # noqa: E402
from pflkit.experiment import validate  # noqa: E402

# allocations without a kernel, and shape-only changes that are not marked as views
NO_KERNEL = {
    "empty",
    "empty_like",
    "empty_strided",
    "new_empty",
    "new_empty_strided",
    "resize_",
    "_unsafe_view",
}


class Dispatched(TorchDispatchMode):
    """Counts the operations that reach the backend, by name (views and bare allocations not
    counted)."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: collections.Counter = collections.Counter()
        self.paused = False  # within a step a CUDA graph would replay (count_round)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = func.overloadpacket.__name__
        if not self.paused and not func.is_view and name not in NO_KERNEL:
            self.counts[name] += 1
        return func(*args, **(kwargs or {}))


NOT_OPERATIONS = ("graph capture", "replayed rows")  # count_round's other figures


def count_round(raw: dict, vectorize: bool, graphs: bool = False) -> collections.Counter:
    """The operations of round 2 of ``raw``'s experiment, in this process, by name. With
    ``graphs`` (``engine.cuda_graphs``' runner), a step that a CUDA graph replays on a GPU
    counts as one ``graph replay``, whatever it dispatches here. Not operations
    (:data:`NOT_OPERATIONS`): ``graph capture``, the graphs captured (each
    :data:`~pflkit.engine.vectorized.GRAPH_WARMUP` eager steps, not counted, and one
    recorded), and ``replayed rows``, the clients' rows the replayed steps stepped."""
    cfg = validate({**raw, "threads": 1, "eval": {"every": 10**6}})
    runner = InProcess(vectorize=vectorize, graphs=graphs)
    sim = Simulation(cfg, build_federated(cfg.data), runner)
    sim.run_round(1)
    mode = Dispatched()

    def replayed(fn: Any, cohort: Any) -> Any:
        mode.counts["graph capture"] += 1

        def replay() -> None:
            mode.paused = True
            try:
                fn()
            finally:
                mode.paused = False
            mode.counts["graph replay"] += 1
            mode.counts["replayed rows"] += cohort.rows_stepped  # set by the step just run

        return replay

    real, real_step = vectorized._graphed, vectorized._Cohort.step

    def step(self: Any, rows: slice, *args: Any) -> None:
        self.rows_stepped = rows.stop - rows.start  # what a replay now steps
        real_step(self, rows, *args)

    vectorized._graphed, vectorized._Cohort.step = replayed, step
    try:
        with mode:
            sim.run_round(2)
    finally:
        vectorized._graphed, vectorized._Cohort.step = real, real_step
    return mode.counts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--subset", type=int, help="train on a Fashion-MNIST subset")
    args = ap.parse_args()
    if args.subset is not None and args.subset < 1:
        ap.error(f"--subset {args.subset}: give a positive number of images, e.g. 5000")
    raw = dict(CONFIG)
    if args.subset:
        raw["data"] = {**raw["data"], "subset": args.subset}
    torch.set_num_threads(1)
    paths = {"per-client": (False, False), "vectorised": (True, False), "graphed": (True, True)}
    counts = {name: count_round(raw, *how) for name, how in paths.items()}
    print("| path | operations in a training round | most frequent |")
    print("|---|---:|---|")
    ops = {k: collections.Counter({n: v for n, v in c.items() if n not in NOT_OPERATIONS})
           for k, c in counts.items()}  # fmt: skip
    for name, c in ops.items():
        top = ", ".join(f"{k} {v}" for k, v in c.most_common(5))
        print(f"| {name} | {c.total()} | {top} |")
    for name in ("vectorised", "graphed"):
        print(f"per-client / {name}: {ops['per-client'].total() / max(ops[name].total(), 1):.2f}x")
    g = counts["graphed"]
    print(f"graphed: {g['graph capture']} graphs captured; {g['graph replay']} replayed steps "
          f"stepped {g['replayed rows']} clients' rows")  # fmt: skip


if __name__ == "__main__":
    main()
