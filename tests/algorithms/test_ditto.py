"""Ditto / DittoRS: defining math and end-to-end behaviour."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pflkit.algorithms.base import parse_params, train_from
from pflkit.algorithms.context import RoundContext, ServerContext
from pflkit.algorithms.ditto import Ditto, smooth_l1_proximal_loss
from pflkit.algorithms.fedavg import FedAvg
from pflkit.engine import Simulation
from pflkit.engine.simulation import seed_torch
from pflkit.errors import PflkitError
from pflkit.primitives.training import (
    cross_entropy,
    proximal_loss,
    set_weights,
)
from pflkit.testing import personal_weights, same_weights
from split_helpers import (
    PATHOLOGICAL,
    assert_close,
    ce,
    hand_sgd,
    missing_classes,
    randn_like,
    rs_ce,
    trains_end_to_end,
)


# -- Ditto ---------------------------------------------------------------------------------------
def test_ditto_personal_loss_gradient_adds_lam_times_v_minus_w(tiny):
    sim = Simulation(tiny(algorithm={"name": "ditto", "lam": 0.3}))
    model = sim.envs[0].model()
    torch.manual_seed(3)
    w = sim.server["weights"]
    v = {k: t + 0.1 * torch.randn_like(t) for k, t in w.items()}
    set_weights(model, v)
    x, y = sim.data.clients[0].train_x[:16], sim.data.clients[0].train_y[:16]
    loss = sim.algo.personal_loss(w)(model, x, y)
    loss.backward()
    grads = {k: p.grad.clone() for k, p in model.named_parameters()}
    model.zero_grad()
    cross_entropy(model, x, y).backward()
    for k, p in model.named_parameters():
        assert torch.allclose(grads[k] - p.grad, 0.3 * (v[k] - w[k]), atol=1e-6)
    # the MAP code's variant: lam * mean over tensors of the mean smooth-L1(v, w)
    lam = 0.3
    got = smooth_l1_proximal_loss(w, lam)(model, x, y)
    terms = [F.smooth_l1_loss(p, w[k]) for k, p in model.named_parameters()]
    assert torch.allclose(got, cross_entropy(model, x, y) + lam * sum(terms) / len(terms))


def test_ditto_upload_is_fedavg_client_update_and_personal_model_persists(tiny):
    cfg = tiny(algorithm={"name": "ditto", "lam": 0.5, "personal_epochs": 2}, eval={"every": 9})
    sim = Simulation(cfg)
    algo, env, w = sim.algo, sim.envs[0], sim.server["weights"]
    fedavg = FedAvg(FedAvg.Params())
    seed_torch(0, 1, 0, 0)
    ref = fedavg.client_update(env, {"weights": w}, {}, RoundContext(1)).upload
    torch.manual_seed(4)
    v0 = {k: t + 0.1 * torch.randn_like(t) for k, t in w.items()}
    seed_torch(0, 1, 0, 0)
    update = algo.client_update(env, {"weights": w}, {"personal": v0}, RoundContext(1))
    assert update.upload.keys() == {"weights", "num_samples"}
    for k in w:  # the global branch is exactly FedAvg's client update
        assert torch.equal(update.upload["weights"][k], ref["weights"][k])
    # the personal branch continues from the stored v (not from w) on CE + lam/2 ||v - w||^2
    seed_torch(0, 1, 0, 0)
    train_from(env, w, RoundContext(1))  # the global branch's draws
    expect, _ = train_from(env, v0, RoundContext(1), epochs=2, loss_fn=proximal_loss(w, 0.5))
    v1 = update.state["personal"]
    for k in w:
        assert torch.equal(v1[k], expect[k])
    assert same_weights(personal_weights(algo, env, {}, update.state, RoundContext(1)), v1)
    # a first participation starts the personal model from the downloaded global model
    seed_torch(0, 1, 0, 0)
    fresh = algo.client_update(env, {"weights": w}, {}, RoundContext(1)).state["personal"]
    assert any(not torch.equal(fresh[k], v1[k]) for k in w)

    # across rounds in the engine: the personal model lives in client state and is scored
    sim.run_round(1)
    p1 = {c: s["personal"] for c, s in sim.clients.items()}
    sim.run_round(2)
    for cid, s in sim.clients.items():
        assert same_weights(
            personal_weights(algo, sim.envs[cid], {}, s, RoundContext(1)), s["personal"]
        )
        assert any(not torch.equal(s["personal"][k], p1[cid][k]) for k in w)
        assert any(not torch.equal(s["personal"][k], sim.server["weights"][k]) for k in w)


def test_ditto_aggregate_is_uniform_mean_by_default(tiny):
    sim = Simulation(tiny(algorithm={"name": "ditto"}))
    ups = {
        i: {"weights": {"w": torch.full((2,), float(i))}, "num_samples": 1 + 9 * i}
        for i in range(2)
    }
    assert torch.equal(
        sim.algo.aggregate(sim.senv, {}, ups, ServerContext(1, "train"))["weights"]["w"],
        torch.full((2,), 0.5),
    )
    weighted = Ditto(Ditto.Params(weighting="samples"))
    assert torch.allclose(
        weighted.aggregate(sim.senv, {}, ups, ServerContext(1, "train"))["weights"]["w"],
        torch.full((2,), 10 / 11),
    )


def test_ditto_client_update_by_hand(tiny):
    """Ditto, Algorithm 1: the upload is E = 1 epoch of SGD on CE from w_t at train.lr; then the
    personal model v continues from the stored v_k with personal_epochs = 2 epochs at
    personal_lr = 0.02 on CE(v) + (lam / 2) ||v - w_t||^2; a first participation starts v at
    w_t. The personalized model is v."""
    lam = 0.5
    algo = {"name": "ditto", "lam": lam, "personal_epochs": 2, "personal_lr": 0.02}
    sim = Simulation(tiny(algorithm=algo))
    env, d, w_t = sim.envs[0], sim.data.clients[0], sim.server["weights"]
    torch.manual_seed(3)
    v0 = randn_like(w_t, 0.1)
    v0 = {k: w_t[k] + v0[k] for k in w_t}

    def h(v, x, y):
        return ce(v, x, y) + lam / 2 * sum(((v[k] - w_t[k]) ** 2).sum() for k in v)

    for start in (v0, None):
        torch.manual_seed(9)
        state = {} if start is None else {"personal": start}
        update = sim.algo.client_update(env, {"weights": w_t}, state, RoundContext(1))
        torch.manual_seed(9)
        w_k = hand_sgd(w_t, d.train_x, d.train_y, lr=0.05)
        v = hand_sgd(start or w_t, d.train_x, d.train_y, h, lr=0.02, epochs=2)
        assert_close(update.upload["weights"], w_k)
        assert_close(update.state["personal"], v)
        assert same_weights(
            personal_weights(sim.algo, env, {}, update.state, RoundContext(1)),
            update.state["personal"],
        )


def test_dittors_client_update_by_hand(tiny):
    """DittoRS: the global branch on the RS loss (hard rule: alpha on the classes the client
    lacks), the personal branch on plain CE + (lam / 2) ||v - w_t||^2."""
    alpha, lam = 0.3, 0.1
    sim = Simulation(tiny(algorithm={"name": "dittors", "alpha": alpha}, data=PATHOLOGICAL))
    env, d, w_t = sim.envs[1], sim.data.clients[1], sim.server["weights"]
    assert missing_classes(sim, 1)

    def h(v, x, y):
        return ce(v, x, y) + lam / 2 * sum(((v[k] - w_t[k]) ** 2).sum() for k in v)

    torch.manual_seed(4)
    update = sim.algo.client_update(env, {"weights": w_t}, {}, RoundContext(1))
    torch.manual_seed(4)
    w_k = hand_sgd(w_t, d.train_x, d.train_y, rs_ce(d.train_y, alpha), lr=0.05)
    v = hand_sgd(w_t, d.train_x, d.train_y, h, lr=0.05)
    assert_close(update.upload["weights"], w_k)
    assert_close(update.state["personal"], v)


def test_dittors_global_branch_uses_rs_and_personal_branch_plain_ce(tiny):
    algo_cfg = {"name": "dittors", "alpha": 0.0, "rs_mode": "hard"}
    sim = Simulation(tiny(algorithm=algo_cfg, data=PATHOLOGICAL))
    missing = missing_classes(sim, 0)
    w = sim.server["weights"]
    update = sim.algo.client_update(sim.envs[0], {"weights": w}, {}, RoundContext(1))
    up, v = update.upload["weights"], update.state["personal"]
    for key in ("head.weight", "head.bias"):
        assert torch.equal(up[key][missing], w[key][missing])  # RS, alpha = 0: no gradient
        assert not torch.equal(v[key][missing], w[key][missing])  # plain CE pushes them
    assert parse_params({"name": "dittors"})[1].rs_mode == "hard"  # the paper's RS (Eq. 8)


# -- end to end ----------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["ditto", "dittors"])
def test_trains_end_to_end(tiny, tmp_path, name):
    trains_end_to_end(tiny, tmp_path, name)


# -- bad input -----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "cfg, key",
    [
        ({"name": "dittors", "alpha": 2}, "dittors.alpha"),
        ({"name": "ditto", "lam": -0.1}, "ditto.lam"),
        ({"name": "dittors", "lam": -1}, "dittors.lam"),
        ({"name": "ditto", "prox": "l1"}, "ditto.prox"),
    ],
)
def test_bad_parameters(cfg, key):
    with pytest.raises(PflkitError, match=key.replace(".", r"\.")):
        parse_params(cfg)
