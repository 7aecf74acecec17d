"""FedAMP: the attention weights of Eqs. 5-6 and of HeurFedAMP, the cloud model u_i, the
proximal pull (lam / alpha_k)(w - u_i), the server's pair matrices, and a short run. Expected
numbers are written by hand (or computed with plain numpy from the stored models)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pflkit.algorithms.base import nbytes
from pflkit.algorithms.blocks.split import common_init
from pflkit.algorithms.context import RoundContext, ServerContext
from pflkit.algorithms.fedamp import heuristic_attention, paper_attention
from pflkit.engine import Simulation
from pflkit.errors import PflkitError
from pflkit.eval.evaluate import accuracy
from pflkit.primitives.training import set_weights


def test_paper_attention_by_hand():
    # client 0 with squared distances 1 and 2 to clients 1 and 2; alpha_k = 0.5, sigma = 2
    # A'(1) = exp(-1/2) / 2 = 0.30326533, A'(2) = exp(-1) / 2 = 0.18393972
    xi = paper_attention(torch.tensor([0.0, 1.0, 2.0], dtype=torch.float64), 0, 0.5, 2.0)
    np.testing.assert_allclose(xi, [0.75639748, 0.15163266, 0.09196986], atol=1e-8)
    # client 1's row (distances 1, 0, 4): A'(4) = exp(-2) / 2 = 0.06766764
    xi = paper_attention(torch.tensor([1.0, 0.0, 4.0], dtype=torch.float64), 1, 0.5, 2.0)
    np.testing.assert_allclose(xi, [0.15163266, 0.81453352, 0.03383382], atol=1e-8)


def test_heuristic_attention_by_hand():
    # cosines 0.5 and -0.5 to clients 1 and 2, scale 2, self weight 0.1: the softmax over the
    # *other* clients of (e^1, e^-1) is (0.88079708, 0.11920292), then times 1 - 0.1
    xi = heuristic_attention(torch.tensor([1.0, 0.5, -0.5], dtype=torch.float64), 0, 2.0, 0.1)
    np.testing.assert_allclose(xi, [0.1, 0.79271737, 0.10728263], atol=1e-8)
    # a single client keeps its own model
    one = heuristic_attention(torch.tensor([1.0], dtype=torch.float64), 0, 2.0, 0.1)
    assert one.tolist() == [1.0]


def _sim(tiny, clients=3, **algo):
    cfg = tiny(
        algorithm={"name": "fedamp", **algo},
        data={"num_clients": clients},
        train={"rounds": 3, "client_fraction": 1.0},
    )
    return Simulation(cfg)


def _fill(weights, value):
    return {k: torch.full_like(v, value) for k, v in weights.items()}


def test_cloud_model_is_the_attention_mix_of_the_stored_models(tiny):
    sim = _sim(tiny, alpha_k=0.5, sigma=2.0)
    server = dict(sim.server)
    server["models"] = {0: _fill(server["init"], 1.0), 1: _fill(server["init"], 2.0)}
    server["init"] = _fill(server["init"], 3.0)  # client 2 was never stored: it counts as w^0
    sq = torch.tensor([[0.0, 1.0, 2.0], [1.0, 0.0, 4.0], [2.0, 4.0, 0.0]], dtype=torch.float64)
    server["sqdist"] = sq
    u0 = sim.algo.configure(sim.senv, server, 0, ServerContext(2, "train"))["weights"]
    # by hand: 0.75639748 * 1 + 0.15163266 * 2 + 0.09196986 * 3
    for k, v in u0.items():
        assert torch.allclose(v, torch.full_like(v, 1.33557238), atol=1e-6), k
    u1 = sim.algo.configure(sim.senv, server, 1, ServerContext(2, "train"))["weights"]
    # 0.15163266 * 1 + 0.81453352 * 2 + 0.03383382 * 3
    for v in u1.values():
        assert torch.allclose(v, torch.full_like(v, 1.88220116), atol=1e-6)
    # the heuristic reads the cosines instead
    heur = _sim(tiny, attention="heuristic", heur_sigma=2.0, heur_self_weight=0.1)
    server["cos"] = torch.tensor(
        [[1.0, 0.5, -0.5], [0.5, 1.0, 0.0], [-0.5, 0.0, 1.0]], dtype=torch.float64
    )
    u0 = heur.algo.configure(heur.senv, server, 0, ServerContext(2, "train"))["weights"]
    for v in u0.values():  # 0.1 * 1 + 0.79271737 * 2 + 0.10728263 * 3
        assert torch.allclose(v, torch.full_like(v, 2.00728263), atol=1e-6)


def test_proximal_pull_is_lam_over_alpha_times_w_minus_u(tiny):
    # one full-batch step of lr eta: the step with cloud model u differs from the step with
    # u = w^0 (no pull) by -eta (lam / alpha_k) (w^0 - u) on every parameter
    cfg = tiny(
        algorithm={"name": "fedamp", "alpha_k": 0.5, "lam": 0.2, "sigma": 2.0},
        data={"num_clients": 3},
        train={"batch_size": 10_000, "local_epochs": 1, "lr": 0.1},
    )
    sim = Simulation(cfg)
    env = sim.envs[0]
    w0 = common_init(env)
    shifted = {k: v + 0.3 for k, v in w0.items()}

    def step(cloud):
        torch.manual_seed(0)
        return sim.algo.client_update(env, {"weights": cloud}, {}, RoundContext(1))

    pulled, free = step(shifted), step(w0)
    for k, v in pulled.upload["weights"].items():
        # -0.1 * (0.2 / 0.5) * (w0 - (w0 + 0.3)) = +0.012
        diff = v - free.upload["weights"][k]
        assert torch.allclose(diff, torch.full_like(diff, 0.012), atol=1e-6), k
    # the upload is the personal model, which the client keeps
    assert pulled.state["weights"] is pulled.upload["weights"]


def test_bad_parameters_give_one_sentence(tiny):
    for algo, match in (
        ({"attention": "cosine"}, "fedamp.attention"),
        ({"sigma": 0}, "fedamp.sigma"),
        ({"heur_self_weight": 1.5}, "fedamp.heur_self_weight"),
    ):
        with pytest.raises(PflkitError, match=match) as err:
            _sim(tiny, **algo)
        assert len(str(err.value).splitlines()) == 1
    # PFLlib's alpha_k = sigma = 1 with 4 clients: sum_j xi_ij can reach 3, xi_ii = -2
    with pytest.raises(PflkitError, match=r"= 3 exceeds 1.*sigma to at least 3") as err:
        _sim(tiny, clients=4, alpha_k=1.0, sigma=1.0)
    assert len(str(err.value).splitlines()) == 1
    _sim(tiny, clients=4, alpha_k=1.0, sigma=3.0)  # the bound itself is allowed
    _sim(tiny, clients=4, attention="heuristic", alpha_k=1.0, sigma=1.0)  # no bound needed
    cfg = tiny(
        algorithm={"name": "fedamp"},
        model={"per_client": [{"name": "mlp", "options": {"hidden": [16]}}, "mlp"]},
    )
    with pytest.raises(PflkitError, match="every client needs the same architecture"):
        Simulation(cfg)


def _flat(w, keys):
    return np.concatenate([w[k].double().numpy().ravel() for k in keys])


def test_short_run_stores_models_pair_matrices_and_sends_one_model(tiny):
    cfg = tiny(
        algorithm={"name": "fedamp", "alpha_k": 1.0, "sigma": 3.0},
        train={"rounds": 3, "client_fraction": 0.5},
    )
    sim = Simulation(cfg)
    algo, senv = sim.algo, sim.senv
    model_bytes = nbytes(sim.server["init"])
    keys = [k for k, _ in senv.model().named_parameters()]
    seen: set[int] = set()
    rows = []
    for rnd in (1, 2, 3):
        before = {j: sim.server["models"].get(j) for j in range(4)}
        row = sim.run_round(rnd)
        rows.append(row)
        sel = row["clients"]
        seen |= set(sel)
        assert row["bytes_down"] == [model_bytes] * len(sel)  # u_i: one model per client
        assert row["bytes_up"] == [model_bytes] * len(sel)  # w_i
        for j in range(4):
            stored = sim.server["models"].get(j)
            if j in sel:  # the upload is the client's personal model
                assert all(torch.equal(stored[k], sim.clients[j]["weights"][k]) for k in stored)
            else:
                assert stored is before[j]  # unselected clients keep their last model
        # the pair matrices, recomputed with numpy from the stored models
        flat = [_flat(sim.server["models"].get(j, sim.server["init"]), keys) for j in range(4)]
        for i in range(4):
            for j in range(4):
                d = ((flat[i] - flat[j]) ** 2).sum()
                c = flat[i] @ flat[j] / (np.linalg.norm(flat[i]) * np.linalg.norm(flat[j]))
                assert sim.server["sqdist"][i, j].item() == pytest.approx(d, rel=1e-9, abs=1e-12)
                assert sim.server["cos"][i, j].item() == pytest.approx(c, rel=1e-9)
    assert sorted(seen) == sorted(sim.server["models"])
    assert "global_acc" not in rows[-1]
    # the next cloud model of client 0 by the paper's formula, from the numpy distances
    flat = [_flat(sim.server["models"].get(j, sim.server["init"]), keys) for j in range(4)]
    xi = np.array([np.exp(-((flat[0] - f) ** 2).sum() / 3.0) / 3.0 for f in flat])
    xi[0] = 1 - xi[1:].sum()
    want = sum(x * f for x, f in zip(xi, flat, strict=True))
    got = _flat(algo.configure(senv, sim.server, 0, ServerContext(4, "train"))["weights"], keys)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    assert 0 < xi[0] < 1 and (xi[1:] > 0.01).all()  # real mixing, not local training
    # a client's personalized model is its own w_i: w^0 until it is selected, then trained
    w0_acc = []
    for env in sim.envs:
        model = env.model()
        set_weights(model, common_init(env))
        w0_acc.append(accuracy(model, env.data.test_x, env.data.test_y, 1000))
    final = rows[-1]["pers_acc_clients"]
    for c in range(4):
        if c not in seen:
            assert final[c] == w0_acc[c]
    gain = np.mean([final[c] - w0_acc[c] for c in seen])
    assert gain > 0.1, gain


def test_client_step_by_hand_starts_from_its_own_model(tiny):
    """One full-batch step (lr 0.1) of client 1 holding its own w_i, given the cloud model u_i:
    w_i - 0.1 (grad CE(w_i) + (lam / alpha_k)(w_i - u_i)), lam / alpha_k = 0.2 / 0.5, written
    out with autograd on the plain cross-entropy."""
    cfg = tiny(
        algorithm={"name": "fedamp", "alpha_k": 0.5, "lam": 0.2, "sigma": 2.0},
        data={"num_clients": 3},
        train={"batch_size": 10_000, "local_epochs": 1, "lr": 0.1},
    )
    sim = Simulation(cfg)
    env = sim.envs[1]
    g = torch.Generator().manual_seed(0)
    w0 = common_init(env)
    own = {k: v + 0.2 * torch.randn(v.shape, generator=g) for k, v in w0.items()}
    cloud = {k: v + 0.5 * torch.randn(v.shape, generator=g) for k, v in w0.items()}
    out = sim.algo.client_update(env, {"weights": cloud}, {"weights": own}, RoundContext(2))
    model = env.model("check")
    model.load_state_dict(own)
    params = dict(model.named_parameters())
    ce = torch.nn.functional.cross_entropy(model(env.data.train_x), env.data.train_y)
    grads = dict(zip(params, torch.autograd.grad(ce, list(params.values())), strict=True))
    for k, v in own.items():
        want = v - 0.1 * (grads[k] + 0.4 * (v - cloud[k]))
        assert torch.allclose(out.upload["weights"][k], want, atol=1e-6), k
