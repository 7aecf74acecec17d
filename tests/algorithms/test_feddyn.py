"""FedDyn: the server's h and model update, the client's gradient state and local objective,
by hand."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch import nn

from bn_helpers import (
    X,
    Y,
    close,
)
from pflkit.algorithms.context import RoundContext, ServerContext
from pflkit.algorithms.feddyn import feddyn_server_update
from pflkit.engine import Simulation
from split_helpers import federation


# -- FedDyn -----------------------------------------------------------------------------------------
def test_feddyn_server_h_and_model_update_by_hand():
    theta = {"w": torch.tensor([1.0, 2.0])}
    h = {"w": torch.tensor([0.5, -0.5])}
    uploads = {
        0: {"weights": {"w": torch.tensor([2.0, 2.0])}, "num_samples": 1},
        3: {"weights": {"w": torch.tensor([0.0, 4.0])}, "num_samples": 3},
    }
    alpha, m = 0.1, 10
    new_theta, new_h = feddyn_server_update(theta, h, uploads, alpha, m)
    # h = h - alpha/m * sum(theta_k - theta) = [0.5, -0.5] - 0.01 * ([1, 0] + [-1, 2])
    np.testing.assert_allclose(new_h["w"], [0.5, -0.52])
    # theta = mean(theta_k) - h / alpha = [1, 3] - [5, -5.2]
    np.testing.assert_allclose(new_theta["w"], [-4.0, 8.2], rtol=1e-6)


def test_feddyn_client_gradient_state_update(tiny):
    sim = Simulation(tiny(algorithm={"name": "feddyn", "alpha": 0.5}))
    env = sim.envs[0]
    theta = sim.server["weights"]
    up = sim.algo.client_update(env, {"weights": theta}, {}, RoundContext(1))
    # g_k = 0 - alpha (theta_k - theta)
    for k, g in up.state["grad"].items():
        assert torch.allclose(g, -0.5 * (up.upload["weights"][k] - theta[k]))


def test_feddyn_local_objective_gradient_by_hand(tiny):
    """One SGD step on a model: the step is -lr (grad L - g_k + alpha (theta - theta_s))."""
    sim = Simulation(
        tiny(
            algorithm={"name": "feddyn", "alpha": 0.5},
            train={"local_epochs": 1, "batch_size": 100000},
        )
    )
    env, algo = sim.envs[0], sim.algo
    theta = sim.server["weights"]
    torch.manual_seed(1)
    start = {k: v + 0.1 * torch.randn_like(v) for k, v in theta.items()}
    grad_state = {k: torch.randn_like(v) for k, v in theta.items()}
    # the plain cross-entropy gradient at the starting point
    model = env.model("check")
    model.load_state_dict(start)
    loss = nn.functional.cross_entropy(model(env.data.train_x), env.data.train_y)
    g_ce = dict(
        zip(
            [k for k, _ in model.named_parameters()],
            torch.autograd.grad(loss, list(model.parameters())),
            strict=True,
        )
    )
    # one full-batch step from the downloaded model (the quadratic term is 0 there)
    up = algo.client_update(env, {"weights": start}, {"grad": grad_state}, RoundContext(2))
    lr = env.run.train.lr
    for k in g_ce:
        want = start[k] - lr * (g_ce[k] - grad_state[k])
        assert torch.allclose(up.upload["weights"][k], want, atol=1e-6), k


# -- FedDyn -----------------------------------------------------------------------------------------
def test_feddyn_aggregate_by_hand():
    algo, senv, _ = federation({"name": "feddyn", "alpha": 0.1}, [(X, Y)] * 5, 2)
    server = algo.server_init(senv)
    fill = lambda v: {k: torch.full_like(t, v) for k, t in server["weights"].items()}  # noqa: E731
    server = {**server, "weights": fill(1.0), "h": fill(0.5)}
    uploads = {
        0: {"weights": fill(2.0), "num_samples": 1},
        3: {"weights": fill(4.0), "num_samples": 3},
    }
    new = algo.aggregate(senv, server, uploads, ServerContext(2, "train"))
    # h = 0.5 - alpha (1/m) sum (theta_k - theta) = 0.5 - 0.1 * (1 + 3) / 5 = 0.42 (m = 5 clients)
    # theta = mean(2, 4) - h / alpha = 3 - 4.2 = -1.2 (the plain mean over the round's clients)
    assert close(new["h"], fill(0.42))
    assert close(new["weights"], fill(-1.2), atol=1e-5)
    assert (
        algo.eval_view(senv, new, None, ServerContext(1)).get("weights") is new["weights"]
    )  # the server model is scored
    view = algo.eval_view(senv, new, 0, ServerContext(1))
    assert view["weights"] is new["weights"]  # by everyone: the default personal_model


def test_feddyn_client_update_two_steps_by_hand():
    algo, senv, envs = federation({"name": "feddyn", "alpha": 0.5}, [(X, Y)] * 2, 2, local_epochs=2)
    g = torch.Generator().manual_seed(4)
    theta = {
        "head.weight": torch.randn(2, 2, generator=g),
        "head.bias": torch.randn(2, generator=g),
    }
    grad = {k: torch.randn(v.shape, generator=g) for k, v in theta.items()}
    out = algo.client_update(envs[0], {"weights": theta}, {"grad": grad}, RoundContext(3))

    def task_loss(w):
        return nn.functional.cross_entropy(X @ w["head.weight"].T + w["head.bias"], Y)

    # two full-batch steps: theta_s+1 = theta_s - lr (grad L(theta_s) - g_k + alpha (theta_s - theta))
    w, losses = dict(theta), []
    for _ in range(2):
        leaf = {k: v.clone().requires_grad_(True) for k, v in w.items()}
        loss = task_loss(leaf)
        losses.append(float(loss.detach()))
        gl = dict(zip(leaf, torch.autograd.grad(loss, list(leaf.values())), strict=True))
        w = {k: w[k] - 0.1 * (gl[k] - grad[k] + 0.5 * (w[k] - theta[k])) for k in w}
    assert close(out.upload["weights"], w)
    # g_k <- g_k - alpha (theta_k - theta)
    assert close(out.state["grad"], {k: grad[k] - 0.5 * (w[k] - theta[k]) for k in w})
    assert out.metrics["train_loss"] == pytest.approx(np.mean(losses), rel=1e-6)  # task loss only


def _feddyn_case():
    g = torch.Generator().manual_seed(4)
    theta = {
        "head.weight": torch.randn(2, 2, generator=g),
        "head.bias": torch.randn(2, generator=g),
    }
    grad = {k: torch.randn(v.shape, generator=g) for k, v in theta.items()}
    return theta, grad


def _task_grad(w):
    leaf = {k: v.clone().requires_grad_(True) for k, v in w.items()}
    loss = nn.functional.cross_entropy(X @ leaf["head.weight"].T + leaf["head.bias"], Y)
    return dict(zip(leaf, torch.autograd.grad(loss, list(leaf.values())), strict=True))


def test_feddyn_linear_prox_term_is_flbench_loss_by_hand():
    """``prox_term: linear``: FL-bench's client loss CE + alpha <theta, nabla_k - theta^{t-1}>
    (src/client/feddyn.py lines 30-32, src/server/feddyn.py lines 34-36), nabla_k = -g_k / alpha,
    written out and differentiated: two full-batch SGD steps."""
    a = 0.5
    algo, senv, envs = federation(
        {"name": "feddyn", "alpha": a, "prox_term": "linear"}, [(X, Y)] * 2, 2, local_epochs=2
    )
    theta, grad = _feddyn_case()
    out = algo.client_update(envs[0], {"weights": theta}, {"grad": grad}, RoundContext(3))
    delta = {k: -grad[k] / a - theta[k] for k in theta}  # FL-bench's local_dual_correction

    def flbench_loss(w):
        ce = nn.functional.cross_entropy(X @ w["head.weight"].T + w["head.bias"], Y)
        return ce + a * sum((w[k] * delta[k]).sum() for k in w)

    w = dict(theta)
    for _ in range(2):
        leaf = {k: v.clone().requires_grad_(True) for k, v in w.items()}
        gl = dict(
            zip(leaf, torch.autograd.grad(flbench_loss(leaf), list(leaf.values())), strict=True)
        )
        w = {k: w[k] - 0.1 * gl[k] for k in w}
    assert close(out.upload["weights"], w)
    assert close(out.state["grad"], {k: grad[k] - a * (w[k] - theta[k]) for k in w})
    # the paper's quadratic term gives another model (its alpha theta part is what differs)
    paper, _, penvs = federation({"name": "feddyn", "alpha": a}, [(X, Y)] * 2, 2, local_epochs=2)
    other = paper.client_update(penvs[0], {"weights": theta}, {"grad": grad}, RoundContext(3))
    assert not close(other.upload["weights"], w, atol=1e-3)


@pytest.mark.parametrize("clip_on", ["task", "total"])
def test_feddyn_clip_on_by_hand(clip_on):
    """``train.grad_clip`` 0.3: ``task`` clips the task gradient, then adds -g_k + alpha (theta
    - theta^{t-1}); ``total`` (FL-bench src/client/feddyn.py lines 33-37) clips their sum. Two
    full-batch steps, the global-norm clip written out (factor c / (norm + 1e-6), at most 1)."""
    a, c = 0.5, 0.3
    algo, senv, envs = federation(
        {"name": "feddyn", "alpha": a, "clip_on": clip_on}, [(X, Y)] * 2, 2, local_epochs=2,
        grad_clip=c,
    )  # fmt: skip
    theta, grad = _feddyn_case()
    out = algo.client_update(envs[0], {"weights": theta}, {"grad": grad}, RoundContext(3))

    def clipped(d):
        norm = math.sqrt(sum(float((v**2).sum()) for v in d.values()))
        return {k: v * min(1.0, c / (norm + 1e-6)) for k, v in d.items()}

    def step(w, order):
        gl = _task_grad(w)
        if order == "task":
            gl = clipped(gl)
        d = {k: gl[k] - grad[k] + a * (w[k] - theta[k]) for k in w}
        if order == "total":
            d = clipped(d)
        return {k: w[k] - 0.1 * d[k] for k in w}

    want, other = dict(theta), dict(theta)
    for _ in range(2):
        want = step(want, clip_on)
        other = step(other, "task" if clip_on == "total" else "total")
    assert close(out.upload["weights"], want)
    assert not close(other, want, atol=1e-3)  # the clip binds: the order matters here
