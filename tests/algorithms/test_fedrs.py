"""FedRS (pflkit.algorithms.fedrs): the client step is SGD on the restricted-softmax loss, by
hand. The restricted softmax itself: blocks/test_rs.py; FedRS on MAP's incomplete-class
federation: test_map.py."""

from __future__ import annotations

import torch

from pflkit.algorithms.context import RoundContext
from pflkit.engine import Simulation
from split_helpers import assert_close, hand_sgd, rs_ce


def test_fedrs_client_step_is_sgd_on_the_rs_loss_by_hand(tiny):
    alpha = 0.3
    cfg = tiny(
        algorithm={"name": "fedrs", "alpha": alpha},
        data={"partition": {"name": "pathological", "classes_per_client": 3}},
    )
    sim = Simulation(cfg)
    env, d, w = sim.envs[0], sim.data.clients[0], sim.server["weights"]
    assert len(d.train_y.unique()) < 10
    torch.manual_seed(2)
    up = sim.algo.client_update(env, {"weights": w}, {}, RoundContext(1)).upload
    torch.manual_seed(2)
    assert_close(up["weights"], hand_sgd(w, d.train_x, d.train_y, rs_ce(d.train_y, alpha), lr=0.05))
