"""Local, FedAvg, FedAvg-FT, FedProx: defining math and end-to-end behaviour.

The ``*_by_hand`` tests recompute a client's local training with :func:`hand_sgd`, mini-batch
SGD written out on the tiny config's MLP (:func:`mlp_logits`) with plain torch ops and autograd,
drawing the batch order as the engine does (one ``torch.randperm(n)`` per epoch after the same
seed), so a wrong loss term, learning rate, epoch count or start model changes the numbers.
(The helpers live in ``split_helpers``.)"""

from __future__ import annotations

import pytest
import torch

from pflkit.algorithms.base import parse_params
from pflkit.algorithms.blocks.training import cross_entropy, get_weights, proximal_loss
from pflkit.algorithms.context import RoundContext
from pflkit.engine import Simulation, run_experiment
from pflkit.errors import PflkitError
from pflkit.experiment import validate
from split_helpers import assert_close, ce, hand_sgd


def test_fedavg_aggregate_is_sample_weighted_mean_of_client_models(tiny):
    sim = Simulation(tiny())
    algo = sim.algo
    uploads = {}
    for env in sim.envs:
        uploads[env.cid] = algo.client_update(
            env, {"weights": sim.server["weights"]}, {}, RoundContext(1)
        ).upload
        assert uploads[env.cid]["num_samples"] == len(sim.data.clients[env.cid].train_y)
    new = algo.aggregate(sim.senv, sim.server, uploads, 1, "train")["weights"]
    n = sum(u["num_samples"] for u in uploads.values())
    for k, v in new.items():
        expect = sum(u["weights"][k] * u["num_samples"] / n for u in uploads.values())
        assert torch.allclose(v, expect, atol=1e-6)


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


def test_local_sends_nothing_and_keeps_private_models(tiny, tmp_path):
    res = run_experiment(tiny(algorithm={"name": "local"}), out=tmp_path / "r")
    assert all(b == 0 for r in res.rows for b in r["bytes_down"] + r["bytes_up"])
    assert "global_acc" not in res.rows[-1]
    sim = Simulation(tiny(algorithm={"name": "local"}))
    w0, w1 = sim.client_state(0)["weights"], sim.client_state(1)["weights"]
    assert any(not torch.equal(w0[k], w1[k]) for k in w0)  # independent initialisations


def test_fedavg_ft_trains_like_fedavg_but_scores_fine_tuned_models(tiny, tmp_path):
    a = run_experiment(tiny(), out=tmp_path / "a")
    b = run_experiment(tiny(algorithm={"name": "fedavg_ft", "ft_epochs": 2}), out=tmp_path / "b")
    # the global model's trajectory is FedAvg's exactly: fine-tuning never feeds back
    assert [r["global_acc"] for r in a.rows] == [r["global_acc"] for r in b.rows]
    assert [r["pers_acc_mean"] for r in a.rows] != [r["pers_acc_mean"] for r in b.rows]
    # and the personal model is the global one after ft_epochs of local SGD
    sim = Simulation(tiny(algorithm={"name": "fedavg_ft", "ft_epochs": 2}))
    pw = sim.algo.personal_weights(
        sim.envs[0], {"weights": sim.server["weights"]}, {}, RoundContext(1)
    )
    assert any(not torch.equal(pw[k], sim.server["weights"][k]) for k in pw)


def test_bad_algorithm_parameters():
    with pytest.raises(PflkitError, match="fedprox.mu"):
        parse_params({"name": "fedprox", "mu": -1})
    with pytest.raises(PflkitError, match="has no parameter 'alpha'; it takes: weighting, mu"):
        parse_params({"name": "fedprox", "alpha": 1})
    with pytest.raises(PflkitError, match="did you mean 'fedavg'"):
        parse_params({"name": "fedavgg"})


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


def test_gradient_hooks_compose_in_order_by_value():
    """One SGD step on loss = 0.5 * w^2 from w = 3 (gradient 3), lr 0.1, by hand: clipping to
    norm 1 gives 1; shifting by 0.5 after it gives 1.5; a proximal pull to 2 with mu 0.4 adds
    0.4 * (3 - 2) = 0.4. Hooks run in the order given."""
    from pflkit.algorithms.blocks.training import clip_grad, local_sgd, proximal_pull, shift_grad

    def run(hooks):
        w = torch.nn.Parameter(torch.tensor([3.0]))
        model = torch.nn.Module()
        model.w = w
        loss = lambda m, x, y: 0.5 * (m.w**2).sum()  # noqa: E731
        local_sgd(model, torch.zeros(1, 1), torch.zeros(1), epochs=1, batch_size=1, lr=0.1,
                  loss_fn=loss, grad_hooks=hooks(w))  # fmt: skip
        return w.item()

    assert run(lambda w: []) == pytest.approx(3 - 0.1 * 3)
    assert run(lambda w: [clip_grad(1.0)]) == pytest.approx(3 - 0.1 * 1)
    shift = torch.tensor([0.5])
    assert run(lambda w: [clip_grad(1.0), shift_grad([(w, shift)])]) == pytest.approx(3 - 0.15)
    assert run(lambda w: [shift_grad([(w, shift)]), clip_grad(1.0)]) == pytest.approx(3 - 0.1)
    anchor = torch.tensor([2.0])
    assert run(lambda w: [proximal_pull([(w, anchor)], 0.4)]) == pytest.approx(3 - 0.1 * 3.4)


def test_parameter_groups_are_named_by_the_model(tiny):
    from pflkit.algorithms.blocks.training import group

    model = Simulation(tiny()).senv.model()
    weights = get_weights(model)
    body, head = group(model, weights, "body"), group(model, weights, "head")
    assert body.keys() | head.keys() == weights.keys() and not body.keys() & head.keys()
    assert head.keys() == {"head.weight", "head.bias"}
    assert [p.shape for p in model.group_params("head")] == [weights["head.weight"].shape,
                                                            weights["head.bias"].shape]  # fmt: skip
    with pytest.raises(ValueError, match="unknown parameter group 'neck'"):
        model.group_keys("neck")


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
    assert sim.algo.personal_weights(env, {}, up.state, RoundContext(1)) is up.state["weights"]


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
    new = sim.algo.aggregate(sim.senv, sim.server, ups, 1, "train")["weights"]
    assert_close(new, {k: 0.25 * w[k] + 0.75 * up["weights"][k] for k in w}, atol=1e-6)


def test_fedavg_ft_scores_the_global_model_fine_tuned_by_hand(tiny):
    """FedAvg-FT's personalized model: the downloaded global model after ft_epochs = 2 epochs
    of SGD at ft_lr = 0.02 (train: 1 epoch at 0.05) on the client's training split."""
    sim = Simulation(tiny(algorithm={"name": "fedavg_ft", "ft_epochs": 2, "ft_lr": 0.02}))
    env, d, w = sim.envs[0], sim.data.clients[0], sim.server["weights"]
    torch.manual_seed(3)
    got = sim.algo.personal_weights(env, {"weights": w}, {}, RoundContext(1))
    torch.manual_seed(3)
    assert_close(got, hand_sgd(w, d.train_x, d.train_y, lr=0.02, epochs=2))


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
