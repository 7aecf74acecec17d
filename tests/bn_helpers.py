"""Helpers for the FedBN and f-FedAP tests (also FedDyn's hand-made federation): a BatchNorm
MLP registered for a test, its one SGD step written out, and a LeNet5-BN config."""

from __future__ import annotations

import torch
from torch import nn

from conftest import tiny_config
from pflkit.experiment import validate


def bn_config(name: str, **train):
    """LeNet5-BN on 400 real Fashion-MNIST images, 4 clients, 2 of them per round."""
    return validate(
        tiny_config(
            data={"dataset": "fashion_mnist", "subset": 400},
            model={"name": "lenet5_bn", "options": {}},
            algorithm={"name": name},
            train={"rounds": 2, "client_fraction": 0.5, "batch_size": 32, **train},
        )
    )


# == by value on hand-made federations =============================================================
# A tiny BatchNorm model (registered for the test only): Flatten -> Linear(d, 3) -> BatchNorm1d
# -> ReLU, head Linear(3, C); its forward and one full-batch SGD step are written out below
# with plain torch ops, so the expected values do not come from pflkit.
BN = ["body.2.weight", "body.2.bias", "body.2.running_mean", "body.2.running_var"]
BN_ALL = [*BN, "body.2.num_batches_tracked"]
REST = ["body.1.weight", "body.1.bias", "head.weight", "head.bias"]


def bn_mlp(input_shape, num_classes):
    from pflkit.models import PFLModel

    body = nn.Sequential(nn.Flatten(), nn.Linear(input_shape[0], 3), nn.BatchNorm1d(3), nn.ReLU())
    return PFLModel(body, nn.Linear(3, num_classes), 3, name="bn_mlp", input_shape=input_shape)


X = torch.tensor([[1.0, 2.0], [-1.0, 0.5], [0.0, -1.0], [2.0, 1.0]])
Y = torch.tensor([0, 1, 1, 0])


def hand_weights(seed: int) -> dict:
    """Non-BN weights of bn_mlp (d = 2, C = 2) drawn from a seeded generator."""
    g = torch.Generator().manual_seed(seed)
    shapes = {
        "body.1.weight": (3, 2),
        "body.1.bias": (3,),
        "head.weight": (2, 3),
        "head.bias": (2,),
    }
    return {k: torch.randn(s, generator=g) for k, s in shapes.items()}


OWN_BN = {
    "body.2.weight": torch.tensor([2.0, 0.5, 1.0]),
    "body.2.bias": torch.tensor([0.1, -0.2, 0.3]),
    "body.2.running_mean": torch.tensor([1.0, 1.0, 1.0]),
    "body.2.running_var": torch.tensor([2.0, 2.0, 2.0]),
    "body.2.num_batches_tracked": torch.tensor(5),
}


def bn_sgd_step(w: dict, x, y, lr: float = 0.1) -> dict:
    """One full-batch SGD step of bn_mlp in train mode, by hand: the parameters move by
    -lr * grad(CE); the running statistics move 10% towards the batch mean and unbiased
    variance of the BN input; the counter adds one."""
    leaf = {k: w[k].clone().requires_grad_(True) for k in [*REST, "body.2.weight", "body.2.bias"]}
    h = x @ leaf["body.1.weight"].T + leaf["body.1.bias"]
    hn = (h - h.mean(0)) / torch.sqrt(h.var(0, unbiased=False) + 1e-5)
    z = torch.relu(hn * leaf["body.2.weight"] + leaf["body.2.bias"])
    loss = nn.functional.cross_entropy(z @ leaf["head.weight"].T + leaf["head.bias"], y)
    grads = dict(zip(leaf, torch.autograd.grad(loss, list(leaf.values())), strict=True))
    out = {k: w[k] - lr * grads[k] for k in leaf}
    h = h.detach()
    out["body.2.running_mean"] = 0.9 * w["body.2.running_mean"] + 0.1 * h.mean(0)
    out["body.2.running_var"] = 0.9 * w["body.2.running_var"] + 0.1 * h.var(0, unbiased=True)
    out["body.2.num_batches_tracked"] = w["body.2.num_batches_tracked"] + 1
    return out


def close(a: dict, b: dict, atol: float = 1e-6) -> bool:
    return a.keys() == b.keys() and all(torch.allclose(a[k], b[k], atol=atol) for k in a)
