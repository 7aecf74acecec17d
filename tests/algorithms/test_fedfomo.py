"""FedFomo (Zhang et al. 2021): the neighbour choice (epsilon-greedy on the affinity row, among
the previous round's clients, random ties), the client's Eq. 5-7 and local step, the server's
affinity update, and the model scored. Every expected value is written out here with plain
torch ops on hand-made tensors (softmax regression, so the loss is one line)."""

from __future__ import annotations

import math
from collections import Counter

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pflkit.algorithms.context import RoundContext, ServerContext
from pflkit.algorithms.fedfomo import fomo_combine, fomo_weights
from pflkit.engine import Simulation
from pflkit.testing import personal_weights
from split_helpers import federation

pytestmark = pytest.mark.usefixtures("one_thread")


def one_sample_clients(n: int):
    return [(torch.tensor([[1.0, -1.0]]), torch.tensor([1]))] * n


def server_with(algo, senv, recent: list[int], affinity: dict[int, dict[int, float]]):
    """A server state in which every client has uploaded a model, ``recent`` uploaded in the
    last round, and P holds ``affinity`` (row -> {column: value}), zeros elsewhere."""
    server = algo.server_init(senv)
    n = senv.num_clients
    models = {
        j: {k: torch.full_like(v, float(j)) for k, v in server["init"].items()} for j in range(n)
    }
    P = torch.zeros(n, n, dtype=torch.float64)
    for i, row in affinity.items():
        for j, v in row.items():
            P[i, j] = v
    return {**server, "models": models, "recent": recent, "P": P}


# -- which models a client downloads ----------------------------------------------------------------
def test_a_client_downloads_its_highest_affinity_clients_of_the_previous_round():
    algo, senv, _ = federation(
        {"name": "fedfomo", "m": 2, "epsilon": 0.0}, one_sample_clients(8), 2
    )
    # clients 3 and 7 have the highest affinity but did not upload last round: not candidates
    row = {1: 0.1, 2: 0.5, 3: 0.9, 5: 0.3, 6: -0.2, 7: 0.8}
    server = server_with(algo, senv, [0, 1, 2, 5, 6], {0: row})
    for rnd in (2, 3, 7, 40):
        payload = algo.configure(senv, server, 0, ServerContext(rnd, "train"))
        # by hand: candidates 1, 2, 5, 6 (0 is the client itself); the two highest are 2 and 5
        assert payload["ids"].tolist() == [2, 5]
        for j, m in zip([2, 5], payload["models"], strict=True):
            assert all(torch.equal(v, server["models"][j][k]) for k, v in m.items())
    # the uploads of a round are the next round's candidates
    up = {"weights": server["init"], "ids": torch.tensor([], dtype=torch.int64)}
    after = algo.aggregate(
        senv, server, {4: {**up, "w": torch.zeros(0)}, 1: up}, ServerContext(5, "train")
    )
    assert after["recent"] == [1, 4]
    assert algo.configure(senv, after, 0, ServerContext(6, "train"))["ids"].tolist() == [
        1,
        4,
    ]  # <= M: all


def test_ties_are_broken_at_random_so_no_client_is_favoured_by_its_id():
    """Empty affinity rows (every P entry 0): the five neighbours are drawn among the previous
    round's clients, each about equally often, not the five lowest ids for everyone."""
    algo, senv, _ = federation(
        {"name": "fedfomo", "m": 5, "epsilon": 0.0}, one_sample_clients(100), 2
    )
    recent = [3, 11, 20, 34, 47, 58, 64, 71, 86, 92]
    server = server_with(algo, senv, recent, {})
    lists = [
        algo.neighbours(senv, server, cid, rnd) for cid in (50, 70, 99) for rnd in (3, 10, 50, 150)
    ]
    assert all(len(ids) == 5 and set(ids) <= set(recent) for ids in lists)
    assert len({tuple(ids) for ids in lists}) >= 10  # 12 draws of 5 among 10: nearly all differ
    counts = Counter(
        j
        for cid in range(20, 60)
        for rnd in (2, 5)
        for j in algo.neighbours(senv, server, cid, rnd)
    )
    # 80 draws of 5 of 10 candidates: each expected 40 times (sd 4.5)
    assert set(counts) == set(recent) and all(25 <= c <= 55 for c in counts.values()), counts


def test_epsilon_decays_per_round_to_the_greedy_choice():
    algo, senv, _ = federation(
        {"name": "fedfomo", "m": 2, "epsilon": 0.5, "epsilon_decay": 0.25}, one_sample_clients(8), 2
    )
    rows = {c: {j: float((3 * j + 5 * c) % 8) for j in range(8)} for c in range(8)}
    server = server_with(algo, senv, list(range(8)), rows)

    def top2(c):  # by hand: the two highest affinities among the other clients
        others = sorted((j for j in range(8) if j != c), key=lambda j: -rows[c][j])
        return sorted(others[:2])

    # epsilon = 0.5 - 0.25 (r - 1) is 0 from round 3 on: greedy
    for c in range(8):
        for rnd in range(3, 30):
            assert algo.neighbours(senv, server, c, rnd) == top2(c), (c, rnd)
    # in round 1 (epsilon 0.5) some slots explore
    assert any(algo.neighbours(senv, server, c, 1) != top2(c) for c in range(8))


# -- the client's update (Eq. 5-7, then local SGD) ----------------------------------------------------
def ce(w: dict, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(x @ w["head.weight"].T + w["head.bias"], y)


def dist(a: dict, b: dict) -> float:
    return float(sum(((a[k] - b[k]) ** 2).sum() for k in a) ** 0.5)


def test_client_update_weights_models_by_validation_gain_then_trains():
    # five identical samples: whichever one is the validation sample, L_i is the loss on it
    x, y = torch.tensor([[1.0, -1.0]]), torch.tensor([1])
    algo, senv, envs = federation(
        {"name": "fedfomo", "m": 3}, [(x.repeat(5, 1), y.repeat(5))] * 7, 2
    )
    own = {"head.weight": torch.tensor([[0.5, 0.0], [0.0, 0.5]]), "head.bias": torch.zeros(2)}
    better = {"head.weight": torch.tensor([[0.0, 0.0], [1.0, 0.0]]), "head.bias": torch.zeros(2)}
    worse = {"head.weight": torch.tensor([[1.0, -1.0], [0.0, 0.0]]), "head.bias": torch.zeros(2)}
    far = {
        "head.weight": torch.tensor([[0.0, 0.0], [2.0, 0.0]]),
        "head.bias": torch.tensor([0.0, 1.0]),
    }
    models = [better, worse, far]
    payload = {"ids": torch.tensor([3, 5, 6]), "models": models}
    out = algo.client_update(envs[0], payload, {"weights": own}, RoundContext(4))
    # Eq. 5: (L(own) - L(n)) / ||theta_n - own||; Eq. 6: negatives to 0, normalised
    raw = [(ce(own, x, y) - ce(m, x, y)).item() / dist(m, own) for m in models]
    assert raw[0] > 0 > raw[1] and raw[2] > 0
    pos = [max(r, 0.0) for r in raw]
    w = [r / sum(pos) for r in pos]
    np.testing.assert_allclose(out.upload["w"].numpy(), w, rtol=1e-6)
    assert out.upload["ids"].tolist() == [3, 5, 6]
    # Eq. 7, then one full-batch SGD step on the four training samples (lr 0.1)
    start = {
        k: own[k] + sum(wn * (m[k] - own[k]) for wn, m in zip(w, models, strict=True)) for k in own
    }
    leaf = {k: v.clone().requires_grad_(True) for k, v in start.items()}
    grads = torch.autograd.grad(ce(leaf, x.repeat(4, 1), y.repeat(4)), list(leaf.values()))
    want = {k: start[k] - 0.1 * g for (k, g) in zip(leaf, grads, strict=True)}
    for k, v in want.items():
        assert torch.allclose(out.upload["weights"][k], v, atol=1e-6), k
        assert torch.equal(out.state["weights"][k], out.upload["weights"][k])
    # the server stores the model and adds w to the affinity row
    server = algo.server_init(senv)
    server["P"][0, 3] = 0.5
    new = algo.aggregate(senv, server, {0: out.upload}, ServerContext(4, "train"))
    np.testing.assert_allclose(new["P"][0, [3, 5, 6]].numpy(), [0.5 + w[0], 0.0, w[2]], rtol=1e-6)
    assert float(new["P"].abs().sum()) == pytest.approx(0.5 + 1.0)
    assert new["models"][0] is out.upload["weights"]
    # the model scored for the client is its own last model, not the initial one
    view = algo.eval_view(senv, new, 0, ServerContext(1))
    scored = personal_weights(algo, envs[0], view, out.state, RoundContext(1))
    assert all(torch.equal(scored[k], out.state["weights"][k]) for k in own)


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
