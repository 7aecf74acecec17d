"""KT-pFL and its homogeneous variant (pflkit.algorithms.ktpfl): the knowledge-coefficient
matrix, the client round, the teachers; the knowledge-distillation family on heterogeneous client
models end to end, the comparison configs, bad input, and KT-pFL's model zoo (specs/ktpfl.md).
FedMD, FedDF/pFedDF and Sim-pFD/TopK-pFD by value: test_fedmd.py, test_feddf.py, test_simpfd.py;
the shared distillation step: blocks/test_distill.py.

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
from distill_helpers import hetero_cfg, logits_of, np_project, setup, soft, trained_by_hand
from pflkit.algorithms import parse_params, resolve_params
from pflkit.algorithms.base import nbytes
from pflkit.algorithms.blocks.distill import mix, restrict
from pflkit.algorithms.context import RoundContext, ServerContext
from pflkit.algorithms.ktpfl import (
    coef_objective,
    coef_step_official,
    coef_step_paper,
    update_coefficients,
)
from pflkit.engine import Simulation
from pflkit.engine.envs import make_envs
from pflkit.errors import PflkitError
from pflkit.experiment import validate
from pflkit.models import build_model
from pflkit.primitives.training import get_weights, set_weights

CONFIGS = Path(__file__).resolve().parents[2] / "configs" / "ktpfl"


pytestmark = pytest.mark.usefixtures("one_thread")


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
    after_share = algo.aggregate(senv, server, share, ServerContext(1, "share"))
    stepped = hand_c_steps(C0, s1.double().numpy(), w)
    mixing = stepped if timing == "before_mix" else C0  # the code updates c, then mixes
    for n in range(4):
        expected = sum(float(mixing[m, n]) * s1[m] for m in range(4))
        assert torch.allclose(after_share["teachers"][n], expected, atol=1e-6)
    distill = {c: ({"soft": s2[c]} if timing == "after_distill_reupload" else {}) for c in range(4)}
    final = algo.aggregate(senv, after_share, distill, ServerContext(1, "distill"))
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


# -- teachers ------------------------------------------------------------------------------------------


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
        payload = sim.algo.configure(sim.senv, sim.server, n, ServerContext(2, "distill"))
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


# -- homogeneous KT-pFL ----------------------------------------------------------------------------


def test_homogeneous_ktpfl_mixes_parameters_by_columns_of_c(tiny, digits_with_public):
    t = 2.0
    cfg = tiny(algorithm={"name": "ktpfl_homo", "temperature": t})
    algo, senv, envs = setup(cfg, digits_with_public)
    server = {**algo.server_init(senv), "c": torch.tensor(C0)}
    uploads = {}
    for c in range(4):
        torch.manual_seed(c)
        payload = algo.configure(senv, server, c, ServerContext(1, "train"))
        uploads[c] = algo.client_update(envs[c], payload, {}, RoundContext(1)).upload
    x = digits_with_public.public_x
    z = logits_of(envs[0], uploads[0]["weights"], x)
    np.testing.assert_allclose(
        uploads[0]["soft"].numpy(), torch.softmax(z / t, 1).numpy(), atol=1e-6
    )
    new = algo.aggregate(senv, server, uploads, ServerContext(1, "train"))
    for n in range(4):  # w_bar_n = sum_m c[m, n] w_m: column n, not row n
        for k, v in new["personal"][n].items():
            expected = sum(float(C0[m, n]) * uploads[m]["weights"][k] for m in range(4))
            assert torch.allclose(v, expected, atol=1e-6), (n, k)
        # ... which client n downloads next round (and is scored with before it trains)
        assert (
            algo.configure(senv, new, n, ServerContext(2, "train"))["weights"] is new["personal"][n]
        )
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
