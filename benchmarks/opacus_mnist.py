"""Cross-check of pflkit's DP-SGD (``privacy.sample_dp``, src/pflkit/privacy/dpsgd.py) against a
plain Opacus training loop: Opacus's MNIST example (``examples/mnist.py``) in its default
settings, once as Opacus runs it and once as pflkit runs it with one client, on the same data.

The example's defaults: the ``SampleConvNet`` (conv 1->16 k8 s2 p3, ReLU, max-pool 2/1,
conv 16->32 k4 s2, ReLU, max-pool 2/1, fc 512->32, ReLU, fc 32->10), SGD at lr 0.1 without
momentum, noise multiplier 1.0, per-sample clipping norm 1.0, batches of 64 by Poisson
sampling (rate 64 / n), delta 1e-5, 10 epochs; it reports the test accuracy and epsilon.

Offline, the data are MNIST's 5,000-image subset that pflkit ships (dataset ``mnist5k``,
pixels mapped to [-1, 1]): one client, a random test split of 1,032 images, 3,968 training
images (62 batches of 64, so both loops take 62 steps an epoch at rate exactly 1/62 and their
accountants agree to the last digit). Each side runs 3 seeds and prints the final test
accuracy (mean ± std) and epsilon at delta 1e-5.

- "opacus": Opacus's ``PrivacyEngine.make_private`` (Poisson ``DPDataLoader``, ``GradSampleModule``,
  ``DPOptimizer``, RDP accountant) on a ``DataLoader`` of the training tensors;
- "pflkit": ``algorithm: local``, ``data.num_clients: 1``, one local epoch a round for 10 rounds,
  ``train.drop_last: true`` (62 steps an epoch, as Opacus's sampler), ``privacy.sample_dp``.

Usage: ``python benchmarks/opacus_mnist.py [--epochs 10] [--seeds 0,1,2]`` (about 3 minutes on
one core of a 2-core machine at the defaults).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn

from pflkit.config import DataConfig
from pflkit.data.federated import build_federated
from pflkit.engine.clients import InProcess
from pflkit.engine.simulation import Simulation
from pflkit.experiment import validate
from pflkit.models import PFLModel
from pflkit.plugins import register_model
from pflkit.privacy import dpsgd

SIGMA, CLIP, LR, BATCH, DELTA = 1.0, 1.0, 0.1, 64, 1e-5
TEST_FRACTION = 0.2064  # 3,968 training images: 62 batches of 64


def sample_convnet(input_shape, num_classes) -> PFLModel:
    """Opacus's MNIST example network as a pflkit model: the convolutions and fc1 are the body
    (features [B, 32]), fc2 the head."""
    body = nn.Sequential(
        nn.Conv2d(input_shape[0], 16, 8, 2, padding=3),  # 28 -> 14
        nn.ReLU(),
        nn.MaxPool2d(2, 1),  # -> 13
        nn.Conv2d(16, 32, 4, 2),  # -> 5
        nn.ReLU(),
        nn.MaxPool2d(2, 1),  # -> 4
        nn.Flatten(),
        nn.Linear(32 * 4 * 4, 32),
        nn.ReLU(),
    )
    return PFLModel(
        body, nn.Linear(32, num_classes), 32,
        name="opacus_sampleconvnet", input_shape=tuple(input_shape), num_classes=num_classes,
    )  # fmt: skip


register_model("opacus_sampleconvnet", "Opacus's MNIST example network", sample_convnet)

DATA = {
    "dataset": "mnist5k",
    "num_clients": 1,
    "partition": {"name": "iid"},
    "test_fraction": TEST_FRACTION,
}


def run_opacus(seed: int, epochs: int, data) -> tuple[float, float]:
    """Opacus's own loop (the example's train/test functions, in short)."""
    from opacus import PrivacyEngine
    from torch.utils.data import DataLoader, TensorDataset

    c = data.clients[0]
    torch.manual_seed(seed)
    model = sample_convnet((1, 28, 28), 10)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0)
    loader = DataLoader(TensorDataset(c.train_x, c.train_y), batch_size=BATCH)
    engine = PrivacyEngine(accountant="rdp")
    model, optimizer, loader = engine.make_private(
        module=model, optimizer=optimizer, data_loader=loader,
        noise_multiplier=SIGMA, max_grad_norm=CLIP,
    )  # fmt: skip
    for _ in range(epochs):
        model.train()
        for x, y in loader:
            optimizer.zero_grad()
            F.cross_entropy(model(x), y).backward()
            optimizer.step()
    model.eval()
    with torch.no_grad():
        acc = (model(c.test_x).argmax(1) == c.test_y).float().mean().item()
    return acc, engine.get_epsilon(DELTA)


def run_pflkit(seed: int, epochs: int) -> tuple[float, float]:
    cfg = validate(
        {
            "name": "opacus-mnist",
            "seed": seed,
            "threads": 1,
            "data": DATA,
            "model": {"name": "opacus_sampleconvnet"},
            "algorithm": {"name": "local"},
            "train": {
                "rounds": epochs, "local_epochs": 1, "batch_size": BATCH, "lr": LR,
                "momentum": 0.0, "drop_last": True,
            },
            "eval": {"every": epochs},
            "privacy": {"sample_dp": {
                "noise_multiplier": SIGMA, "max_grad_norm": CLIP, "target_delta": DELTA,
            }},
            "engine": {"workers": 1},
            "output": {"progress": False},
        }
    )  # fmt: skip
    with Simulation(cfg, runner=InProcess()) as sim:
        for rnd in range(1, epochs + 1):
            row = sim.run_round(rnd)
        eps = dpsgd.epsilon(sim.client_state(0)[dpsgd.HISTORY], DELTA, "rdp")
        steps = sim.client_state(0)[dpsgd.HISTORY]
    print(f"    pflkit seed {seed}: DP-SGD history [z, q, steps] = {steps}", flush=True)
    return row["pers_acc_mean"], eps


def summary(name: str, results: list[tuple[float, float]]) -> str:
    accs = [100 * a for a, _ in results]
    eps = [e for _, e in results]
    std = statistics.stdev(accs) if len(accs) > 1 else 0.0
    return (
        f"| {name} | {statistics.mean(accs):.2f} ± {std:.2f} | "
        f"{', '.join(f'{a:.2f}' for a in accs)} | {statistics.mean(eps):.4f} |"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--epochs", type=int, default=10)
    ap.add_argument("--seeds", default="0,1,2")
    args = ap.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    torch.set_num_threads(1)
    data = build_federated(DataConfig(**DATA))
    n = data.clients[0].size("train")
    print(
        f"mnist5k, one client: {n} training and {data.clients[0].size('test')} test images; "
        f"SampleConvNet, SGD lr {LR}, sigma {SIGMA}, C {CLIP}, batch {BATCH} (q = {BATCH}/{n}), "
        f"{args.epochs} epochs, delta {DELTA}",
        flush=True,
    )
    results: dict[str, list[tuple[float, float]]] = {"opacus": [], "pflkit": []}
    for seed in seeds:
        t = time.perf_counter()
        results["opacus"].append(run_opacus(seed, args.epochs, data))
        t1 = time.perf_counter()
        results["pflkit"].append(run_pflkit(seed, args.epochs))
        t2 = time.perf_counter()
        print(
            f"  seed {seed}: opacus acc {100 * results['opacus'][-1][0]:.2f}% "
            f"eps {results['opacus'][-1][1]:.4f} ({t1 - t:.0f} s); pflkit acc "
            f"{100 * results['pflkit'][-1][0]:.2f}% eps {results['pflkit'][-1][1]:.4f} "
            f"({t2 - t1:.0f} s)",
            flush=True,
        )
    print("\n| loop | test accuracy (%) | per seed | epsilon at delta 1e-5 |")
    print("|---|---|---|---|")
    for name, res in results.items():
        print(summary(name, res))


if __name__ == "__main__":
    main()
