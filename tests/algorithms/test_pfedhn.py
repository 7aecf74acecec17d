"""pFedHN: the generated weights, the hypernetwork step of Algorithm 1 on a linear hypernetwork
(phi <- phi + lr (Delta theta) v^T, v_i <- v_i + lr W^T Delta theta), the embeddings that must
not move, what crosses the network, and a short run. Expected values are written with plain
numpy/torch formulas in the test."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from conftest import tiny_config
from pflkit.algorithms.base import nbytes, train_from
from pflkit.algorithms.context import RoundContext, ServerContext
from pflkit.algorithms.pfedhn import generate, hypernet_grads
from pflkit.engine import Simulation
from pflkit.engine.clients import seed_torch
from pflkit.errors import PflkitError
from pflkit.experiment import validate


def test_linear_hypernet_gradient_by_hand():
    # theta = W v + b (no MLP), one target tensor of 3 values, client embedding v = (1, 2)
    W = torch.tensor([[1.0, 0.0], [0.5, -1.0], [2.0, 1.0]])
    b = torch.tensor([0.1, 0.2, 0.3])
    phi = {"mlp": [], "heads": {"t": {"weight": W, "bias": b}}}
    v = torch.tensor([1.0, 2.0])
    delta = {"t": torch.tensor([0.5, -1.0, 2.0])}  # theta~ - theta, uploaded by the client
    g_phi, g_v = hypernet_grads(phi, v, delta, {"t": torch.Size([3])})
    # grad of theta . (-delta): dW = -delta v^T, db = -delta, dv = -W^T delta
    assert torch.allclose(g_phi[0], -torch.tensor([[0.5, 1.0], [-1.0, -2.0], [2.0, 4.0]]))
    assert torch.allclose(g_phi[1], -torch.tensor([0.5, -1.0, 2.0]))
    # W^T delta = (0.5 - 0.5 + 4, 0 + 1 + 2) = (4, 3)
    assert torch.allclose(g_v, -torch.tensor([4.0, 3.0]))


def test_mlp_has_relu_between_its_layers_only():
    # v = 2 -> Linear (1, -1) -> (2, -2) -> ReLU -> (2, 0) -> Linear (-1, -1) -> -2 (no ReLU)
    # -> head 3 x + 1 = -5
    lin = lambda w: {"weight": torch.tensor(w), "bias": torch.zeros(len(w))}  # noqa: E731
    phi = {
        "mlp": [lin([[1.0], [-1.0]]), lin([[-1.0, -1.0]])],
        "heads": {"t": {"weight": torch.tensor([[3.0]]), "bias": torch.tensor([1.0])}},
    }
    theta = generate(phi, torch.tensor([2.0]), {"t": torch.Size([1, 1])})
    assert theta["t"].tolist() == [[-5.0]]


def _linear_server(sim, embed_dim=2, seed=0):
    """A server state whose hypernetwork is linear: theta_k = W_k v + b_k for every tensor."""
    g = torch.Generator().manual_seed(seed)
    shapes = {k: p.shape for k, p in sim.senv.model().named_parameters()}
    heads = {
        k: {
            "weight": torch.randn(math.prod(s), embed_dim, generator=g),
            "bias": torch.randn(math.prod(s), generator=g),
        }
        for k, s in shapes.items()
    }
    phi = {"mlp": [], "heads": heads}
    emb = torch.randn(sim.senv.num_clients, embed_dim, generator=g)
    zeros = {
        "mlp": [],
        "heads": {k: {n: torch.zeros_like(t) for n, t in h.items()} for k, h in heads.items()},
    }
    server = {
        "phi": phi,
        "embeddings": emb,
        "momentum": {"phi": zeros, "embeddings": torch.zeros_like(emb)},
    }
    return server, shapes


def _sim(tiny, **algo):
    return Simulation(tiny(algorithm={"name": "pfedhn", **algo}, train={"rounds": 2}))


def test_payload_is_the_generated_model(tiny):
    sim = _sim(tiny)
    server, shapes = _linear_server(sim)
    payload = sim.algo.configure(sim.senv, server, 1, ServerContext(1, "train"))
    v = server["embeddings"][1].numpy()
    for k, s in shapes.items():
        h = server["phi"]["heads"][k]
        want = (h["weight"].numpy() @ v + h["bias"].numpy()).reshape(tuple(s))
        np.testing.assert_allclose(payload["weights"][k].numpy(), want, rtol=1e-6, atol=1e-6)
    assert list(payload) == ["weights"]  # phi and the embeddings never leave the server
    assert (
        sim.algo.eval_view(sim.senv, server, 1, ServerContext(1))["weights"].keys()
        == payload["weights"].keys()
    )


def _check_plain_step(server, new, delta, v, lr, atol):
    """Each linear head's first momentum step is plain SGD on -Delta: W <- W + lr d v^T and
    b <- b + lr d (d = Delta flattened); returns the embedding's gradient sum_k W_k^T d_k."""
    dv = torch.zeros_like(v)
    for k, h in server["phi"]["heads"].items():
        d = delta[k].reshape(-1)
        want_w = h["weight"] + lr * torch.outer(d, v)
        assert torch.allclose(new["phi"]["heads"][k]["weight"], want_w, atol=atol), k
        assert torch.allclose(new["phi"]["heads"][k]["bias"], h["bias"] + lr * d, atol=atol), k
        dv += h["weight"].T @ d
    return dv


def test_server_step_moves_phi_along_delta_and_only_the_client_embedding(tiny):
    lr, embed_lr = 0.1, 0.2
    sim = _sim(tiny, hn_lr=lr, embed_lr=embed_lr, weight_decay=0.0, grad_clip=None)
    server, shapes = _linear_server(sim)
    g = torch.Generator().manual_seed(1)
    delta = {k: torch.randn(s, generator=g) for k, s in shapes.items()}
    new = sim.algo.aggregate(sim.senv, server, {2: {"delta": delta}}, ServerContext(1, "train"))
    v = server["embeddings"][2]
    dv = _check_plain_step(server, new, delta, v, lr, atol=1e-6)
    assert torch.allclose(new["embeddings"][2], v + embed_lr * dv, atol=1e-5)
    assert not torch.equal(new["embeddings"][2], v)
    for j in (0, 1, 3):  # embeddings of clients not in the round do not move
        assert torch.equal(new["embeddings"][j], server["embeddings"][j])
        assert not new["momentum"]["embeddings"][j].any()
    # the input state is not modified in place
    assert torch.equal(server["embeddings"][2], v)


def test_two_clients_step_in_client_order_with_momentum(tiny):
    lr, mu, wd = 0.1, 0.9, 0.01
    sim = _sim(tiny, hn_lr=lr, momentum=mu, weight_decay=wd, grad_clip=None)
    server, shapes = _linear_server(sim)
    g = torch.Generator().manual_seed(2)
    deltas = {c: {k: torch.randn(s, generator=g) for k, s in shapes.items()} for c in (3, 1)}
    new = sim.algo.aggregate(
        sim.senv, server, {c: {"delta": d} for c, d in deltas.items()}, ServerContext(1, "t")
    )
    k = next(iter(shapes))
    W = server["phi"]["heads"][k]["weight"]
    # both gradients at the round's phi: g_c = -d_c v_c^T; client 1 steps first, then client 3
    g1 = -torch.outer(deltas[1][k].reshape(-1), server["embeddings"][1])
    g3 = -torch.outer(deltas[3][k].reshape(-1), server["embeddings"][3])
    b1 = g1 + wd * W
    W1 = W - lr * b1
    b3 = mu * b1 + g3 + wd * W1
    assert torch.allclose(new["phi"]["heads"][k]["weight"], W1 - lr * b3, atol=1e-6)
    assert torch.allclose(new["momentum"]["phi"]["heads"][k]["weight"], b3, atol=1e-6)
    # each embedding takes one step from its own (zero) momentum buffer
    for c in (1, 3):
        v = server["embeddings"][c]
        gv = -sum(server["phi"]["heads"][q]["weight"].T @ deltas[c][q].reshape(-1) for q in shapes)
        assert torch.allclose(new["embeddings"][c], v - lr * (gv + wd * v), atol=1e-5)


def test_gradient_clipping_scales_phi_and_embedding_together(tiny):
    sim = _sim(tiny, hn_lr=1.0, embed_lr=1.0, weight_decay=0.0, grad_clip=0.5)
    server, shapes = _linear_server(sim)
    delta = {k: torch.ones(s) for k, s in shapes.items()}
    new = sim.algo.aggregate(sim.senv, server, {0: {"delta": delta}}, ServerContext(1, "train"))
    moved = [
        new["phi"]["heads"][k][n] - server["phi"]["heads"][k][n]
        for k in shapes
        for n in ("weight", "bias")
    ]
    moved.append(new["embeddings"][0] - server["embeddings"][0])
    total = math.sqrt(sum(float(m.double().pow(2).sum()) for m in moved))
    assert total == pytest.approx(0.5, rel=1e-4)


def test_client_uploads_the_change_of_its_local_training(tiny):
    sim = _sim(tiny)
    env = sim.envs[0]
    payload = sim.algo.configure(sim.senv, sim.server, 0, ServerContext(1, "train"))
    seed_torch(0, 1, 0, 0)
    upd = sim.algo.client_update(env, payload, {}, RoundContext(1))
    seed_torch(0, 1, 0, 0)
    trained, _ = train_from(
        env, payload["weights"], RoundContext(1)
    )  # FedAvg's local step from theta_i
    assert list(upd.upload) == ["delta"]
    for k, d in upd.upload["delta"].items():
        assert torch.allclose(d, trained[k] - payload["weights"][k], atol=1e-7), k
    assert nbytes(upd.upload) == nbytes(payload) == nbytes(trained)


def test_default_hypernetwork_follows_the_official_sizes(tiny):
    sim = _sim(tiny)
    phi, emb = sim.server["phi"], sim.server["embeddings"]
    assert emb.shape == (4, 2)  # int(1 + 4 / 4)
    assert [tuple(layer["weight"].shape) for layer in phi["mlp"]] == [(100, 2)] + [(100, 100)] * 3
    for k, p in sim.senv.model().named_parameters():
        assert phi["heads"][k]["weight"].shape == (p.numel(), 100)
    bound = 1 / math.sqrt(100)  # nn.Linear's default initialisation range
    assert phi["heads"]["head.weight"]["weight"].abs().max() <= bound
    again = _sim(tiny)  # drawn from the run seed
    assert torch.equal(again.server["embeddings"], emb)


def test_bad_parameters_and_models_are_refused(tiny):
    for algo, match in (
        ({"n_hidden": -1}, "pfedhn.n_hidden"),
        ({"hn_lr": 0}, "pfedhn.hn_lr"),
        ({"momentum": 1.0}, "pfedhn.momentum"),
    ):
        with pytest.raises(PflkitError, match=match) as err:
            _sim(tiny, **algo)
        assert len(str(err.value).splitlines()) == 1
    bn = validate(
        tiny_config(
            data={"dataset": "fashion_mnist", "subset": 200},
            model={"name": "lenet5_bn", "options": {}},
            algorithm={"name": "pfedhn"},
        )
    )
    with pytest.raises(PflkitError, match="pick a model without BatchNorm") as err:
        Simulation(bn)
    assert len(str(err.value).splitlines()) == 1
    het = tiny(
        algorithm={"name": "pfedhn"},
        model={"per_client": [{"name": "mlp", "options": {"hidden": [16]}}, "mlp"]},
    )
    with pytest.raises(PflkitError, match="every client needs the same architecture"):
        Simulation(het)


def test_short_run_trains_only_selected_embeddings_and_learns(tiny):
    cfg = tiny(algorithm={"name": "pfedhn"}, train={"rounds": 5, "client_fraction": 0.5})
    sim = Simulation(cfg)
    model_bytes = nbytes({k: p for k, p in sim.senv.model().state_dict().items()})
    rows = []
    for rnd in range(1, 6):
        before = sim.server["embeddings"].clone()
        row = sim.run_round(rnd)
        rows.append(row)
        sel = row["clients"]
        assert row["bytes_down"] == [model_bytes] * len(sel)  # theta_i
        assert row["bytes_up"] == [model_bytes] * len(sel)  # Delta theta_i
        for j in range(4):
            moved = not torch.equal(sim.server["embeddings"][j], before[j])
            assert moved == (j in sel), (rnd, j)
    assert "global_acc" not in rows[-1]
    # the personalized models h(v_i; phi) learn: round 1 is near chance on 10 classes
    acc = [r["pers_acc_mean"] for r in rows]
    assert acc[0] < 0.15 and acc[-1] > acc[0] + 0.15, acc


def test_unclipped_step_below_the_threshold_by_hand(tiny):
    """grad_clip 50 with a small Delta theta (total gradient norm far below 50): the step is
    the plain one, W <- W + lr Delta v^T, b <- b + lr Delta, v <- v + lr W^T Delta."""
    lr = 0.1
    sim = _sim(tiny, hn_lr=lr, weight_decay=0.0, grad_clip=50.0)
    server, shapes = _linear_server(sim)
    delta = {k: torch.full(s, 1e-3) for k, s in shapes.items()}
    new = sim.algo.aggregate(sim.senv, server, {1: {"delta": delta}}, ServerContext(1, "train"))
    v = server["embeddings"][1]
    dv = _check_plain_step(server, new, delta, v, lr, atol=1e-7)
    assert torch.allclose(new["embeddings"][1], v + lr * dv, atol=1e-6)
    assert float(dv.norm()) < 50  # the threshold is not reached
