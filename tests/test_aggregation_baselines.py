"""pFedSim's baselines: FedBN, FedDyn, FedFomo, f-FedAP (FedGen's math: tests/test_fedgen.py).
Every expected value is computed by hand or with numpy."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch import nn

from conftest import tiny_config
from pflkit.algorithms.context import RoundContext
from pflkit.algorithms.fedap import bn_wasserstein, feature_stats, fedap_weights
from pflkit.algorithms.feddyn import feddyn_server_update
from pflkit.algorithms.fedfomo import fomo_combine, fomo_weights
from pflkit.engine import Simulation
from pflkit.experiment import validate
from split_helpers import federation


def bn_config(name: str, **train):
    """LeNet5-BN on 400 real Fashion-MNIST images, 4 clients, 2 of them per round."""
    return validate(
        tiny_config(
            data={"dataset": "fashion_mnist", "subset": 400},
            model={"name": "lenet5_bn", "options": {}},
            algorithm={"name": name},
            train={"rounds": 2, "client_fraction": 0.5, "batch_size": 32, **train},
        )
    )


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
    view = sim.algo.eval_view(sim.senv, sim.server, a, 1)
    pw = sim.algo.personal_weights(sim.envs[a], view, sim.clients[a], RoundContext(1))
    assert torch.equal(pw["body.bn2.running_var"], sim.clients[a]["bn"]["body.bn2.running_var"])
    assert torch.equal(pw["body.conv1.weight"], sim.server["weights"]["body.conv1.weight"])


# -- FedDyn -----------------------------------------------------------------------------------------
def test_feddyn_server_h_and_model_update_by_hand():
    theta = {"w": torch.tensor([1.0, 2.0])}
    h = {"w": torch.tensor([0.5, -0.5])}
    uploads = {
        0: {"weights": {"w": torch.tensor([2.0, 2.0])}, "num_samples": 1},
        3: {"weights": {"w": torch.tensor([0.0, 4.0])}, "num_samples": 3},
    }
    alpha, m = 0.1, 10
    new_theta, new_h = feddyn_server_update(theta, h, uploads, alpha, m)
    # h = h - alpha/m * sum(theta_k - theta) = [0.5, -0.5] - 0.01 * ([1, 0] + [-1, 2])
    np.testing.assert_allclose(new_h["w"], [0.5, -0.52])
    # theta = mean(theta_k) - h / alpha = [1, 3] - [5, -5.2]
    np.testing.assert_allclose(new_theta["w"], [-4.0, 8.2], rtol=1e-6)


def test_feddyn_client_gradient_state_update(tiny):
    sim = Simulation(tiny(algorithm={"name": "feddyn", "alpha": 0.5}))
    env = sim.envs[0]
    theta = sim.server["weights"]
    up = sim.algo.client_update(env, {"weights": theta}, {}, RoundContext(1))
    # g_k = 0 - alpha (theta_k - theta)
    for k, g in up.state["grad"].items():
        assert torch.allclose(g, -0.5 * (up.upload["weights"][k] - theta[k]))


def test_feddyn_local_objective_gradient_by_hand(tiny):
    """One SGD step on a model: the step is -lr (grad L - g_k + alpha (theta - theta_s))."""
    sim = Simulation(
        tiny(
            algorithm={"name": "feddyn", "alpha": 0.5},
            train={"local_epochs": 1, "batch_size": 100000},
        )
    )
    env, algo = sim.envs[0], sim.algo
    theta = sim.server["weights"]
    torch.manual_seed(1)
    start = {k: v + 0.1 * torch.randn_like(v) for k, v in theta.items()}
    grad_state = {k: torch.randn_like(v) for k, v in theta.items()}
    # the plain cross-entropy gradient at the starting point
    model = env.model("check")
    model.load_state_dict(start)
    loss = nn.functional.cross_entropy(model(env.data.train_x), env.data.train_y)
    g_ce = dict(
        zip(
            [k for k, _ in model.named_parameters()],
            torch.autograd.grad(loss, list(model.parameters())),
            strict=True,
        )
    )
    # one full-batch step from the downloaded model (the quadratic term is 0 there)
    up = algo.client_update(env, {"weights": start}, {"grad": grad_state}, RoundContext(2))
    lr = env.run.train.lr
    for k in g_ce:
        want = start[k] - lr * (g_ce[k] - grad_state[k])
        assert torch.allclose(up.upload["weights"][k], want, atol=1e-6), k


# -- FedFomo ----------------------------------------------------------------------------------------
def test_fedfomo_weights_on_a_toy_case():
    # own loss 1.0; neighbours: losses 0.5, 1.2, 0.8 at distances 1, 2, 0.5
    # raw: 0.5/1 = 0.5, -0.2/2 = -0.1 -> 0, 0.2/0.5 = 0.4; normalised by 0.9
    w = fomo_weights(1.0, [0.5, 1.2, 0.8], [1.0, 2.0, 0.5])
    np.testing.assert_allclose(w, [0.5 / 0.9, 0.0, 0.4 / 0.9])
    assert fomo_weights(1.0, [1.5, 2.0], [1.0, 1.0]).sum() == 0  # nobody helps: keep own
    own = {"w": torch.tensor([0.0, 0.0]), "n": torch.tensor(3)}
    models = [
        {"w": torch.tensor([1.0, 0.0]), "n": torch.tensor(7)},
        {"w": torch.tensor([9.0, 9.0]), "n": torch.tensor(7)},
        {"w": torch.tensor([0.0, 2.0]), "n": torch.tensor(7)},
    ]
    new = fomo_combine(own, models, w)
    np.testing.assert_allclose(new["w"], [0.5 / 0.9, 0.8 / 0.9], rtol=1e-6)
    assert int(new["n"]) == 3


def test_fedfomo_client_weights_from_validation_losses(tiny):
    sim = Simulation(
        tiny(
            algorithm={"name": "fedfomo", "m": 2, "epsilon": 0.0},
            train={"rounds": 3, "client_fraction": 1.0},
        )
    )
    sim.run_round(1)
    rec = {}
    real = sim.algo.client_update

    def spy(env, payload, state, ctx):
        out = real(env, payload, state, ctx)
        rec[env.cid] = (payload, state, out)
        return out

    sim.algo.client_update = spy
    # client 0 goes back to the untrained model, and one neighbour holds client 0's trained
    # model: that neighbour has a lower validation loss, so its weight is positive (client 1 has
    # the highest affinity of client 0's candidates, so it is one of the two downloaded models)
    trained = sim.clients[0]["weights"]
    sim.clients[0]["weights"] = sim.server["init"]
    sim.server["models"] = {**sim.server["models"], 1: trained}
    sim.server["P"][0, 1] = 1.0
    sim.run_round(2)
    from pflkit.algorithms.fedfomo import val_split

    payload, state, out = rec[0]
    assert len(payload["models"]) == 2 and 0 not in payload["ids"].tolist()
    _, vx, vy = val_split(sim.envs[0], 0.2)
    model = sim.envs[0].model("hand")

    def loss(w):
        model.load_state_dict(w)
        model.eval()
        with torch.no_grad():
            return float(nn.functional.cross_entropy(model(vx), vy))

    own = state["weights"]
    keys = [k for k, _ in model.named_parameters()]
    raw = []
    for m in payload["models"]:
        d = math.sqrt(sum(float(((m[k].double() - own[k].double()) ** 2).sum()) for k in keys))
        raw.append(max((loss(own) - loss(m)) / d, 0.0))
    assert sum(raw) > 0
    want = np.array(raw) / sum(raw)
    np.testing.assert_allclose(out.upload["w"].numpy(), want, rtol=1e-5, atol=1e-9)
    # the server adds the weights to the affinity row
    P = sim.server["P"]
    assert 1 in payload["ids"].tolist()
    for j, wj in zip(payload["ids"].tolist(), want, strict=True):
        assert float(P[0, j]) == pytest.approx(wj + (j == 1), rel=1e-5, abs=1e-9)


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
    payload = sim.algo.configure(sim.senv, sim.server, 0, 4, "train")
    k = "body.conv1.weight"
    want = 0.5 * stored[0][k] + sum(0.5 * inv[j] / s * stored[j][k] for j in d)
    assert torch.allclose(payload["weights"][k], want, atol=1e-6)
    assert "body.bn1.running_mean" not in payload["weights"]


# == by value on hand-made federations =============================================================
# A tiny BatchNorm model (registered for the test only): Flatten -> Linear(d, 3) -> BatchNorm1d
# -> ReLU, head Linear(3, C); its forward and one full-batch SGD step are written out below
# with plain torch ops, so the expected values do not come from pflkit.
BN = ["body.2.weight", "body.2.bias", "body.2.running_mean", "body.2.running_var"]
BN_ALL = [*BN, "body.2.num_batches_tracked"]
REST = ["body.1.weight", "body.1.bias", "head.weight", "head.bias"]


def bn_mlp(input_shape, num_classes):
    from pflkit.models import PFLModel

    body = nn.Sequential(nn.Flatten(), nn.Linear(input_shape[0], 3), nn.BatchNorm1d(3), nn.ReLU())
    return PFLModel(body, nn.Linear(3, num_classes), 3, name="bn_mlp", input_shape=input_shape)


@pytest.fixture
def bn_model(monkeypatch):
    from pflkit.models import MODELS
    from pflkit.models.base import ModelInfo

    monkeypatch.setitem(MODELS, "bn_mlp", ModelInfo("bn_mlp", "test: MLP with BatchNorm", bn_mlp))


X = torch.tensor([[1.0, 2.0], [-1.0, 0.5], [0.0, -1.0], [2.0, 1.0]])
Y = torch.tensor([0, 1, 1, 0])


def hand_weights(seed: int) -> dict:
    """Non-BN weights of bn_mlp (d = 2, C = 2) drawn from a seeded generator."""
    g = torch.Generator().manual_seed(seed)
    shapes = {
        "body.1.weight": (3, 2),
        "body.1.bias": (3,),
        "head.weight": (2, 3),
        "head.bias": (2,),
    }
    return {k: torch.randn(s, generator=g) for k, s in shapes.items()}


OWN_BN = {
    "body.2.weight": torch.tensor([2.0, 0.5, 1.0]),
    "body.2.bias": torch.tensor([0.1, -0.2, 0.3]),
    "body.2.running_mean": torch.tensor([1.0, 1.0, 1.0]),
    "body.2.running_var": torch.tensor([2.0, 2.0, 2.0]),
    "body.2.num_batches_tracked": torch.tensor(5),
}


def bn_sgd_step(w: dict, x, y, lr: float = 0.1) -> dict:
    """One full-batch SGD step of bn_mlp in train mode, by hand: the parameters move by
    -lr * grad(CE); the running statistics move 10% towards the batch mean and unbiased
    variance of the BN input; the counter adds one."""
    leaf = {k: w[k].clone().requires_grad_(True) for k in [*REST, "body.2.weight", "body.2.bias"]}
    h = x @ leaf["body.1.weight"].T + leaf["body.1.bias"]
    hn = (h - h.mean(0)) / torch.sqrt(h.var(0, unbiased=False) + 1e-5)
    z = torch.relu(hn * leaf["body.2.weight"] + leaf["body.2.bias"])
    loss = nn.functional.cross_entropy(z @ leaf["head.weight"].T + leaf["head.bias"], y)
    grads = dict(zip(leaf, torch.autograd.grad(loss, list(leaf.values())), strict=True))
    out = {k: w[k] - lr * grads[k] for k in leaf}
    h = h.detach()
    out["body.2.running_mean"] = 0.9 * w["body.2.running_mean"] + 0.1 * h.mean(0)
    out["body.2.running_var"] = 0.9 * w["body.2.running_var"] + 0.1 * h.var(0, unbiased=True)
    out["body.2.num_batches_tracked"] = w["body.2.num_batches_tracked"] + 1
    return out


def close(a: dict, b: dict, atol: float = 1e-6) -> bool:
    return a.keys() == b.keys() and all(torch.allclose(a[k], b[k], atol=atol) for k in a)


def test_fedbn_client_trains_with_its_own_bn_and_uploads_the_rest(bn_model):
    algo, senv, envs = federation({"name": "fedbn"}, [(X, Y)] * 2, 2, model="bn_mlp")
    shared = hand_weights(0)
    out = algo.client_update(envs[0], {"weights": shared}, {"bn": OWN_BN}, RoundContext(1))
    want = bn_sgd_step({**shared, **OWN_BN}, X, Y)
    assert close(out.upload["weights"], {k: want[k] for k in REST})  # non-BN only, trained
    assert out.upload["num_samples"] == 4
    assert close(out.state["bn"], {k: want[k] for k in BN_ALL})  # its own BN, trained
    # the personalized model: the global non-BN weights with the client's own BN layers
    view = algo.eval_view(senv, {"weights": shared}, 0, 1)
    assert close(
        algo.personal_weights(envs[0], view, out.state, RoundContext(1)),
        {**shared, **out.state["bn"]},
    )
    assert algo.global_weights(senv, {"weights": shared}, 1) is None  # no global model with BN


def test_fedbn_server_averages_the_non_bn_weights_by_sample_count(bn_model):
    algo, senv, _ = federation({"name": "fedbn"}, [(X, Y)] * 3, 2, model="bn_mlp")
    server = algo.server_init(senv)
    assert set(server["weights"]) == set(REST)
    a, b = hand_weights(1), hand_weights(2)
    uploads = {0: {"weights": a, "num_samples": 1}, 2: {"weights": b, "num_samples": 3}}
    new = algo.aggregate(senv, server, uploads, 1, "train")
    assert close(new["weights"], {k: (a[k] + 3 * b[k]) / 4 for k in REST})


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
    payload = algo.configure(senv, server, 0, 3, "train")
    assert set(payload["weights"]) == set(REST)
    for k, v in payload["weights"].items():
        assert torch.allclose(v, torch.full_like(v, 0.3 * 1 + 0.2 * 2 + 0.5 * 3)), k
    # client 3 has no statistics yet: its own (warm-up) model, and a request for statistics
    payload3 = algo.configure(senv, server, 3, 3, "train")
    assert payload3["need_stats"] and all(
        torch.equal(v, server["weights"][k]) for k, v in payload3["weights"].items()
    )
    # the model scored: the client's stored (last trained) non-BN part with its own BN layers
    view = algo.eval_view(senv, server, 1, 1)
    scored = algo.personal_weights(envs[1], view, {"bn": OWN_BN}, RoundContext(1))
    assert close(scored, {**server["personal"][1], **OWN_BN})
    assert algo.global_weights(senv, server, 1) is None


# -- FedDyn -----------------------------------------------------------------------------------------
def test_feddyn_aggregate_by_hand():
    algo, senv, _ = federation({"name": "feddyn", "alpha": 0.1}, [(X, Y)] * 5, 2)
    server = algo.server_init(senv)
    fill = lambda v: {k: torch.full_like(t, v) for k, t in server["weights"].items()}  # noqa: E731
    server = {**server, "weights": fill(1.0), "h": fill(0.5)}
    uploads = {
        0: {"weights": fill(2.0), "num_samples": 1},
        3: {"weights": fill(4.0), "num_samples": 3},
    }
    new = algo.aggregate(senv, server, uploads, 2, "train")
    # h = 0.5 - alpha (1/m) sum (theta_k - theta) = 0.5 - 0.1 * (1 + 3) / 5 = 0.42 (m = 5 clients)
    # theta = mean(2, 4) - h / alpha = 3 - 4.2 = -1.2 (the plain mean over the round's clients)
    assert close(new["h"], fill(0.42))
    assert close(new["weights"], fill(-1.2), atol=1e-5)
    assert algo.global_weights(senv, new, 1) is new["weights"]  # the server model is scored
    assert (
        algo.personal_weights(None, algo.eval_view(senv, new, 0, 1), {}, RoundContext(1)) is None
    )  # by everyone


def test_feddyn_client_update_two_steps_by_hand():
    algo, senv, envs = federation({"name": "feddyn", "alpha": 0.5}, [(X, Y)] * 2, 2, local_epochs=2)
    g = torch.Generator().manual_seed(4)
    theta = {
        "head.weight": torch.randn(2, 2, generator=g),
        "head.bias": torch.randn(2, generator=g),
    }
    grad = {k: torch.randn(v.shape, generator=g) for k, v in theta.items()}
    out = algo.client_update(envs[0], {"weights": theta}, {"grad": grad}, RoundContext(3))

    def task_loss(w):
        return nn.functional.cross_entropy(X @ w["head.weight"].T + w["head.bias"], Y)

    # two full-batch steps: theta_s+1 = theta_s - lr (grad L(theta_s) - g_k + alpha (theta_s - theta))
    w, losses = dict(theta), []
    for _ in range(2):
        leaf = {k: v.clone().requires_grad_(True) for k, v in w.items()}
        loss = task_loss(leaf)
        losses.append(float(loss.detach()))
        gl = dict(zip(leaf, torch.autograd.grad(loss, list(leaf.values())), strict=True))
        w = {k: w[k] - 0.1 * (gl[k] - grad[k] + 0.5 * (w[k] - theta[k])) for k in w}
    assert close(out.upload["weights"], w)
    # g_k <- g_k - alpha (theta_k - theta)
    assert close(out.state["grad"], {k: grad[k] - 0.5 * (w[k] - theta[k]) for k in w})
    assert out.metrics["train_loss"] == pytest.approx(np.mean(losses), rel=1e-6)  # task loss only


def _feddyn_case():
    g = torch.Generator().manual_seed(4)
    theta = {
        "head.weight": torch.randn(2, 2, generator=g),
        "head.bias": torch.randn(2, generator=g),
    }
    grad = {k: torch.randn(v.shape, generator=g) for k, v in theta.items()}
    return theta, grad


def _task_grad(w):
    leaf = {k: v.clone().requires_grad_(True) for k, v in w.items()}
    loss = nn.functional.cross_entropy(X @ leaf["head.weight"].T + leaf["head.bias"], Y)
    return dict(zip(leaf, torch.autograd.grad(loss, list(leaf.values())), strict=True))


def test_feddyn_linear_prox_term_is_flbench_loss_by_hand():
    """``prox_term: linear``: FL-bench's client loss CE + alpha <theta, nabla_k - theta^{t-1}>
    (src/client/feddyn.py lines 30-32, src/server/feddyn.py lines 34-36), nabla_k = -g_k / alpha,
    written out and differentiated: two full-batch SGD steps."""
    a = 0.5
    algo, senv, envs = federation(
        {"name": "feddyn", "alpha": a, "prox_term": "linear"}, [(X, Y)] * 2, 2, local_epochs=2
    )
    theta, grad = _feddyn_case()
    out = algo.client_update(envs[0], {"weights": theta}, {"grad": grad}, RoundContext(3))
    delta = {k: -grad[k] / a - theta[k] for k in theta}  # FL-bench's local_dual_correction

    def flbench_loss(w):
        ce = nn.functional.cross_entropy(X @ w["head.weight"].T + w["head.bias"], Y)
        return ce + a * sum((w[k] * delta[k]).sum() for k in w)

    w = dict(theta)
    for _ in range(2):
        leaf = {k: v.clone().requires_grad_(True) for k, v in w.items()}
        gl = dict(
            zip(leaf, torch.autograd.grad(flbench_loss(leaf), list(leaf.values())), strict=True)
        )
        w = {k: w[k] - 0.1 * gl[k] for k in w}
    assert close(out.upload["weights"], w)
    assert close(out.state["grad"], {k: grad[k] - a * (w[k] - theta[k]) for k in w})
    # the paper's quadratic term gives another model (its alpha theta part is what differs)
    paper, _, penvs = federation({"name": "feddyn", "alpha": a}, [(X, Y)] * 2, 2, local_epochs=2)
    other = paper.client_update(penvs[0], {"weights": theta}, {"grad": grad}, RoundContext(3))
    assert not close(other.upload["weights"], w, atol=1e-3)


@pytest.mark.parametrize("clip_on", ["task", "total"])
def test_feddyn_clip_on_by_hand(clip_on):
    """``train.grad_clip`` 0.3: ``task`` clips the task gradient, then adds -g_k + alpha (theta
    - theta^{t-1}); ``total`` (FL-bench src/client/feddyn.py lines 33-37) clips their sum. Two
    full-batch steps, the global-norm clip written out (factor c / (norm + 1e-6), at most 1)."""
    a, c = 0.5, 0.3
    algo, senv, envs = federation(
        {"name": "feddyn", "alpha": a, "clip_on": clip_on}, [(X, Y)] * 2, 2, local_epochs=2,
        grad_clip=c,
    )  # fmt: skip
    theta, grad = _feddyn_case()
    out = algo.client_update(envs[0], {"weights": theta}, {"grad": grad}, RoundContext(3))

    def clipped(d):
        norm = math.sqrt(sum(float((v**2).sum()) for v in d.values()))
        return {k: v * min(1.0, c / (norm + 1e-6)) for k, v in d.items()}

    def step(w, order):
        gl = _task_grad(w)
        if order == "task":
            gl = clipped(gl)
        d = {k: gl[k] - grad[k] + a * (w[k] - theta[k]) for k in w}
        if order == "total":
            d = clipped(d)
        return {k: w[k] - 0.1 * d[k] for k in w}

    want, other = dict(theta), dict(theta)
    for _ in range(2):
        want = step(want, clip_on)
        other = step(other, "task" if clip_on == "total" else "total")
    assert close(out.upload["weights"], want)
    assert not close(other, want, atol=1e-3)  # the clip binds: the order matters here
