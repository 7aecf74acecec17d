"""GPFL's defining math, each piece against a hand (numpy) computation; exact byte counts."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import tiny_config
from pflkit.algorithms import parse_params
from pflkit.algorithms.context import RoundContext, ServerContext
from pflkit.algorithms.gpfl import (
    TABLE,
    alg_loss,
    cond_inputs,
    cov_apply,
    cov_params,
    decay,
    init_cov,
    mlg_loss,
    reg_norms,
)
from pflkit.engine import run_experiment
from pflkit.errors import PflkitError
from pflkit.experiment import validate
from split_helpers import data, one_client

A = np.array([[0.5, -1.0, 0.2], [0.3, 0.8, -0.4], [-0.6, 0.1, 0.9]])
B = np.array([[0.2, 0.4, -0.1], [-0.7, 0.3, 0.5], [0.1, -0.2, 0.6]])


def hand_cov():
    """CoV weights by hand (K = 3), as float64 tensors and numpy arrays."""
    w = {
        "cov.gamma.linear.weight": A, "cov.gamma.linear.bias": np.array([0.1, -0.2, 0.3]),
        "cov.gamma.ln.weight": np.array([1.5, 0.5, 1.0]), "cov.gamma.ln.bias": np.array([0.0, 0.1, -0.1]),
        "cov.beta.linear.weight": B, "cov.beta.linear.bias": np.array([0.0, 0.2, -0.3]),
        "cov.beta.ln.weight": np.array([1.0, 2.0, 0.5]), "cov.beta.ln.bias": np.array([0.3, 0.0, 0.2]),
    }  # fmt: skip
    return {k: torch.tensor(v) for k, v in w.items()}, w


def np_ln(u, w, b, eps=1e-5):
    return (u - u.mean()) / np.sqrt(u.var() + eps) * w + b


def np_cov(w, z, f):
    gamma = np_ln(np.maximum(A @ z + w["cov.gamma.linear.bias"], 0), w["cov.gamma.ln.weight"],
                  w["cov.gamma.ln.bias"])  # fmt: skip
    beta = np_ln(np.maximum(B @ z + w["cov.beta.linear.bias"], 0), w["cov.beta.ln.weight"],
                 w["cov.beta.ln.bias"])  # fmt: skip
    return gamma, beta, np.maximum((gamma + 1) * f + beta, 0)


def test_cov_math_by_hand():
    t, w = hand_cov()
    z = np.array([0.4, -0.3, 1.2])
    f = np.array([[1.0, -2.0, 0.5], [0.0, 3.0, -1.0]])
    gamma, beta, out = np_cov(w, z, f)
    tg, tb = cov_params(t, torch.tensor(z))
    assert np.allclose(tg.numpy(), gamma) and np.allclose(tb.numpy(), beta)
    assert np.allclose(cov_apply(torch.tensor(f), tg, tb).numpy(), out)
    # gamma and beta depend on z only: one vector each, broadcast over the batch
    assert tg.shape == (3,) and tb.shape == (3,)


def test_cov_and_gce_shapes_and_parameter_counts():
    # specs/gpfl.md §4.3: CoV has 2(K^2 + K) + 4K parameters = 527,360 at K = 512
    cov = init_cov(512, torch.Generator().manual_seed(0))
    assert sum(v.numel() for v in cov.values()) == 527_360
    assert all(cov[f"cov.{r}.linear.weight"].shape == (512, 512) for r in ("gamma", "beta"))
    assert cov["cov.gamma.linear.weight"].abs().max() <= 1 / np.sqrt(512)  # PyTorch's default
    assert torch.equal(cov["cov.beta.ln.weight"], torch.ones(512))
    x, y = data(8, 5, 4)
    algo, senv, _ = one_client({"name": "gpfl"}, x, y, 4, hidden=(6,))
    shared = algo.server_init(senv)["shared"]
    assert shared[TABLE].shape == (4, 6)  # U x K, K = the body's feature width
    assert sum(v.numel() for k, v in shared.items() if k.startswith("cov.")) == 2 * (36 + 6) + 24
    assert {k.split(".")[0] for k in shared} == {"body", "cov", "gce"}  # no head


def test_alg_loss_by_hand():
    fg = np.array([[1.0, 2.0, 0.0], [0.5, -1.0, 2.0]])
    table = np.array([[1.0, 0.0, 0.0], [0.0, 3.0, 4.0], [-1.0, 1.0, 1.0]])
    y = np.array([1, 2])
    cos = (fg / np.linalg.norm(fg, axis=1, keepdims=True)) @ (
        table / np.linalg.norm(table, axis=1, keepdims=True)
    ).T
    # row 0: cos to c_0 = 1/sqrt5, to c_1 = 6/(5 sqrt5), to c_2 = 1/sqrt15
    assert np.allclose(cos[0], [1 / np.sqrt(5), 6 / (5 * np.sqrt(5)), 1 / np.sqrt(15)])
    hand = np.mean([np.log(np.exp(c).sum()) - c[t] for c, t in zip(cos, y, strict=True)])
    got = alg_loss(torch.tensor(fg), torch.tensor(table), torch.tensor(y))
    assert got.item() == pytest.approx(hand, rel=1e-12)


def test_mlg_loss_both_forms_by_hand():
    fg = torch.tensor([[3.0, 4.0], [1.0, 1.0]])
    target = torch.tensor([[0.0, 0.0], [1.0, 2.0]])
    assert mlg_loss(fg, target, "mean_l2").item() == pytest.approx((5.0 + 1.0) / 2)
    assert mlg_loss(fg, target, "batch_frobenius").item() == pytest.approx(np.sqrt(26.0))


def test_regularisers_by_hand():
    a, b = torch.tensor([3.0, 0.0]), torch.tensor([[4.0]])
    assert reg_norms([a, b]).item() == pytest.approx(5.0)
    p = torch.tensor([2.0, -1.0], requires_grad=True)
    p.grad = torch.tensor([0.5, 0.5])
    decay([p], 0.1)([p])
    assert torch.allclose(p.grad, torch.tensor([0.7, 0.4]))


def test_one_step_pulls_cov_and_gce_by_mu_times_the_unit_direction():
    """Eq. 11's mu ||V||_2 + mu ||C||_2: one full-batch SGD step with mu against the same step
    with mu = 0 differs by exactly lr * mu * V / ||V||_2 (and C / ||C||_2), from numpy."""
    x, y = data(6, 3, 3)

    def step(mu):
        algo, senv, env = one_client({"name": "gpfl", "mu": mu}, x, y, 3)
        server = algo.server_init(senv)
        torch.manual_seed(0)
        upd = algo.client_update(env, algo.configure(senv, server, 0, ServerContext(1, "train")),
                                 algo.client_init(env), RoundContext(1))  # fmt: skip
        return server["shared"], upd

    start, with_mu = step(0.3)
    _, without = step(0.0)
    lr, mu = 0.1, 0.3
    cov = [k for k in start if k.startswith("cov.")]
    for keys in (cov, [TABLE]):
        v = {k: start[k].double().numpy() for k in keys}
        norm = np.sqrt(sum((a**2).sum() for a in v.values()))
        for k in keys:
            diff = with_mu.upload["shared"][k].double() - without.upload["shared"][k].double()
            assert np.allclose(diff.numpy(), -lr * mu * v[k] / norm, atol=1e-6), k
    c = start[TABLE].double().numpy()
    norms = np.sqrt(sum((start[k].double().numpy() ** 2).sum() for k in cov)), np.linalg.norm(c)
    assert with_mu.metrics["train_loss"] - without.metrics["train_loss"] == pytest.approx(
        mu * sum(norms), rel=1e-5
    )


def test_conditional_inputs_are_the_mean_and_the_label_weighted_mean():
    table = torch.tensor([[1.0, 2.0], [3.0, -1.0], [0.0, 4.0], [5.0, 5.0]])
    alpha = torch.tensor([0.5, 0.25, 0.25, 0.0])
    g, p = cond_inputs(table, alpha)
    assert torch.allclose(g, torch.tensor([9 / 4, 10 / 4]))
    assert torch.allclose(p, torch.tensor([0.5 + 0.75 + 0.0, 1.0 - 0.25 + 1.0]))
    _, printed = cond_inputs(table, alpha, "printed")
    assert torch.allclose(printed, p / 4)


def test_personalized_input_of_a_client_is_its_label_weighted_embedding_mean():
    x, y = data(8, 5, 4)
    y = torch.tensor([0, 0, 0, 0, 1, 1, 2, 2])  # alpha = (1/2, 1/4, 1/4, 0)
    algo, senv, env = one_client({"name": "gpfl"}, x, y, 4, hidden=(3,))
    server = algo.server_init(senv)
    state = algo.client_init(env)
    c = server["shared"][TABLE].numpy().astype(np.float64)
    hand = 0.5 * c[0] + 0.25 * c[1] + 0.25 * c[2]
    view = algo.eval_view(senv, server, 0, ServerContext(1))
    got = algo.personal_model(env, view, state, RoundContext(1)).cond
    assert np.allclose(got.numpy(), hand, atol=1e-6)


def test_inference_goes_through_the_personalized_route():
    x, y = data(6, 3, 3)
    algo, senv, env = one_client({"name": "gpfl"}, x, y, 3)  # body = flatten: f = x, K = 3
    server = algo.server_init(senv)
    t, w = hand_cov()
    server["shared"].update({k: v.float() for k, v in t.items()})
    state = algo.client_init(env)
    weights = algo.personal_model(
        env, algo.eval_view(senv, server, 0, ServerContext(1)), state, RoundContext(1)
    )
    p = weights.cond.double().numpy()
    _, _, fp = np_cov(w, p, x.double().numpy())
    W, b = (
        state["head"]["head.weight"].double().numpy(),
        state["head"]["head.bias"].double().numpy(),
    )
    logits = weights(x)
    assert np.allclose(logits.detach().numpy(), fp @ W.T + b, atol=1e-5)


def test_without_cov_and_gce_gpfl_is_fedper(tmp_path):
    def run(algo):
        cfg = validate(tiny_config(algorithm=algo, train={"rounds": 2}))
        return [r["pers_acc_mean"] for r in run_experiment(cfg, out=tmp_path / algo["name"]).rows]

    assert run({"name": "gpfl", "use_cov": False, "use_gce": False}) == run({"name": "fedper"})


def body_params(hidden=32, d=64):
    return d * hidden + hidden


@pytest.mark.parametrize(
    "algo, shared",
    [
        ({"name": "gpfl"}, body_params() + 2 * (32 * 32 + 32) + 4 * 32 + 10 * 32),
        ({"name": "gpfl", "use_cov": False}, body_params() + 10 * 32),
        ({"name": "gpfl", "use_gce": False}, body_params() + 2 * (32 * 32 + 32) + 4 * 32),
    ],
)
def test_only_shared_parts_go_over_the_wire(tmp_path, algo, shared):
    cfg = validate(tiny_config(algorithm=algo, train={"rounds": 1}))
    row = run_experiment(cfg, out=tmp_path / "r").rows[0]
    # digits: 64 features, 10 classes; mlp [32]; float32 = 4 bytes; + 8 for num_samples
    assert set(row["bytes_down"]) == {4 * shared} and set(row["bytes_up"]) == {4 * shared + 8}


@pytest.mark.parametrize(
    "bad, match",
    [
        ({"lam": -1}, "gpfl.lam"),
        ({"mlg": "frobenius"}, "gpfl.mlg"),
        ({"cond_source": "global"}, "gpfl.cond_source"),
        ({"temperature": 1}, "has no parameter 'temperature'"),
    ],
)
def test_bad_parameters_are_one_sentence(bad, match):
    with pytest.raises(PflkitError, match=match):
        parse_params({"name": "gpfl", **bad})


# -- client_update, aggregate and the evaluated model, by value (plain torch, float64) ------------
#
# A tiny federation: inputs of 2 numbers, body Linear(2, 3) + ReLU (K = 3), U = 3 classes, three
# samples of classes (0, 0, 1) (alpha = (2/3, 1/3, 0): p differs from g), one full-batch step of
# SGD. Every number the client starts from is set by hand below; the expected results come from
# Eq. 4-11 written out with plain torch ops, and autograd of that hand loss.

X3 = torch.tensor([[1.0, 0.5], [0.2, 1.0], [0.8, -0.3]])
Y3 = torch.tensor([0, 0, 1])
ALPHA3 = torch.tensor([2 / 3, 1 / 3, 0.0], dtype=torch.float64)


def hand_start():
    """(shared, head) of the tiny federation: fixed numbers (a seeded generator), the body's
    bias positive so every feature is active."""
    gen = torch.Generator().manual_seed(7)

    def r(*shape, lo=-1.0, hi=1.0):
        return lo + (hi - lo) * torch.rand(*shape, generator=gen)

    shared = {"body.1.weight": r(3, 2), "body.1.bias": r(3, lo=0.5, hi=1.0)}
    for route in ("gamma", "beta"):
        shared[f"cov.{route}.linear.weight"] = r(3, 3)
        shared[f"cov.{route}.linear.bias"] = r(3, lo=0.1, hi=0.6)
        shared[f"cov.{route}.ln.weight"] = r(3, lo=0.5, hi=1.5)
        shared[f"cov.{route}.ln.bias"] = r(3, lo=-0.3, hi=0.3)
    shared[TABLE] = r(3, 3, lo=-1.5, hi=1.5)
    head = {"head.weight": r(3, 3), "head.bias": r(3, lo=-0.2, hi=0.2)}
    return shared, head


def h_ln(u, w, b):
    """LayerNorm over the last dimension by hand (biased variance, eps 1e-5)."""
    mean = u.mean(-1, keepdim=True)
    var = ((u - mean) ** 2).mean(-1, keepdim=True)
    return (u - mean) / torch.sqrt(var + 1e-5) * w + b


def h_route(t, f, z):
    """CoV(f, z) = ReLU((gamma + 1) f + beta), gamma/beta = LN(ReLU(A z + a)) (Eq. 4)."""

    def h(r):
        u = torch.relu(t[f"cov.{r}.linear.weight"] @ z + t[f"cov.{r}.linear.bias"])
        return h_ln(u, t[f"cov.{r}.ln.weight"], t[f"cov.{r}.ln.bias"])

    return torch.relu((h("gamma") + 1) * f + h("beta"))


def h_ce(logits, y):
    """Mean softmax cross-entropy: log sum_c exp(z_c) - z_y."""
    return (torch.logsumexp(logits, 1) - logits[torch.arange(len(y)), y]).mean()


def h_features(t, x):
    return torch.relu(x @ t["body.1.weight"].T + t["body.1.bias"])


def hand_gpfl_step(shared, head, x, y, *, lam, mu, lr, mlg="mean_l2", reg="norm", cond=None):
    """One full-batch SGD step of Eq. 11 by hand: (new shared, new head, loss at the start).
    ``cond``: (g, p) to use (default: from the received table, Eq. 5 and 7 without 1/U)."""
    t = {k: v.double().clone().requires_grad_() for k, v in {**shared, **head}.items()}
    x = x.double()
    c_hat = shared[TABLE].double()  # the frozen copy: a constant
    g, p = cond if cond is not None else (c_hat.mean(0), ALPHA3 @ c_hat)
    f = h_features(t, x)
    f_p, f_g = h_route(t, f, p), h_route(t, f, g)  # personalized route, global route
    loss_p = h_ce(f_p @ t["head.weight"].T + t["head.bias"], y)  # Eq. 10
    c = t[TABLE]
    cos = (f_g / f_g.norm(dim=1, keepdim=True)) @ (c / c.norm(dim=1, keepdim=True)).T
    loss_alg = h_ce(cos, y)  # Eq. 8: against the trainable table
    diff = f_g - c_hat[y]
    loss_mlg = diff.norm(dim=1).mean() if mlg == "mean_l2" else torch.sqrt((diff**2).sum())
    cov = [v for k, v in t.items() if k.startswith("cov.")]
    if reg == "norm":  # Eq. 11: mu ||V||_2 + mu ||C||_2 (unsquared)
        regs = mu * torch.sqrt(sum((v**2).sum() for v in cov)) + mu * torch.sqrt((c**2).sum())
    else:  # SGD weight decay mu on V and C = the gradient of (mu / 2) ||.||^2
        regs = 0.5 * mu * (sum((v**2).sum() for v in cov) + (c**2).sum())
    loss = loss_p + loss_alg + lam * loss_mlg + regs
    grads = dict(zip(t, torch.autograd.grad(loss, list(t.values())), strict=True))
    new = {k: (v - lr * grads[k]).detach() for k, v in t.items()}
    shown = loss if reg == "norm" else loss - regs  # weight decay is not part of the loss
    return (
        {k: new[k] for k in shared},
        {k: new[k] for k in head},
        shown.item(),
    )


def gpfl_client(**params):
    algo, senv, env = one_client({"name": "gpfl", **params}, X3, Y3, 3, hidden=(3,))
    shared, head = hand_start()
    return algo, senv, env, shared, head


def assert_close(got: dict, want: dict, atol=2e-6):
    assert got.keys() == want.keys()
    for k in want:
        assert torch.allclose(got[k].double(), want[k].double(), atol=atol), k


@pytest.mark.parametrize("lam, mu", [(0.7, 0.2), (0.01, 0.1)])  # hand values; the defaults
def test_client_update_is_one_sgd_step_on_eq11_by_hand(lam, mu):
    """client_update as a whole: L^P on the personalized route, L^alg against the trainable
    table and lam L^mlg to the frozen table on the global route, mu ||V|| + mu ||C||; phi, V,
    C uploaded, the head kept."""
    algo, senv, env, shared, head = gpfl_client(lam=lam, mu=mu)
    state = {**algo.client_init(env), "head": head}
    upd = algo.client_update(env, {"shared": shared}, state, RoundContext(1))
    want_shared, want_head, want_loss = hand_gpfl_step(shared, head, X3, Y3, lam=lam, mu=mu, lr=0.1)
    assert_close(upd.upload["shared"], want_shared)
    assert_close(upd.state["head"], want_head)
    assert upd.upload["num_samples"] == 3
    assert upd.metrics["train_loss"] == pytest.approx(want_loss, rel=1e-6)


def test_client_update_with_the_authors_code_options_by_hand():
    """mlg: batch_frobenius, regulariser: weight_decay, cond_source: local_previous (PFLlib's
    clientgpfl.py): the first round's conditional inputs are zero vectors; the second round's
    come from the client's own table of its first round, not from the received one."""
    opts = {"mlg": "batch_frobenius", "regulariser": "weight_decay",
            "cond_source": "local_previous", "lam": 0.7, "mu": 0.2}  # fmt: skip
    algo, senv, env, shared, head = gpfl_client(**opts)
    state = {**algo.client_init(env), "head": head}
    zero = torch.zeros(3, dtype=torch.float64)
    upd = algo.client_update(env, {"shared": shared}, state, RoundContext(1))
    kw = {"lam": 0.7, "mu": 0.2, "lr": 0.1, "mlg": "batch_frobenius", "reg": "weight_decay"}
    want_shared, want_head, want_loss = hand_gpfl_step(
        shared, head, X3, Y3, cond=(zero, zero), **kw
    )
    assert_close(upd.upload["shared"], want_shared)
    assert_close(upd.state["head"], want_head)
    assert upd.metrics["train_loss"] == pytest.approx(want_loss, rel=1e-6)
    # round 2 receives the round-1 start again; g and p come from the client's own table
    own = upd.upload["shared"][TABLE].double()
    upd2 = algo.client_update(env, {"shared": shared}, upd.state, RoundContext(2))
    want2, _, _ = hand_gpfl_step(
        shared, upd.state["head"], X3, Y3, cond=(own.mean(0), ALPHA3 @ own), **kw
    )
    assert_close(upd2.upload["shared"], want2)


def test_aggregate_weights_phi_cov_and_gce_by_samples():
    algo, senv, _, shared, _ = gpfl_client()
    a = {k: torch.full_like(v, 1.0) for k, v in shared.items()}
    b = {k: torch.full_like(v, 5.0) for k, v in shared.items()}
    ups = {0: {"shared": a, "num_samples": 1}, 2: {"shared": b, "num_samples": 3}}
    new = algo.aggregate(senv, {"shared": shared}, ups, ServerContext(1, "train"))["shared"]
    assert_close(new, {k: torch.full_like(v, (1 * 1 + 3 * 5) / 4) for k, v in shared.items()})
    algo_u, *_ = gpfl_client(weighting="uniform")
    new_u = algo_u.aggregate(senv, {"shared": shared}, ups, ServerContext(1, "train"))["shared"]
    assert_close(new_u, {k: torch.full_like(v, 3.0) for k, v in shared.items()})


def test_the_evaluated_model_is_the_aggregate_with_the_own_head_and_p_by_hand():
    """The scored model after a round: the latest aggregated phi and V, the client's own
    (trained) head, p_i from the latest global table (Sec. 3.2); logits by hand."""
    algo, senv, env, shared, head = gpfl_client(lam=0.7, mu=0.2)
    state = {**algo.client_init(env), "head": head}
    upd = algo.client_update(env, {"shared": shared}, state, RoundContext(1))
    other = {k: v + 0.25 for k, v in shared.items()}  # another client's upload
    ups = {0: upd.upload, 1: {"shared": other, "num_samples": 1}}
    server = algo.aggregate(senv, {"shared": shared}, ups, ServerContext(1, "train"))
    agg = {k: (3 * upd.upload["shared"][k] + other[k]) / 4 for k in shared}  # n = 3 and 1
    view = algo.eval_view(senv, server, 0, ServerContext(1))
    weights = algo.personal_model(env, view, upd.state, RoundContext(1))
    t = {k: v.double() for k, v in {**agg, **upd.state["head"]}.items()}
    p = ALPHA3 @ t[TABLE]
    f_p = h_route(t, h_features(t, X3.double()), p)
    want = f_p @ t["head.weight"].T + t["head.bias"]
    got = weights(X3)
    assert torch.allclose(got.double(), want, atol=1e-5)
    # MAP's protocol scores the freshly trained model: the uploaded phi, V and table (p from
    # that table) with the trained head
    trained = algo.personal_model(env, view, upd.state, RoundContext(1), upload=upd.upload)
    t2 = {k: v.double() for k, v in {**upd.upload["shared"], **upd.state["head"]}.items()}
    f_p2 = h_route(t2, h_features(t2, X3.double()), ALPHA3 @ t2[TABLE])
    want2 = f_p2 @ t2["head.weight"].T + t2["head.bias"]
    got2 = trained(X3)
    assert torch.allclose(got2.double(), want2, atol=1e-5)
