"""FLDA: the gated mixture by value (paper: mixed probabilities; MAP code: mixed logits), the gate
learning to trust the expert that is right, the client step (the general model trained as in
FedAvg and uploaded alone; the private model and the gate trained and kept), the personalized
accuracy of the scored mixture recomputed by hand, bad parameters."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from conftest import tiny_config
from pflkit.algorithms.base import parse_params
from pflkit.algorithms.flda import flda_loss, gate_logit, mixture
from pflkit.engine import Simulation
from pflkit.errors import PflkitError
from pflkit.experiment import validate
from pflkit.models import PFLModel

LN3 = math.log(3.0)
ZG = torch.tensor([[1.0, 0.0], [0.0, 0.0]])
ZP = torch.tensor([[0.0, 2.0], [LN3, 0.0]])
S = torch.tensor([LN3, -LN3])  # alpha = sigmoid(s) = 0.75 and 0.25 (the general model's weight)


def test_mixture_paper_mixes_probabilities_by_hand():
    out = mixture(ZG, ZP, S, "paper").exp()
    # row 0: 0.75 * softmax(1, 0) + 0.25 * softmax(0, 2)
    #      = 0.75 * (0.73105858, 0.26894142) + 0.25 * (0.11920292, 0.88079708)
    # row 1: 0.25 * (0.5, 0.5) + 0.75 * (0.75, 0.25)
    want = torch.tensor([[0.57809467, 0.42190533], [0.6875, 0.3125]])
    assert torch.allclose(out, want, atol=1e-6)


def test_mixture_map_code_mixes_logits_by_hand():
    out = mixture(ZG, ZP, S, "map_code")
    # 0.75 * (1, 0) + 0.25 * (0, 2) and 0.25 * (0, 0) + 0.75 * (ln 3, 0)
    want = torch.tensor([[0.75, 0.5], [0.82395922, 0.0]])
    assert torch.allclose(out, want, atol=1e-6)


def test_gate_is_a_logistic_regression_on_the_flattened_input():
    u = torch.tensor([[[1.0, 2.0]], [[3.0, 4.0]]])  # [B, 1, 2]
    s = gate_logit(u, torch.tensor([0.5, -1.0]), torch.tensor([0.25]))
    assert torch.allclose(s, torch.tensor([-1.25, -2.25]))  # 0.5 - 2 + 0.25, 1.5 - 4 + 0.25


def expert(cls: int) -> PFLModel:
    """A linear classifier on 2-d inputs that always prefers class ``cls`` (logit margin 3)."""
    head = nn.Linear(2, 2, bias=True)
    with torch.no_grad():
        head.weight.zero_()
        head.bias.copy_(torch.tensor([3.0, 0.0] if cls == 0 else [0.0, 3.0]))
    return PFLModel(nn.Flatten(), head, 2)


def test_client_losses_by_hand():
    # general logits (0, 3), private logits (3, 0), gate w = 0, c = ln 3: alpha = 0.75; y = 0
    x, y = torch.zeros(1, 2), torch.tensor([0])
    gate = (torch.zeros(2), torch.tensor([LN3]))
    paper = flda_loss(expert(0), gate, "paper")(expert(1), x, y)
    # CE(G) = ln(1 + e^3) = 3.0485874; mixture p(0) = 0.75 * 0.0474259 + 0.25 * 0.9525741
    # = 0.2737129, -ln = 1.2956754
    assert paper.item() == pytest.approx(3.0485874 + 1.2956754, abs=1e-6)
    # mixed logits 0.75 * (0, 3) + 0.25 * (3, 0) = (0.75, 2.25): CE = ln(1 + e^1.5), twice
    code = flda_loss(expert(0), gate, "map_code")(expert(1), x, y)
    assert code.item() == pytest.approx(2 * 1.7014133, abs=1e-6)


@pytest.mark.parametrize("variant", ["paper", "map_code"])
@pytest.mark.parametrize("right", ["private", "general"])
def test_gate_learns_to_trust_the_expert_that_is_right(variant, right):
    torch.manual_seed(0)
    x = torch.randn(32, 2)
    y = torch.zeros(32, dtype=torch.long)  # every label is class 0
    general, private = (expert(1), expert(0)) if right == "private" else (expert(0), expert(1))
    w = torch.zeros(2, requires_grad=True)
    b = torch.zeros(1, requires_grad=True)  # alpha = 0.5 at the start
    loss_fn = flda_loss(private, (w, b), variant)
    opt = torch.optim.SGD([w, b], lr=0.5)  # only the gate moves
    for _ in range(30):
        opt.zero_grad()
        loss_fn(general, x, y).backward()
        opt.step()
    u = x if variant == "paper" else general.features(x)
    alpha = torch.sigmoid(gate_logit(u, w, b)).mean().item()  # the general model's weight
    if right == "private":
        assert alpha < 0.2, alpha
    else:
        assert alpha > 0.8, alpha


def config(name: str, rounds: int = 2, **algo):
    return validate(
        tiny_config(
            algorithm={"name": name, **algo},
            train={"rounds": rounds, "client_fraction": 0.5},
        )
    )


def run(cfg):
    sim = Simulation(cfg)
    rows = [sim.run_round(r) for r in range(1, cfg.train.rounds + 1)]
    sim.close()
    return sim, rows


def hand_personal_accuracy(sim, cid: int, variant: str) -> float:
    """The mixture of the latest global model and client ``cid``'s private model and gate,
    recomputed with torch formulas, scored on the client's local test split."""
    env, state = sim.envs[cid], sim.clients[cid]
    general, private = env.model("hand_g"), env.model("hand_p")
    general.load_state_dict(sim.server["weights"])
    private.load_state_dict(state["private"])
    general.eval(), private.eval()
    x, y = env.data.test_x, env.data.test_y
    w, b = state["gate"]["weight"], state["gate"]["bias"]
    with torch.no_grad():
        h = general.features(x)
        u = x.flatten(1) if variant == "paper" else h
        alpha = torch.sigmoid(u @ w + b)[:, None]
        zg, zp = general.head(h), private(x)
        if variant == "paper":
            score = alpha * F.softmax(zg, 1) + (1 - alpha) * F.softmax(zp, 1)
        else:
            score = alpha * zg + (1 - alpha) * zp
    return (score.argmax(1) == y).sum().item() / len(y)


@pytest.fixture(scope="module")
def fedavg():
    return run(config("fedavg"))[0]


def test_paper_client_step_is_fedavg_for_the_general_model_and_uploads_only_it(fedavg):
    avg = fedavg
    sim, rows = run(config("flda"))
    # the general model is trained on its own cross-entropy: FedAvg's global model exactly
    w = sim.server["weights"]
    assert all(torch.equal(w[k], avg.server["weights"][k]) for k in w)
    # only the general model crosses the wire, both ways (+ 8 bytes for num_samples)
    full = sum(v.numel() * v.element_size() for v in w.values())
    for row in rows:
        assert row["bytes_down"] == [full] * len(row["clients"])
        assert row["bytes_up"] == [full + 8] * len(row["clients"])
    trained = set(rows[0]["clients"]) | set(rows[1]["clients"])
    assert trained != set(range(4))  # some client never trained: scored on the global model
    fresh = sim.algo._init_gate(sim.envs[0])
    d = sim.envs[0].data.train_x[0].numel()
    for cid in range(4):
        state = sim.clients.get(cid, {})
        if cid not in trained:
            assert "private" not in state
            continue
        # the private model and the gate were trained (and kept on the client)
        assert state["gate"]["weight"].shape == (d,)
        assert not torch.equal(state["gate"]["weight"], fresh["weight"])
        init = sim.algo._init_private(sim.envs[cid])
        assert any(not torch.equal(state["private"][k], init[k]) for k in init)
        acc = rows[-1]["pers_acc_clients"][cid]
        assert acc == pytest.approx(hand_personal_accuracy(sim, cid, "paper"), abs=1e-9)


def test_map_code_trains_the_general_model_through_the_mixture(fedavg):
    avg = fedavg
    sim, rows = run(config("flda", variant="map_code"))
    w = sim.server["weights"]
    assert any(not torch.allclose(w[k], avg.server["weights"][k]) for k in w)
    full = sum(v.numel() * v.element_size() for v in w.values())
    assert rows[-1]["bytes_up"] == [full + 8] * len(rows[-1]["clients"])
    feature_dim = sim.envs[0].model().feature_dim
    for cid in rows[-1]["clients"]:
        assert sim.clients[cid]["gate"]["weight"].shape == (feature_dim,)  # gate on h_G
        acc = rows[-1]["pers_acc_clients"][cid]
        assert acc == pytest.approx(hand_personal_accuracy(sim, cid, "map_code"), abs=1e-9)


@pytest.mark.parametrize(
    "bad, match",
    [
        ({"variant": "code"}, "flda.variant"),
        ({"weighting": "median"}, "flda.weighting"),
        ({"alpha": 0.5}, "has no parameter 'alpha'"),
    ],
)
def test_bad_parameters_are_one_sentence(bad, match):
    with pytest.raises(PflkitError, match=match) as err:
        parse_params({"name": "flda", **bad})
    assert "\n" not in str(err.value)
