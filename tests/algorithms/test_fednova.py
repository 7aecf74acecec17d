"""FedNova: the normaliser ||a_i||_1, the server's normalised averaging and its momentum, by
hand; the client's upload on real local training (tau_i, a_i, d_i); FedAvg as the special case
of equal steps; bad parameters. Expected values are written out or computed with plain
numpy/torch formulas here."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from conftest import tiny_config
from pflkit.algorithms.base import weighted_average
from pflkit.algorithms.context import RoundContext, ServerContext
from pflkit.algorithms.fednova import FedNova, nova_norm
from pflkit.engine import Simulation
from pflkit.errors import PflkitError
from pflkit.experiment import validate


def assert_close(actual, expected, rtol=1e-6, atol=0.0):
    """numpy's assert_allclose on tensors (torch.testing's first call costs seconds)."""
    np.testing.assert_allclose(
        actual.detach().cpu().numpy(), expected.detach().cpu().numpy(), rtol=rtol, atol=atol
    )


def algo(**params) -> FedNova:
    return FedNova(FedNova.Params(**params))


def up(d, a, n, steps=None, **buffers):
    u = {"d": {"w": torch.tensor(d)}, "a": a, "buffers": buffers, "num_samples": n}
    if steps is not None:
        u["steps"] = steps
    return u


# -- the normaliser ||a_i||_1 -------------------------------------------------------------------------
def test_norm_by_hand():
    assert nova_norm(7) == 7  # plain SGD: tau
    # momentum 0.9, 5 steps: counters 1, 1.9, 2.71, 3.439, 4.0951 sum to 13.1441, which is
    # [tau - rho (1 - rho^tau) / (1 - rho)] / (1 - rho) = [5 - 9 * 0.40951] / 0.1
    assert nova_norm(5, momentum=0.9) == pytest.approx(13.1441, rel=1e-12)
    assert nova_norm(5, momentum=0.9) == pytest.approx((5 - 0.9 * (1 - 0.9**5) / 0.1) / 0.1)
    assert nova_norm(3, momentum=0.5) == pytest.approx(4.25)  # 1 + 1.5 + 1.75
    # proximal SGD, alpha = eta mu = 0.1: 1 + 0.9 + 0.81 = [1 - 0.9^3] / 0.1
    assert nova_norm(3, eta_mu=0.1) == pytest.approx(2.71)
    # both, 2 steps, rho 0.5, alpha 0.1: a unit gradient moves x by 1, then by 0.5 * 1 + 1 - 0.1
    assert nova_norm(2, momentum=0.5, eta_mu=0.1) == pytest.approx(2.4)
    # the FedNova code's recursion: (0 + 1) 0.9 + 1 = 1.9, then (1.9 + 1.5) 0.9 + 1 = 4.06
    assert nova_norm(2, momentum=0.5, eta_mu=0.1, variant="code") == pytest.approx(4.06)
    # without the combination both variants agree
    assert nova_norm(9, momentum=0.7, variant="code") == pytest.approx(nova_norm(9, momentum=0.7))
    assert nova_norm(9, eta_mu=0.05, variant="code") == pytest.approx(nova_norm(9, eta_mu=0.05))
    assert nova_norm(0, momentum=0.9) == 0


# -- the server step ----------------------------------------------------------------------------------
def test_server_step_by_hand_and_not_fedavg():
    x = {"w": torch.tensor([1.0, 2.0])}
    uploads = {0: up([0.5, -1.0], 2.0, 1), 3: up([1.0, 1.0], 4.0, 3)}
    new = algo().aggregate(None, {"weights": x}, uploads, ServerContext(1, "train"))
    # p = (1/4, 3/4); tau_eff = 0.5 + 3 = 3.5; sum p d = (0.875, 0.5); x - 3.5 * that
    np.testing.assert_allclose(new["weights"]["w"], [-2.0625, 0.25], rtol=1e-6)
    # FedAvg of the same client models x_i = x - a_i d_i = (0, 4) and (-3, -2): (-2.25, -0.5)
    models = {c: {"weights": {"w": x["w"] - u["a"] * u["d"]["w"]}, "num_samples": u["num_samples"]}
              for c, u in uploads.items()}  # fmt: skip
    np.testing.assert_allclose(weighted_average(models)["w"], [-2.25, -0.5])
    # uniform weighting (the MAP code): p = 1/2, tau_eff = 3, sum p d = (0.75, 0)
    new = algo(weighting="uniform").aggregate(
        None, {"weights": x}, uploads, ServerContext(1, "train")
    )
    np.testing.assert_allclose(new["weights"]["w"], [-1.25, 2.0], rtol=1e-6)


def test_code_variant_tau_eff_counts_steps_with_prox():
    x = {"w": torch.tensor([1.0, 2.0])}
    uploads = {0: up([0.5, -1.0], 2.0, 1, steps=3), 1: up([1.0, 1.0], 4.0, 3, steps=5)}
    a = algo(variant="code", prox_mu=0.01)
    new = a.aggregate(None, {"weights": x}, uploads, ServerContext(1, "train"))
    # tau_eff = 0.25 * 3 + 0.75 * 5 = 4.5 (steps, not a_i); 1 - 4.5 * 0.875, 2 - 4.5 * 0.5
    np.testing.assert_allclose(new["weights"]["w"], [-2.9375, -0.25], rtol=1e-6)


def test_server_momentum_over_two_rounds_and_buffers():
    a = algo(gmf=0.5)
    x0 = {"w": torch.tensor([1.0, 2.0]), "rm": torch.tensor([0.0]), "nbt": torch.tensor(0)}
    server = {"weights": x0, "momentum": {"w": torch.zeros(2)}}
    r1 = {
        0: up([0.5, -1.0], 2.0, 1, rm=torch.tensor([1.0]), nbt=torch.tensor(7)),
        3: up([1.0, 1.0], 4.0, 3, rm=torch.tensor([3.0]), nbt=torch.tensor(9)),
    }
    server = a.aggregate(None, server, r1, ServerContext(1, "train"))
    # M1 = Delta1 = (3.0625, 1.75); x1 = x0 - M1
    np.testing.assert_allclose(server["momentum"]["w"], [3.0625, 1.75], rtol=1e-6)
    np.testing.assert_allclose(server["weights"]["w"], [-2.0625, 0.25], rtol=1e-6)
    # buffers: sample-weighted mean of the clients' (not normalised); integers from the first
    np.testing.assert_allclose(server["weights"]["rm"], [2.5])
    assert int(server["weights"]["nbt"]) == 7
    assert list(server["weights"]) == ["w", "rm", "nbt"]
    r2 = {1: up([2.0, 0.0], 1.0, 1, rm=torch.tensor([4.0]), nbt=torch.tensor(1))}
    server = a.aggregate(None, server, r2, ServerContext(2, "train"))
    # Delta2 = 1 * (2, 0); M2 = 0.5 M1 + Delta2 = (3.53125, 0.875); x2 = x1 - M2
    np.testing.assert_allclose(server["momentum"]["w"], [3.53125, 0.875], rtol=1e-6)
    np.testing.assert_allclose(server["weights"]["w"], [-5.59375, -0.625], rtol=1e-6)


def test_equal_steps_without_momentum_is_fedavg():
    x = {"w": torch.tensor([0.3, -1.2, 2.0])}
    models = [torch.tensor([1.0, 0.0, 2.5]), torch.tensor([-2.0, 0.5, 1.0]), x["w"] + 0.25]
    n = [10, 30, 60]
    tau = 6.0
    uploads = {c: up(((x["w"] - m) / tau).tolist(), tau, n[c]) for c, m in enumerate(models)}
    new = algo().aggregate(None, {"weights": x}, uploads, ServerContext(1, "train"))
    want = sum(nc / 100 * m for nc, m in zip(n, models, strict=True))
    np.testing.assert_allclose(new["weights"]["w"], want, rtol=1e-6, atol=1e-6)


# -- the client, on real local training ---------------------------------------------------------------
def nova_sim(**train):
    raw = tiny_config(algorithm={"name": "fednova"})
    raw["train"].update(train)
    return Simulation(validate(raw))


def linear_loss(coef):
    """A loss whose gradient is the constant ``coef`` (per parameter name)."""

    def loss_fn(model, x, y):
        return sum((p * coef[k]).sum() for k, p in model.named_parameters())

    return loss_fn


@pytest.mark.parametrize(
    "momentum,prox_mu",
    [(0.0, 0.0), (0.9, 0.0), (0.0, 0.5), (0.9, 0.5)],
)
def test_normalised_update_is_lr_times_a_constant_gradient(momentum, prox_mu):
    """With a constant loss gradient c, x_t - x_i = eta ||a_i||_1 c exactly, whatever tau_i,
    momentum and prox: so d_i = eta c on every client, although their tau_i differ."""
    sim = nova_sim(momentum=momentum, lr=0.05)
    a = algo(prox_mu=prox_mu)
    x = sim.server["weights"]
    torch.manual_seed(3)
    coef = {k: torch.randn_like(v) for k, v in x.items()}
    a.local_objective = lambda env, payload: linear_loss(coef)
    taus = set()
    for env in sim.envs[:2]:
        u = a.client_update(env, {"weights": x}, {}, RoundContext(1)).upload
        tau = math.ceil(env.num_train / 16)  # batch 16, one epoch: every batch is a step
        taus.add(tau)
        if momentum:  # a_i's closed form with momentum (prox: the recursion)
            want_a = (tau - momentum * (1 - momentum**tau) / (1 - momentum)) / (1 - momentum)
            if not prox_mu:
                assert u["a"] == pytest.approx(want_a, rel=1e-9)
        elif not prox_mu:
            assert u["a"] == tau
        for k, c in coef.items():
            assert_close(u["d"][k], 0.05 * c, rtol=2e-4, atol=2e-6)
    assert len(taus) == 2  # the two clients ran different numbers of steps


def test_prox_normaliser_uses_the_rounds_learning_rate():
    """Under train.lr_schedule, alpha = eta_r mu with round r's learning rate."""
    sim = nova_sim(momentum=0.5, lr=0.05, lr_schedule="step", lr_gamma=0.5)
    a = algo(prox_mu=2.0)
    x = sim.server["weights"]
    coef = {k: torch.ones_like(v) for k, v in x.items()}
    a.local_objective = lambda env, payload: linear_loss(coef)
    ctx = RoundContext(3, lr_factor=0.25)  # round 3 of a step schedule: 0.5^2 (engine)
    u = a.client_update(sim.envs[0], {"weights": x}, {}, ctx).upload
    for d in u["d"].values():
        assert_close(d, torch.full_like(d, 0.05 * 0.25), rtol=2e-4, atol=2e-6)


def test_code_variant_normaliser_differs_with_momentum_and_prox():
    sim = nova_sim(momentum=0.9, lr=0.05)
    a = algo(prox_mu=0.5, variant="code")
    x = sim.server["weights"]
    coef = {k: torch.ones_like(v) for k, v in x.items()}
    a.local_objective = lambda env, payload: linear_loss(coef)
    env = sim.envs[1]
    u = a.client_update(env, {"weights": x}, {}, RoundContext(1)).upload
    tau = math.ceil(env.num_train / 16)
    assert u["steps"] == tau
    # the code's recursion A <- (A + c)(1 - 0.025) + 1, c <- 0.9 c + 1, by a plain loop here
    code_a, c = 0.0, 0.0
    for _ in range(tau):
        c = 0.9 * c + 1
        code_a = (code_a + c) * 0.975 + 1
    assert u["a"] == pytest.approx(code_a, rel=1e-9)
    # the solver's true coefficient sum (b <- 0.9 b + 1 - 0.025 A, A <- A + b) is smaller, so
    # d_i = (x_t - x_i) / a_i undershoots eta c by the ratio of the two
    true_a, b = 0.0, 0.0
    for _ in range(tau):
        b = 0.9 * b + 1 - 0.025 * true_a
        true_a += b
    assert true_a / code_a < 0.95
    for d in u["d"].values():
        assert_close(d, torch.full_like(d, 0.05 * true_a / code_a), rtol=2e-4, atol=2e-6)


def test_one_round_against_fedavg_clients():
    """A full round: FedNova's global model equals x - (sum p tau) sum p (x - x_i) / tau_i with
    x_i the clients' models after FedAvg's local training (same seeds, same batches)."""
    fedavg = Simulation(validate(tiny_config()))
    models = {}
    real = fedavg.algo.client_update

    def spy(env, payload, state, ctx):
        out = real(env, payload, state, ctx)
        models[env.cid] = (out.upload["weights"], env.num_train)
        return out

    fedavg.algo.client_update = spy
    fedavg.run_round(1)
    nova = nova_sim()
    x = nova.server["weights"]
    nova.run_round(1)
    n = sum(nc for _, nc in models.values())
    tau = {c: math.ceil(nc / 16) for c, (_, nc) in models.items()}
    assert len(set(tau.values())) == len(tau) == 4  # unequal steps
    tau_eff = sum(nc / n * tau[c] for c, (_, nc) in models.items())
    for k, v in x.items():
        d = sum(nc / n * (v - m[k]) / tau[c] for c, (m, nc) in models.items())
        assert_close(nova.server["weights"][k], v - tau_eff * d, rtol=1e-4, atol=1e-6)
    gap = max(
        float((nova.server["weights"][k] - fedavg.server["weights"][k]).abs().max()) for k in x
    )
    assert gap > 1e-3  # and that is not FedAvg's model


def test_straggler_normaliser_counts_the_steps_it_ran():
    sim = nova_sim()
    env = sim.envs[2]
    x = sim.server["weights"]
    u = sim.algo.client_update(env, {"weights": x}, {}, RoundContext(1, work=0.5)).upload
    assert u["a"] == math.floor(0.5 * math.ceil(env.num_train / 16))


# -- bad input ----------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "params", [{"gmf": 1.0}, {"gmf": -0.1}, {"prox_mu": -1e-3}, {"variant": "official"}]
)
def test_bad_parameters_are_one_sentence(params):
    with pytest.raises(PflkitError, match="fednova"):
        Simulation(validate(tiny_config(algorithm={"name": "fednova", **params})))


def test_refuses_a_non_sgd_local_optimiser():
    raw = tiny_config(algorithm={"name": "fednova"})
    raw["train"]["optimizer"] = "adam"
    with pytest.raises(PflkitError, match="train.optimizer: sgd"):
        Simulation(validate(raw))
