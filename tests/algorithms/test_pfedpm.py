"""pFedPM: the mixed anchors (Eq. 8, fixed during training), a = 0 = FedProto, the relation
module's one-hot targets and squared-error loss (Eq. 13), relation inference over the anchored
classes, the relation step leaving the extractor alone, training independent of the inference
mode, heterogeneous models. Expected values are written by hand or computed with plain torch
formulas in the test."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from test_fedproto import synthetic_images
from torch import nn

from conftest import tiny_config
from pflkit.algorithms import parse_params
from pflkit.algorithms.context import RoundContext, ServerContext
from pflkit.algorithms.pfedpm import (
    RelationClassifier,
    RelationModule,
    mixed_anchors,
    relation_loss,
    relation_scores,
    relation_targets,
)
from pflkit.engine import Simulation
from pflkit.errors import PflkitError
from pflkit.experiment import validate
from pflkit.models import PFLModel

pytestmark = pytest.mark.usefixtures("one_thread")


def make(name: str = "pfedpm", **params):
    cls, p = parse_params({"name": name, **params})
    return cls(p)


def sim_of(
    algorithm: dict, rounds: int = 3, momentum: float = 0.0, batch_size: int = 16, **sections
) -> Simulation:
    train = {
        "rounds": rounds,
        "batch_size": batch_size,
        "lr": 0.05,
        "local_epochs": 1,
        "momentum": momentum,
    }
    return Simulation(validate(tiny_config(algorithm=algorithm, train=train, **sections)))


# the shared runs: lam 0.2 (the paper's class-mean L2 at lam = 1 overpowers CE on this tiny
# MLP), relation_lr 0.005 (the paper's summed relation loss saturates the sigmoid at lr 0.05)
SHARED = {"name": "pfedpm", "lam": 0.2, "relation_lr": 0.005}


def anchor_gap(sim: Simulation) -> float:
    """Mean distance between each client's new prototypes and the anchors it trained toward,
    relative to the anchor's norm."""
    out = []
    for state in sim.clients.values():
        anchors = dict(
            zip(state["anchors"]["classes"].tolist(), state["anchors"]["protos"], strict=True)
        )
        for c, p in zip(
            state["protos"]["classes"].tolist(), state["protos"]["protos"], strict=True
        ):
            out.append(float((p - anchors[c]).norm() / anchors[c].norm()))
    return sum(out) / len(out)


@pytest.fixture(scope="module")
def runs():
    """{name: (simulation after its rounds, rows, anchor gap after round 2)}."""
    out = {}
    for key, extra, rounds in (
        ("head", {}, 3),
        ("relation", {"inference": "relation"}, 3),
        ("lam0", {"lam": 0.0}, 2),
    ):
        sim = sim_of({**SHARED, **extra}, rounds=rounds)
        rows = [sim.run_round(1), sim.run_round(2)]
        gap = anchor_gap(sim)
        rows += [sim.run_round(r) for r in range(3, rounds + 1)]
        out[key] = (sim, rows, gap)
    return out


ENV = SimpleNamespace(num_classes=4, device=torch.device("cpu"))
LOCAL = {"classes": torch.tensor([0, 1]), "protos": torch.tensor([[1.0, 2.0], [3.0, 3.0]])}
GLOBAL = {"classes": torch.tensor([1, 2]), "protos": torch.tensor([[1.0, 1.0], [4.0, 0.0]])}


# -- anchors (Eq. 8) -------------------------------------------------------------------------------


def test_mixed_anchors_by_hand():
    table, has = make(a=0.25).targets(ENV, GLOBAL, {"protos": LOCAL}, 2)
    assert has.tolist() == [True, True, True, False]
    # class 0: only the client's own previous prototype; class 1: 0.25 * [3,3] + 0.75 * [1,1];
    # class 2 (missing on the client): the global prototype; class 3: no anchor
    expected = torch.tensor([[1.0, 2.0], [1.5, 1.5], [4.0, 0.0]])
    assert torch.allclose(table[:3], expected)


def test_a_zero_gives_fedprotos_targets_and_a_one_the_clients_own():
    local = {"classes": torch.tensor([1]), "protos": torch.tensor([[3.0, 3.0]])}
    ours, ours_has = make(a=0.0).targets(ENV, GLOBAL, {"protos": local}, 2)
    theirs, theirs_has = make("fedproto").targets(ENV, GLOBAL, {"protos": local}, 2)
    assert torch.equal(ours, theirs) and torch.equal(ours_has, theirs_has)
    own, _ = make(a=1.0).targets(ENV, GLOBAL, {"protos": local}, 2)
    assert torch.equal(own[1], torch.tensor([3.0, 3.0])) and torch.equal(own[2], theirs[2])


def test_round_one_has_no_anchor():
    table, has = make().targets(ENV, {}, {}, 2)
    assert not has.any()


def test_anchors_are_detached():
    live = {"classes": LOCAL["classes"], "protos": LOCAL["protos"].clone().requires_grad_(True)}
    table, _ = mixed_anchors(live, GLOBAL, 0.5, 4, 2, torch.device("cpu"))
    assert not table.requires_grad


def test_anchors_are_built_once_from_last_rounds_prototypes(runs):
    sim = runs["head"][0]  # after 3 rounds; one more client step by hand
    a, env = sim.algo, sim.envs[2]
    before = sim.clients[2]
    payload = a.configure(sim.senv, sim.server, 2, ServerContext(4, "train"))
    torch.manual_seed(0)
    upload, state, metrics = a.client_update(env, payload, before, RoundContext(4))
    prev = dict(zip(before["protos"]["classes"].tolist(), before["protos"]["protos"], strict=True))
    glob = dict(zip(payload["classes"].tolist(), payload["protos"], strict=True))
    assert state["anchors"]["classes"].tolist() == sorted(glob) == list(range(10))
    for c, anchor in zip(
        state["anchors"]["classes"].tolist(), state["anchors"]["protos"], strict=True
    ):
        expected = 0.4 * prev[c] + 0.6 * glob[c] if c in prev else glob[c]
        assert torch.allclose(anchor, expected, atol=1e-6), c
    # the new upload differs from the previous prototypes: the anchors were not rebuilt from it
    assert not torch.allclose(upload["protos"], before["protos"]["protos"])
    assert metrics["relation_loss"] > 0


# -- the relation module (Eqs. 12-13) ----------------------------------------------------------------


def test_relation_targets_and_loss_by_hand():
    y = torch.tensor([1, 0, 2])
    classes = torch.tensor([0, 1, 3])  # anchored classes; label 2 has none: an all-zero row
    assert relation_targets(y, classes).tolist() == [[0, 1, 0], [1, 0, 0], [0, 0, 0]]
    scores = torch.tensor([[0.2, 0.7, 0.1], [0.6, 0.3, 0.0], [0.1, 0.2, 0.5]])
    # rows: 0.04 + 0.09 + 0.01, 0.16 + 0.09 + 0, 0.01 + 0.04 + 0.25
    assert float(relation_loss(scores, y, classes, "sum")) == pytest.approx(0.69)
    assert float(relation_loss(scores, y, classes, "mean")) == pytest.approx(0.69 / 9)


class Dot(nn.Module):
    def forward(self, h, anchor):
        return (h * anchor).sum(1)


class NegDist(nn.Module):
    def forward(self, h, anchor):
        return torch.sigmoid(-((h - anchor) ** 2).sum(1))


def test_relation_scores_pair_every_sample_with_every_anchor():
    h = torch.tensor([[1.0, 0.0], [0.0, 2.0]])
    anchors = torch.tensor([[1.0, 1.0], [3.0, 0.0], [0.0, -1.0]])
    assert relation_scores(Dot(), h, anchors).tolist() == [[1.0, 3.0, 0.0], [2.0, 0.0, -2.0]]


def test_relation_module_shapes_and_range():
    for kind, key, shape in (("conv", "fc.1.weight", (8, 16 * 2)), ("mlp", "fc.0.weight", (7, 10))):
        rel = RelationModule(kind, 5, hidden=7)
        assert tuple(rel.state_dict()[key].shape) == shape
        out = rel(torch.randn(6, 5), torch.randn(6, 5))
        assert out.shape == (6,) and ((out > 0) & (out < 1)).all()


def test_relation_inference_is_the_argmax_over_anchored_classes():
    model = PFLModel(nn.Identity(), nn.Linear(2, 4), 2)
    classes, anchors = torch.tensor([1, 3]), torch.tensor([[0.0, 0.0], [5.0, 5.0]])
    x = torch.tensor([[1.0, 1.0], [4.0, 4.0], [3.0, 3.0]])
    out = RelationClassifier(model, NegDist(), classes, anchors, 4, None).eval()(x)
    assert out.argmax(1).tolist() == [1, 3, 3]  # distances 2 / 32, 32 / 2, 18 / 8
    assert torch.isinf(out[:, [0, 2]]).all()  # no anchor: never predicted
    allowed = torch.tensor([True, True, True, False])  # restrict_to_local_classes
    out = RelationClassifier(model, NegDist(), classes, anchors, 4, allowed).eval()(x)
    assert out.argmax(1).tolist() == [1, 1, 1]


def test_relation_scoring_model_uses_the_clients_relation_module_and_anchors(runs):
    sim = runs["relation"][0]
    a, env, state = sim.algo, sim.envs[0], sim.clients[0]
    scorer = a.personal_model(env, {}, state, RoundContext(1)).eval()
    x = env.data.test_x
    with torch.no_grad():
        out = scorer(x)
        model = env.model()
        model.load_state_dict(state["weights"])
        rel = RelationModule("conv", model.feature_dim)
        rel.load_state_dict(state["relation"])
        h = model.eval().features(x)
        expected = rel.eval()(
            h.repeat_interleave(10, 0), state["anchors"]["protos"].repeat(len(x), 1)
        ).view(len(x), 10)
    assert state["anchors"]["classes"].tolist() == list(range(10))
    assert torch.allclose(out, expected, atol=1e-6)


# -- training: extractor untouched by the relation step, independent of inference ------------------


def test_a_zero_trains_exactly_like_fedproto_and_the_relation_step_only_moves_psi():
    sims = {}
    for name, extra in (("fedproto", {}), ("pfedpm", {"a": 0.0})):
        sim = sim_of({"name": name, **extra}, rounds=2, momentum=0.5)
        rows = [sim.run_round(r) for r in (1, 2)]
        sims[name] = (sim, rows)
    (fp, fp_rows), (pm, pm_rows) = sims["fedproto"], sims["pfedpm"]
    assert [r["train_loss"] for r in fp_rows] == [r["train_loss"] for r in pm_rows]
    for cid in range(4):
        for k, v in fp.clients[cid]["weights"].items():
            assert torch.equal(pm.clients[cid]["weights"][k], v), (cid, k)
        assert torch.equal(pm.clients[cid]["protos"]["protos"], fp.clients[cid]["protos"]["protos"])
        init = pm.algo.client_init(pm.envs[cid])["relation"]
        moved = [
            k
            for k, v in init.items()
            if v.is_floating_point() and not torch.equal(v, pm.clients[cid]["relation"][k])
        ]
        assert moved  # the relation module did train
    assert torch.equal(fp.server["protos"], pm.server["protos"])


def test_training_does_not_depend_on_the_inference_mode(runs):
    (h, hrows, _), (r, rrows, _) = runs["head"], runs["relation"]
    for a, b in zip(hrows, rrows, strict=True):
        assert a["train_loss"] == b["train_loss"] and a["bytes_up"] == b["bytes_up"]
    for cid in range(4):
        for part in ("weights", "relation"):
            for k, v in h.clients[cid][part].items():
                assert torch.equal(r.clients[cid][part][k], v)
        assert torch.equal(h.clients[cid]["anchors"]["protos"], r.clients[cid]["anchors"]["protos"])
    assert hrows[-1]["pers_acc_mean"] != rrows[-1]["pers_acc_mean"]  # scored differently


def test_relation_step_leaves_a_dropout_extractor_alone():
    """fedproto_cnn's body has Dropout2d: a relation step that ran the extractor in train mode
    would draw dropout masks, and every later batch of the body would differ from FedProto's."""
    model = {"name": "fedproto_cnn", "options": {}}
    sims = {}
    for name, extra in (("fedproto", {}), ("pfedpm", {"a": 0.0})):
        algorithm = {"name": name, **extra}
        cfg = validate(tiny_config(model=model, algorithm=algorithm, train={"rounds": 2}))
        sims[name] = Simulation(cfg, data=synthetic_images())
        for r in (1, 2):
            sims[name].run_round(r)
    for cid in range(3):
        for k, v in sims["fedproto"].clients[cid]["weights"].items():
            assert torch.equal(sims["pfedpm"].clients[cid]["weights"][k], v), (cid, k)
    assert "anchors" in sims["pfedpm"].clients[0]  # round 2 did run relation steps


# -- bad input, heterogeneous models ---------------------------------------------------------------


def test_bad_input_is_refused():
    with pytest.raises(PflkitError, match="a"):
        parse_params({"name": "pfedpm", "a": 1.5})
    with pytest.raises(PflkitError, match="inference"):
        parse_params({"name": "pfedpm", "inference": "prototype"})
    mixed = {
        "name": "mlp",
        "options": {"hidden": [32]},
        "per_client": [
            {"name": "mlp", "options": {"hidden": [32]}},
            {"name": "mlp", "options": {"hidden": [8]}},
        ],
    }
    with pytest.raises(PflkitError, match="feature_dim"):
        sim_of({"name": "pfedpm"}, model=mixed)
    with pytest.raises(PflkitError, match="relation: mlp"):
        sim_of({"name": "pfedpm"}, model={"name": "mlp", "options": {"hidden": [1]}})


def test_heterogeneous_fedproto_cnn_clients_run_with_relation_inference():
    model = {
        "name": "fedproto_cnn",
        "options": {},
        "per_client": [
            {"name": "fedproto_cnn", "options": {"channels": 18}},
            {"name": "fedproto_cnn", "options": {"channels": 20}},
        ],
    }
    algorithm = {"name": "pfedpm", "inference": "relation"}
    cfg = validate(tiny_config(model=model, algorithm=algorithm, train={"rounds": 2}))
    sim = Simulation(cfg, data=synthetic_images())
    rows = [sim.run_round(r) for r in (1, 2)]
    assert [sim.clients[c]["weights"]["body.conv2.weight"].shape[0] for c in range(3)] == [
        18,
        20,
        18,
    ]
    assert all(sim.clients[c]["anchors"]["protos"].shape == (4, 50) for c in range(3))
    assert rows[-1]["pers_acc_clients"][1] is not None


# -- end to end ------------------------------------------------------------------------------------


def test_end_to_end_regulariser_pulls_features_to_the_anchors_and_relation_head_learns(runs):
    # after round 2 (the first with anchors): measured 0.23 vs 0.45
    assert runs["head"][2] < 0.7 * runs["lam0"][2]
    # R-pFedPM: nothing to score with after round 1, then the relation module separates the
    # classes well above chance (10 anchored classes): measured 0.10, 0.46, 0.78
    acc = [row["pers_acc_mean"] for row in runs["relation"][1]]
    assert acc[0] < 0.2 and acc[2] > 0.6


def test_one_relation_step_by_hand():
    """One full-batch round with anchors (a = 0.4, lam = 0.5, lr 0.05, relation: mlp with 3
    hidden units, relation_lr 0.02), written out with plain torch: the anchors (Eq. 8), the body
    step on CE + lam * sum_j ||mean_j h - A_j||, then one relation step on Eq. 13's summed
    squared error with the features of the *stepped* extractor."""
    lr, rel_lr, lam, a = 0.05, 0.02, 0.5, 0.4
    sim = sim_of(
        {
            "name": "pfedpm",
            "a": a,
            "lam": lam,
            "relation": "mlp",
            "relation_hidden": 3,
            "relation_lr": rel_lr,
        },
        rounds=2,
        batch_size=100000,
    )
    env = sim.envs[0]
    x, y = env.data.train_x, env.data.train_y
    state = sim.algo.client_init(env)
    d, k_all = 32, 10
    g = torch.Generator().manual_seed(0)
    glob = torch.randn(k_all, d, generator=g)
    held = torch.unique(y)
    prev = torch.randn(len(held), d, generator=g)
    state["protos"] = {"classes": held, "protos": prev}
    payload = {"classes": torch.arange(k_all), "protos": glob}
    upload, new, _ = sim.algo.client_update(env, payload, state, RoundContext(2))
    # Eq. 8: every class has a global prototype; the held ones mix in the client's own
    anchors = glob.clone()
    anchors[held] = a * prev + (1 - a) * glob[held]
    assert torch.allclose(new["anchors"]["protos"], anchors, atol=1e-6)
    # the body step
    model = env.model("check")
    model.load_state_dict(state["weights"])
    h = model.features(x)
    logits = model.head(h)
    ce = (torch.logsumexp(logits, 1) - logits[torch.arange(len(y)), y]).mean()
    reg = sum((h[y == c].mean(0) - anchors[c]).norm() for c in held.tolist())
    params = dict(model.named_parameters())
    grads = torch.autograd.grad(ce + lam * reg, list(params.values()))
    w1 = {k: state["weights"][k] - lr * gk for k, gk in zip(params, grads, strict=True)}
    for k, v in w1.items():
        assert torch.allclose(new["weights"][k], v, atol=1e-6), k
    # the relation step, on the features of the stepped model
    with torch.no_grad():
        model.load_state_dict(w1)
        h1 = model.features(x)
    r0 = {k: v.clone().requires_grad_(True) for k, v in state["relation"].items()}
    pairs = torch.cat(
        [h1.repeat_interleave(k_all, 0), anchors.repeat(len(x), 1)], dim=1
    )  # row s * K + j: (h_s, A_j)
    hidden = torch.relu(pairs @ r0["fc.0.weight"].T + r0["fc.0.bias"])
    score = torch.sigmoid(hidden @ r0["fc.2.weight"].T + r0["fc.2.bias"]).view(len(x), k_all)
    target = (y[:, None] == torch.arange(k_all)[None, :]).float()
    rel_loss = ((score - target) ** 2).sum()
    rel_grads = dict(zip(r0, torch.autograd.grad(rel_loss, list(r0.values())), strict=True))
    for k, v in state["relation"].items():
        want = v - rel_lr * rel_grads[k]
        assert torch.allclose(new["relation"][k], want, atol=1e-6), k
        assert not torch.allclose(want, v, atol=1e-4), k  # the step is not negligible
