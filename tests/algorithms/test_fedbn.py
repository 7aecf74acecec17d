"""FedBN: BatchNorm layers stay per client, the rest is averaged, by value."""

from __future__ import annotations

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
from pflkit.engine import Simulation
from pflkit.testing import personal_weights
from split_helpers import federation


# -- FedBN ------------------------------------------------------------------------------------------
def test_fedbn_never_sends_bn_layers_and_keeps_them_per_client():
    sim = Simulation(bn_config("fedbn"))
    model = sim.senv.model()
    bn = {
        f"{n}.{k}"
        for n, m in model.named_modules()
        if isinstance(m, nn.BatchNorm2d)
        for k in m.state_dict()
    }
    assert len(bn) == 10  # 2 layers x (weight, bias, running mean, running var, counter)
    rest = {k: v for k, v in model.state_dict().items() if k not in bn}
    rest_bytes = sum(v.numel() * v.element_size() for v in rest.values())
    rows = [sim.run_round(r) for r in (1, 2)]
    for row in rows:
        assert row["bytes_down"] == [rest_bytes] * 2  # non-BN weights only
        assert row["bytes_up"] == [rest_bytes + 8] * 2  # + num_samples
    assert not bn & set(sim.server["weights"])
    trained = [c for c in sim.clients if sim.clients[c]["bn"]["body.bn1.num_batches_tracked"] > 0]
    assert len(trained) >= 2
    a, b = trained[:2]
    assert not torch.equal(
        sim.clients[a]["bn"]["body.bn1.running_mean"], sim.clients[b]["bn"]["body.bn1.running_mean"]
    )
    # the personalized model is the shared part plus the client's own BN layers
    view = sim.algo.eval_view(sim.senv, sim.server, a, ServerContext(1))
    pw = personal_weights(sim.algo, sim.envs[a], view, sim.clients[a], RoundContext(1))
    assert torch.equal(pw["body.bn2.running_var"], sim.clients[a]["bn"]["body.bn2.running_var"])
    assert torch.equal(pw["body.conv1.weight"], sim.server["weights"]["body.conv1.weight"])


def test_fedbn_client_trains_with_its_own_bn_and_uploads_the_rest(bn_model):
    algo, senv, envs = federation({"name": "fedbn"}, [(X, Y)] * 2, 2, model="bn_mlp")
    shared = hand_weights(0)
    out = algo.client_update(envs[0], {"weights": shared}, {"bn": OWN_BN}, RoundContext(1))
    want = bn_sgd_step({**shared, **OWN_BN}, X, Y)
    assert close(out.upload["weights"], {k: want[k] for k in REST})  # non-BN only, trained
    assert out.upload["num_samples"] == 4
    assert close(out.state["bn"], {k: want[k] for k in BN_ALL})  # its own BN, trained
    # the personalized model: the global non-BN weights with the client's own BN layers
    view = algo.eval_view(senv, {"weights": shared}, 0, ServerContext(1))
    assert close(
        personal_weights(algo, envs[0], view, out.state, RoundContext(1)),
        {**shared, **out.state["bn"]},
    )
    assert (
        algo.eval_view(senv, {"weights": shared}, None, ServerContext(1)).get("weights") is None
    )  # no global model with BN


def test_fedbn_server_averages_the_non_bn_weights_by_sample_count(bn_model):
    algo, senv, _ = federation({"name": "fedbn"}, [(X, Y)] * 3, 2, model="bn_mlp")
    server = algo.server_init(senv)
    assert set(server["weights"]) == set(REST)
    a, b = hand_weights(1), hand_weights(2)
    uploads = {0: {"weights": a, "num_samples": 1}, 2: {"weights": b, "num_samples": 3}}
    new = algo.aggregate(senv, server, uploads, ServerContext(1, "train"))
    assert close(new["weights"], {k: (a[k] + 3 * b[k]) / 4 for k in REST})
