"""KT-pFL and the knowledge-distillation baselines (FedMD, FedDF, pFedDF, Sim-pFD, TopK-pFD),
heterogeneous client models, and KT-pFL's model zoo (specs/ktpfl.md).

Expected values are computed here by hand (numpy, or torch formulas and autograd on a copy of
the model), never with the modules' own helpers."""

from __future__ import annotations

import copy
import math
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from conftest import tiny_config
from pflkit.algorithms import build_algorithm, parse_params, resolve_params
from pflkit.algorithms.base import nbytes
from pflkit.algorithms.blocks.distill import cosine_matrix, kd_loss, mix, project_simplex, restrict
from pflkit.algorithms.blocks.training import get_weights, set_weights
from pflkit.algorithms.context import RoundContext
from pflkit.algorithms.feddf import ensemble_distill
from pflkit.algorithms.ktpfl import (
    coef_objective,
    coef_step_official,
    coef_step_paper,
    update_coefficients,
)
from pflkit.algorithms.simpfd import similarity_weights, topk_weights
from pflkit.data.federated import build_federated
from pflkit.engine import Simulation
from pflkit.engine.envs import make_envs
from pflkit.errors import PflkitError
from pflkit.experiment import validate
from pflkit.models import build_model
from split_helpers import assert_close, hand_sgd, mlp_logits

CONFIGS = Path(__file__).resolve().parents[2] / "configs" / "ktpfl"


pytestmark = pytest.mark.usefixtures("one_thread")


# digits are 1x8x8: four distinct architectures that accept that input (ShuffleNetV2 would
# reach 1x1 before its last BatchNorm, which a 1-sample last batch cannot train)
ZOO = [
    {"name": "mlp", "options": {"hidden": [32]}},
    {"name": "resnet8", "options": {"width": 4}},
    {"name": "mlp", "options": {"hidden": [16, 16]}},
    {"name": "mlp", "options": {"hidden": []}},
]


def hetero_cfg(algorithm: dict, rounds: int = 2, **train):
    raw = tiny_config(
        model={"name": "mlp", "options": {"hidden": [32]}, "per_client": ZOO},
        algorithm=algorithm,
        train={"rounds": rounds, "batch_size": 16, "lr": 0.05, "local_epochs": 1, **train},
    )
    return validate(raw)


@pytest.fixture(scope="module")
def digits_with_public():
    """The tiny digits federation (4 clients) plus a 64-sample public set of the same shape."""
    data = build_federated(validate(tiny_config()).data)
    data.public_x = data.test_x[:64].clone()
    return data


def setup(cfg, data):
    """The algorithm, server environment and client environments of ``cfg`` (no engine)."""
    senv, envs = make_envs(cfg, data)
    return build_algorithm(cfg.algorithm), senv, envs


def soft(a: int, b: int, c: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.softmax(torch.randn(a, b, c, generator=g, dtype=torch.float64) * 2, dim=-1)


def logits_of(env, weights, x, slot="ref") -> torch.Tensor:
    """Eval-mode logits of ``weights`` (the client's architecture) on ``x``, by hand."""
    m = env.model(slot)
    set_weights(m, weights)
    m.eval()
    with torch.no_grad():
        return m(x)


def kl_rows(p: torch.Tensor, logq: torch.Tensor) -> float:
    """mean_x KL(p(x) || q(x)) with ``logq`` = log q."""
    return float((p * (p.clamp_min(1e-30).log() - logq)).sum(1).mean())


def np_project(v: np.ndarray) -> np.ndarray:
    """Independent simplex projection (per column), for checking."""
    out = np.empty_like(v)
    for j in range(v.shape[1]):
        u = np.sort(v[:, j])[::-1]
        css = np.cumsum(u) - 1
        r = np.nonzero(u - css / np.arange(1, len(u) + 1) > 0)[0][-1]
        out[:, j] = np.maximum(v[:, j] - css[r] / (r + 1), 0)
    return out


def hand_c_steps(c, s, w, lam=1.0, rho=0.7, lr=0.01, steps=20, reduction="mean"):
    """Eq. 7 by hand: ``steps`` projected gradient steps, d/dc_mn = lam w_n R_x sum_k S_m (log
    P_n - log S_n + 1) + 2 rho (c_mn - 1/N), R = sum or mean over the public samples."""
    c, s, w = np.array(c, dtype=np.float64), np.array(s, dtype=np.float64), np.array(w)
    n, b = s.shape[0], s.shape[1]
    for _ in range(steps):
        grad = np.zeros_like(c)
        for j in range(n):
            p = sum(c[i, j] * s[i] for i in range(n))
            for m in range(n):
                kl = (s[m] * (np.log(p) - np.log(s[j]) + 1)).sum()
                grad[m, j] = lam * w[j] * (kl / b if reduction == "mean" else kl)
                grad[m, j] += 2 * rho * (c[m, j] - 1 / n)
        c = np_project(c - lr * grad)
    return c


# a column-stochastic, non-symmetric mixing matrix (rows != columns)
C0 = np.array(
    [[0.55, 0.10, 0.05, 0.30], [0.25, 0.60, 0.15, 0.10], [0.15, 0.05, 0.70, 0.20],
     [0.05, 0.25, 0.10, 0.40]]
)  # fmt: skip


# -- the knowledge-coefficient matrix --------------------------------------------------------------


def test_c_update_matches_hand_computed_gradient_steps():
    n = 3
    s = soft(n, 4, 3).numpy()
    c = np.array([[0.5, 0.2, 0.3], [0.3, 0.6, 0.3], [0.2, 0.2, 0.4]])  # columns on the simplex
    d = np.array([10.0, 20.0, 30.0])
    lam, rho, lr = 0.5, 0.7, 0.01
    w = d / d.sum()
    for reduction in ("sum", "mean"):
        expected = hand_c_steps(c, s, w, lam, rho, lr, steps=1, reduction=reduction)
        got = coef_step_paper(
            torch.tensor(c), torch.tensor(s), torch.tensor(w), lam=lam, rho=rho, lr=lr,
            reduction=reduction,
        )  # fmt: skip
        np.testing.assert_allclose(got.numpy(), expected, rtol=0, atol=1e-12)
    # through the algorithm's entry point (D_n as sample counts): eq. 2's sum, one step ...
    p = parse_params(
        {"name": "ktpfl", "lam": lam, "rho": rho, "coef_lr": lr, "coef_kl": "sum", "coef_steps": 1}
    )[1]
    via = update_coefficients(torch.tensor(c), torch.arange(3), torch.tensor(s), torch.tensor(d), p)
    np.testing.assert_allclose(
        via.numpy(), hand_c_steps(c, s, w, lam, rho, lr, 1, "sum"), atol=1e-12
    )
    # ... and the defaults: the per-sample mean, 20 steps of eta_3 = 0.01, lam = 1, rho = 0.7
    p = parse_params({"name": "ktpfl"})[1]
    via = update_coefficients(torch.tensor(c), torch.arange(3), torch.tensor(s), torch.tensor(d), p)
    np.testing.assert_allclose(via.numpy(), hand_c_steps(c, s, w), atol=1e-12)
    np.testing.assert_allclose(via.sum(0).numpy(), 1.0, atol=1e-12)


def test_objective_value():
    s = soft(3, 5, 4, seed=1)
    c = torch.tensor([[0.6, 0.1, 0.2], [0.3, 0.8, 0.2], [0.1, 0.1, 0.6]], dtype=torch.float64)
    w = torch.tensor([0.2, 0.3, 0.5], dtype=torch.float64)
    kl = 0.0
    for j in range(3):
        p = sum(c[i, j] * s[i] for i in range(3))
        kl += w[j] * (p * (p.log() - s[j].log())).sum()
    reg = ((c - 1 / 3) ** 2).sum()
    assert coef_objective(c, s, w, 2.0, 0.3) == pytest.approx(float(2 * kl + 0.3 * reg))
    assert coef_objective(c, s, w, 2.0, 0.3, "mean") == pytest.approx(float(2 * kl / 5 + 0.3 * reg))


def test_rho_large_keeps_c_uniform_and_rho_zero_drifts_to_self():
    s = soft(4, 8, 5, seed=2)
    w = torch.full((4,), 0.25, dtype=torch.float64)
    uniform = torch.full((4, 4), 0.25, dtype=torch.float64)
    big = coef_step_paper(uniform, s, w, lam=1.0, rho=1e4, lr=1e-5, steps=200)
    assert (big - 0.25).abs().max() < 1e-3
    # ... so the teacher is FedMD's consensus (the plain mean of the soft predictions)
    assert torch.allclose(mix(big, s), s.mean(0).expand(4, -1, -1), atol=1e-3)
    free = coef_step_paper(uniform, s, w, lam=1.0, rho=0.0, lr=0.5, steps=300)
    assert free.diag().min() > 0.9  # the trivial solution: self-teaching (spec §8.4)


def grouped_soft(groups: int = 3, per_group: int = 2, b: int = 300, k: int = 10) -> torch.Tensor:
    """Soft predictions (T = 1) of clients in groups: same-group clients predict alike."""
    g = torch.Generator().manual_seed(0)
    base = torch.randn(groups, b, k, generator=g, dtype=torch.float64) * 3
    noise = torch.randn(groups * per_group, b, k, generator=g, dtype=torch.float64)
    return torch.softmax(base.repeat_interleave(per_group, 0) + noise, dim=-1)


def test_default_c_personalises_without_collapsing_and_summed_kl_collapses():
    s = grouped_soft()  # clients (0, 1), (2, 3), (4, 5) are alike
    n = len(s)

    def ten_rounds(params):
        p = parse_params({"name": "ktpfl", **params})[1]
        c = torch.full((n, n), 1 / n, dtype=torch.float64)
        for _ in range(10):
            c = update_coefficients(c, torch.arange(n), s, torch.ones(n), p)
        return c

    c = ten_rounds({})
    for j in range(n):
        partner = j ^ 1
        others = [m for m in range(n) if m // 2 != j // 2]
        assert c[partner, j] > 3 * c[others, j].max()  # it found the client like itself ...
    assert 0.3 < float(c.diag().mean()) < 0.6  # ... without collapsing to itself
    # eq. 2's sum over the B = 300 public samples: the KL part wins, self-teaching
    assert float(ten_rounds({"coef_kl": "sum"}).diag().mean()) > 0.95
    # one step of eta_3 = 0.01 a round: c hardly leaves uniform
    assert float((ten_rounds({"coef_steps": 1}) - 1 / n).abs().max()) < 0.05


def test_simplex_projection():
    v = torch.tensor([[0.5, 2.0, -1.0], [0.5, 0.0, -1.0], [0.2, -3.0, -1.0]], dtype=torch.float64)
    got = project_simplex(v)
    np.testing.assert_allclose(got.numpy(), np_project(v.numpy()), atol=1e-12)
    assert torch.allclose(got[:, 1], torch.tensor([1.0, 0.0, 0.0], dtype=torch.float64))
    assert torch.allclose(got[:, 2], torch.full((3,), 1 / 3, dtype=torch.float64))
    on = torch.tensor([[0.2], [0.3], [0.5]], dtype=torch.float64)
    assert torch.allclose(project_simplex(on), on)  # already on the simplex: unchanged


def test_official_coef_update_is_the_codes_normalised_step_and_softmax():
    n = 3
    s = soft(n, 6, 4, seed=3)
    c = torch.full((n, n), 1 / n, dtype=torch.float64)
    rho = 0.7
    got = coef_step_official(c, s, rho=rho)
    for j in range(n):
        teacher = sum(c[m, j] * s[m] for m in range(n))
        g = torch.stack(
            [
                -2 * ((s[j] - teacher) * s[m]).mean() + 2 * rho / n * (c[m, j] - 1 / n)
                for m in range(n)
            ]
        )
        avg, step = float(g.abs().sum()) / n, 1.0
        for _ in range(5):
            if avg > 0.01:
                avg, step = avg / 5, step / 5
            if avg < 0.01:
                avg, step = avg * 5, step * 5
        assert 0.01 <= float(g.abs().mean()) * step < 0.05 + 1e-12
        assert torch.allclose(got[:, j], torch.softmax(5 * (c[:, j] - step * g), 0), atol=1e-12)


def test_partial_participation_updates_only_the_sub_block():
    n = 5
    g = torch.Generator().manual_seed(4)
    c = torch.softmax(torch.randn(n, n, generator=g, dtype=torch.float64), 0)
    active = torch.tensor([0, 2, 3])
    s = soft(3, 6, 4, seed=4)
    counts = torch.tensor([5.0, 10.0, 15.0], dtype=torch.float64)
    p = parse_params({"name": "ktpfl"})[1]
    new = update_coefficients(c, active, s, counts, p)
    untouched = torch.ones(n, n, dtype=torch.bool)
    untouched[active.view(-1, 1), active.view(1, -1)] = False
    assert torch.equal(new[untouched], c[untouched])
    # the sub-block: its columns renormalised, eq. 7 on them, then scaled back to their mass
    sub = c[active][:, active].numpy()
    mass = sub.sum(0, keepdims=True)
    expected = hand_c_steps(sub / mass, s.numpy(), (counts / counts.sum()).numpy()) * mass
    np.testing.assert_allclose(new[active][:, active].numpy(), expected, atol=1e-12)
    assert torch.allclose(new.sum(0), c.sum(0))
    sub = restrict(new, active)  # the round's mixing weights: renormalised columns
    assert torch.allclose(sub.sum(0), torch.ones(3, dtype=torch.float64))


@pytest.mark.parametrize("timing", ["after_distill_reuse_uploads", "before_mix", "after_distill_reupload"])  # fmt: skip
def test_coef_timing_decides_which_c_mixes_and_which_uploads_update_it(timing, digits_with_public):
    algo, senv, _ = setup(hetero_cfg({"name": "ktpfl", "coef_timing": timing}), digits_with_public)
    server = algo.server_init(senv)
    server["c"] = torch.tensor(C0)
    s1 = soft(4, 64, 10, seed=7).float()  # the share-phase uploads
    s2 = soft(4, 64, 10, seed=8).float()  # fresh predictions after distilling (reupload)
    counts = [40.0, 30.0, 20.0, 10.0]
    w = np.array(counts) / sum(counts)
    share = {c: {"soft": s1[c], "num_samples": int(counts[c])} for c in range(4)}
    after_share = algo.aggregate(senv, server, share, 1, "share")
    stepped = hand_c_steps(C0, s1.double().numpy(), w)
    mixing = stepped if timing == "before_mix" else C0  # the code updates c, then mixes
    for n in range(4):
        expected = sum(float(mixing[m, n]) * s1[m] for m in range(4))
        assert torch.allclose(after_share["teachers"][n], expected, atol=1e-6)
    distill = {c: ({"soft": s2[c]} if timing == "after_distill_reupload" else {}) for c in range(4)}
    final = algo.aggregate(senv, after_share, distill, 1, "distill")
    if timing == "after_distill_reupload":
        stepped = hand_c_steps(C0, s2.double().numpy(), w)  # eq. 7 at the distilled w*
    np.testing.assert_allclose(final["c"].numpy(), stepped, atol=1e-9)
    assert final["c_self_mass"] == [pytest.approx(float(np.diag(stepped).mean()))]


# -- one client round, by value ------------------------------------------------------------------------


def distilled_by_hand(env, weights, x, teacher, temperature, lr):
    """One full-batch SGD step on mean_x KL(teacher || softmax(f(x) / T)) from ``weights``."""
    m = env.model("ref")
    set_weights(m, weights)
    m.train()
    logq = torch.log_softmax(m(x) / temperature, dim=1)
    loss = (teacher * (teacher.log() - logq)).sum(1).mean()
    names = [k for k, _ in m.named_parameters()]
    grads = torch.autograd.grad(loss, list(m.parameters()))
    return {k: weights[k] - lr * g for k, g in zip(names, grads, strict=True)}


def trained_by_hand(env, weights, seed, **overrides):
    """``weights`` after the client's private training, batches drawn after seeding ``seed``."""
    m = env.model("ref")
    set_weights(m, weights)
    torch.manual_seed(seed)
    env.train(m, RoundContext(1), **overrides)
    return get_weights(m)


def spy_on_training(monkeypatch, env) -> list:
    """Make ``env.train`` record (weights before, weights after) of every call; it still
    trains."""
    calls = []
    real = env.train

    def spy(model, ctx, **kw):
        before = get_weights(model)
        loss = real(model, ctx, **kw)
        calls.append((before, get_weights(model)))
        return loss

    monkeypatch.setattr(env, "train", spy)
    return calls


def assert_weights_close(got, expected, atol=1e-6):
    assert got.keys() == expected.keys()
    for k in expected:
        assert torch.allclose(got[k], expected[k], atol=atol), k


@pytest.mark.parametrize("name", ["ktpfl", "fedmd"])
def test_client_round_order_upload_temperature_and_distillation_by_value(
    name, monkeypatch, digits_with_public
):
    t = 3.0
    cfg = hetero_cfg({"name": name, "temperature": t, "distill_batch_size": 64})
    algo, _, envs = setup(cfg, digits_with_public)
    env, x = envs[0], digits_with_public.public_x  # an MLP: no BatchNorm
    calls = spy_on_training(monkeypatch, env)
    w0 = algo.client_init(env)["weights"]
    torch.manual_seed(11)
    share = algo.client_update(env, {}, {"weights": w0}, RoundContext(1, "share"))
    if name == "ktpfl":  # KT-pFL Alg. 1: private epochs first, then the upload
        assert len(calls) == 1 and "train_loss" in share.metrics
        assert_weights_close(calls[0][0], w0)
        w1 = trained_by_hand(env, w0, 11)
    else:  # FedMD: upload first; digest, then revisit, in the second phase
        assert calls == [] and "train_loss" not in share.metrics
        w1 = w0
    assert_weights_close(share.state["weights"], w1)
    z = logits_of(env, w1, x)  # the upload: softmax(f(x) / T) of the model as it is now
    np.testing.assert_allclose(
        share.upload["soft"].numpy(), torch.softmax(z / t, 1).numpy(), atol=1e-6
    )
    assert not torch.allclose(share.upload["soft"], torch.softmax(z, 1), atol=1e-3)
    assert share.upload["num_samples"] == env.num_train
    # the distill phase: one full-batch step (distill_batch_size 64 = |public|) at train.lr
    teacher = torch.softmax(logits_of(envs[2], envs[2].init_weights(), x, "t") / t, 1)
    calls.clear()
    out = algo.client_update(env, {"teacher": teacher}, share.state, RoundContext(1, "distill"))
    distilled = {**w1, **distilled_by_hand(env, w1, x, teacher, t, cfg.train.lr)}
    if name == "ktpfl":  # nothing after distillation: the client is scored on this model
        assert calls == []
        assert_weights_close(out.state["weights"], distilled)
    else:  # FedMD revisits its private data starting from the distilled model
        assert len(calls) == 1
        assert_weights_close(calls[0][0], distilled)
        assert_weights_close(out.state["weights"], calls[0][1], atol=0)


@pytest.mark.parametrize("name", ["ktpfl", "fedmd", "simpfd"])
def test_distillation_lowers_kl_to_the_teacher_on_the_public_set(name, digits_with_public):
    cfg = hetero_cfg(
        {"name": name, "distill_epochs": 8, "distill_batch_size": 16, "order": "train_then_distill"}
    )
    algo, _, envs = setup(cfg, digits_with_public)
    x = digits_with_public.public_x
    teacher = torch.softmax(logits_of(envs[2], envs[2].init_weights(), x, "t") * 10, 1)
    for env in envs[:2]:  # an MLP and the ResNet
        w = algo.client_init(env)["weights"]
        before = kl_rows(teacher, torch.log_softmax(logits_of(env, w, x), 1))
        out = algo.client_update(
            env, {"teacher": teacher}, {"weights": w}, RoundContext(1, "distill")
        )
        after = kl_rows(teacher, torch.log_softmax(logits_of(env, out.state["weights"], x), 1))
        assert after < 0.8 * before, (before, after)


def test_local_epoch_ramp_and_fixed_schedule(monkeypatch, digits_with_public):
    for schedule, expected in (("ramp", [1, 2, 3, 3]), ("fixed", [3, 3, 3, 3])):
        cfg = hetero_cfg({"name": "ktpfl", "local_epoch_schedule": schedule}, local_epochs=3)
        algo, _, envs = setup(cfg, digits_with_public)
        env = envs[0]
        seen = []

        def spy(model, ctx, _seen=seen, _default=env.run.train.local_epochs, **kw):
            _seen.append(kw.get("epochs", _default))
            return 0.0

        monkeypatch.setattr(env, "train", spy)
        state = algo.client_init(env)
        for rnd in (1, 2, 3, 4):
            state = algo.client_update(env, {}, state, RoundContext(rnd, "share")).state
        assert seen == expected, schedule


# -- teachers, Sim-pFD, TopK-pFD, the distillation loss ------------------------------------------------


def test_teacher_for_client_n_is_exactly_the_c_weighted_mix(digits_with_public):
    sim = Simulation(hetero_cfg({"name": "ktpfl"}, rounds=2), data=digits_with_public)
    sim.run_round(1)
    c_before = sim.server["c"].clone()
    assert not torch.allclose(c_before, torch.full_like(c_before, 0.25), atol=1e-3)  # learned
    sim.run_round(2)
    s = sim.server["soft"]  # round 2's uploads
    for n in range(4):
        expected = sum(c_before[m, n] * s[m].double() for m in range(4)).float()
        assert torch.allclose(sim.server["teachers"][n], expected, atol=1e-6)
        assert torch.allclose(sim.server["teachers"][n].sum(1), torch.ones(64), atol=1e-5)
        payload = sim.algo.configure(sim.senv, sim.server, n, 2, "distill")
        assert torch.equal(payload["teacher"], sim.server["teachers"][n])
    # the collapse diagnostic: the mean diagonal of c after each round's update
    diag = [float(c_before.diagonal().mean()), float(sim.server["c"].diagonal().mean())]
    assert sim.server["c_self_mass"] == pytest.approx(diag)


@pytest.mark.parametrize("c_init", ["uniform", "identity"])
def test_fixed_c_ablations_teach_with_the_mean_or_the_students_own_predictions(
    c_init, digits_with_public
):
    cfg = hetero_cfg({"name": "ktpfl", "coef_update": "fixed", "c_init": c_init}, rounds=2)
    sim = Simulation(cfg, data=digits_with_public)
    for rnd in (1, 2):
        sim.run_round(rnd)
        s = sim.server["soft"]
        for n in range(4):
            expected = s[n] if c_init == "identity" else s.mean(0)  # never updated
            assert torch.allclose(sim.server["teachers"][n], expected, atol=1e-6)
    diag = 1.0 if c_init == "identity" else 0.25
    assert sim.server["c_self_mass"] == pytest.approx([diag, diag])


def test_sim_pfd_weights_are_the_cosine_similarities():
    s = soft(3, 5, 4, seed=5)
    flat = s.reshape(3, -1).numpy()
    cos = np.array([[a @ b / np.linalg.norm(a) / np.linalg.norm(b) for b in flat] for a in flat])
    np.testing.assert_allclose(cosine_matrix(s).numpy(), cos, atol=1e-12)
    np.testing.assert_allclose(similarity_weights(s).numpy(), cos / cos.sum(0), atol=1e-12)
    shifted = cos - cos.min(0)  # the authors' code: least similar client gets 0
    np.testing.assert_allclose(
        similarity_weights(s, "code").numpy(), shifted / shifted.sum(0), atol=1e-12
    )


def test_topk_pfd_averages_the_k_most_similar_clients_including_itself():
    s = soft(5, 6, 4, seed=6)
    cos = cosine_matrix(s)
    w = topk_weights(s, 3)
    for n in range(5):
        chosen = set(torch.nonzero(w[:, n]).flatten().tolist())
        others = sorted((m for m in range(5) if m != n), key=lambda m: -float(cos[m, n]))
        assert chosen == {n, *others[:2]}
        assert torch.allclose(w[list(chosen), n], torch.full((3,), 1 / 3, dtype=torch.float64))
    assert torch.allclose(topk_weights(s, 10).sum(0), torch.ones(5, dtype=torch.float64))


def test_kd_loss_is_kl_teacher_student_and_its_t2_form():
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 4)
    x, t = torch.randn(5, 3), 4.0
    teacher = torch.softmax(torch.randn(5, 4), 1)
    q = torch.softmax(model(x) / t, 1)
    kl = (teacher * (teacher.log() - q.log())).sum(1).mean()
    assert kd_loss(t)(model, x, teacher).item() == pytest.approx(kl.item(), rel=1e-5)
    assert kd_loss(t, "kl_t2")(model, x, teacher).item() == pytest.approx(
        t * t * kl.item(), rel=1e-5
    )
    assert kd_loss(t, "kl_mean")(model, x, teacher).item() == pytest.approx(kl.item() / 4, rel=1e-5)
    # the gradient on the logits: (q - p) / (T B) for kl, T (q - p) / B with the T^2 factor
    z = model(x).detach().requires_grad_(True)
    logit_model = lambda _: z  # noqa: E731
    (g,) = torch.autograd.grad(kd_loss(t, "kl_t2")(logit_model, x, teacher), z)
    assert torch.allclose(g, t * (q.detach() - teacher) / 5, atol=1e-6)


def test_simpfd_and_topkpfd_teachers_through_the_server_by_hand(digits_with_public):
    """The share phase's teachers, S_hat_n = sum_m w[m, n] S_m: Sim-pFD's w[:, n] the cosine
    similarities of the flattened soft predictions to S_n, normalised over m; TopK-pFD's
    (k = 2) 1/2 on the student and on its most similar other client."""
    s = soft(4, 64, 10, seed=12).float()
    flat = s.double().reshape(4, -1).numpy()
    cos = np.array([[a @ b / np.linalg.norm(a) / np.linalg.norm(b) for b in flat] for a in flat])
    share = {c: {"soft": s[c], "num_samples": 10 * (c + 1)} for c in range(4)}
    algo, senv, _ = setup(hetero_cfg({"name": "simpfd"}), digits_with_public)
    teachers = algo.aggregate(senv, algo.server_init(senv), share, 1, "share")["teachers"]
    w = cos / cos.sum(0)
    for n in range(4):
        expected = sum(float(w[m, n]) * s[m] for m in range(4))
        assert torch.allclose(teachers[n], expected, atol=1e-6)
    algo, senv, _ = setup(hetero_cfg({"name": "topkpfd", "k": 2}), digits_with_public)
    teachers = algo.aggregate(senv, algo.server_init(senv), share, 1, "share")["teachers"]
    for n in range(4):
        nearest = max((m for m in range(4) if m != n), key=lambda m: cos[m, n])
        assert torch.allclose(teachers[n], (s[n] + s[nearest]) / 2, atol=1e-6)


# -- end to end: heterogeneous clients ---------------------------------------------------------------


def accuracy_by_hand(env, weights) -> float:
    z = logits_of(env, weights, env.data.test_x)
    return float((z.argmax(1) == env.data.test_y).float().mean())


@pytest.mark.parametrize(
    "algorithm",
    [
        {"name": "ktpfl"},
        {"name": "ktpfl", "order": "distill_then_train", "coef_timing": "before_mix",
         "coef_update": "official", "local_epoch_schedule": "ramp", "public_per_round": 32},
        {"name": "fedmd"},
        {"name": "simpfd", "sim_weights": "code"},
        {"name": "topkpfd", "k": 2},
        {"name": "feddf", "server_steps": 10, "eval_every": 5, "patience": 5},
        {"name": "pfeddf", "ft_epochs": 1, "server_steps": 10, "eval_every": 5},
    ],
    ids=["ktpfl", "ktpfl-code-order", "fedmd", "simpfd", "topkpfd", "feddf", "pfeddf"],
)  # fmt: skip
def test_heterogeneous_clients_train_together_end_to_end(algorithm, digits_with_public):
    cfg = hetero_cfg(algorithm)
    sim = Simulation(cfg, data=digits_with_public)
    assert len({sim.senv.arch(c) for c in range(4)}) == 4
    rows = [sim.run_round(r) for r in (1, 2)]
    assert rows[1]["pers_acc_mean"] > 0.3  # chance is 0.1
    assert "global_acc" not in rows[1]  # no single global model across architectures
    b = algorithm.get("public_per_round", 64) * 10 * 4  # B x C float32 soft predictions / teacher
    name = algorithm["name"]
    if name in ("feddf", "pfeddf"):
        for cid, down in zip(rows[0]["clients"], rows[0]["bytes_down"], strict=True):
            assert down == nbytes(sim.envs[cid].model().state_dict())
    else:
        extra_down = 32 * 8 if "public_per_round" in algorithm else 0  # the round's indices
        assert rows[0]["bytes_down"] == [b + extra_down] * 4
        assert rows[0]["bytes_up"] == [b + 8] * 4  # soft predictions + D_n
    # what was scored: each client's own model at the end of the round (its architecture's
    # prototype for FedDF); pFedDF fine-tunes it first
    for cid in range(4):
        env = sim.envs[cid]
        if name == "pfeddf":
            continue
        w = sim.server["protos"][env.arch] if name == "feddf" else sim.clients[cid]["weights"]
        assert rows[1]["pers_acc_clients"][cid] == pytest.approx(accuracy_by_hand(env, w))


def test_reupload_doubles_the_upload(digits_with_public):
    sim = Simulation(
        hetero_cfg({"name": "ktpfl", "coef_timing": "after_distill_reupload"}),
        data=digits_with_public,
    )
    row = sim.run_round(1)
    assert row["bytes_up"] == [2 * 64 * 10 * 4 + 8] * 4


def test_fedmd_teacher_is_the_plain_mean(digits_with_public):
    algo, senv, _ = setup(hetero_cfg({"name": "fedmd"}), digits_with_public)
    s = soft(4, 64, 10, seed=9).float()
    counts = (5, 10, 20, 40)  # the consensus ignores D_n
    server = algo.aggregate(
        senv, algo.server_init(senv),
        {c: {"soft": s[c], "num_samples": counts[c]} for c in range(4)}, 1, "share",
    )  # fmt: skip
    for n in range(4):
        assert torch.allclose(server["teachers"][n], (s[0] + s[1] + s[2] + s[3]) / 4, atol=1e-6)
    assert algo.order == "distill_then_train"  # FedMD: digest, then revisit


# -- FedDF and pFedDF ---------------------------------------------------------------------------------


def feddf_round(algorithm: dict, data):
    """FedDF's uploads of round 1 (every client trained from its prototype) and the server
    state after aggregating them."""
    algo, senv, envs = setup(hetero_cfg(algorithm), data)
    server = algo.server_init(senv)
    uploads = {}
    for c in range(4):
        torch.manual_seed(c)
        payload = algo.configure(senv, server, c, 1, "train")
        uploads[c] = algo.client_update(envs[c], payload, {}, RoundContext(1)).upload
    torch.manual_seed(99)
    return algo, senv, envs, uploads, algo.aggregate(senv, server, uploads, 1, "train")


def ensemble_by_hand(envs, uploads, x, t):
    """softmax(mean over ALL clients of their logits / T)."""
    logits = [logits_of(envs[c], uploads[c]["weights"], x, "t") for c in range(4)]
    return torch.softmax(torch.stack(logits).mean(0) / t, 1)


def test_feddf_one_epoch_distils_the_all_client_ensemble_into_each_group_by_value(
    digits_with_public,
):
    t = 3.0
    algo, senv, envs, uploads, server = feddf_round(
        {"name": "feddf", "server_distill": "one_epoch", "temperature": t,
         "distill_batch_size": 64},
        digits_with_public,
    )  # fmt: skip
    x = digits_with_public.public_x
    teacher = ensemble_by_hand(envs, uploads, x, t)
    np.testing.assert_allclose(algo.ensemble_teacher(senv, uploads).numpy(), teacher, atol=1e-5)
    for c in range(4):  # one client per architecture: its group average is its upload
        env, w = envs[c], uploads[c]["weights"]
        m = env.model("ref")
        set_weights(m, w)
        m.train()
        logq = torch.log_softmax(m(x) / t, dim=1)
        loss = (teacher * (teacher.log() - logq)).sum(1).mean()
        grads = dict(zip([k for k, _ in m.named_parameters()],
                         torch.autograd.grad(loss, list(m.parameters())), strict=True))  # fmt: skip
        expected = {**get_weights(m), **{k: w[k] - 0.05 * g for k, g in grads.items()}}
        proto = server["protos"][env.arch]
        for k in expected:  # parameters one SGD step on, BatchNorm buffers after the batch
            assert torch.allclose(proto[k].double(), expected[k].double(), atol=1e-5), (c, k)
    assert server["fusion"] == {}


def test_feddf_default_fusion_keeps_the_best_student_on_the_held_out_public_samples(
    digits_with_public,
):
    t = 3.0
    algo, senv, envs, uploads, server = feddf_round(
        {"name": "feddf", "temperature": t, "server_steps": 30, "eval_every": 10},
        digits_with_public,
    )
    x = digits_with_public.public_x
    teacher = ensemble_by_hand(envs, uploads, x, t)
    cut = 64 - 7  # the last ceil(0.1 * 64) public samples are held out
    for c in range(4):
        env = envs[c]
        info = server["fusion"][env.arch]
        assert info["steps"] == 30 and info["best_step"] in (10, 20, 30)
        proto = server["protos"][env.arch]
        logq = torch.log_softmax(logits_of(env, proto, x) / t, 1)
        assert info["heldout_kl"] == pytest.approx(kl_rows(teacher[cut:], logq[cut:]), rel=1e-4)
        # distillation lowered KL(teacher || student) on the public samples it trained on
        start = torch.log_softmax(logits_of(env, uploads[c]["weights"], x) / t, 1)
        assert kl_rows(teacher[:cut], logq[:cut]) < kl_rows(teacher[:cut], start[:cut]), c


def test_feddf_server_step_is_adam_with_cosine_annealing_by_value():
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 4)
    x = torch.randn(20, 3)
    teacher = torch.softmax(torch.randn(20, 4), 1)
    p0 = {k: v.detach().clone() for k, v in model.named_parameters()}
    lr, t, b1, b2, eps = 0.01, 2.0, 0.9, 0.999, 1e-8

    def grad_at(params):
        z = x @ params["weight"].T + params["bias"]
        logq = torch.log_softmax(z / t, 1)
        loss = (teacher * (teacher.log() - logq)).sum(1).mean()
        return dict(zip(params, torch.autograd.grad(loss, list(params.values())), strict=True))

    p = {k: v.clone().requires_grad_(True) for k, v in p0.items()}
    m = {k: torch.zeros_like(v) for k, v in p0.items()}
    v = {k: torch.zeros_like(v) for k, v in p0.items()}
    for step, step_lr in ((1, lr), (2, lr * (1 + math.cos(math.pi / 2)) / 2)):
        g = grad_at(p)
        with torch.no_grad():
            for k in p:
                m[k] = b1 * m[k] + (1 - b1) * g[k]
                v[k] = b2 * v[k] + (1 - b2) * g[k] ** 2
                mhat, vhat = m[k] / (1 - b1**step), v[k] / (1 - b2**step)
                p[k] -= step_lr * mhat / (vhat.sqrt() + eps)
    info = ensemble_distill(
        model, x, teacher, x[:5], teacher[:5], steps=2, batch_size=32, lr=lr, temperature=t
    )
    assert info["steps"] == 2 and info["best_step"] == 2
    for k, w in model.named_parameters():
        assert torch.allclose(w, p[k], atol=1e-6), k


def test_feddf_stops_early_when_the_held_out_kl_stops_improving():
    torch.manual_seed(0)
    x = torch.ones(8, 3)  # one input, so the held-out KL moves monotonically
    towards_0 = torch.tensor([[0.95, 0.05]]).expand(8, 2)
    towards_1 = torch.tensor([[0.05, 0.95]]).expand(8, 2)

    def run(patience):
        model = torch.nn.Linear(3, 2)
        torch.nn.init.zeros_(model.weight)
        torch.nn.init.zeros_(model.bias)
        info = ensemble_distill(
            model, x, towards_0, x, towards_1, steps=60, batch_size=8, lr=2e-3, temperature=1.0,
            eval_every=10, patience=patience,
        )  # fmt: skip
        logq = torch.log_softmax(model(x).detach(), 1)
        return info, kl_rows(towards_1, logq)

    info, kept = run(patience=30)
    # held-out KL rises from the first check on: best at 10, no better at 20, 30, 40: stop
    assert (info["steps"], info["best_step"]) == (40, 10)
    assert kept == pytest.approx(info["heldout_kl"], rel=1e-5)  # the step-10 student is kept
    info, _ = run(patience=1000)
    assert (info["steps"], info["best_step"]) == (60, 10)


def test_pfeddf_fine_tunes_the_prototype_for_ft_epochs_by_value(digits_with_public):
    algo, senv, envs, _, server = feddf_round(
        {"name": "pfeddf", "ft_epochs": 2, "server_steps": 5}, digits_with_public
    )
    env = envs[1]
    proto = server["protos"][env.arch]
    torch.manual_seed(21)
    personal = algo.personal_weights(env, algo.eval_view(senv, server, 1, 1), {}, RoundContext(1))
    expected = trained_by_hand(env, proto, 21, epochs=2)  # train.local_epochs is 1
    for k in expected:
        assert torch.allclose(personal[k], expected[k], atol=1e-6), k


def test_feddf_group_average_is_sample_weighted_before_distillation_by_hand(
    tiny, digits_with_public
):
    """One architecture, four uploads with n_k = 10, 20, 30, 40: the server starts from
    sum_k (n_k / n) w_k, forms the teacher softmax(mean_k f_k(x) / T) (the clients' logits
    averaged) and takes one full-batch SGD step (server_distill one_epoch, 64 public samples,
    distill_batch_size 64, lr = train.lr) on KL(teacher || softmax(f(x) / T))."""
    t = 2.0
    algo_cfg = {"name": "feddf", "server_distill": "one_epoch", "temperature": t,
                "distill_batch_size": 64}  # fmt: skip
    algo, senv, _ = setup(tiny(algorithm=algo_cfg), digits_with_public)
    base = algo.server_init(senv)["protos"][senv.arch()]
    gen = torch.Generator().manual_seed(1)
    uploads = {
        c: {"weights": {k: v + 0.3 * torch.randn(v.shape, generator=gen) for k, v in base.items()},
            "num_samples": 10 * (c + 1)}
        for c in range(4)
    }  # fmt: skip
    server = algo.aggregate(senv, algo.server_init(senv), uploads, 1, "train")
    x = digits_with_public.public_x
    avg = {k: sum(u["weights"][k] * u["num_samples"] for u in uploads.values()) / 100 for k in base}
    with torch.no_grad():
        z = torch.stack([mlp_logits(u["weights"], x) for u in uploads.values()]).mean(0)
        teacher = torch.softmax(z / t, 1)
    p = {k: v.clone().requires_grad_(True) for k, v in avg.items()}
    logq = torch.log_softmax(mlp_logits(p, x) / t, 1)
    loss = (teacher * (teacher.log() - logq)).sum(1).mean()
    grads = torch.autograd.grad(loss, list(p.values()))
    expected = {k: avg[k] - 0.05 * g for k, g in zip(p, grads, strict=True)}
    assert_close(server["protos"][senv.arch()], expected)


def test_pfeddf_fine_tunes_the_prototype_by_hand(tiny, digits_with_public):
    """pFedDF's personalized model: the architecture's prototype after ft_epochs = 2 epochs of
    SGD at train.lr on the client's data (train.local_epochs is 1)."""
    algo, senv, envs = setup(tiny(algorithm={"name": "pfeddf", "ft_epochs": 2}), digits_with_public)
    torch.manual_seed(0)
    proto = {k: v + 0.1 * torch.randn_like(v) for k, v in senv.init_weights().items()}
    d = digits_with_public.clients[2]
    torch.manual_seed(6)
    got = algo.personal_weights(envs[2], {"proto": proto}, {}, RoundContext(1))
    torch.manual_seed(6)
    assert_close(got, hand_sgd(proto, d.train_x, d.train_y, lr=0.05, epochs=2))


# -- homogeneous KT-pFL ----------------------------------------------------------------------------


def test_homogeneous_ktpfl_mixes_parameters_by_columns_of_c(tiny, digits_with_public):
    t = 2.0
    cfg = tiny(algorithm={"name": "ktpfl_homo", "temperature": t})
    algo, senv, envs = setup(cfg, digits_with_public)
    server = {**algo.server_init(senv), "c": torch.tensor(C0)}
    uploads = {}
    for c in range(4):
        torch.manual_seed(c)
        payload = algo.configure(senv, server, c, 1, "train")
        uploads[c] = algo.client_update(envs[c], payload, {}, RoundContext(1)).upload
    x = digits_with_public.public_x
    z = logits_of(envs[0], uploads[0]["weights"], x)
    np.testing.assert_allclose(
        uploads[0]["soft"].numpy(), torch.softmax(z / t, 1).numpy(), atol=1e-6
    )
    new = algo.aggregate(senv, server, uploads, 1, "train")
    for n in range(4):  # w_bar_n = sum_m c[m, n] w_m: column n, not row n
        for k, v in new["personal"][n].items():
            expected = sum(float(C0[m, n]) * uploads[m]["weights"][k] for m in range(4))
            assert torch.allclose(v, expected, atol=1e-6), (n, k)
        # ... which client n downloads next round (and is scored with before it trains)
        assert algo.configure(senv, new, n, 2, "train")["weights"] is new["personal"][n]
    s = torch.stack([uploads[c]["soft"] for c in range(4)]).double().numpy()
    counts = np.array([envs[c].num_train for c in range(4)], dtype=float)
    stepped = hand_c_steps(C0, s, counts / counts.sum())
    np.testing.assert_allclose(new["c"].numpy(), stepped, atol=1e-9)
    assert new["c_self_mass"] == [pytest.approx(float(np.diag(stepped).mean()))]


def test_homogeneous_ktpfl_end_to_end_bytes_and_scored_model(tiny, digits_with_public):
    sim = Simulation(tiny(algorithm={"name": "ktpfl_homo"}), data=digits_with_public)
    row = sim.run_round(1)
    w = nbytes(sim.senv.model().state_dict())
    assert row["bytes_up"] == [w + 64 * 10 * 4 + 8] * 4 and row["bytes_down"] == [w] * 4
    for cid in range(4):  # scored: its model after local training
        acc = accuracy_by_hand(sim.envs[cid], sim.clients[cid]["weights"])
        assert row["pers_acc_clients"][cid] == pytest.approx(acc)


# -- the comparison configs -------------------------------------------------------------------------


@pytest.mark.parametrize("path", sorted(CONFIGS.glob("*.yaml")), ids=lambda p: p.stem)
def test_every_method_of_a_comparison_distils_with_the_same_settings(path):
    raw = yaml.safe_load(path.read_text())
    cfg = validate(raw)
    entries = [a if isinstance(a, dict) else {"name": a} for a in cfg.compare.algorithms]
    entries = [{k: v for k, v in a.items() if k != "label"} for a in entries]  # setting names
    resolved = [resolve_params(a, cfg.train.weighting) for a in entries]
    kd = [r for r in resolved if "temperature" in r]
    assert len(kd) >= 2
    for key in ("temperature", "kd_loss"):
        values = [(r["name"], r[key]) for r in kd if key in r]
        assert len({v for _, v in values}) == 1, (key, values)
    orders = {r["order"] or "default" for r in resolved if "order" in r}
    assert orders == {"train_then_distill"}, orders
    # the run's own algorithm section agrees with its compare entry
    own = resolve_params(raw["algorithm"], cfg.train.weighting)
    assert own in resolved


# -- bad input ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "algorithm, match",
    [
        ({"name": "ktpfl", "temperature": 0}, "ktpfl.temperature"),
        ({"name": "ktpfl", "temperature": -1.0}, "ktpfl.temperature"),
        ({"name": "fedmd", "temperature": 0}, "fedmd.temperature"),
        ({"name": "feddf", "temperature": 0}, "feddf.temperature"),
        ({"name": "feddf", "holdout_fraction": 1.0}, "feddf.holdout_fraction"),
        ({"name": "feddf", "server_steps": 0}, "feddf.server_steps"),
        ({"name": "feddf", "server_distill": "sgd"}, "feddf.server_distill"),
        ({"name": "ktpfl", "rho": -0.1}, "ktpfl.rho"),
        ({"name": "ktpfl", "coef_update": "magic"}, "ktpfl.coef_update"),
        ({"name": "ktpfl", "coef_kl": "max"}, "ktpfl.coef_kl"),
        ({"name": "ktpfl", "c_init": "random"}, "ktpfl.c_init"),
        ({"name": "topkpfd", "k": 0}, "topkpfd.k"),
        ({"name": "ktpfl", "tmperature": 3}, "has no parameter 'tmperature'"),
    ],
)
def test_bad_parameters_are_one_sentence_errors(algorithm, match):
    with pytest.raises(PflkitError, match=match):
        parse_params(algorithm)


def test_missing_public_set_says_how_to_configure_it(tiny):
    for name in ("ktpfl", "fedmd", "feddf", "ktpfl_homo"):
        with pytest.raises(PflkitError, match=r"data\.public: \{dataset: mnist5k"):
            Simulation(tiny(algorithm={"name": name}))


def test_public_set_with_other_class_count_is_refused(mnist5k_with_26_classes):
    cfg = validate(
        tiny_config(
            data={"dataset": "fashion_mnist", "subset": 400, "num_clients": 2,
                  "partition": {"name": "iid"}, "public": {"dataset": "mnist5k", "size": 100}},
            algorithm={"name": "ktpfl"},
        )
    )  # fmt: skip
    with pytest.raises(PflkitError, match="has 26 classes but the task"):
        Simulation(cfg)


def test_other_bad_combinations(digits_with_public):
    with pytest.raises(PflkitError, match="public_per_round 100 exceeds"):
        Simulation(hetero_cfg({"name": "ktpfl", "public_per_round": 100}), data=digits_with_public)
    with pytest.raises(PflkitError, match="needs the same architecture"):
        Simulation(hetero_cfg({"name": "ktpfl_homo"}), data=digits_with_public)
    one = copy.copy(digits_with_public)
    one.public_x = digits_with_public.public_x[:1].clone()
    with pytest.raises(PflkitError, match="holdout_fraction 0.1 leaves none of the 1 public"):
        Simulation(hetero_cfg({"name": "feddf"}), data=one)


def test_unknown_client_architecture_is_a_clear_error(digits_with_public):
    bad = [{"name": "mlp", "count": 2}, {"name": "lenet55", "count": 2}]
    cfg = validate(tiny_config(model={"per_client": bad}, algorithm={"name": "ktpfl"}))
    with pytest.raises(PflkitError, match="unknown model 'lenet55'"):
        make_envs(cfg, digits_with_public)
    with pytest.raises(PflkitError, match="unknown model 'lenet55'"):
        Simulation(cfg, data=digits_with_public)


# -- the zoo ---------------------------------------------------------------------------------------------


def test_paper_zoo_parameter_counts_and_split():
    # specs/ktpfl.md §4: AlexNet about 20.1 M, ShuffleNetV2 1.0x about 1.27 M (3x28x28, 10 classes)
    for name, total, head in (("alexnet", 20_126_538, 40_970), ("shufflenetv2", 1_268_646, 10_250)):
        torch.manual_seed(0)
        m = build_model(name, (3, 28, 28), 10)
        assert sum(p.numel() for p in m.parameters()) == total
        assert sum(p.numel() for p in m.head.parameters()) == head
        assert all(k.startswith(("body.", "head.")) for k in m.state_dict())
        m.eval()
        x = torch.randn(2, 3, 28, 28)
        with torch.no_grad():
            assert torch.equal(m(x), m.head(m.features(x)))
    small = build_model("alexnet", (1, 28, 28), 10, width=0.25, hidden=256, init="kaiming")
    assert small(torch.randn(2, 1, 28, 28)).shape == (2, 10)
    fc = small.body.fc7
    assert torch.all(fc.bias == 0) and abs(fc.weight.std().item() - math.sqrt(2 / 256)) < 0.005
    with pytest.raises(PflkitError, match="option 'init'"):
        build_model("alexnet", (1, 28, 28), 10, init="xavier")
    with pytest.raises(PflkitError, match="H, W >= 15"):
        build_model("alexnet", (1, 14, 14), 10)
    with pytest.raises(PflkitError, match="option 'width'"):
        build_model("shufflenetv2", (1, 28, 28), 10, width=0.75)
    with pytest.raises(PflkitError, match="option 'units'"):
        build_model("shufflenetv2", (1, 28, 28), 10, units=[1, 2])
