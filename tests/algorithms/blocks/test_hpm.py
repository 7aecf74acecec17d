"""pflkit.algorithms.blocks.hpm: the inherited private model (HPM) of FedPHP, MAP and ScaMAP:
its momentum and moving average, the KD and MMD losses, Eq. 13 and the personalization step."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from map_helpers import np_softmax, two_heads
from pflkit.algorithms.blocks.hpm import (
    hpm_momentum,
    hpm_update,
    kd_loss,
    mmd_loss,
    personalize,
)
from pflkit.algorithms.context import RoundContext
from pflkit.engine import Simulation
from pflkit.engine.simulation import seed_torch
from pflkit.primitives.training import get_weights, set_weights


def test_hpm_momentum_schedules():
    # paper: mu * z / (Q T), z includes this selection, clipped to [0, 1]
    assert hpm_momentum(1, 0.2, 150) == pytest.approx(0.9 / 30)
    assert hpm_momentum(15, 0.2, 150) == pytest.approx(0.45)
    assert hpm_momentum(40, 0.2, 150) == 1.0
    # code: previous selections only, int(Q T), clipped to [0, 0.9]
    assert hpm_momentum(1, 0.2, 150, schedule="code") == 0.0
    assert hpm_momentum(16, 0.2, 150, schedule="code") == pytest.approx(0.45)
    assert hpm_momentum(40, 0.2, 150, schedule="code") == 0.9


def test_hpm_update_is_the_moving_average():
    old = {"w": torch.tensor([1.0, 2.0]), "n": torch.tensor(3)}
    new = {"w": torch.tensor([5.0, -2.0]), "n": torch.tensor(7)}
    out = hpm_update(old, new, 0.25)
    assert torch.allclose(out["w"], 0.75 * new["w"] + 0.25 * old["w"])
    assert out["n"].item() == 7


def test_personalize_folds_the_fine_tuned_model_into_the_hpm(tiny):
    sim = Simulation(
        tiny(algorithm={"name": "fedphp"}, train={"rounds": 10, "client_fraction": 0.5})
    )
    env, p = sim.envs[0], sim.algo.params
    model = env.model()
    set_weights(model, sim.server["weights"])
    first = RoundContext(1)
    state, _ = personalize(env, model, {}, p, first)  # first selection: HPM := fine-tuned model
    assert state["selected"] == 1
    assert all(torch.equal(state["hpm"][k], v) for k, v in get_weights(model).items())
    old = {k: v + 0.1 for k, v in state["hpm"].items()}
    state, _ = personalize(env, model, {"hpm": old, "selected": 1}, p, RoundContext(2))
    mu = 0.9 * 2 / (0.5 * 10)
    for k, v in get_weights(model).items():
        assert torch.allclose(state["hpm"][k], (1 - mu) * v + mu * old[k], atol=1e-6)


def test_kd_loss_matches_hand_computation():
    s = torch.tensor([[1.0, 2.0, 0.5]])
    t = torch.tensor([[0.2, 3.0, -1.0]])
    tau = 4.0
    ps = np.exp(s.numpy()[0] / tau) / np.exp(s.numpy()[0] / tau).sum()
    pt = np.exp(t.numpy()[0] / tau) / np.exp(t.numpy()[0] / tau).sum()
    kl = float((pt * np.log(pt / ps)).sum())
    assert kd_loss(s, t, tau).item() == pytest.approx(tau**2 * kl, rel=1e-5)
    ce = -float((pt * np.log(np.exp(s.numpy()[0]) / np.exp(s.numpy()[0]).sum())).sum())
    assert kd_loss(s, t, tau, form="code").item() == pytest.approx(ce, rel=1e-5)


def test_mmd_matches_the_kernel_formula():
    torch.manual_seed(0)
    h, hp = torch.randn(4, 3), torch.randn(4, 3) + 1.0
    assert mmd_loss(h, h).item() == pytest.approx(0.0, abs=1e-6)
    z = torch.cat([h, hp]).numpy()
    d2 = ((z[:, None] - z[None]) ** 2).sum(-1)
    base = d2.sum() / (64 - 8) / 4
    k = sum(np.exp(-d2 / (base * 2**i)) for i in range(5))
    expect = k[:4, :4].mean() + k[4:, 4:].mean() - 2 * k[:4, 4:].mean()
    assert mmd_loss(h, hp).item() == pytest.approx(expect, rel=1e-4)


def test_kd_loss_averages_over_the_batch():
    # Eq. 11 for a batch of 3: tau^2 times the mean (not the sum) of the per-sample KL terms
    s = torch.tensor([[1.0, 2.0, 0.5], [0.0, 0.0, 3.0], [-1.0, 1.0, 0.0]])
    t = torch.tensor([[0.2, 3.0, -1.0], [1.0, 1.0, 1.0], [2.0, 0.0, 0.0]])
    ps, pt = np_softmax(s.numpy() / 4), np_softmax(t.numpy() / 4)
    per_sample = (pt * np.log(pt / ps)).sum(1)
    assert kd_loss(s, t, 4.0).item() == pytest.approx(16 * per_sample.mean(), rel=1e-5)
    ce = -(pt * np.log(np_softmax(s.numpy()))).sum(1).mean()  # the code's form, batch mean too
    assert kd_loss(s, t, 4.0, form="code").item() == pytest.approx(ce, rel=1e-5)


@pytest.mark.parametrize("kt", ["kd", "mmd"])
def test_eq13_weights_ce_by_one_minus_lambda_and_kt_by_lambda(kt):
    from pflkit.algorithms.blocks.hpm import HPMParams, kt_loss

    student, teacher, x, y = two_heads()
    lam = 0.2  # asymmetric, so swapping lambda and 1 - lambda changes the value
    g = (x @ student.head.weight.T).detach().numpy()
    gp = (x @ teacher.head.weight.T).detach().numpy()
    ce = -np.mean(np.log(np_softmax(g)[[0, 1, 2], y.numpy()]))
    if kt == "kd":
        ps, pt = np_softmax(g / 4), np_softmax(gp / 4)
        ktv = 16 * (pt * np.log(pt / ps)).sum(1).mean()
    else:  # features are x for both (Head.features): MMD between a batch and itself is 0
        ktv = 0.0
    loss = kt_loss(teacher, HPMParams(lam=lam, kt=kt))(student, x, y)
    assert loss.item() == pytest.approx((1 - lam) * ce + lam * ktv, rel=1e-5)


def test_mmd_of_identical_batches_is_zero_not_nan():
    z = torch.zeros(4, 3)
    assert mmd_loss(z, z).item() == 0.0  # the bandwidth epsilon (1e-8) of the authors' code


def test_stage_b_distils_from_the_hpm(tiny):
    # the same start, seed and data with two different HPMs: the fine-tuned model must differ
    # (if the teacher were the student itself, KT would do nothing and both would be equal)
    sim = Simulation(
        tiny(algorithm={"name": "fedphp", "lam": 0.5}, train={"rounds": 10, "client_fraction": 0.5})
    )
    env, p = sim.envs[0], sim.algo.params
    w0 = sim.server["weights"]
    trained = []
    for shift in (0.0, 0.5):
        hpm = {k: v + shift * torch.sign(v) for k, v in w0.items()}
        model = env.model()
        set_weights(model, w0)
        seed_torch(3)
        personalize(env, model, {"hpm": hpm, "selected": 1}, p, RoundContext(2))
        trained.append(get_weights(model))
    assert any(not torch.allclose(trained[0][k], trained[1][k]) for k in w0)
