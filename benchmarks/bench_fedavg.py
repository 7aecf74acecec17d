"""Engine overhead benchmark: pflkit FedAvg rounds vs. a tight PyTorch loop, in one run.

Setting (issue 2): FedAvg, Fashion-MNIST, 20 clients, Dirichlet(0.1), 75/25 local split, the
4-layer CNN (cnn4), batch 10, 1 local epoch, lr 0.005, all clients every round, evaluation of
every client (and the global model) every round.

The tight loop is plain PyTorch: the same model class, the same clients' training samples as
preloaded tensors, the same batch size and optimiser; per client it loads the global weights,
runs one epoch of SGD and keeps a copy of the result, with no pflkit code involved. Engine
rounds and tight-loop rounds are interleaved (engine, tight, engine, tight, ...) so that machine
noise hits both alike; the ratios are of the medians.

    python benchmarks/bench_fedavg.py [--rounds 3] [--threads 1]

Goals: training phase <= 1.15x the tight loop; whole round (with evaluation) <= 1.35x.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from pflkit.config import validate
from pflkit.engine.simulation import Simulation
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


def tight_round(sim: Simulation, global_weights: dict) -> float:
    """One round of plain PyTorch training over every client's samples; returns seconds."""
    data = sim.data
    model = build_model("cnn4", data.input_shape, data.num_classes)
    t0 = time.perf_counter()
    results = []
    for c in data.clients:
        model.load_state_dict(global_weights)
        opt = torch.optim.SGD(model.parameters(), lr=0.005)
        x, y = c.train_x, c.train_y
        perm = torch.randperm(len(y))
        for i in range(0, len(y), 10):
            idx = perm[i : i + 10]
            opt.zero_grad()
            F.cross_entropy(model(x[idx]), y[idx]).backward()
            opt.step()
        results.append({k: v.clone() for k, v in model.state_dict().items()})
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--subset", type=int, default=None, help="use a subset of Fashion-MNIST")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    cfg = dict(CONFIG)
    if args.subset:
        cfg["data"] = {**cfg["data"], "subset": args.subset}
    sim = Simulation(validate(cfg))
    n_train = sum(len(c.train_y) for c in sim.data.clients)
    print(
        f"fashion_mnist, 20 clients, dirichlet 0.1, cnn4, batch 10: {n_train} training samples "
        f"per round, torch threads {torch.get_num_threads()}"
    )
    engine_train, engine_round, tight = [], [], []
    for rnd in range(1, args.rounds + 1):
        start = {k: v.clone() for k, v in sim.server["weights"].items()}
        row = sim.run_round(rnd)
        engine_train.append(row["seconds_train"])
        engine_round.append(row["seconds_train"] + row["seconds_eval"])
        tight.append(tight_round(sim, start))
        print(
            f"round {rnd}: engine train {row['seconds_train']:.2f}s + eval {row['seconds_eval']:.2f}s "
            f"| tight loop {tight[-1]:.2f}s | pers acc {row['pers_acc_mean']:.3f}",
            flush=True,
        )
    m_train, m_round, m_tight = map(statistics.median, (engine_train, engine_round, tight))
    print(
        f"seconds per round (median of {args.rounds}): engine {m_round:.2f}, tight loop {m_tight:.2f}"
    )
    print(f"training phase / tight loop: {m_train / m_tight:.3f}x (goal <= 1.15x)")
    print(f"whole round / tight loop:    {m_round / m_tight:.3f}x (goal <= 1.35x)")
    print(
        f"training throughput: engine {n_train / m_train:.0f} samples/s, tight {n_train / m_tight:.0f} samples/s"
    )


if __name__ == "__main__":
    main()
