"""f-FedAP: the BN-statistics distance, the weights, the warm-up and the personalized
aggregation, by value."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch import nn

from bn_helpers import (
    BN_ALL,
    OWN_BN,
    REST,
    X,
    Y,
    bn_config,
    bn_sgd_step,
    close,
    hand_weights,
)
from pflkit.algorithms.context import RoundContext, ServerContext
from pflkit.algorithms.fedap import bn_wasserstein, feature_stats, fedap_weights
from pflkit.engine import Simulation
from pflkit.testing import personal_weights
from split_helpers import federation


# -- f-FedAP ----------------------------------------------------------------------------------------
def test_fedap_distance_on_known_gaussians():
    a = {"mean": [torch.tensor([0.0, 0.0])], "var": [torch.tensor([1.0, 1.0])]}
    b = {"mean": [torch.tensor([3.0, 4.0])], "var": [torch.tensor([4.0, 1.0])]}
    # sqrt(3^2 + 4^2 + (2 - 1)^2 + 0) = sqrt(26); two layers add up
    assert bn_wasserstein(a, b) == pytest.approx(math.sqrt(26))
    two = {k: v * 2 for k, v in a.items()}
    b2 = {k: v * 2 for k, v in b.items()}
    assert bn_wasserstein(two, b2) == pytest.approx(2 * math.sqrt(26))
    # statistics measured at the BN input on samples of N(mu, sigma^2) per channel
    torch.manual_seed(0)
    net = nn.Sequential(nn.BatchNorm1d(2))
    xa = torch.randn(200000, 2) * torch.tensor([1.0, 2.0]) + torch.tensor([0.0, 1.0])
    xb = torch.randn(200000, 2) * torch.tensor([3.0, 2.0]) + torch.tensor([1.0, -1.0])
    sa, sb = feature_stats(net, xa), feature_stats(net, xb)
    np.testing.assert_allclose(sa["mean"][0], [0.0, 1.0], atol=0.02)
    np.testing.assert_allclose(sa["var"][0], [1.0, 4.0], rtol=0.02)
    # closed form: sqrt((0-1)^2 + (1+1)^2 + (1-3)^2 + (2-2)^2) = 3
    assert bn_wasserstein(sa, sb) == pytest.approx(3.0, rel=0.01)


def test_fedap_weights_momentum_and_inverse_distance():
    w = fedap_weights(0, [1, 2], [1.0, 3.0], momentum=0.3)
    # 1/d = 1, 1/3; shares 0.75, 0.25 of (1 - 0.3)
    assert w == pytest.approx({0: 0.3, 1: 0.525, 2: 0.175})
    assert fedap_weights(0, [], [], 0.5) == {0: 1.0}


def test_fedap_warmup_is_fedbn_then_stats_are_uploaded_once():
    sim = Simulation(bn_config("fedap", rounds=4, client_fraction=1.0))  # T_g = 2
    rows = [sim.run_round(r) for r in (1, 2)]
    assert rows[0]["bytes_down"] == rows[1]["bytes_down"]  # FedBN: non-BN weights only
    sim.run_round(3)
    assert sorted(sim.server["stats"]) == [0, 1, 2, 3]
    st = sim.server["stats"][0]
    assert [v.shape[0] for v in st["mean"]] == [6, 16]  # inputs of bn1 and bn2
    # round 4: client 0 receives the momentum mix of stored non-BN models, by hand
    stored = sim.server["personal"]
    d = {j: bn_wasserstein(st, sim.server["stats"][j]) for j in (1, 2, 3)}
    inv = {j: 1 / d[j] for j in d}
    s = sum(inv.values())
    payload = sim.algo.configure(sim.senv, sim.server, 0, ServerContext(4, "train"))
    k = "body.conv1.weight"
    want = 0.5 * stored[0][k] + sum(0.5 * inv[j] / s * stored[j][k] for j in d)
    assert torch.allclose(payload["weights"][k], want, atol=1e-6)
    assert "body.bn1.running_mean" not in payload["weights"]


# -- f-FedAP ----------------------------------------------------------------------------------------
def test_fedap_client_uploads_the_mean_and_variance_of_its_bn_inputs(bn_model):
    algo, senv, envs = federation({"name": "fedap"}, [(X, Y)] * 2, 2, model="bn_mlp")
    shared = hand_weights(3)
    payload = {"weights": shared, "need_stats": True}
    out = algo.client_update(envs[0], payload, {"bn": OWN_BN}, RoundContext(3))
    h = (X @ shared["body.1.weight"].T + shared["body.1.bias"]).double()  # the BN layer's input
    stats = out.upload["stats"]
    assert len(stats["mean"]) == len(stats["var"]) == 1
    assert torch.allclose(stats["mean"][0], h.mean(0), atol=1e-9)
    assert torch.allclose(stats["var"][0], h.var(0, unbiased=False), atol=1e-9)
    want = bn_sgd_step({**shared, **OWN_BN}, X, Y)  # then FedBN's local step
    assert close(out.upload["weights"], {k: want[k] for k in REST})
    assert close(out.state["bn"], {k: want[k] for k in BN_ALL})


def fedap_server(algo, senv):
    """Round 3 of 4 (T_g = 2): clients 0, 1, 2 have stored models (all entries 1, 2, 3) and
    one-layer statistics; client 3 has neither (the warm-up model has all entries 10)."""
    server = algo.server_init(senv)
    fill = lambda v: {k: torch.full_like(t, v) for k, t in server["weights"].items()}  # noqa: E731
    one = torch.ones(2, dtype=torch.float64)
    stats = {
        0: {"mean": [0 * one], "var": [one]},
        1: {"mean": [torch.tensor([3.0, 4.0], dtype=torch.float64)], "var": [one]},
        2: {"mean": [0 * one], "var": [torch.tensor([9.0, 1.0], dtype=torch.float64)]},
    }
    personal = {0: fill(1.0), 1: fill(2.0), 2: fill(3.0)}
    return {**server, "weights": fill(10.0), "personal": personal, "stats": stats}


def test_fedap_personalized_aggregation_by_hand(bn_model):
    algo, senv, envs = federation(
        {"name": "fedap", "momentum": 0.3}, [(X, Y)] * 4, 2, model="bn_mlp", rounds=4
    )
    server = fedap_server(algo, senv)
    # d_01 = sqrt(|(0,0) - (3,4)|^2 + |(1,1) - (1,1)|^2) = 5 (sigma = sqrt(var))
    # d_02 = sqrt(0 + |(1,1) - (3,1)|^2) = 2
    # W_00 = 0.3; W_01 = 0.7 * (1/5) / (1/5 + 1/2) = 0.2; W_02 = 0.7 * (1/2) / (7/10) = 0.5
    payload = algo.configure(senv, server, 0, ServerContext(3, "train"))
    assert set(payload["weights"]) == set(REST)
    for k, v in payload["weights"].items():
        assert torch.allclose(v, torch.full_like(v, 0.3 * 1 + 0.2 * 2 + 0.5 * 3)), k
    # client 3 has no statistics yet: its own (warm-up) model, and a request for statistics
    payload3 = algo.configure(senv, server, 3, ServerContext(3, "train"))
    assert payload3["need_stats"] and all(
        torch.equal(v, server["weights"][k]) for k, v in payload3["weights"].items()
    )
    # the model scored: the client's stored (last trained) non-BN part with its own BN layers
    view = algo.eval_view(senv, server, 1, ServerContext(1))
    scored = personal_weights(algo, envs[1], view, {"bn": OWN_BN}, RoundContext(1))
    assert close(scored, {**server["personal"][1], **OWN_BN})
    assert algo.eval_view(senv, server, None, ServerContext(1)).get("weights") is None


def test_fedap_warmup_epochs_is_the_code_option_for_warmup_rounds_only(bn_model):
    """``warmup_epochs: 1`` (FL-bench) trains one epoch in a warm-up round and
    ``train.local_epochs`` (here 2) afterwards; unset, warm-up rounds train 2 as well."""
    shared, start = hand_weights(3), {**hand_weights(3), **OWN_BN}
    one = bn_sgd_step(start, X, Y)
    two = bn_sgd_step(one, X, Y)
    payload = {"weights": shared}

    def trained(algo_cfg, rnd):  # 3 rounds: T_g = 1
        algo, _, envs = federation(algo_cfg, [(X, Y)] * 2, 2, model="bn_mlp", local_epochs=2)
        out = algo.client_update(envs[0], payload, {"bn": OWN_BN}, RoundContext(rnd))
        return {**out.upload["weights"], **out.state["bn"]}

    code = {"name": "fedap", "warmup_epochs": 1}
    assert close(trained(code, 1), {k: one[k] for k in [*REST, *BN_ALL]})
    assert close(trained(code, 2), {k: two[k] for k in [*REST, *BN_ALL]})
    assert close(trained({"name": "fedap"}, 1), {k: two[k] for k in [*REST, *BN_ALL]})
