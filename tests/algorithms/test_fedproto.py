"""FedProto (the prototype core pFedPM builds on): per-class prototypes (Eq. 6), the server's
weighted / uniform prototype mean (Eq. 7, spec §2.1), both regulariser forms, round 1, the
upload's exact bytes, nearest-prototype inference, heterogeneous models. Expected values are
written by hand or computed with plain torch formulas in the test."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from conftest import tiny_config
from pflkit.algorithms import parse_params
from pflkit.algorithms.base import nbytes
from pflkit.algorithms.context import RoundContext, ServerContext
from pflkit.algorithms.fedproto import (
    FedProto,
    RunningMeans,
    class_prototypes,
    eval_features,
    proto_reg,
    prototype_loss,
)
from pflkit.data.federated import ClientData, FederatedDataset
from pflkit.engine import Simulation
from pflkit.errors import PflkitError
from pflkit.experiment import validate
from pflkit.models import PFLModel
from pflkit.primitives.training import cross_entropy, get_weights, set_weights

pytestmark = pytest.mark.usefixtures("one_thread")


def algo(**params) -> FedProto:
    cls, p = parse_params({"name": "fedproto", **params})
    return cls(p)


def sim_of(algorithm: dict, rounds: int = 3, **sections) -> Simulation:
    train = {"rounds": rounds, "batch_size": 16, "lr": 0.05, "local_epochs": 1}
    return Simulation(validate(tiny_config(algorithm=algorithm, train=train, **sections)))


# -- prototypes and the server mean ----------------------------------------------------------------


def test_prototypes_are_per_class_means():
    h = torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0], [0.0, 1.0], [2.0, 2.0]])
    y = torch.tensor([0, 2, 0, 2, 2])
    classes, protos, counts = class_prototypes(h, y, 4)
    assert classes.tolist() == [0, 2] and counts.tolist() == [2, 3]
    # class 0: ([1,2] + [5,6]) / 2; class 2: ([3,4] + [0,1] + [2,2]) / 3
    assert torch.allclose(protos, torch.tensor([[3.0, 4.0], [5 / 3, 7 / 3]]))


UPLOADS = {
    0: {
        "classes": torch.tensor([0, 1]),
        "protos": torch.tensor([[1.0, 0.0], [0.0, 2.0]]),
        "counts": torch.tensor([1, 3]),
    },
    5: {
        "classes": torch.tensor([1]),
        "protos": torch.tensor([[4.0, 2.0]]),
        "counts": torch.tensor([1]),
    },
    7: {
        "classes": torch.tensor([0, 2]),
        "protos": torch.tensor([[3.0, 3.0], [5.0, 5.0]]),
        "counts": torch.tensor([3, 2]),
    },
}
SENV = SimpleNamespace(num_classes=4)


def test_server_weighted_mean_by_hand():
    server = algo(proto_agg="weighted").aggregate(SENV, {}, UPLOADS, ServerContext(1, "train"))
    assert server["classes"].tolist() == [0, 1, 2]
    # class 0: (1*[1,0] + 3*[3,3]) / 4; class 1: (3*[0,2] + 1*[4,2]) / 4; class 2: [5,5]
    expected = torch.tensor([[2.5, 2.25], [1.0, 2.0], [5.0, 5.0]])
    assert torch.allclose(server["protos"], expected)


def test_server_uniform_mean_by_hand():
    server = algo(proto_agg="uniform").aggregate(SENV, {}, UPLOADS, ServerContext(1, "train"))
    # plain means over the clients holding the class: never both normalisations
    expected = torch.tensor([[2.0, 1.5], [2.0, 2.0], [5.0, 5.0]])
    assert torch.allclose(server["protos"], expected)


def test_server_keeps_classes_nobody_uploaded_this_round():
    a = algo()
    server = a.aggregate(SENV, {}, UPLOADS, ServerContext(1, "train"))
    server = a.aggregate(SENV, server, {5: UPLOADS[5]}, ServerContext(2, "train"))
    assert server["classes"].tolist() == [0, 1, 2]
    assert torch.allclose(server["protos"], torch.tensor([[2.5, 2.25], [4.0, 2.0], [5.0, 5.0]]))
    payload = a.configure(SENV, server, 3, ServerContext(3, "train"))
    assert set(payload) == {"classes", "protos"}
    assert a.configure(SENV, {}, 3, ServerContext(1, "train")) == {}  # round 1: nothing to send


# -- the regulariser -------------------------------------------------------------------------------

H = torch.tensor([[1.0, 2.0], [3.0, 0.0], [0.0, 0.0], [2.0, 2.0]])
Y = torch.tensor([0, 0, 1, 2])
TARGETS = torch.tensor([[1.0, 1.0], [3.0, 4.0], [9.0, 9.0]])
HAS = torch.tensor([True, True, False])  # class 2 has no global prototype


def test_class_mean_l2_by_hand_and_its_gradient():
    h = H.clone().requires_grad_(True)
    value = proto_reg(h, Y, TARGETS, HAS, "class_mean_l2")
    # class 0: mean [2,1], ||[2,1]-[1,1]|| = 1; class 1: ||[0,0]-[3,4]|| = 5; class 2: none
    assert float(value.detach()) == pytest.approx(6.0)
    value.backward()
    # d/dh_s = (mean - t) / ||mean - t|| / n_class for the samples of the class
    expected = torch.tensor([[0.5, 0.0], [0.5, 0.0], [-0.6, -0.8], [0.0, 0.0]])
    assert torch.allclose(h.grad, expected)


def test_sample_mse_by_hand():
    # per sample ||h - t||^2: 1, 5, 25 and 0 (no prototype, still counted): / (B d) = 31 / 8
    assert float(proto_reg(H, Y, TARGETS, HAS, "sample_mse")) == pytest.approx(31 / 8)


def test_local_loss_is_ce_plus_lambda_reg_and_just_ce_in_round_one():
    model = PFLModel(nn.Identity(), nn.Linear(2, 3), 2)
    with torch.no_grad():
        model.head.weight.copy_(torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, -1.0]]))
        model.head.bias.zero_()
    ce = F.cross_entropy(H @ model.head.weight.T, Y)
    loss = prototype_loss(TARGETS, HAS, 2.5, "class_mean_l2")(model, H, Y)
    assert float(loss.detach()) == pytest.approx(float(ce.detach()) + 2.5 * 6.0)
    none = torch.zeros(3, dtype=torch.bool)  # round 1: no global prototype at all
    plain = prototype_loss(TARGETS, none, 2.5, "class_mean_l2")(model, H, Y)
    assert float(plain.detach()) == float(ce.detach())


def test_running_prototypes_restart_each_epoch():
    run = RunningMeans(3, 2, torch.device("cpu"), epoch_steps=2)
    run.add(torch.tensor([[9.0, 9.0]]), torch.tensor([0]))  # epoch 1
    run.add(torch.tensor([[9.0, 9.0]]), torch.tensor([1]))
    run.add(torch.tensor([[1.0, 2.0], [3.0, 2.0]]), torch.tensor([0, 0]))  # epoch 2
    run.add(torch.tensor([[4.0, 4.0]]), torch.tensor([2]))
    classes, protos = run.prototypes()
    assert classes.tolist() == [0, 2]
    assert torch.allclose(protos, torch.tensor([[2.0, 2.0], [4.0, 4.0]]))


# -- the client step -------------------------------------------------------------------------------


def test_round_one_is_plain_cross_entropy_and_upload_is_exactly_the_prototypes():
    sim = sim_of({"name": "fedproto"})
    a, env = sim.algo, sim.envs[0]
    state = a.client_init(env)
    torch.manual_seed(3)
    upload, new_state, _ = a.client_update(env, {}, state, RoundContext(1))
    # the same training with the plain cross-entropy from the same seed
    model = env.model()
    set_weights(model, state["weights"])
    torch.manual_seed(3)
    env.train(model, RoundContext(1), loss_fn=cross_entropy)
    for k, v in get_weights(model).items():
        assert torch.equal(new_state["weights"][k], v), k
    # Eq. 6 post hoc: per-class means of the eval-mode features of the whole training split
    h, y = eval_features(model, env.data.train_x), env.data.train_y
    classes = sorted(set(y.tolist()))
    assert upload["classes"].tolist() == classes
    for i, c in enumerate(classes):
        assert torch.allclose(upload["protos"][i], h[y == c].mean(0), atol=1e-6)
        assert int(upload["counts"][i]) == int((y == c).sum())
    n, d = len(classes), model.feature_dim
    assert set(upload) == {"classes", "protos", "counts"}
    assert (
        nbytes(upload) == n * d * 4 + upload["classes"].numel() * 8 + upload["counts"].numel() * 8
    )
    assert nbytes(upload) == n * (d * 4 + 16)
    # uniform aggregation needs no counts: they are not sent
    uni = algo(proto_agg="uniform")
    torch.manual_seed(3)
    up2, _, _ = uni.client_update(env, {}, state, RoundContext(1))
    assert set(up2) == {"classes", "protos"} and nbytes(up2) == n * (d * 4 + 8)


def test_prototype_inference_uses_the_global_prototypes():
    sim = sim_of({"name": "fedproto", "inference": "prototype"})
    a, env = sim.algo, sim.envs[1]
    state = a.client_init(env)
    model = env.model()
    set_weights(model, state["weights"])
    h = eval_features(model, env.data.test_x)
    d = model.feature_dim
    g = torch.Generator().manual_seed(0)
    glob = {"classes": torch.tensor([2, 5, 7]), "protos": torch.randn(3, d, generator=g) * 3}
    # the client's own last prototypes, deliberately different: they must not be used
    state["protos"] = {"classes": torch.tensor([0, 1]), "protos": torch.randn(2, d, generator=g)}
    server = {**glob}
    view = a.eval_view(sim.senv, server, 1, ServerContext(1))
    scorer = a.personal_model(env, view, state, RoundContext(1))
    scorer.eval()
    with torch.no_grad():
        pred = scorer(env.data.test_x).argmax(1)
    dist = ((h[:, None, :] - glob["protos"][None]) ** 2).sum(-1)
    assert torch.equal(pred, glob["classes"][dist.argmin(1)])
    # restricted to the client's training classes: those without a global prototype drop out
    local = set(env.data.train_y.tolist())
    r = algo(inference="prototype", restrict_to_local_classes=True)
    with torch.no_grad():
        out = r.personal_model(env, view, state, RoundContext(1))(env.data.test_x)
    allowed = [c for c in (2, 5, 7) if c in local]
    assert set(out.argmax(1).tolist()) <= set(allowed)
    assert torch.isinf(out[:, [c for c in range(10) if c not in allowed]]).all()


def test_head_inference_is_the_clients_model():
    sim = sim_of({"name": "fedproto"})
    a, env = sim.algo, sim.envs[0]
    state = a.client_init(env)
    assert (
        a.eval_view(
            sim.senv,
            {"classes": torch.tensor([0]), "protos": torch.ones(1, 32)},
            0,
            ServerContext(1),
        )
        == {}
    )
    scorer = a.personal_model(env, {}, state, RoundContext(1))
    assert isinstance(scorer, PFLModel)
    assert a.eval_view(sim.senv, sim.server, None, ServerContext(1)).get("weights") is None


# -- bad input, heterogeneous models ---------------------------------------------------------------


def test_bad_parameter_and_mismatched_feature_dims_are_refused():
    with pytest.raises(PflkitError, match="reg"):
        parse_params({"name": "fedproto", "reg": "l1"})
    mixed = {
        "name": "mlp",
        "options": {"hidden": [32]},
        "per_client": [
            {"name": "mlp", "options": {"hidden": [32]}},
            {"name": "mlp", "options": {"hidden": [16]}},
        ],
    }
    with pytest.raises(PflkitError, match="feature_dim"):
        sim_of({"name": "fedproto"}, model=mixed)


def synthetic_images(clients: int = 3, per_client: int = 24, side: int = 16) -> FederatedDataset:
    """A tiny 4-class image task (class-dependent brightness pattern) for the CNN test."""
    g = torch.Generator().manual_seed(0)
    out = []
    for c in range(clients):
        y = torch.tensor([(c + i) % 4 for i in range(per_client)])
        x = torch.randn(per_client, 1, side, side, generator=g) * 0.3
        x[:, 0, :4, :4] += y.view(-1, 1, 1).float()
        out.append(ClientData(x, y, x[:8].clone(), y[:8].clone()))
    test_x = torch.cat([c.test_x for c in out])
    test_y = torch.cat([c.test_y for c in out])
    idx = [torch.arange(per_client).numpy() for _ in range(clients)]
    return FederatedDataset("synthetic16", out, test_x, test_y, 4, (1, side, side), "s", idx, idx)


def test_heterogeneous_fedproto_cnn_clients_run():
    model = {
        "name": "fedproto_cnn",
        "options": {},
        "per_client": [
            {"name": "fedproto_cnn", "options": {"channels": 18}},
            {"name": "fedproto_cnn", "options": {"channels": 20}},
        ],
    }
    cfg = validate(tiny_config(model=model, algorithm={"name": "fedproto"}, train={"rounds": 2}))
    sim = Simulation(cfg, data=synthetic_images())
    assert len(set(sim.senv.archs)) == 2
    for r in (1, 2):
        row = sim.run_round(r)
    assert row["bytes_up"][0] > 0 and sim.server["protos"].shape == (4, 50)
    # the two architectures keep their own (differently shaped) private models
    conv = [sim.clients[c]["weights"]["body.conv2.weight"].shape[0] for c in range(3)]
    assert conv == [18, 20, 18]


# -- end to end ------------------------------------------------------------------------------------


def spread(sim: Simulation) -> float:
    """Mean distance of every client's last uploaded prototype to the global one, relative to
    the global prototype's norm."""
    glob = dict(zip(sim.server["classes"].tolist(), sim.server["protos"], strict=True))
    ratios = []
    for state in sim.clients.values():
        for c, p in zip(
            state["protos"]["classes"].tolist(), state["protos"]["protos"], strict=True
        ):
            ratios.append(float((p - glob[c]).norm() / glob[c].norm()))
    return sum(ratios) / len(ratios)


def test_end_to_end_the_regulariser_pulls_clients_prototypes_together():
    runs = {}
    for lam in (0.0, 0.2):  # the paper's class-mean L2 (lam = 1 overpowers CE on this tiny MLP)
        sim = sim_of({"name": "fedproto", "lam": lam}, rounds=4)
        rows = [sim.run_round(r) for r in range(1, 5)]
        runs[lam] = (spread(sim), rows)
    assert runs[0.2][0] < 0.6 * runs[0.0][0]  # measured: 0.21 vs 0.40
    rows = runs[0.2][1]
    assert "global_acc" not in rows[-1]  # no global model
    # bytes up: each client's n_i * (d * 4 + 8 + 8) exactly
    sim = sim_of({"name": "fedproto"}, rounds=1)
    row = sim.run_round(1)
    for cid, b in zip(row["clients"], row["bytes_up"], strict=True):
        n = len(set(sim.envs[cid].data.train_y.tolist()))
        assert b == n * (32 * 4 + 16)
    assert row["bytes_down"] == [0] * len(row["clients"])  # nothing to download in round 1
