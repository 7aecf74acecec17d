"""FedOpt: one and two server steps of each server optimiser on a 2-parameter toy, by hand
(written-out numbers or plain numpy formulas here); FedAvg as the special case sgdm with
beta1 = 0, eta = 1; BatchNorm-like buffers averaged; a real run's server steps; bad input."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import tiny_config
from pflkit.algorithms.base import weighted_average
from pflkit.algorithms.context import ServerContext
from pflkit.algorithms.fedopt import FedOpt
from pflkit.engine import Simulation
from pflkit.errors import PflkitError
from pflkit.experiment import validate


def assert_close(actual, expected, rtol=1e-6, atol=0.0):
    """numpy's assert_allclose on tensors (torch.testing's first call costs seconds)."""
    np.testing.assert_allclose(
        actual.detach().cpu().numpy(), expected.detach().cpu().numpy(), rtol=rtol, atol=atol
    )


X0 = [1.0, -2.0]
# round 1: client models (2, -2) with n = 1 and (1, 0) with n = 3: mean (1.25, -0.5),
# Delta1 = (0.25, 1.5); round 2: one client at (1.1, -1)
ROUND1 = {0: ([2.0, -2.0], 1, 3.0, 5), 2: ([1.0, 0.0], 3, 7.0, 9)}
ROUND2 = {1: ([1.1, -1.0], 4, 1.0, 2)}


def algo(**params) -> FedOpt:
    return FedOpt(FedOpt.Params(**params))


def uploads(rows):
    return {
        c: {
            "weights": {"w": torch.tensor(w), "rm": torch.tensor([rm]), "nbt": torch.tensor(nbt)},
            "num_samples": n,
        }
        for c, (w, n, rm, nbt) in rows.items()
    }


def start(opt: str, tau: float = 1e-3):
    server = {
        "weights": {"w": torch.tensor(X0), "rm": torch.tensor([0.0]), "nbt": torch.tensor(0)},
        "m": {"w": torch.zeros(2)},
    }
    if opt != "sgdm":
        server["v"] = {"w": torch.full((2,), tau**2)}
    return server


def two_rounds(a: FedOpt, opt: str):
    s1 = a.aggregate(None, start(opt, a.params.tau), uploads(ROUND1), ServerContext(1, "train"))
    s1_copy = {k: dict(v) if isinstance(v, dict) else v for k, v in s1.items()}
    s2 = a.aggregate(None, s1, uploads(ROUND2), ServerContext(2, "train"))
    return s1_copy, s2


def test_sgdm_two_steps_by_hand():
    s1, s2 = two_rounds(algo(server_lr=0.1), "sgdm")  # beta1 = 0.9 (the default)
    # m1 = Delta1 = (0.25, 1.5); x1 = x0 + 0.1 m1
    np.testing.assert_allclose(s1["m"]["w"], [0.25, 1.5])
    np.testing.assert_allclose(s1["weights"]["w"], [1.025, -1.85], rtol=1e-6)
    # Delta2 = (1.1, -1) - x1 = (0.075, 0.85); m2 = 0.9 m1 + Delta2 = (0.3, 2.2); x1 + 0.1 m2
    np.testing.assert_allclose(s2["m"]["w"], [0.3, 2.2], rtol=1e-6)
    np.testing.assert_allclose(s2["weights"]["w"], [1.055, -1.63], rtol=1e-6)
    assert "v" not in s2


def test_adaptive_first_step_written_out():
    # adagrad, eta 0.1, beta1 0.9, tau 1e-3: m1 = 0.1 Delta1 = (0.025, 0.15),
    # v1 = 1e-6 + Delta1^2 = (0.062501, 2.250001), sqrt(v1) = (0.250002, 1.5000003)
    s1 = algo(server_opt="adagrad", server_lr=0.1).aggregate(
        None, start("adagrad"), uploads(ROUND1), ServerContext(1, "train")
    )
    np.testing.assert_allclose(s1["m"]["w"], [0.025, 0.15], rtol=1e-6)
    np.testing.assert_allclose(s1["v"]["w"], [0.062501, 2.250001], rtol=1e-6)
    # x1 = x0 + 0.1 m1 / (sqrt(v1) + 1e-3) = (1 + 0.0025 / 0.251002, -2 + 0.015 / 1.5010003)
    np.testing.assert_allclose(s1["weights"]["w"], [1.0099601, -1.9900067], rtol=1e-6)


@pytest.mark.parametrize("opt", ["adagrad", "adam", "yogi"])
def test_adaptive_two_steps_by_numpy(opt):
    eta, b1, b2, tau = 0.3, 0.8, 0.95, 1e-2
    a = algo(server_opt=opt, server_lr=eta, beta1=b1, beta2=b2, tau=tau)
    s1, s2 = two_rounds(a, opt)
    x = np.array(X0)
    m = np.zeros(2)
    v = np.full(2, tau**2)
    for rows, got in ((ROUND1, s1), (ROUND2, s2)):
        ws = np.array([w for w, *_ in rows.values()])
        n = np.array([r[1] for r in rows.values()], dtype=float)
        delta = (n[:, None] * ws).sum(0) / n.sum() - x
        m = b1 * m + (1 - b1) * delta
        if opt == "adagrad":
            v = v + delta**2
        elif opt == "adam":
            v = b2 * v + (1 - b2) * delta**2
        else:
            v = v - (1 - b2) * delta**2 * np.sign(v - delta**2)
        x = x + eta * m / (np.sqrt(v) + tau)
        np.testing.assert_allclose(got["m"]["w"], m, rtol=1e-5)
        np.testing.assert_allclose(got["v"]["w"], v, rtol=1e-5)
        np.testing.assert_allclose(got["weights"]["w"], x, rtol=1e-5)


def test_yogi_both_sign_branches_written_out():
    # round 1 (beta2 0.99, tau 1e-3): v1 = 1e-6 + 0.01 Delta1^2 = (0.000626, 0.022501)
    a = algo(server_opt="yogi", server_lr=0.1)
    s1, s2 = two_rounds(a, "yogi")
    np.testing.assert_allclose(s1["v"]["w"], [0.000626, 0.022501], rtol=1e-6)
    # round 2: Delta2 = (1.1, -1) - x1 where x1 = x0 + 0.1 m1 / (sqrt(v1) + 1e-3)
    #   = (1 + 0.0025 / 0.026020, -2 + 0.015 / 0.151003) = (1.09608, -1.90066)
    x1 = s1["weights"]["w"].double()
    np.testing.assert_allclose(x1, [1.096080, -1.900664], rtol=1e-6)
    d2 = torch.tensor([1.1, -1.0], dtype=torch.float64) - x1
    assert d2[0] ** 2 < 0.000626 and d2[1] ** 2 > 0.022501  # v shrinks, then grows
    want = [0.000626 - 0.01 * float(d2[0]) ** 2, 0.022501 + 0.01 * float(d2[1]) ** 2]
    np.testing.assert_allclose(s2["v"]["w"], want, rtol=1e-6)
    # Adam's v2 differs: 0.99 v1 + 0.01 Delta2^2
    _, adam2 = two_rounds(algo(server_opt="adam", server_lr=0.1), "adam")
    assert abs(float(adam2["v"]["w"][0]) - want[0]) > 1e-6


def test_sgdm_without_momentum_at_lr_1_is_fedavg_and_buffers_are_averaged():
    a = algo(server_opt="sgdm", server_lr=1.0, beta1=0.0)
    s1, s2 = two_rounds(a, "sgdm")
    for rows, got in ((ROUND1, s1), (ROUND2, s2)):
        want = weighted_average(uploads(rows))
        assert_close(got["weights"]["w"], want["w"], atol=1e-7)
    # float buffers: the sample-weighted mean (0.25 * 3 + 0.75 * 7), not optimised; integer
    # buffers from the first client
    np.testing.assert_allclose(s1["weights"]["rm"], [6.0])
    assert int(s1["weights"]["nbt"]) == 5
    assert list(s1["weights"]) == ["w", "rm", "nbt"]
    # uniform weighting: the plain mean (1.5, -1)
    u = algo(server_lr=1.0, beta1=0.0, weighting="uniform")
    s = u.aggregate(None, start("sgdm"), uploads(ROUND1), ServerContext(1, "train"))
    np.testing.assert_allclose(s["weights"]["w"], [1.5, -1.0])


def test_default_server_lr_per_optimiser():
    assert algo().server_lr == 1.0  # sgdm: the MAP code grid's 1.0
    assert algo(server_opt="adam").server_lr == 1e-2
    assert algo(server_opt="yogi").server_lr == 1e-2
    assert algo(server_opt="adagrad").server_lr == 1e-1
    assert algo(server_opt="adam", server_lr=0.5).server_lr == 0.5


# -- real runs ----------------------------------------------------------------------------------------
def run_config(**algorithm):
    """Two of the four clients per round, no evaluation in the first rounds (faster)."""
    return validate(
        tiny_config(
            algorithm={"name": "fedopt", **algorithm},
            train={**tiny_config()["train"], "rounds": 20, "client_fraction": 0.5},
            eval={"every": 20},
        )
    )


def spy_uploads(sim):
    seen: dict[int, dict] = {}
    real = sim.algo.client_update

    def spy(env, payload, state, ctx):
        out = real(env, payload, state, ctx)
        seen.setdefault(ctx.round, {})[env.cid] = (out.upload["weights"], env.num_train)
        return out

    sim.algo.client_update = spy
    return seen


def mean_of(models):
    n = sum(nc for _, nc in models.values())
    keys = next(iter(models.values()))[0]
    return {k: sum(nc / n * w[k] for w, nc in models.values()) for k in keys}


def test_default_run_is_fedavgm():
    """The MAP configuration (sgdm, momentum 0.9, eta 1): round 1 is FedAvg's average; round 2
    adds 0.9 times round 1's step."""
    sim = Simulation(run_config())
    seen = spy_uploads(sim)
    x0 = sim.server["weights"]
    sim.run_round(1)
    x1 = sim.server["weights"]
    mean1 = mean_of(seen[1])
    sim.run_round(2)
    mean2 = mean_of(seen[2])
    for k in x0:
        assert_close(x1[k], mean1[k], rtol=1e-5, atol=1e-6)
        want = mean2[k] + 0.9 * (x1[k] - x0[k])
        assert_close(sim.server["weights"][k], want, rtol=1e-5, atol=1e-6)
    assert max(float((x1[k] - x0[k]).abs().max()) for k in x0) > 1e-3


def test_adam_run_state_and_step():
    sim = Simulation(run_config(server_opt="adam"))
    seen = spy_uploads(sim)
    x0 = sim.server["weights"]
    params = [k for k, _ in sim.senv.model().named_parameters()]
    assert set(sim.server["m"]) == set(sim.server["v"]) == set(params)
    for k in params:
        assert float(sim.server["m"][k].abs().max()) == 0.0
        assert torch.all(sim.server["v"][k] == 1e-6)  # tau^2
    sim.run_round(1)
    mean1 = mean_of(seen[1])
    for k in x0:
        delta = mean1[k] - x0[k]
        v = 0.99 * 1e-6 + 0.01 * delta**2
        want = x0[k] + 1e-2 * (0.1 * delta) / (v.sqrt() + 1e-3)
        assert_close(sim.server["weights"][k], want, rtol=1e-5, atol=1e-7)


# -- bad input ----------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "params",
    [
        {"server_lr": -0.1},
        {"server_opt": "rmsprop"},
        {"beta1": 1.0},
        {"beta2": -0.5},
        {"tau": 0.0},
        {"v_init": -1.0},
    ],
)
def test_bad_parameters_are_one_sentence(params):
    with pytest.raises(PflkitError, match="fedopt"):
        Simulation(validate(tiny_config(algorithm={"name": "fedopt", **params})))
