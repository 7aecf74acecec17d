"""pFedMe by value: client_update as R local steps, each K gradient steps on the inner problem
f(theta; D) + (lam / 2) ||theta - w||^2 warm-started from the previous theta, then
w <- w - eta lam (w - theta) (Algorithm 1), computed by hand with plain torch ops; the server's
beta-mixing of the plain mean; the scored model (theta, not w)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pflkit.algorithms.context import RoundContext, ServerContext
from pflkit.algorithms.pfedme import moreau_steps, pfedme_loss
from pflkit.testing import personal_weights, same_weights
from split_helpers import data, np_ce_grad, one_client

# inputs of 2 numbers, 2 classes; softmax regression (mlp []: head only); full batch
X = torch.tensor([[1.0, -0.5], [0.3, 0.8], [-0.6, 0.4]])
Y = torch.tensor([0, 1, 1])
LAM, K, PLR, LR = 2.0, 3, 0.2, 0.1


def start():
    return {
        "head.weight": torch.tensor([[0.4, -0.2], [-0.3, 0.5]]),
        "head.bias": torch.tensor([0.1, -0.1]),
    }


def h_loss(t):
    z = X.double() @ t["head.weight"].T + t["head.bias"]
    return (torch.logsumexp(z, 1) - z[torch.arange(len(Y)), Y]).mean()


def hand_round(steps):
    """(w, theta, mean loss) after ``steps`` local steps from start() (theta = w at the start)."""
    w = {k: v.double() for k, v in start().items()}
    theta = dict(w)
    losses = []
    for _ in range(steps):
        for _ in range(K):  # inner GD on f(theta) + lam/2 ||theta - w||^2, from the last theta
            t = {k: v.clone().requires_grad_() for k, v in theta.items()}
            grads = torch.autograd.grad(h_loss(t), list(t.values()))
            theta = {
                k: theta[k] - PLR * (g + LAM * (theta[k] - w[k]))
                for k, g in zip(theta, grads, strict=True)
            }
        pull = 0.5 * LAM * sum(((w[k] - theta[k]) ** 2).sum() for k in w)
        losses.append((h_loss(theta) + pull).item())
        w = {k: w[k] - LR * LAM * (w[k] - theta[k]) for k in w}  # w - eta lam (w - theta)
    return w, theta, sum(losses) / len(losses)


def pfedme(**params):
    p = {"name": "pfedme", "lam": LAM, "inner_steps": K, "personal_lr": PLR, **params}
    return one_client(p, X, Y, 2, lr=LR)


@pytest.mark.parametrize("steps", [1, 3])
def test_client_update_by_hand(steps):
    """R = ``local_steps`` full-batch steps (the same batch each time, so theta's warm start
    shows): w uploaded, the last theta kept as the personalized model."""
    algo, senv, env = pfedme(local_steps=steps)
    upd = algo.client_update(env, {"weights": start()}, {}, RoundContext(1))
    want_w, want_theta, want_loss = hand_round(steps)
    for k in want_w:
        assert torch.allclose(upd.upload["weights"][k].double(), want_w[k], atol=1e-6), k
        assert torch.allclose(upd.state["personal"][k].double(), want_theta[k], atol=1e-6), k
    assert upd.metrics["train_loss"] == pytest.approx(want_loss, rel=1e-6)
    assert upd.upload["num_samples"] == 3


def test_local_steps_default_to_epochs_of_batches():
    """No ``local_steps``: train.local_epochs (2) epochs of ceil(3 / 3) = 1 batch: R = 2."""
    algo, senv, env = one_client(
        {"name": "pfedme", "lam": LAM, "inner_steps": K, "personal_lr": PLR},
        X, Y, 2, lr=LR, local_epochs=2,
    )  # fmt: skip
    upd = algo.client_update(env, {"weights": start()}, {}, RoundContext(1))
    want_w, want_theta, _ = hand_round(2)
    for k in want_w:
        assert torch.allclose(upd.upload["weights"][k].double(), want_w[k], atol=1e-6), k
        assert torch.allclose(upd.state["personal"][k].double(), want_theta[k], atol=1e-6), k


def test_aggregate_mixes_the_plain_mean_with_beta():
    """w^{t+1} = (1 - beta) w^t + beta mean_S(w_i): the plain mean by default, whatever the
    sample counts; by n_i with ``weighting: samples``."""
    old = {k: torch.full_like(v, 1.0) for k, v in start().items()}
    ups = {
        0: {"weights": {k: torch.full_like(v, 2.0) for k, v in old.items()}, "num_samples": 1},
        1: {"weights": {k: torch.full_like(v, 6.0) for k, v in old.items()}, "num_samples": 3},
    }
    cases = [({}, 4.0), ({"beta": 0.5}, 0.5 * 1.0 + 0.5 * 4.0),
             ({"beta": 0.5, "weighting": "samples"}, 0.5 * 1.0 + 0.5 * 5.0)]  # fmt: skip
    for params, value in cases:
        algo, senv, _ = pfedme(**params)
        new = algo.aggregate(senv, {"weights": old}, ups, ServerContext(1, "train"))["weights"]
        for k, v in new.items():
            assert torch.allclose(v, torch.full_like(v, value)), (params, k)


def test_the_scored_model_is_theta_and_the_global_model_is_w():
    algo, senv, env = pfedme(local_steps=2)
    assert same_weights(
        personal_weights(algo, env, {"weights": start()}, algo.client_init(env), RoundContext(1)),
        start(),
    )  # before it first trains: the global model
    upd = algo.client_update(env, {"weights": start()}, {}, RoundContext(1))
    server = algo.aggregate(senv, {"weights": start()}, {0: upd.upload}, ServerContext(1, "train"))
    view = algo.eval_view(senv, server, 0, ServerContext(1))
    got = personal_weights(algo, env, view, upd.state, RoundContext(1))
    want_w, want_theta, _ = hand_round(2)
    for k in want_theta:
        assert torch.allclose(got[k].double(), want_theta[k], atol=1e-6), k
        assert torch.allclose(view["weights"][k].double(), want_w[k], atol=1e-6), k
    # the personalized model differs from w: the test tells them apart
    assert not torch.allclose(want_theta["head.weight"], want_w["head.weight"], atol=1e-3)
    trained = personal_weights(algo, env, view, upd.state, RoundContext(1), upload=upd.upload)
    assert all(torch.equal(trained[k], got[k]) for k in got)


# -- options for PFLlib's code ------------------------------------------------------------------
def hand_round_with_decay(steps, mu):
    """hand_round with PFLlib's inner step theta - plr (g + lam (theta - w) + mu theta)
    (pFedMeOptimizer.step); the reported loss adds (mu / 2) ||theta||^2."""
    w = {k: v.double() for k, v in start().items()}
    theta = dict(w)
    losses = []
    for _ in range(steps):
        for _ in range(K):
            t = {k: v.clone().requires_grad_() for k, v in theta.items()}
            grads = torch.autograd.grad(h_loss(t), list(t.values()))
            theta = {
                k: theta[k] - PLR * (g + LAM * (theta[k] - w[k]) + mu * theta[k])
                for k, g in zip(theta, grads, strict=True)
            }
        pull = 0.5 * LAM * sum(((w[k] - theta[k]) ** 2).sum() for k in w)
        decay = 0.5 * mu * sum((v**2).sum() for v in theta.values())
        losses.append((h_loss(theta) + pull + decay).item())
        w = {k: w[k] - LR * LAM * (w[k] - theta[k]) for k in w}
    return w, theta, sum(losses) / len(losses)


def test_theta_decay_adds_mu_theta_to_every_inner_step():
    algo, senv, env = pfedme(local_steps=2, theta_decay=0.5)
    upd = algo.client_update(env, {"weights": start()}, {}, RoundContext(1))
    want_w, want_theta, want_loss = hand_round_with_decay(2, 0.5)
    for k in want_w:
        assert torch.allclose(upd.upload["weights"][k].double(), want_w[k], atol=1e-6), k
        assert torch.allclose(upd.state["personal"][k].double(), want_theta[k], atol=1e-6), k
    assert upd.metrics["train_loss"] == pytest.approx(want_loss, rel=1e-6)
    # the decay matters at this size (theta moves by more than the tolerance)
    _, plain_theta, _ = hand_round(2)
    assert (want_theta["head.weight"] - plain_theta["head.weight"]).abs().max() > 1e-2
    # mu = 0 is the paper's step
    algo0, _, env0 = pfedme(local_steps=2, theta_decay=0.0)
    upd0 = algo0.client_update(env0, {"weights": start()}, {}, RoundContext(1))
    for k in plain_theta:
        assert torch.allclose(upd0.state["personal"][k].double(), plain_theta[k], atol=1e-6), k


def test_scored_global_scores_the_global_model_as_pfllib_does():
    """``scored: global``: the personalized accuracy scores the global model (the server's w),
    and under MAP's protocol the uploaded w, not theta."""
    algo, senv, env = pfedme(local_steps=2, scored="global")
    upd = algo.client_update(env, {"weights": start()}, {}, RoundContext(1))
    server = algo.aggregate(senv, {"weights": start()}, {0: upd.upload}, ServerContext(1, "train"))
    view = algo.eval_view(senv, server, 0, ServerContext(1))
    assert same_weights(
        personal_weights(algo, env, view, upd.state, RoundContext(1)), view["weights"]
    )  # w
    want_w, want_theta, _ = hand_round(2)
    for k in want_w:
        assert torch.allclose(view["weights"][k].double(), want_w[k], atol=1e-6), k
    trained = personal_weights(algo, env, view, upd.state, RoundContext(1), upload=upd.upload)
    for k in want_w:
        assert torch.allclose(trained[k].double(), want_w[k], atol=1e-6), k
    assert not torch.allclose(want_theta["head.weight"], want_w["head.weight"], atol=1e-3)
    # training is the same whatever is scored: theta is still kept
    for k in want_theta:
        assert torch.allclose(upd.state["personal"][k].double(), want_theta[k], atol=1e-6), k


# -- pFedMe ---------------------------------------------------------------------------------------


def test_pfedme_inner_problem_on_a_quadratic():
    a = np.array([[2.0, 0.0], [1.0, 1.0], [0.0, 3.0]])
    bb = np.array([1.0, -2.0, 0.5])
    w = np.array([0.3, -0.7])
    lam = 2.0
    # minimiser of 1/2 ||A theta - b||^2 + lam/2 ||theta - w||^2: (A^T A + lam I)^-1 (A^T b + lam w)
    star = np.linalg.solve(a.T @ a + lam * np.eye(2), a.T @ bb + lam * w)
    at, bt = torch.tensor(a), torch.tensor(bb)

    def f(th):
        return 0.5 * (at @ th["t"] - bt).pow(2).sum()

    theta0 = {"t": torch.zeros(2, dtype=torch.float64)}
    anchor = {"t": torch.tensor(w)}
    one = moreau_steps(f, theta0, anchor, lam, 0.05, 1)["t"].numpy()
    assert np.allclose(one, -0.05 * (a.T @ (-bb) + lam * (0 - w)))  # one GD step by hand
    many = moreau_steps(f, theta0, anchor, lam, 0.05, 2000)["t"].numpy()
    assert np.allclose(many, star, atol=1e-10)


def test_pfedme_local_step_pulls_w_toward_theta():
    torch.manual_seed(2)
    x, y = data(6, 3, 3)
    model = torch.nn.Linear(3, 3)
    theta = {k: v.detach().clone() for k, v in model.named_parameters()}
    lam, lr, k = 15.0, 0.01, 3
    pfedme_loss(theta, lam, lr, k)(model, x, y).backward()
    W, b = model.weight.detach().double().numpy(), model.bias.detach().double().numpy()
    tW, tb = W.copy(), b.copy()
    for _ in range(k):  # inner GD by hand, then the w-gradient lam (w - theta)
        gW, gb = np_ce_grad(tW, tb, x.double().numpy(), y.numpy())
        tW, tb = tW - lr * (gW + lam * (tW - W)), tb - lr * (gb + lam * (tb - b))
    assert np.allclose(theta["weight"].numpy(), tW, atol=1e-6)
    assert np.allclose(model.weight.grad.numpy(), lam * (W - tW), atol=1e-5)
    assert np.allclose(model.bias.grad.numpy(), lam * (b - tb), atol=1e-5)


def test_pfedme_server_mixes_with_beta():
    x, y = data(4, 3, 2)
    algo, senv, _ = one_client({"name": "pfedme", "beta": 2.0}, x, y, 2)
    old = {"head.weight": torch.tensor([[1.0]]), "head.bias": torch.tensor([0.0])}
    ups = {
        0: {"weights": {"head.weight": torch.tensor([[3.0]]), "head.bias": torch.tensor([1.0])}},
        1: {"weights": {"head.weight": torch.tensor([[5.0]]), "head.bias": torch.tensor([3.0])}},
    }
    for u in ups.values():
        u["num_samples"] = 1
    new = algo.aggregate(senv, {"weights": old}, ups, ServerContext(1, "train"))["weights"]
    # (1 - 2) * 1 + 2 * mean(3, 5) = 7;  (1 - 2) * 0 + 2 * mean(1, 3) = 4
    assert new["head.weight"].item() == 7.0 and new["head.bias"].item() == 4.0
