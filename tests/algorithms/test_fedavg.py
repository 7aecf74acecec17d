"""FedAvg: defining math and end-to-end behaviour.

The ``*_by_hand`` tests recompute a client's local training with :func:`hand_sgd`, mini-batch
SGD written out on the tiny config's MLP (:func:`mlp_logits`) with plain torch ops and autograd,
drawing the batch order as the engine does (one ``torch.randperm(n)`` per epoch after the same
seed), so a wrong loss term, learning rate, epoch count or start model changes the numbers.
(The helpers live in ``split_helpers``.) The ``*_on_toy_clients`` tests need no config:
:mod:`pflkit.testing` builds two clients from tensors written here."""

from __future__ import annotations

import torch

from pflkit.algorithms import build_algorithm
from pflkit.algorithms.context import RoundContext, ServerContext
from pflkit.engine import Simulation, run_experiment
from pflkit.experiment import validate
from pflkit.testing import round_ctx, toy_envs
from split_helpers import assert_close, hand_sgd


def test_fedavg_aggregate_is_sample_weighted_mean_of_client_models(tiny):
    sim = Simulation(tiny())
    algo = sim.algo
    uploads = {}
    for env in sim.envs:
        uploads[env.cid] = algo.client_update(
            env, {"weights": sim.server["weights"]}, {}, RoundContext(1)
        ).upload
        assert uploads[env.cid]["num_samples"] == len(sim.data.clients[env.cid].train_y)
    new = algo.aggregate(sim.senv, sim.server, uploads, ServerContext(1, "train"))["weights"]
    n = sum(u["num_samples"] for u in uploads.values())
    for k, v in new.items():
        expect = sum(u["weights"][k] * u["num_samples"] / n for u in uploads.values())
        assert torch.allclose(v, expect, atol=1e-6)


def test_fedavg_on_real_fashion_mnist_learns(tmp_path):
    """End to end on the real Fashion-MNIST (Debian package), a 6,000-image subset."""
    cfg = validate(
        {
            "name": "fmnist-e2e",
            "data": {
                "dataset": "fashion_mnist",
                "subset": 6000,
                "num_clients": 10,
                "partition": {"name": "dirichlet", "alpha": 1.0},
                "test_fraction": 0.25,
            },
            "model": {"name": "mlp", "options": {"hidden": [128]}},
            "algorithm": {"name": "fedavg"},
            "train": {"rounds": 5, "batch_size": 32, "lr": 0.05},
            "output": {"progress": False},
        }
    )
    res = run_experiment(cfg, out=tmp_path / "r")
    final = res.summary["final"]
    assert final["global_acc"] > 0.70  # chance is 0.10
    assert final["pers_acc_mean"] > 0.70


def test_fedavg_client_step_is_e_epochs_of_minibatch_sgd_by_hand(tiny):
    sim = Simulation(tiny(train={"local_epochs": 2}))
    env, d, w = sim.envs[2], sim.data.clients[2], sim.server["weights"]
    torch.manual_seed(5)
    up = sim.algo.client_update(env, {"weights": w}, {}, RoundContext(1)).upload
    torch.manual_seed(5)
    assert_close(up["weights"], hand_sgd(w, d.train_x, d.train_y, lr=0.05, epochs=2))
    assert up["num_samples"] == len(d.train_y)
    # the server: sum_k (n_k / n) w_k over the uploads, n_k = 1 and 3 here
    ups = {0: {"weights": w, "num_samples": 1}, 3: {"weights": up["weights"], "num_samples": 3}}
    new = sim.algo.aggregate(sim.senv, sim.server, ups, ServerContext(1, "train"))["weights"]
    assert_close(new, {k: 0.25 * w[k] + 0.75 * up["weights"][k] for k in w}, atol=1e-6)


# -- one round on two toy clients, no config (pflkit.testing) ---------------------------------------
def test_one_round_on_toy_clients_is_the_sample_weighted_mean_of_one_sgd_step_by_hand():
    """Softmax regression on 1-d inputs, two classes, weights starting at zero (logits 0, so
    p = 1/2 for both classes): one full-batch step at lr 0.1 gives head.weight row c
    -0.1 * mean_i (1/2 - [y_i = c]) x_i and head.bias -0.1 * mean_i (1/2 - [y_i = c]).
    Client 0 (1 sample): x = 2, y = 0. Client 1 (3 samples): x = 1, -1, 4, y = 1, 1, 0."""
    a = (torch.tensor([[2.0]]), torch.tensor([0]))
    b = (torch.tensor([[1.0], [-1.0], [4.0]]), torch.tensor([1, 1, 0]))
    server_env, clients = toy_envs([a, b], num_classes=2)
    algo = build_algorithm({"name": "fedavg"})
    server = {"weights": {k: torch.zeros_like(v) for k, v in server_env.init_weights().items()}}
    uploads = {}
    for env in clients:
        payload = algo.configure(server_env, server, env.cid, ServerContext(1, "train"))
        uploads[env.cid] = algo.client_update(env, payload, {}, round_ctx(env)).upload
    new = algo.aggregate(server_env, server, uploads, ServerContext(1, "train"))["weights"]

    # client 0: class 0 row: -0.1 * (1/2 - 1) * 2 = 0.1; class 1 row: -0.1 * (1/2) * 2 = -0.1
    w0, b0 = torch.tensor([[0.1], [-0.1]]), torch.tensor([0.05, -0.05])
    # client 1: class 0 row: -0.1 * ((1/2)(1) + (1/2)(-1) + (1/2 - 1)(4)) / 3 = 0.2 / 3
    w1, b1 = torch.tensor([[0.2 / 3], [-0.2 / 3]]), torch.tensor([-0.05 / 3, 0.05 / 3])
    assert uploads[0]["num_samples"] == 1 and uploads[1]["num_samples"] == 3
    assert torch.allclose(uploads[0]["weights"]["head.weight"], w0)
    assert torch.allclose(uploads[1]["weights"]["head.bias"], b1)
    # the server: (1 * client 0 + 3 * client 1) / 4
    assert torch.allclose(new["head.weight"], (1 * w0 + 3 * w1) / 4)
    assert torch.allclose(new["head.bias"], (1 * b0 + 3 * b1) / 4)
