"""GPFL's cost per round relative to FedAvg's, interleaved in one run (issue 11, "Speed").

Setting: GPFL's Table 1 Fashion-MNIST practical column as configs/gpfl/fmnist_practical.yaml
runs it (full Fashion-MNIST, 20 clients, Dirichlet(0.1), 75/25 local split, the 4-layer CNN
``cnn4``, batch 10, one local epoch, lr 0.005, every client every round; GPFL at its defaults,
lambda 0.01, mu 0.1). Two simulations in this process with the same data and engine
(in-process, torch's default threads), one round of GPFL then one round of FedAvg, repeated,
so that machine noise hits both alike. Each round is timed by the engine: training (every
client's local update and the server's aggregation) and evaluation (every client's
personalized model on its local test split, as PFLlib does; FedAvg's global model is not also
scored on the official test set, ``eval.global_model: false``). Reported: the
median over rounds of GPFL / FedAvg, pair by pair, for training and for the whole round.

    python benchmarks/bench_gpfl.py [--rounds 5] [--subset N] [--threads T]

Reference point (issue 11): PFLlib's GPFL costs about 1.8x its FedAvg per round on this
machine's CPU; the goal is <= 1.3x.
"""

from __future__ import annotations

import argparse
import statistics

import torch
from bench_fedavg import CONFIG as ANCHOR  # this folder is on sys.path when run as a script

from pflkit.data.federated import build_federated
from pflkit.engine.clients import InProcess
from pflkit.engine.simulation import Simulation
from pflkit.experiment import validate

# bench_fedavg.py's anchor setting, scoring only the personalized models
CONFIG = {k: v for k, v in ANCHOR.items() if k != "algorithm"} | {
    "name": "bench-gpfl",
    "eval": {"every": 1, "global_model": False},
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--subset", type=int, default=None, help="use a subset of Fashion-MNIST")
    ap.add_argument("--threads", type=int, default=None, help="torch threads")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    raw = dict(CONFIG)
    if args.subset:
        raw["data"] = {**raw["data"], "subset": args.subset}
    cfgs = {name: validate(raw | {"algorithm": {"name": name}}) for name in ("gpfl", "fedavg")}
    data = build_federated(cfgs["gpfl"].data)
    sims = {name: Simulation(cfg, data, InProcess()) for name, cfg in cfgs.items()}
    n_train = sum(len(c.train_y) for c in data.clients)
    print(
        f"fashion_mnist, 20 clients, dirichlet 0.1, cnn4, batch 10: {n_train} training samples "
        f"per round; {torch.get_num_threads()} torch threads"
    )
    train: dict[str, list[float]] = {k: [] for k in sims}
    whole: dict[str, list[float]] = {k: [] for k in sims}
    for rnd in range(1, args.rounds + 1):
        line = []
        for name, sim in sims.items():
            row = sim.run_round(rnd)
            train[name].append(row["seconds_train"])
            whole[name].append(row["seconds_train"] + row["seconds_eval"])
            line.append(f"{name} {row['seconds_train']:.2f}s + eval {row['seconds_eval']:.2f}s")
        print(f"round {rnd}: " + " | ".join(line), flush=True)
    for sim in sims.values():
        sim.close()

    def ratio(series: dict[str, list[float]]) -> float:
        return statistics.median(
            g / f for g, f in zip(series["gpfl"], series["fedavg"], strict=True)
        )

    print(f"\nmedians over {args.rounds} rounds (ratio: median of the per-round GPFL / FedAvg)")
    print("| | GPFL (s) | FedAvg (s) | GPFL / FedAvg |")
    print("|---|---|---|---|")
    for label, series in (("training", train), ("whole round", whole)):
        g, f = statistics.median(series["gpfl"]), statistics.median(series["fedavg"])
        print(f"| {label} | {g:.2f} | {f:.2f} | {ratio(series):.3f}x |")
    print("goal (issue 11): GPFL <= 1.3x FedAvg per round (PFLlib's GPFL: about 1.8x)")


if __name__ == "__main__":
    main()
