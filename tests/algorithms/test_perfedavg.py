"""Per-FedAvg by value: client_update as MAML steps on independent batches D, D' (and D'' for
HF) of B samples each, with step sizes alpha (inner) and beta (outer), computed by hand with
plain torch ops; the plain-mean aggregation (Alg. 1); the scored model (one SGD step of size
alpha from the latest w)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pflkit.algorithms.context import RoundContext, ServerContext
from pflkit.algorithms.perfedavg import meta_loss
from pflkit.testing import personal_weights
from split_helpers import data, np_ce_grad, one_client

# inputs of 2 numbers, 2 classes; softmax regression (mlp []: head only)
X = torch.tensor([[1.0, -0.5], [0.3, 0.8], [-0.6, 0.4], [0.9, 0.1], [-0.2, -0.7], [0.5, 0.5]])
Y = torch.tensor([0, 1, 1, 0, 1, 0])
ALPHA, BETA, DELTA = 0.3, 0.07, 1e-3


def start():
    return {
        "head.weight": torch.tensor([[0.4, -0.2], [-0.3, 0.5]]),
        "head.bias": torch.tensor([0.1, -0.1]),
    }


def h_grad(w, idx):
    """Gradient of the mean cross-entropy of softmax regression on the samples ``idx``."""
    t = {k: v.clone().requires_grad_() for k, v in w.items()}
    z = X[idx].double() @ t["head.weight"].T + t["head.bias"]
    loss = (torch.logsumexp(z, 1) - z[torch.arange(len(idx)), Y[idx]]).mean()
    return dict(zip(t, torch.autograd.grad(loss, list(t.values())), strict=True)), loss.item()


def hand_round(n, variant, seed, b=1):
    """One epoch of Per-FedAvg steps from start(): batches of 2B (FO) or 3B (HF) samples in
    the order torch.randperm(n) draws after torch.manual_seed(seed) (local_sgd's order)."""
    k = 2 if variant == "fo" else 3
    torch.manual_seed(seed)
    perm = torch.randperm(n)
    w = {key: v.double() for key, v in start().items()}
    losses = []
    for i in range(0, n, k * b):
        d1, d2, d3 = (perm[i + j * b : i + (j + 1) * b] for j in range(3))
        g, _ = h_grad(w, d1)
        tmp = {key: w[key] - ALPHA * g[key] for key in w}  # w - alpha grad f(w, D)
        v, outer = h_grad(tmp, d2)  # grad f(w_tmp, D')
        losses.append(outer)
        if variant == "hf":  # (I - alpha Hessian(D'')) v, the Hessian by finite differences
            gp, _ = h_grad({key: w[key] + DELTA * v[key] for key in w}, d3)
            gm, _ = h_grad({key: w[key] - DELTA * v[key] for key in w}, d3)
            v = {key: v[key] - ALPHA * (gp[key] - gm[key]) / (2 * DELTA) for key in w}
        w = {key: w[key] - BETA * v[key] for key in w}
    return w, sum(losses) / len(losses)


def perfedavg(**params):
    return one_client(
        {"name": "perfedavg", "alpha": ALPHA, "beta": BETA, **params}, X, Y, 2, batch_size=1
    )


@pytest.mark.parametrize("variant, n", [("fo", 4), ("hf", 6)])
def test_client_update_is_maml_steps_with_alpha_inside_and_beta_outside_by_hand(variant, n):
    """B = 1: FO takes batches of 2 samples (D, D'), HF of 3 (D, D', D''); two steps."""
    algo, senv, env = one_client(
        {"name": "perfedavg", "alpha": ALPHA, "beta": BETA, "variant": variant, "delta": DELTA},
        X[:n], Y[:n], 2, batch_size=1,
    )  # fmt: skip
    want, want_loss = hand_round(n, variant, seed=11)
    torch.manual_seed(11)
    upd = algo.client_update(env, {"weights": start()}, {}, RoundContext(1))
    for key in want:
        assert torch.allclose(upd.upload["weights"][key].double(), want[key], atol=2e-6), key
    assert upd.metrics["train_loss"] == pytest.approx(want_loss, rel=1e-6)
    assert upd.upload["num_samples"] == n


def test_aggregate_is_the_plain_mean_by_default_and_sample_weighted_on_request():
    ups = {
        0: {"weights": {k: torch.full_like(v, 1.0) for k, v in start().items()}, "num_samples": 1},
        1: {"weights": {k: torch.full_like(v, 5.0) for k, v in start().items()}, "num_samples": 3},
    }
    for params, value in [({}, 3.0), ({"weighting": "samples"}, (1.0 + 3 * 5.0) / 4)]:
        algo, senv, _ = perfedavg(**params)
        new = algo.aggregate(senv, {"weights": start()}, ups, ServerContext(1, "train"))["weights"]
        for k, v in new.items():
            assert torch.allclose(v, torch.full_like(v, value)), (params, k)


def test_the_scored_model_is_one_alpha_step_from_the_latest_w_by_hand():
    """personal_weights: one SGD step of size alpha (not beta, not lr) on one batch of B
    samples (the first of torch.randperm after the seed) from the view's w; the meta-model w
    itself is the global model."""
    algo, senv, env = perfedavg()
    server = {"weights": {k: v + 0.1 for k, v in start().items()}}
    view = algo.eval_view(senv, server, 0, ServerContext(1))
    torch.manual_seed(4)
    first = torch.randperm(6)[:1]
    torch.manual_seed(4)
    got = personal_weights(algo, env, view, {}, RoundContext(1))
    w = {k: v.double() for k, v in server["weights"].items()}
    g, _ = h_grad(w, first)
    for k in w:
        assert torch.allclose(got[k].double(), w[k] - ALPHA * g[k], atol=1e-6), k
    assert algo.eval_view(senv, server, None, ServerContext(1)).get("weights") is server["weights"]


# -- Per-FedAvg -------------------------------------------------------------------------------


def test_perfedavg_personal_model_is_one_sgd_step_of_size_alpha():
    x, y = data(8, 3, 2)
    algo, senv, env = one_client({"name": "perfedavg", "alpha": 0.3}, x, y, 2)  # batch = all 8
    w = algo.server_init(senv)["weights"]
    adapted = personal_weights(algo, env, {"weights": w}, {}, RoundContext(1))
    W, b = w["head.weight"].double().numpy(), w["head.bias"].double().numpy()
    gW, gb = np_ce_grad(W, b, x.double().numpy(), y.numpy())
    assert np.allclose(adapted["head.weight"].numpy(), W - 0.3 * gW, atol=1e-6)
    assert np.allclose(adapted["head.bias"].numpy(), b - 0.3 * gb, atol=1e-6)


@pytest.mark.parametrize("variant", ["fo", "hf"])
def test_perfedavg_meta_step_direction_by_hand(variant):
    torch.manual_seed(1)
    x, y = data(9, 3, 3)
    x = x.double()
    model = torch.nn.Linear(3, 3).double()
    alpha, delta = 0.4, 1e-3
    meta_loss(alpha, variant, delta)(model, x, y).backward()
    W, b = model.weight.detach().numpy(), model.bias.detach().numpy()
    xs, ys = x.numpy(), y.numpy()
    if variant == "fo":  # the batch split in two: D = 5 samples, D' = 4
        (x1, y1), (x2, y2) = (xs[:5], ys[:5]), (xs[5:], ys[5:])
    else:  # in three: D, D', D'' of 3 samples each
        (x1, y1), (x2, y2), (x3, y3) = [(xs[i : i + 3], ys[i : i + 3]) for i in (0, 3, 6)]
    g1W, g1b = np_ce_grad(W, b, x1, y1)
    vW, vb = np_ce_grad(W - alpha * g1W, b - alpha * g1b, x2, y2)
    if variant == "hf":
        pW, pb = np_ce_grad(W + delta * vW, b + delta * vb, x3, y3)
        mW, mb = np_ce_grad(W - delta * vW, b - delta * vb, x3, y3)
        vW, vb = vW - alpha * (pW - mW) / (2 * delta), vb - alpha * (pb - mb) / (2 * delta)
    assert np.allclose(model.weight.grad.numpy(), vW, atol=1e-9)
    assert np.allclose(model.bias.grad.numpy(), vb, atol=1e-9)
