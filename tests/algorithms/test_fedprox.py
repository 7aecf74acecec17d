"""FedProx: the proximal term by value, mu = 0 is FedAvg, the client step by hand (the
``*_by_hand`` tests use ``split_helpers.hand_sgd``)."""

from __future__ import annotations

import pytest
import torch

from pflkit.algorithms import build_algorithm
from pflkit.algorithms.base import parse_params
from pflkit.algorithms.context import RoundContext
from pflkit.engine import Simulation, run_experiment
from pflkit.errors import PflkitError
from pflkit.primitives.training import cross_entropy, get_weights, proximal_loss
from pflkit.testing import round_ctx, toy_envs
from split_helpers import assert_close, ce, hand_sgd


def test_fedprox_loss_adds_exact_proximal_term():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 2))
    ref = {k: v + 0.5 for k, v in get_weights(model).items()}
    x, y = torch.randn(4, 3), torch.tensor([0, 1, 1, 0])
    mu = 0.3
    got = proximal_loss(ref, mu)(model, x, y)
    dist = sum(((p - ref[k]) ** 2).sum() for k, p in model.named_parameters())
    assert torch.allclose(got, cross_entropy(model, x, y) + mu / 2 * dist)
    # its gradient adds mu * (w - w_global): here every entry is -0.5 * mu
    got.backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    cross_entropy(model, x, y).backward()
    for g, p in zip(grads, model.parameters(), strict=True):
        assert torch.allclose(g - p.grad, torch.full_like(g, -0.5 * mu))


def test_fedprox_with_mu_zero_equals_fedavg(tiny, tmp_path):
    a = run_experiment(tiny(), out=tmp_path / "a")
    b = run_experiment(tiny(algorithm={"name": "fedprox", "mu": 0.0}), out=tmp_path / "b")
    assert [r["pers_acc_mean"] for r in a.rows] == [r["pers_acc_mean"] for r in b.rows]
    c = run_experiment(tiny(algorithm={"name": "fedprox", "mu": 1.0}), out=tmp_path / "c")
    assert [r["global_acc"] for r in a.rows] != [r["global_acc"] for r in c.rows]


def test_bad_algorithm_parameters():
    with pytest.raises(PflkitError, match="fedprox.mu"):
        parse_params({"name": "fedprox", "mu": -1})
    with pytest.raises(PflkitError, match="has no parameter 'alpha'; it takes: weighting, mu"):
        parse_params({"name": "fedprox", "alpha": 1})
    with pytest.raises(PflkitError, match="did you mean 'fedavg'"):
        parse_params({"name": "fedavgg"})


def test_fedprox_client_step_by_hand(tiny):
    """FedProx: SGD on h_k(w) = CE(w) + (mu / 2) ||w - w_t||^2 from the download w_t."""
    mu = 0.5
    sim = Simulation(tiny(algorithm={"name": "fedprox", "mu": mu}))
    env, d = sim.envs[1], sim.data.clients[1]
    torch.manual_seed(0)
    w_t = {k: v + 0.2 * torch.randn_like(v) for k, v in sim.server["weights"].items()}

    def h(w, x, y):
        return ce(w, x, y) + mu / 2 * sum(((w[k] - w_t[k]) ** 2).sum() for k in w)

    torch.manual_seed(4)
    up = sim.algo.client_update(env, {"weights": w_t}, {}, RoundContext(1)).upload
    torch.manual_seed(4)
    assert_close(up["weights"], hand_sgd(w_t, d.train_x, d.train_y, h, lr=0.05))


# -- the proximal term on a toy client, no config (pflkit.testing) ----------------------------------
def test_proximal_term_adds_mu_times_the_distance_to_the_global_model_on_a_toy_client():
    """Two full-batch steps from the global model g at lr 0.1: the first has no proximal
    gradient (w = g), so both algorithms reach the same w1; the second adds mu (w1 - g) to the
    gradient, so FedProx ends exactly 0.1 * mu * (w1 - g) away from FedAvg."""
    mu, lr = 0.5, 0.1
    _, (env,) = toy_envs(num_clients=1, samples=6, train={"lr": lr, "local_epochs": 2})
    g = {k: torch.randn_like(v) for k, v in env.init_weights().items()}
    _, (one_epoch,) = toy_envs(num_clients=1, samples=6, train={"lr": lr, "local_epochs": 1})

    def trained(algo: dict, e) -> dict:
        return build_algorithm(algo).client_update(e, {"weights": g}, {}, round_ctx(e)).upload

    w1 = trained({"name": "fedavg"}, one_epoch)["weights"]
    fedavg = trained({"name": "fedavg"}, env)["weights"]
    fedprox = trained({"name": "fedprox", "mu": mu}, env)
    assert fedprox["num_samples"] == 6
    assert_close(fedprox["weights"], {k: fedavg[k] - lr * mu * (w1[k] - g[k]) for k in g}, 1e-6)
    assert any((w1[k] - g[k]).abs().max() > 1e-3 for k in g)  # the term is not zero here
