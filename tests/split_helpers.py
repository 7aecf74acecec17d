"""Helpers for the by-value algorithm tests: a federation (or one client) built from given
tensors, and numpy softmax regression (independent of torch's autograd)."""

from __future__ import annotations

import numpy as np
import torch

from conftest import tiny_config
from pflkit.algorithms import build_algorithm
from pflkit.data.federated import ClientData, FederatedDataset
from pflkit.engine.envs import make_envs
from pflkit.experiment import validate


def federation(algo: dict, clients, classes: int, model: str = "mlp", hidden=(), **train):
    """(algorithm, server env, client envs) for clients whose train and test sets are the given
    (x, y) pairs; model ``mlp`` with ``hidden`` (``()``: softmax regression, body = flatten)
    or another registered model without options; full-batch SGD at lr 0.1 unless ``train``
    says otherwise."""
    options = {"hidden": list(hidden)} if model == "mlp" else {}
    cfg = validate(
        tiny_config(
            algorithm=algo,
            model={"name": model, "options": options},
            train={"batch_size": max(len(y) for _, y in clients), "lr": 0.1, **train},
        )
    )
    x0, y0 = clients[0]
    data = FederatedDataset(
        name="hand", clients=[ClientData(x, y, x, y) for x, y in clients], test_x=x0, test_y=y0,
        num_classes=classes, input_shape=tuple(x0.shape[1:]), partition_id="hand",
        train_indices=[np.arange(len(y)) for _, y in clients],
        test_indices=[np.arange(len(y)) for _, y in clients],
    )  # fmt: skip
    senv, cenvs = make_envs(cfg, data)
    return build_algorithm(cfg.algorithm), senv, cenvs


def one_client(algo: dict, x: torch.Tensor, y: torch.Tensor, classes: int, hidden=(), **train):
    """(algorithm, server env, client env) of a :func:`federation` of one client."""
    algo, senv, cenvs = federation(algo, [(x, y)], classes, hidden=hidden, **train)
    return algo, senv, cenvs[0]


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
