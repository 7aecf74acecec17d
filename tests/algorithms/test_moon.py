"""MOON: the model-contrastive loss l_con (Eq. 2) by hand, its gradient, the client loss with
the global and previous models, mu = 0 against FedAvg, the stored previous model, and a short
end-to-end run. Expected numbers are written by hand or computed with plain torch formulas."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from conftest import tiny_config
from pflkit.algorithms import build_algorithm
from pflkit.algorithms.context import RoundContext, ServerContext
from pflkit.algorithms.moon import model_contrastive_loss, moon_loss
from pflkit.engine import Simulation
from pflkit.errors import PflkitError
from pflkit.experiment import validate
from pflkit.models.base import PFLModel

R2 = math.sqrt(2.0)


def test_l_con_by_hand_on_2d_features():
    z = torch.tensor([[1.0, 0.0], [1.0, 1.0]])
    z_glob = torch.tensor([[1.0, 0.0], [2.0, 0.0]])  # cosines with z: 1 and 1/sqrt(2)
    z_prev = torch.tensor([[0.0, 3.0], [-1.0, 0.0]])  # cosines with z: 0 and -1/sqrt(2)
    # -log(e^{a/t} / (e^{a/t} + e^{b/t})) = log(1 + e^{(b - a)/t}), a = sim to glob, b = to prev
    want = (math.log(1 + math.exp(-1 / 0.5)) + math.log(1 + math.exp(-R2 / 0.5))) / 2
    assert model_contrastive_loss(z, z_glob, z_prev, 0.5).item() == pytest.approx(want, abs=1e-6)
    assert want == pytest.approx(0.0921765, abs=1e-6)
    want_t1 = (math.log(1 + math.exp(-1)) + math.log(1 + math.exp(-R2))) / 2
    assert model_contrastive_loss(z, z_glob, z_prev, 1.0).item() == pytest.approx(want_t1, abs=1e-6)
    # equal similarities: log 2 whatever tau
    assert model_contrastive_loss(z, z_glob, z_glob, 0.5).item() == pytest.approx(math.log(2))


def test_l_con_gradient_pulls_toward_global_and_pushes_from_previous():
    z = torch.tensor([[1.0, 0.0]], requires_grad=True)
    z_glob = torch.tensor([[0.0, 1.0]])  # cos 0
    z_prev = torch.tensor([[0.6, -0.8]])  # cos 0.6
    model_contrastive_loss(z, z_glob, z_prev, 0.5).backward()
    # dl/dz = sigmoid((b - a)/t) / t * (dcos_prev/dz - dcos_glob/dz), dcos(z, v)/dz = v^ - cos z^
    # = sigmoid(1.2) / 0.5 * ((0, -0.8) - (0, 1))
    s = 1 / (1 + math.exp(-1.2))
    want = torch.tensor([[0.0, s / 0.5 * -1.8]])
    assert torch.allclose(z.grad, want, atol=1e-6)
    assert want[0, 1].item() == pytest.approx(-2.766690, abs=1e-5)
    # one gradient step: closer to z_glob, farther from z_prev
    z1 = z.detach() - 0.1 * z.grad
    cos = lambda a, b: (a @ b.T / (a.norm() * b.norm())).item()  # noqa: E731
    assert cos(z1, z_glob) > 0.26 and cos(z1, z_prev) < 0.38  # from 0 and 0.6
    assert cos(z1, z_glob) == pytest.approx(0.276669 / math.hypot(1, 0.276669), abs=1e-5)


def _toy(body_w, head_w, head_b) -> PFLModel:
    body, head = nn.Linear(2, 2, bias=False), nn.Linear(2, 2)
    with torch.no_grad():
        body.weight.copy_(torch.tensor(body_w))
        head.weight.copy_(torch.tensor(head_w))
        head.bias.copy_(torch.tensor(head_b))
    return PFLModel(body, head, 2)


def test_client_loss_contrasts_against_the_global_and_the_previous_model():
    model = _toy([[1.0, 0.0], [0.0, 1.0]], [[1.0, -1.0], [0.5, 2.0]], [0.1, -0.2])
    glob = _toy([[1.0, 1.0], [0.0, 1.0]], [[0.0, 0.0], [0.0, 0.0]], [0.0, 0.0])
    prev = _toy([[0.0, -1.0], [1.0, 0.0]], [[0.0, 0.0], [0.0, 0.0]], [0.0, 0.0])
    x = torch.tensor([[1.0, 2.0], [-1.0, 0.5]])
    y = torch.tensor([1, 0])
    # by hand: z = x (identity body), z_glob = (x0 + x1, x1), z_prev = (-x1, x0)
    z = x
    zg = torch.stack([x[:, 0] + x[:, 1], x[:, 1]], 1)
    zp = torch.stack([-x[:, 1], x[:, 0]], 1)
    logits = z @ torch.tensor([[1.0, -1.0], [0.5, 2.0]]).T + torch.tensor([0.1, -0.2])
    ce = (torch.logsumexp(logits, 1) - logits[torch.arange(2), y]).mean()
    cg = (z * zg).sum(1) / (z.norm(dim=1) * zg.norm(dim=1))
    cp = (z * zp).sum(1) / (z.norm(dim=1) * zp.norm(dim=1))
    lcon = torch.log(1 + torch.exp((cp - cg) / 0.5)).mean()
    got = moon_loss(glob, prev, mu=2.0, tau=0.5)(model, x, y)
    assert got.item() == pytest.approx((ce + 2.0 * lcon).item(), abs=1e-6)
    assert lcon.item() > 0.1  # the contrastive term matters in this check
    # no previous model yet (first participation): plain cross-entropy
    assert moon_loss(glob, None, 2.0, 0.5)(model, x, y).item() == pytest.approx(ce.item())
    assert not glob.training and not prev.training  # frozen references run in eval mode


@pytest.fixture(scope="module")
def sims():
    def make(**algo):
        cfg = tiny_config(algorithm=algo, train={"rounds": 2, "client_fraction": 0.75})
        return Simulation(validate(cfg))

    return make


def test_mu_zero_is_fedavg_and_the_trained_model_becomes_prev(sims):
    moon0, moon, fedavg = sims(name="moon", mu=0.0), sims(name="moon"), sims(name="fedavg")
    env = moon.envs[0]
    payload = moon.algo.configure(moon.senv, moon.server, 0, ServerContext(1, "train"))
    gen = torch.Generator().manual_seed(0)
    prev = {
        k: v + 0.05 * torch.randn(v.shape, generator=gen) for k, v in payload["weights"].items()
    }

    def run(sim, state):
        torch.manual_seed(7)
        return sim.algo.client_update(env, payload, state, RoundContext(2))

    base = run(fedavg, {})
    zero = run(moon0, {"prev": prev})
    full = run(moon, {"prev": prev})
    for k, v in base.upload["weights"].items():
        assert torch.allclose(zero.upload["weights"][k], v, atol=1e-6, rtol=0), k
    assert zero.metrics["train_loss"] == pytest.approx(base.metrics["train_loss"], abs=1e-6)
    assert full.metrics["train_loss"] > base.metrics["train_loss"] + 0.1  # + mu * l_con
    diff = max(
        (full.upload["weights"][k] - v).abs().max().item()
        for k, v in base.upload["weights"].items()
    )
    assert diff > 1e-4
    # the trained (uploaded) model is kept as the next round's previous model, as a copy
    for k, v in full.upload["weights"].items():
        assert torch.equal(full.state["prev"][k], v) and full.state["prev"][k] is not v
    assert not any(torch.equal(full.state["prev"][k], v) for k, v in prev.items() if v.numel() > 1)


def test_end_to_end_first_round_is_fedavg_then_contrastive(sims):
    moon, fedavg = sims(name="moon", mu=1.0), sims(name="fedavg")
    m1, f1 = moon.run_round(1), fedavg.run_round(1)
    assert m1["clients"] == f1["clients"] and len(m1["clients"]) == 3
    # no client has a previous model in round 1: plain CE, exactly FedAvg's round
    assert m1["train_loss"] == pytest.approx(f1["train_loss"], abs=1e-6)
    assert m1["global_acc"] == f1["global_acc"]
    for cid in range(4):
        assert ("prev" in moon.client_state(cid)) == (cid in m1["clients"])
    m2, f2 = moon.run_round(2), fedavg.run_round(2)
    assert m2["clients"] == f2["clients"]
    assert set(m2["clients"]) & set(m1["clients"])  # 3 of 4 per round: some have a prev model
    assert m2["train_loss"] > f2["train_loss"] + 0.05  # their loss adds mu * l_con > 0
    assert m2["bytes_up"] == f2["bytes_up"]  # uploads exactly what FedAvg uploads


@pytest.mark.parametrize(
    "bad, word", [({"tau": 0}, "tau"), ({"mu": -1.0}, "mu"), ({"tau": "x"}, "tau")]
)
def test_bad_parameters_are_one_sentence(bad, word):
    with pytest.raises(PflkitError) as err:
        build_algorithm({"name": "moon", **bad})
    msg = str(err.value)
    assert word in msg and "\n" not in msg


def _perturbed(weights, scale, seed):
    g = torch.Generator().manual_seed(seed)
    return {k: v + scale * torch.randn(v.shape, generator=g) for k, v in weights.items()}


def _cos(a, b):
    return (a * b).sum(1) / (a.norm(dim=1) * b.norm(dim=1))


def _moon_step(model, w, w_glob, w_prev, x, y, mu, tau, lr):
    """One full-batch SGD step on CE + mu * l_con, written out: the features of the frozen
    references are taken without gradient, l_con = mean log(1 + e^{(cos_prev - cos_glob)/tau})."""
    with torch.no_grad():
        model.load_state_dict(w_glob)
        zg = model.features(x)
        model.load_state_dict(w_prev)
        zp = model.features(x)
    model.load_state_dict(w)
    z = model.features(x)
    logits = model.head(z)
    ce = (torch.logsumexp(logits, 1) - logits[torch.arange(len(y)), y]).mean()
    lcon = torch.log(1 + torch.exp((_cos(z, zp) - _cos(z, zg)) / tau)).mean()
    params = dict(model.named_parameters())
    grads = torch.autograd.grad(ce + mu * lcon, list(params.values()))
    return {k: w[k] - lr * g for k, g in zip(params, grads, strict=True)}


def test_one_client_step_by_hand():
    """Two rounds of one client, one full-batch step each (lr 0.1, mu 2, tau 0.5): each step is
    written out, and round 2 contrasts against the model round 1 trained (its ``prev``)."""
    cfg = tiny_config(
        algorithm={"name": "moon", "mu": 2.0, "tau": 0.5},
        train={"batch_size": 100000, "lr": 0.1, "local_epochs": 1},
    )
    sim = Simulation(validate(cfg))
    env = sim.envs[0]
    x, y = env.data.train_x, env.data.train_y
    model = env.model("check")
    g1 = sim.server["weights"]
    prev0 = _perturbed(g1, 0.3, 1)
    out1 = sim.algo.client_update(env, {"weights": g1}, {"prev": prev0}, RoundContext(1))
    want1 = _moon_step(model, g1, g1, prev0, x, y, 2.0, 0.5, 0.1)
    for k, v in want1.items():
        assert torch.allclose(out1.upload["weights"][k], v, atol=1e-6), k
    # round 2: a new global model; the previous model is round 1's trained one
    g2 = _perturbed(g1, 0.2, 2)
    out2 = sim.algo.client_update(env, {"weights": g2}, out1.state, RoundContext(2))
    want2 = _moon_step(model, g2, g2, want1, x, y, 2.0, 0.5, 0.1)
    for k, v in want2.items():
        assert torch.allclose(out2.upload["weights"][k], v, atol=1e-6), k
    # the contrastive term moved this step: CE alone gives another model
    plain = _moon_step(model, g2, g2, want1, x, y, 0.0, 0.5, 0.1)
    assert max(float((plain[k] - want2[k]).abs().max()) for k in plain) > 1e-4


# -- first_prev: initial (PFLlib clientmoon.py line 17) ------------------------------------------
def _moon_sim(**algo):
    cfg = tiny_config(
        algorithm={"name": "moon", "mu": 2.0, "tau": 0.5, **algo},
        train={"batch_size": 100000, "lr": 0.1, "local_epochs": 1, "client_fraction": 0.5},
    )
    return Simulation(validate(cfg))


def test_first_prev_initial_sends_the_initial_model_until_the_first_upload():
    sim = _moon_sim(first_prev="initial")
    algo, senv, server = sim.algo, sim.senv, sim.server
    init = server["init"]
    assert all(torch.equal(init[k], v) and init[k] is not v for k, v in server["weights"].items())
    assert server["uploaded"] == []
    later = {**server, "weights": _perturbed(server["weights"], 0.2, 3), "uploaded": [0, 2]}
    for cid in range(4):
        payload = algo.configure(senv, later, cid, ServerContext(2, "train"))
        assert ("init" in payload) == (cid in (1, 3)), cid
        if cid in (1, 3):  # the initial model, not the current global one
            assert all(torch.equal(payload["init"][k], v) for k, v in init.items())
    ups = {3: {"weights": later["weights"], "num_samples": 5}}
    assert algo.aggregate(senv, later, ups, ServerContext(2, "train"))["uploaded"] == [0, 2, 3]
    # the default keeps no initial model and sends none
    plain = _moon_sim()
    assert set(plain.server) == {"weights"}
    assert set(plain.algo.configure(plain.senv, plain.server, 1, ServerContext(1, "train"))) == {
        "weights"
    }


@pytest.mark.parametrize("first_prev", ["none", "initial"])
def test_a_first_selection_in_a_later_round_by_hand(first_prev):
    """A client without a previous model, in a round whose global model is not the initial one:
    ``initial`` contrasts against the initial model (one step of CE + mu l_con written out),
    ``none`` trains on CE alone."""
    sim = _moon_sim(first_prev=first_prev)
    env = sim.envs[1]
    x, y = env.data.train_x, env.data.train_y
    init = sim.server["weights"]
    g = _perturbed(init, 0.3, 5)
    payload = sim.algo.configure(
        sim.senv, {**sim.server, "weights": g}, 1, ServerContext(4, "train")
    )
    out = sim.algo.client_update(env, payload, {}, RoundContext(4))
    model = env.model("check")
    mu = 2.0 if first_prev == "initial" else 0.0
    want = _moon_step(model, g, g, init, x, y, mu, 0.5, 0.1)
    for k, v in want.items():
        assert torch.allclose(out.upload["weights"][k], v, atol=1e-6), k
    other = _moon_step(model, g, g, init, x, y, 2.0 - mu, 0.5, 0.1)
    assert max(float((other[k] - want[k]).abs().max()) for k in want) > 1e-4
    assert all(torch.equal(out.state["prev"][k], v) for k, v in out.upload["weights"].items())


def test_first_prev_initial_round_one_adds_mu_log2_and_changes_no_step():
    """In round 1 the initial model is the downloaded one: z_prev = z_glob, l_con = log 2 with
    zero gradient, so the models are FedAvg's and the loss is FedAvg's + mu log 2; the first
    download carries the initial model too."""
    moon = _moon_sim(first_prev="initial")
    fedavg = Simulation(
        validate(
            tiny_config(
                algorithm={"name": "fedavg", "weighting": "samples"},
                train={"batch_size": 100000, "lr": 0.1, "local_epochs": 1, "client_fraction": 0.5},
            )
        )
    )
    m1, f1 = moon.run_round(1), fedavg.run_round(1)
    assert m1["clients"] == f1["clients"]
    assert m1["train_loss"] == pytest.approx(f1["train_loss"] + 2.0 * math.log(2), abs=1e-5)
    for k, v in fedavg.server["weights"].items():
        assert torch.allclose(moon.server["weights"][k], v, atol=1e-6), k
    assert m1["bytes_down"] == [2 * b for b in f1["bytes_down"]]  # weights + initial model
    assert moon.server["uploaded"] == sorted(m1["clients"])
