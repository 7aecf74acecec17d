"""Helpers for the by-value algorithm tests: a federation (or one client) built from given
tensors, numpy softmax regression (independent of torch's autograd), and :func:`hand_sgd`.

The ``*_by_hand`` tests recompute a client's local training with :func:`hand_sgd`, mini-batch
SGD written out on the tiny config's MLP (:func:`mlp_logits`) with plain torch ops and autograd,
drawing the batch order as the engine does (one ``torch.randperm(n)`` per epoch after the same
seed), so a wrong loss term, learning rate, epoch count or start model changes the numbers."""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F

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


def mlp_logits(w, x):
    """The tiny config's MLP (Flatten, Linear 64-32, ReLU, Linear 32-10) written out."""
    h = torch.relu(x.flatten(1) @ w["body.1.weight"].T + w["body.1.bias"])
    return h @ w["head.weight"].T + w["head.bias"]


def ce(w, x, y):
    return F.cross_entropy(mlp_logits(w, x), y)


def hand_sgd(w, x, y, loss=ce, *, lr, batch_size=16, epochs=1, steps=None, shift=None):
    """Plain mini-batch SGD (no momentum) from ``w`` on ``loss(w, x_b, y_b)``: ``steps`` steps
    (default ``epochs`` passes), a fresh ``torch.randperm(n)`` order per pass, each step
    ``w <- w - lr * (grad + shift)`` (``shift``: a constant added to the gradient)."""
    w = {k: v.detach().clone() for k, v in w.items()}
    n = len(y)
    steps = epochs * math.ceil(n / batch_size) if steps is None else steps
    done = 0
    while done < steps:
        perm = torch.randperm(n)
        for i in range(0, n, batch_size):
            if done == steps:
                break
            idx = perm[i : i + batch_size]
            p = {k: v.clone().requires_grad_(True) for k, v in w.items()}
            grads = torch.autograd.grad(loss(p, x[idx], y[idx]), list(p.values()))
            for (k, v), g in zip(p.items(), grads, strict=True):
                w[k] = (v - lr * (g + (0 if shift is None else shift[k]))).detach()
            done += 1
    return w


def assert_close(got, want, atol=1e-5):
    assert got.keys() == want.keys()
    for k in want:
        assert torch.allclose(got[k], want[k], atol=atol), (k, (got[k] - want[k]).abs().max())


PATHOLOGICAL = {"partition": {"name": "pathological", "classes_per_client": 3}}


def randn_like(ws, scale=1.0):
    return {k: scale * torch.randn_like(v) for k, v in ws.items()}


def missing_classes(sim, cid):
    y = sim.data.clients[cid].train_y
    return sorted(set(range(sim.data.num_classes)) - set(y.tolist()))


def rs_ce(train_y, alpha, num_classes=10):
    """MAP Eq. 8 written out: CE of the logits scaled by 1 (classes the client has) or alpha."""
    have = torch.zeros(num_classes, dtype=torch.bool)
    have[train_y.unique()] = True
    a = torch.where(have, 1.0, alpha)

    def loss(w, x, y):
        return F.cross_entropy(mlp_logits(w, x) * a, y)

    return loss


def trains_end_to_end(tiny, tmp_path, name: str):
    """A 3-round run of algorithm ``name`` on the tiny config, also under MAP's protocol
    (selected clients scored right after local training), well above chance (0.1)."""
    from pflkit.engine import run_experiment

    cfg = tiny(algorithm={"name": name}, eval={"selected_clients": True})
    res = run_experiment(cfg, out=tmp_path / name)
    final = res.summary["final"]
    assert final["pers_acc_mean"] > 0.5 and final["global_acc"] > 0.5
    assert res.rows[-1]["pers_acc_selected"] > 0.5
    assert len(res.rows) == 3
    return res
