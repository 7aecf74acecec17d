"""Helpers for tests/test_gpfl.py and tests/test_model_split.py: a one-client federation built
from given tensors, and numpy softmax regression (independent of torch's autograd)."""

from __future__ import annotations

import numpy as np
import torch

from conftest import tiny_config
from pflkit.algorithms import build_algorithm, make_envs
from pflkit.config import validate
from pflkit.data.federated import ClientData, FederatedDataset


def one_client(algo: dict, x: torch.Tensor, y: torch.Tensor, classes: int, hidden=(), **train):
    """(algorithm, server env, client env) for one client whose train and test sets are
    (x, y); model: mlp with ``hidden`` (``()``: softmax regression, body = flatten)."""
    cfg = validate(
        tiny_config(
            algorithm=algo,
            model={"name": "mlp", "options": {"hidden": list(hidden)}},
            train={"batch_size": len(y), "lr": 0.1, **train},
        )
    )
    n = len(y)
    data = FederatedDataset(
        name="hand", clients=[ClientData(x, y, x, y)], test_x=x, test_y=y, num_classes=classes,
        input_shape=tuple(x.shape[1:]), partition_id="hand",
        train_indices=[np.arange(n)], test_indices=[np.arange(n)],
    )  # fmt: skip
    senv, cenvs = make_envs(cfg, data)
    return build_algorithm(cfg.algorithm), senv, cenvs[0]


def np_softmax(z: np.ndarray) -> np.ndarray:
    e = np.exp(z - z.max(1, keepdims=True))
    return e / e.sum(1, keepdims=True)


def np_ce(W, b, x, y) -> float:
    p = np_softmax(x @ W.T + b)
    return float(-np.log(p[np.arange(len(y)), y]).mean())


def np_ce_grad(W, b, x, y):
    """Gradient of the mean cross-entropy of softmax regression (W: C x d, b: C)."""
    p = np_softmax(x @ W.T + b)
    p[np.arange(len(y)), y] -= 1
    return p.T @ x / len(y), p.mean(0)


def data(n: int, d: int, c: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g)
    y = torch.arange(n) % c
    return x, y
