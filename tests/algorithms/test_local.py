"""Local: no communication, private models, the client step by hand (the ``*_by_hand``
tests use ``split_helpers.hand_sgd``)."""

from __future__ import annotations

import torch

from pflkit.algorithms import build_algorithm
from pflkit.algorithms.context import RoundContext, ServerContext
from pflkit.engine import Simulation, run_experiment
from pflkit.testing import personal_weights, round_ctx, same_weights, toy_envs
from split_helpers import assert_close, hand_sgd


def test_local_sends_nothing_and_keeps_private_models(tiny, tmp_path):
    res = run_experiment(tiny(algorithm={"name": "local"}), out=tmp_path / "r")
    assert all(b == 0 for r in res.rows for b in r["bytes_down"] + r["bytes_up"])
    assert "global_acc" not in res.rows[-1]
    sim = Simulation(tiny(algorithm={"name": "local"}))
    w0, w1 = sim.client_state(0)["weights"], sim.client_state(1)["weights"]
    assert any(not torch.equal(w0[k], w1[k]) for k in w0)  # independent initialisations


# -- client steps by hand --------------------------------------------------------------------------
def test_local_client_step_trains_its_own_model_by_hand(tiny):
    """Local: E = 2 epochs of SGD from the client's own stored model; nothing is uploaded and
    the trained model is kept and scored."""
    sim = Simulation(tiny(algorithm={"name": "local"}, train={"local_epochs": 2}))
    env, d = sim.envs[1], sim.data.clients[1]
    w0 = sim.client_state(1)["weights"]
    torch.manual_seed(7)
    up = sim.algo.client_update(env, {}, {"weights": w0}, RoundContext(3))
    torch.manual_seed(7)
    want = hand_sgd(w0, d.train_x, d.train_y, lr=0.05, epochs=2)
    assert up.upload == {}
    assert_close(up.state["weights"], want)
    assert same_weights(
        personal_weights(sim.algo, env, {}, up.state, RoundContext(1)), up.state["weights"]
    )


# -- private state on two toy clients, no config (pflkit.testing) -----------------------------------
def test_local_trains_its_own_state_and_sends_nothing_on_toy_clients():
    """Client 0 (x = 2, y = 0) starts from zero weights in its state, whatever the server
    holds: one full-batch step at lr 0.1 of softmax regression gives head.weight [[0.1],
    [-0.1]] and head.bias [0.05, -0.05] (p = 1/2 at zero logits). Nothing is uploaded, the
    server state does not change, and client 1's state is not touched."""
    a = (torch.tensor([[2.0]]), torch.tensor([0]))
    b = (torch.tensor([[1.0], [-1.0]]), torch.tensor([1, 0]))
    server_env, (c0, c1) = toy_envs([a, b], num_classes=2)
    algo = build_algorithm({"name": "local"})
    server = algo.server_init(server_env)
    zero = {k: torch.zeros_like(v) for k, v in c0.init_weights().items()}
    states = {0: {"weights": zero}, 1: algo.client_init(c1)}
    before = {k: v.clone() for k, v in states[1]["weights"].items()}

    payload = algo.configure(server_env, server, 0, ServerContext(1, "train"))
    update = algo.client_update(c0, payload, states[0], round_ctx(c0))
    assert payload == {} and update.upload == {}
    mine = update.state["weights"]
    assert torch.allclose(mine["head.weight"], torch.tensor([[0.1], [-0.1]]))
    assert torch.allclose(mine["head.bias"], torch.tensor([0.05, -0.05]))
    assert (
        algo.aggregate(server_env, server, {0: update.upload}, ServerContext(1, "train")) == server
    )
    assert same_weights(
        personal_weights(algo, c0, {}, update.state, round_ctx(c0, phase="evaluate")), mine
    )
    assert all(torch.equal(states[1]["weights"][k], before[k]) for k in before)
    assert not any(v.any() for v in zero.values())  # the old state was not trained in place
