"""FedGen (Zhu et al. 2021): the diversity term, the server's count-weighted teacher ensemble
(Eq. 4) and the client's decayed objective (Eq. 5), each against a computation written out
here."""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from conftest import tiny_config
from pflkit.algorithms.context import RoundContext, ServerContext
from pflkit.algorithms.fedgen import FedGen, diversity_loss
from pflkit.data.federated import build_federated
from pflkit.engine import Simulation
from pflkit.experiment import validate
from pflkit.primitives.training import get_weights


def test_diversity_loss_by_hand():
    z = torch.tensor([[0.0, 0.0], [1.0, 1.0]])  # mean squared noise distance 1
    feat = torch.tensor([[0.0], [2.0]])  # mean absolute feature distance 2
    # pairs (0,1) and (1,0): 1 * 2 each; (0,0), (1,1): 0 -> mean over 4 pairs = 1
    assert diversity_loss(z, feat).item() == pytest.approx(math.exp(-1.0))


def simulation(**algo):
    cfg = validate(tiny_config(algorithm={"name": "fedgen", **algo}))
    return Simulation(cfg, build_federated(cfg.data))


def test_generator_step_follows_the_count_weighted_ensemble_of_heads():
    sim = simulation(gen_iters=1, gen_batch=8, eta=0.0)
    algo, senv = sim.algo, sim.senv
    server = algo.server_init(senv)
    w = senv.init_weights()
    head_keys = [k for k in w if k.startswith("head.")]
    # two clients: their heads differ; client 0 holds only class 0, client 1 classes 0 and 1
    w0 = {k: (v + 1.0 if k in head_keys else v) for k, v in w.items()}
    w1 = {k: (v - 1.0 if k in head_keys else v) for k, v in w.items()}
    c0 = torch.zeros(senv.num_classes, dtype=torch.float64)
    c1 = torch.zeros_like(c0)
    c0[0], c1[0], c1[1] = 3.0, 1.0, 4.0
    uploads = {
        0: {"weights": w0, "num_samples": 3, "label_counts": c0},
        1: {"weights": w1, "num_samples": 5, "label_counts": c1},
    }
    gen = algo.generator(senv, server["gen"]).train()
    torch.manual_seed(7)
    new, labels = algo.train_generator(senv, server, uploads, 1)
    assert labels.tolist() == [0, 1]  # the labels some client holds
    # the same draws, the loss written out: alpha_{k,y} = n_{k,y} / sum_k n_{k,y}
    torch.manual_seed(7)
    y = labels[torch.randint(2, (8,))]
    z = torch.randn(8, algo.params.noise_dim)
    feat = gen(z, y)

    def head(weights):
        model = copy.deepcopy(senv.model())  # one model per client: both heads stay in the graph
        model.load_state_dict(weights)
        return model.head(feat)

    share0 = torch.where(y == 0, torch.tensor(0.75), torch.tensor(0.0))  # 3 / (3 + 1), 0 / 4
    share1 = 1 - share0  # 1 / 4 and 4 / 4
    logits = share0[:, None] * head(w0) + share1[:, None] * head(w1)
    F.cross_entropy(logits, y).backward()
    # Adam's first step moves every parameter by lr * g / (|g| + eps): minus lr times its sign
    lr = algo.params.gen_lr
    for name, p in gen.named_parameters():
        if p.grad is None or name.startswith("bn."):
            continue
        step = new["gen"][name] - p.detach()
        big = p.grad.abs() > 1e-6
        assert torch.allclose(step[big], -lr * p.grad[big].sign(), rtol=1e-3, atol=1e-9), name


def test_client_objective_decays_alpha_and_beta_per_round():
    sim = simulation(alpha=2.0, beta=3.0, decay=0.5, gen_batch=4)
    algo, env = sim.algo, sim.envs[0]
    server = algo.server_init(sim.senv)
    payload = {"weights": server["weights"], "gen": server["gen"], "labels": torch.tensor([0, 3])}
    model = env.model()
    model.load_state_dict(server["weights"])
    x, y = env.data.train_x[:5], env.data.train_y[:5]
    torch.manual_seed(3)
    got = algo.local_loss(env, payload, rnd=3)(model, x, y)
    # round 3: alpha_t = 2 * 0.5^2 = 0.5, beta_t = 3 * 0.5^2 = 0.75; same draws as the module
    gen = algo.generator(env, server["gen"]).eval()
    torch.manual_seed(3)
    want, _ = _hand_loss(model, gen, x, y, [0, 3], 4, algo.params.noise_dim, 0.5, 0.75)
    assert got.item() == pytest.approx(want, rel=1e-5)


def test_round_one_is_plain_fedavg_and_the_generator_is_sent_afterwards():
    sim = simulation()
    algo, senv = sim.algo, sim.senv
    server = algo.server_init(senv)
    assert set(algo.configure(senv, server, 0, ServerContext(1, "train"))) == {"weights"}
    trained = {**server, "trained": True}
    assert set(algo.configure(senv, trained, 0, ServerContext(2, "train"))) == {
        "weights",
        "gen",
        "labels",
    }
    assert isinstance(algo, FedGen)


def test_diversity_loss_squares_noise_and_takes_absolute_feature_distances():
    z = torch.tensor([[0.0, 0.0], [2.0, 0.0]])  # mean squared noise distance (4 + 0) / 2 = 2
    feat = torch.tensor([[0.0, 1.0], [3.0, -2.0]])  # mean absolute feature distance (3 + 3) / 2
    # pairs (0,1) and (1,0): 2 * 3 = 6 each, (0,0) and (1,1): 0 -> mean over 4 pairs = 3
    assert diversity_loss(z, feat).item() == pytest.approx(math.exp(-3.0))


def hand_fedgen(**algo):
    """(algorithm, server env, client envs): two clients, softmax regression on 2 features and
    3 classes (the head reads the flattened input); the test labels differ from the train
    labels."""
    from pflkit.algorithms import build_algorithm
    from pflkit.data.federated import ClientData, FederatedDataset
    from pflkit.engine.envs import make_envs

    cfg = validate(
        tiny_config(
            algorithm={"name": "fedgen", **algo},
            model={"name": "mlp", "options": {"hidden": []}},
            train={"batch_size": 1000, "lr": 0.1},
        )
    )
    x = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]])
    clients = [
        ClientData(x, torch.tensor([0, 0, 2]), x, torch.tensor([1, 1, 1])),
        ClientData(x[:2], torch.tensor([1, 1]), x[:2], torch.tensor([2, 2])),
    ]
    data = FederatedDataset(
        name="hand", clients=clients, test_x=x, test_y=torch.tensor([0, 1, 2]), num_classes=3,
        input_shape=(2,), partition_id="hand", train_indices=[np.arange(3), np.arange(2)],
        test_indices=[np.arange(3), np.arange(2)],
    )  # fmt: skip
    senv, cenvs = make_envs(cfg, data)
    return build_algorithm(cfg.algorithm), senv, cenvs


def test_client_round_one_is_a_plain_sgd_step_and_uploads_its_train_label_counts():
    algo, senv, envs = hand_fedgen()
    server = algo.server_init(senv)
    w = {
        "head.weight": torch.tensor([[1.0, -1.0], [0.5, 0.0], [0.0, 2.0]]),
        "head.bias": torch.zeros(3),
    }
    out = algo.client_update(envs[0], {"weights": w}, {}, RoundContext(1))
    x, y = envs[0].data.train_x, torch.tensor([0, 0, 2])
    leaf = {k: v.clone().requires_grad_(True) for k, v in w.items()}
    loss = F.cross_entropy(x @ leaf["head.weight"].T + leaf["head.bias"], y)
    grads = dict(zip(leaf, torch.autograd.grad(loss, list(leaf.values())), strict=True))
    for k in w:
        assert torch.allclose(out.upload["weights"][k], w[k] - 0.1 * grads[k], atol=1e-6), k
    assert out.upload["label_counts"].tolist() == [2.0, 0.0, 1.0]  # of the training labels
    assert out.upload["num_samples"] == 3
    assert set(server) >= {"weights", "gen", "labels"}


def test_server_averages_by_sample_count_and_remembers_the_labels_seen():
    algo, senv, _ = hand_fedgen(gen_iters=0)  # no generator step: only the FedAvg part
    server = {**algo.server_init(senv), "labels": torch.tensor([1])}  # label 1 seen before
    fill = lambda v: {k: torch.full_like(t, v) for k, t in server["weights"].items()}  # noqa: E731
    uploads = {
        0: {"weights": fill(1.0), "num_samples": 1, "label_counts": torch.tensor([1.0, 0, 0])},
        1: {"weights": fill(5.0), "num_samples": 3, "label_counts": torch.tensor([0.0, 0, 3])},
    }
    new = algo.aggregate(senv, server, uploads, ServerContext(2, "train"))
    for k, v in new["weights"].items():
        assert torch.equal(v, torch.full_like(v, (1 * 1 + 3 * 5) / 4)), k
    assert new["labels"].tolist() == [0, 1, 2] and new["trained"]
    assert all(torch.equal(new["gen"][k], server["gen"][k]) for k in server["gen"])
    assert (
        algo.eval_view(senv, new, None, ServerContext(1)).get("weights") is new["weights"]
    )  # the global model is scored
    view = algo.eval_view(senv, new, 0, ServerContext(1))
    assert view["weights"] is new["weights"]  # by everyone: the default personal_model
    payload = algo.configure(senv, new, 0, ServerContext(3, "train"))
    assert payload["labels"] is new["labels"] and payload["gen"] is new["gen"]


def test_teacher_labels_client_draws_from_the_clients_own_training_labels():
    """``teacher_labels: client`` (FL-bench src/client/fedgen.py lines 66-72): y~ uniform over
    the labels of the client's training split ({0, 2} for client 0), whatever the server sent;
    the loss written out with the same draws."""
    algo, senv, envs = hand_fedgen(teacher_labels="client", alpha=2.0, beta=3.0, gen_batch=6)
    env = envs[0]
    server = algo.server_init(senv)
    payload = {"weights": server["weights"], "gen": server["gen"], "labels": torch.tensor([1])}
    model = hand_model(env)
    x, y = env.data.train_x, env.data.train_y
    torch.manual_seed(11)
    got = algo.local_loss(env, payload, rnd=1)(model, x, y)
    gen = algo.generator(env, server["gen"]).eval()
    torch.manual_seed(11)
    want, y_gen = _hand_loss(model, gen, x, y, [0, 2], 6, algo.params.noise_dim, 2.0, 3.0)
    assert got.item() == pytest.approx(want, rel=1e-5)
    assert set(y_gen.tolist()) == {0, 2}  # both of the client's labels drawn, never label 1
    # the server's label set (the default) gives another loss on the same draws
    default, _, _ = hand_fedgen(alpha=2.0, beta=3.0, gen_batch=6)
    torch.manual_seed(11)
    other = default.local_loss(env, payload, rnd=1)(model, x, y)
    assert abs(other.item() - got.item()) > 1e-3


def hand_model(env):
    """The client's softmax regression with a hand-picked head (3 classes, 2 features)."""
    model = env.model()
    model.load_state_dict(
        {
            "head.weight": torch.tensor([[1.0, -1.0], [0.5, 0.0], [0.0, 2.0]]),
            "head.bias": torch.zeros(3),
        }
    )
    return model


@torch.no_grad()
def _hand_loss(model, gen, x, y, labels, n_gen, noise_dim, alpha, beta):
    """FedGen's client loss written out: CE + alpha * CE of the
    head on ``n_gen`` generated features of labels drawn from ``labels`` + beta * KL from the
    generator's target; the draws in the module's order. Returns (loss, the drawn labels)."""
    target = F.softmax(model.head(gen(torch.randn(len(y), noise_dim), y)), 1)
    y_gen = torch.tensor(labels)[torch.randint(len(labels), (n_gen,))]
    feat = gen(torch.randn(n_gen, noise_dim), y_gen)
    logits = model(x)
    ce = F.cross_entropy(logits, y)
    teacher = F.cross_entropy(model.head(feat), y_gen)
    latent = (target * (target.log() - F.log_softmax(logits, 1))).sum(1).mean()
    return (ce + alpha * teacher + beta * latent).item(), y_gen


def test_teacher_server_trains_the_generator_against_the_rounds_starting_head():
    """``teacher: server`` (FL-bench's code): the generator's loss is CE of the head of the
    model the round started from, whatever the clients uploaded."""
    sim = simulation(gen_iters=1, gen_batch=8, eta=0.0, teacher="server")
    algo, senv = sim.algo, sim.senv
    server = algo.server_init(senv)
    w = senv.init_weights()
    server["weights"] = {k: (v * 2.0 if k.startswith("head.") else v) for k, v in w.items()}
    c = torch.zeros(senv.num_classes, dtype=torch.float64)
    c[0], c[1] = 2.0, 2.0
    moved = {k: (v + 5.0 if k.startswith("head.") else v) for k, v in w.items()}  # ignored
    uploads = {0: {"weights": moved, "num_samples": 4, "label_counts": c}}
    gen = algo.generator(senv, server["gen"]).train()
    torch.manual_seed(7)
    new, labels = algo.train_generator(senv, server, uploads, 1)
    torch.manual_seed(7)
    y = labels[torch.randint(2, (8,))]
    feat = gen(torch.randn(8, algo.params.noise_dim), y)
    model = copy.deepcopy(senv.model())
    model.load_state_dict(server["weights"])
    F.cross_entropy(model.head(feat), y).backward()
    lr = algo.params.gen_lr
    for name, p in gen.named_parameters():
        if p.grad is None or name.startswith("bn."):
            continue
        step = new["gen"][name] - p.detach()
        big = p.grad.abs() > 1e-4  # Adam: g / (|g| + 1e-8) is sign(g) within 1e-4
        assert torch.allclose(step[big], -lr * p.grad[big].sign(), rtol=1e-3, atol=1e-9), name


def _one_upload_step(algo, senv, server, uploads, rnd):
    """The generator's first Adam step in round ``rnd`` and its gradient (the module's draws)."""
    gen = algo.generator(senv, server["gen"]).train()
    torch.manual_seed(7)
    new, labels = algo.train_generator(senv, server, uploads, rnd)
    torch.manual_seed(7)
    y = labels[torch.randint(len(labels), (8,))]
    feat = gen(torch.randn(8, algo.params.noise_dim), y)
    model = copy.deepcopy(senv.model())
    model.load_state_dict(server["weights"])
    F.cross_entropy(model.head(feat), y).backward()
    return gen, new


def test_gen_lr_decay_scales_the_generators_adam_step_by_decay_to_the_round_minus_one():
    """``gen_lr_decay`` (FL-bench's ExponentialLR(0.98) stepped after every round): round 3
    trains with gen_lr * 0.5^2; Adam's first step is minus that lr times the gradient's sign."""
    sim = simulation(gen_iters=1, gen_batch=8, eta=0.0, teacher="server", gen_lr_decay=0.5)
    algo, senv = sim.algo, sim.senv
    server = algo.server_init(senv)
    c = torch.zeros(senv.num_classes, dtype=torch.float64)
    c[0], c[1] = 2.0, 2.0
    uploads = {0: {"weights": server["weights"], "num_samples": 4, "label_counts": c}}
    gen, new = _one_upload_step(algo, senv, server, uploads, rnd=3)
    lr = algo.params.gen_lr * 0.25
    moved = 0
    for name, p in gen.named_parameters():
        if p.grad is None or name.startswith("bn."):
            continue
        step = new["gen"][name] - p.detach()
        big = p.grad.abs() > 1e-4
        moved += int(big.sum())
        assert torch.allclose(step[big], -lr * p.grad[big].sign(), rtol=1e-3, atol=1e-9), name
    assert moved > 0


def test_gen_labels_round_keeps_the_labels_whose_mean_count_over_the_round_exceeds_one():
    """``gen_labels: round`` (FL-bench lines 139-143): counts [3, 1, 0] and [0, 1, 0] have
    means 1.5, 1, 0: only label 0 qualifies; ``seen`` keeps 0 and 1 and the earlier label 2."""
    for option, want in (("round", [0]), ("seen", [0, 1, 2])):
        algo, senv, _ = hand_fedgen(gen_iters=0, gen_labels=option)
        server = {**algo.server_init(senv), "labels": torch.tensor([2])}
        uploads = {
            0: {"weights": server["weights"], "num_samples": 4,
                "label_counts": torch.tensor([3.0, 1.0, 0.0])},
            1: {"weights": server["weights"], "num_samples": 1,
                "label_counts": torch.tensor([0.0, 1.0, 0.0])},
        }  # fmt: skip
        _, labels = algo.train_generator(senv, server, uploads, 2)
        assert labels.tolist() == want, option


def test_client_gen_mode_train_normalises_each_generated_batch_and_skips_one_sample_batches():
    """``client_gen_mode: train`` (FL-bench src/client/fedgen.py lines 45, 49): the generator's
    BatchNorm uses each batch's own statistics; the loss written out with the generator in
    train mode; a one-sample batch gives a zero loss with a zero gradient."""
    algo, senv, envs = hand_fedgen(client_gen_mode="train", alpha=2.0, beta=3.0, gen_batch=6)
    env = envs[0]
    server = algo.server_init(senv)
    gen = algo.generator(env, server["gen"])
    with torch.no_grad():  # running statistics far from any batch's: the two modes differ
        gen.bn.running_mean.fill_(5.0)
    payload = {
        "weights": server["weights"],
        "gen": get_weights(gen),
        "labels": torch.tensor([0, 2]),
    }
    model = hand_model(env)
    x, y = env.data.train_x, env.data.train_y
    torch.manual_seed(11)
    got = algo.local_loss(env, payload, rnd=1)(model, x, y)
    torch.manual_seed(11)
    want, _ = _hand_loss(model, gen.train(), x, y, [0, 2], 6, algo.params.noise_dim, 2.0, 3.0)
    assert got.item() == pytest.approx(want, rel=1e-5)
    torch.manual_seed(11)
    frozen, _ = _hand_loss(model, gen.eval(), x, y, [0, 2], 6, algo.params.noise_dim, 2.0, 3.0)
    assert abs(frozen - want) > 1e-3
    one = algo.local_loss(env, payload, rnd=1)(model, x[:1], y[:1])
    one.backward()
    assert one.item() == 0.0 and all(p.grad.abs().max() == 0 for p in model.parameters())
