"""FedAvg-FT: trains like FedAvg, scores fine-tuned models (the ``*_by_hand`` tests use
``split_helpers.hand_sgd``)."""

from __future__ import annotations

import torch

from pflkit.algorithms.context import RoundContext
from pflkit.engine import Simulation, run_experiment
from pflkit.testing import personal_weights
from split_helpers import assert_close, hand_sgd


def test_fedavg_ft_trains_like_fedavg_but_scores_fine_tuned_models(tiny, tmp_path):
    a = run_experiment(tiny(), out=tmp_path / "a")
    b = run_experiment(tiny(algorithm={"name": "fedavg_ft", "ft_epochs": 2}), out=tmp_path / "b")
    # the global model's trajectory is FedAvg's exactly: fine-tuning never feeds back
    assert [r["global_acc"] for r in a.rows] == [r["global_acc"] for r in b.rows]
    assert [r["pers_acc_mean"] for r in a.rows] != [r["pers_acc_mean"] for r in b.rows]
    # and the personal model is the global one after ft_epochs of local SGD
    sim = Simulation(tiny(algorithm={"name": "fedavg_ft", "ft_epochs": 2}))
    pw = personal_weights(
        sim.algo, sim.envs[0], {"weights": sim.server["weights"]}, {}, RoundContext(1)
    )
    assert any(not torch.equal(pw[k], sim.server["weights"][k]) for k in pw)


def test_fedavg_ft_scores_the_global_model_fine_tuned_by_hand(tiny):
    """FedAvg-FT's personalized model: the downloaded global model after ft_epochs = 2 epochs
    of SGD at ft_lr = 0.02 (train: 1 epoch at 0.05) on the client's training split."""
    sim = Simulation(tiny(algorithm={"name": "fedavg_ft", "ft_epochs": 2, "ft_lr": 0.02}))
    env, d, w = sim.envs[0], sim.data.clients[0], sim.server["weights"]
    torch.manual_seed(3)
    got = personal_weights(sim.algo, env, {"weights": w}, {}, RoundContext(1))
    torch.manual_seed(3)
    assert_close(got, hand_sgd(w, d.train_x, d.train_y, lr=0.02, epochs=2))
