"""pFedSim: classifier similarity (Eq. 3), aggregation weights (Eq. 4), the warm-up switch,
and the measurement-study command. Expected numbers are computed by hand (or with numpy)."""

from __future__ import annotations

import json
import math
import sys

import numpy as np
import pytest
import torch
import yaml

from conftest import tiny_config
from pflkit.algorithms.context import RoundContext, ServerContext
from pflkit.algorithms.pfedsim import (
    CODE_SELF_WEIGHT,
    aggregation_weights,
    class_rows,
    classifier_similarity,
    warmup_rounds,
)
from pflkit.data.federated import build_federated
from pflkit.engine import Simulation
from pflkit.experiment import validate
from pflkit.testing import personal_weights

A = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
B = torch.tensor([[0.6, 0.8], [0.6, 0.8]])  # cos with A's rows: 0.6 and 0.8


def test_similarity_per_class_log_and_mean_then_log_by_hand():
    # Eq. 3: mean over classes of -log(1 - cos_c) = (-ln 0.4 - ln 0.2) / 2
    assert classifier_similarity(A, B, "per_class_log") == pytest.approx(1.2628643, abs=1e-6)
    # code: -log(1 - mean cos) = -ln(1 - 0.7) = -ln 0.3
    assert classifier_similarity(A, B, "mean_then_log") == pytest.approx(1.2039728, abs=1e-6)
    # symmetric
    assert classifier_similarity(B, A) == pytest.approx(classifier_similarity(A, B))


def test_negative_cosines_are_clipped_per_class_or_after_the_mean():
    c = torch.tensor([[1.0, 0.0], [1.0, 1.0]])
    d = torch.tensor([[1.0, 1.0], [-1.0, 0.0]])  # cosines 1/sqrt(2) and -1/sqrt(2)
    # per class: (-ln(1 - 0.70710678) + 0) / 2 = 1.2279471 / 2
    assert classifier_similarity(c, d, "per_class_log") == pytest.approx(0.6139736, abs=1e-6)
    # mean cosine 0 -> -ln 1 = 0
    assert classifier_similarity(c, d, "mean_then_log") == pytest.approx(0.0, abs=1e-9)


def test_identical_classifiers_give_a_finite_weight():
    w = torch.randn(10, 84)
    value = classifier_similarity(w, w.clone())
    assert math.isfinite(value)
    assert value == pytest.approx(-math.log(1e-6), rel=1e-6)  # cosine clamped to 1 - 1e-6
    row = torch.tensor([0.0, value, 0.0])
    assert torch.isfinite(aggregation_weights(row, 0)).all()


def test_bias_is_appended_to_the_class_rows_when_asked():
    head_a = {"head.weight": A, "head.bias": torch.tensor([0.0, 0.0])}
    head_b = {"head.weight": B, "head.bias": torch.tensor([1.0, 0.0])}
    assert torch.equal(class_rows(head_a), A.double())
    ra, rb = class_rows(head_a, True), class_rows(head_b, True)
    # row 0: [1,0,0] vs [0.6,0.8,1] -> cos 0.6/sqrt(2); row 1: [0,1,0] vs [0.6,0.8,0] -> 0.8
    expected = (-math.log(1 - 0.6 / math.sqrt(2)) - math.log(0.2)) / 2
    assert classifier_similarity(ra, rb) == pytest.approx(expected, abs=1e-6)


def test_aggregation_weights_paper_identity_and_code_self_weight():
    row = torch.tensor([0.0, 1.2628643, 0.0])  # client 2 never co-sampled with client 0
    paper = aggregation_weights(row, 0, "paper")
    np.testing.assert_allclose(paper, [1 / 2.2628643, 1.2628643 / 2.2628643, 0.0], atol=1e-7)
    code = aggregation_weights(row, 0, "code")
    s = -math.log(1e-4)  # 9.2103404
    assert CODE_SELF_WEIGHT == pytest.approx(9.2103404, abs=1e-6)
    np.testing.assert_allclose(code, [s / (s + 1.2628643), 1.2628643 / (s + 1.2628643), 0.0])


def test_warmup_rounds_is_floor_of_rho_t():
    assert [warmup_rounds(200, r) for r in (0, 0.1, 0.3, 0.5, 0.7, 1)] == [0, 20, 60, 100, 140, 200]
    assert warmup_rounds(5, 0.5) == 2 and warmup_rounds(10, 0.29) == 2


def _pfedsim(tiny, **algo):
    cfg = tiny(
        algorithm={"name": "pfedsim", **algo},
        train={"rounds": 4, "client_fraction": 0.75},
    )
    return Simulation(cfg)


def test_personalized_extractor_is_the_weighted_mix_of_stored_models(tiny):
    sim = _pfedsim(tiny)  # T = 4, rho = 0.5: rounds 3 and 4 personalize
    algo, senv = sim.algo, sim.senv
    server = dict(sim.server)
    fill = lambda v: {k: torch.full_like(t, v) for k, t in server["weights"].items()}  # noqa: E731
    server["weights"] = fill(10.0)  # the warm-up model: client 3 was never stored since
    server["personal"] = {0: fill(1.0), 1: fill(2.0), 2: fill(3.0)}
    phi = torch.zeros(4, 4, dtype=torch.float64)
    phi[0, 1] = phi[1, 0] = 1.2628643
    phi[0, 3] = phi[3, 0] = 0.5
    server["phi"] = phi
    payload = algo.configure(senv, server, 0, ServerContext(3, "train"))["weights"]
    # by hand: weights (1, 1.2628643, 0, 0.5) / 2.7628643 over stored values (1, 2, 3, 10)
    body = (1 * 1 + 1.2628643 * 2 + 0.5 * 10) / 2.7628643
    for k, v in payload.items():
        want = 1.0 if k.startswith("head.") else body  # own classifier, mixed extractor
        assert torch.allclose(v, torch.full_like(v, want)), k
    # client 2's row is still the identity row: its own stored model, unchanged
    own = algo.configure(senv, server, 2, ServerContext(3, "train"))["weights"]
    assert all(torch.equal(v, server["personal"][2][k]) for k, v in own.items())
    # during the warm-up every client gets the global model
    assert (
        algo.configure(senv, server, 0, ServerContext(2, "train"))["weights"] is server["weights"]
    )


def test_warmup_switch_and_similarity_updates(tiny):
    sim = _pfedsim(tiny)
    rows = [sim.run_round(r) for r in (1, 2)]
    assert all("global_acc" in r for r in rows) and sim.server["personal"] == {}
    assert not sim.server["phi"].any()
    warm = sim.server["weights"]
    # round 3: first personalization round; Phi is still I, so every payload is the warm model
    payloads = {
        c: sim.algo.configure(sim.senv, sim.server, c, ServerContext(3, "train")) for c in range(4)
    }
    for p in payloads.values():
        assert all(torch.equal(p["weights"][k], warm[k]) for k in warm)
    row3 = sim.run_round(3)
    assert "global_acc" not in row3  # no global model after the warm-up
    assert sim.server["weights"] is warm  # the warm-up model is frozen
    clients = row3["clients"]
    assert sorted(sim.server["personal"]) == clients
    phi = sim.server["phi"].numpy()
    for i in range(4):
        for j in range(4):
            if i == j or i not in clients or j not in clients:
                assert phi[i, j] == 0.0
                continue
            a = sim.server["personal"][i]["head.weight"].double().numpy()
            b = sim.server["personal"][j]["head.weight"].double().numpy()
            cos = (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1) + 1e-8)
            want = np.mean(-np.log(1 - np.clip(cos, 0, None)))
            assert phi[i, j] == pytest.approx(want, rel=1e-9)
    # byte counts: every download is one full model (omega_i plus own phi_i)
    full = sum(v.numel() * v.element_size() for v in warm.values())
    assert row3["bytes_down"] == [full] * len(clients)


def bn_config(**algo):
    """A small BatchNorm run: LeNet5-BN on 400 real Fashion-MNIST images, 4 clients."""
    return validate(
        tiny_config(
            data={"dataset": "fashion_mnist", "subset": 400},
            model={"name": "lenet5_bn", "options": {}},
            algorithm=algo,
            train={"rounds": 2, "client_fraction": 0.5, "batch_size": 32},
        )
    )


def test_bn_local_never_sends_running_statistics():
    sim = Simulation(bn_config(name="pfedsim", bn_stats="local"))
    stats = {k for k, _ in sim.senv.model().named_buffers()}
    assert stats  # running means, variances, counters
    for rnd in (1, 2):  # warm-up round, then personalization round
        payload = sim.algo.configure(sim.senv, sim.server, 0, ServerContext(rnd, "train"))
        assert not stats & set(payload["weights"])
        row = sim.run_round(rnd)
        cid = row["clients"][0]
        assert not stats & set(sim.server["personal"].get(cid, sim.server["weights"]))
        assert stats <= set(sim.clients[cid]["buffers"])


# -- the measurement study -----------------------------------------------------------------------
def pflkit(monkeypatch, *args: str) -> int:
    """Run the command line in this process (as ``pflkit ARGS``), return its exit code."""
    from pflkit.cli import main

    monkeypatch.setattr(sys, "argv", ["pflkit", *args])
    try:
        main()
    except SystemExit as exc:
        return int(exc.code or 0)
    return 0


def test_analyze_similarity_command_writes_table_and_heatmap(tmp_path, monkeypatch):
    cfg = tmp_path / "tiny.yaml"
    cfg.write_text(yaml.safe_dump(tiny_config()))
    out = tmp_path / "sim"
    assert (
        pflkit(monkeypatch, "analyze", "similarity", str(cfg), "--out", str(out), "--steps", "5")
        == 0
    )
    table = json.loads((out / "similarity.json").read_text())
    md = (out / "similarity.md").read_text()
    assert "CS: classifier cosine" in md and "| (0, 1) |" in md
    assert (out / "similarity.png").read_bytes()[:4] == b"\x89PNG"
    assert len(table["pairs"]) == 6  # 4 clients
    counts = build_federated(validate(tiny_config()).data).class_table("train")
    for pair in table["pairs"]:
        i, j = pair["clients"]
        # Eq. 1 by hand: samples of labels both hold, over all samples of the two clients
        both = [c for c in range(10) if counts[i][c] > 0 and counts[j][c] > 0]
        shared = sum(counts[i][c] + counts[j][c] for c in both)
        assert pair["data_similarity"] == pytest.approx(
            shared / (counts[i].sum() + counts[j].sum())
        )
        assert -1 <= pair["cs"] <= 1 and -1 <= pair["mdb"] <= 1
        assert "wdb" not in pair  # the MLP has no BatchNorm
    truth = [p["data_similarity"] for p in table["pairs"]]
    cs = [p["cs"] for p in table["pairs"]]
    rank = lambda v: np.argsort(np.argsort(v))  # noqa: E731 (no ties here)
    rho = np.corrcoef(rank(truth), rank(cs))[0, 1]
    assert table["scores"]["cs"]["spearman"] == pytest.approx(rho)


def test_analyze_similarity_bad_input(tmp_path, monkeypatch, capsys):
    missing = str(tmp_path / "missing.yaml")
    assert pflkit(monkeypatch, "analyze", "similarity", missing, "--out", str(tmp_path)) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and len(err.strip().splitlines()) == 1
    cfg = tmp_path / "tiny.yaml"
    cfg.write_text(yaml.safe_dump(tiny_config()))
    assert pflkit(monkeypatch, "analyze", "similarity", str(cfg), "--steps", "0") == 2
    assert "--steps must be at least 1" in capsys.readouterr().err


def test_heterogeneous_clients_are_refused_in_one_sentence(tiny):
    from pflkit.engine import Simulation
    from pflkit.errors import PflkitError

    cfg = tiny(
        algorithm={"name": "pfedsim"},
        model={"per_client": [{"name": "mlp", "options": {"hidden": [16]}}, "mlp"]},
    )
    with pytest.raises(PflkitError, match="every client needs the same architecture"):
        Simulation(cfg)


# -- by value on a hand-made federation ------------------------------------------------------------
def hand_pfedsim(n: int = 4, **algo):
    """(algorithm, server env, client envs): ``n`` clients with two samples each, an MLP 2 -> 2
    (ReLU) -> head 3 classes; T = 4 rounds, rho = 0.5: rounds 1-2 warm up, 3-4 personalize."""
    from pflkit.algorithms import build_algorithm
    from pflkit.data.federated import ClientData, FederatedDataset
    from pflkit.engine.envs import make_envs

    cfg = validate(
        tiny_config(
            algorithm={"name": "pfedsim", **algo},
            model={"name": "mlp", "options": {"hidden": [2]}},
            train={"rounds": 4, "batch_size": 1000, "lr": 0.1},
        )
    )
    x, y = torch.tensor([[1.0, 0.0], [0.0, 1.0]]), torch.tensor([0, 2])
    data = FederatedDataset(
        name="hand", clients=[ClientData(x, y, x, y)] * n, test_x=x, test_y=y, num_classes=3,
        input_shape=(2,), partition_id="hand", train_indices=[np.arange(2)] * n,
        test_indices=[np.arange(2)] * n,
    )  # fmt: skip
    senv, cenvs = make_envs(cfg, data)
    return build_algorithm(cfg.algorithm), senv, cenvs


def filled(server, v: float) -> dict:
    return {k: torch.full_like(t, v) for k, t in server["weights"].items()}


def test_warmup_averages_whole_models_by_training_set_size():
    algo, senv, _ = hand_pfedsim()
    server = algo.server_init(senv)
    a, b = filled(server, 1.0), filled(server, 5.0)
    uploads = {0: {"weights": a, "num_samples": 1}, 2: {"weights": b, "num_samples": 3}}
    new = algo.aggregate(senv, server, uploads, ServerContext(2, "train"))  # round 2 <= T_g = 2
    for k, v in new["weights"].items():  # (1 * 1 + 3 * 5) / 4, the classifier included
        assert torch.equal(v, torch.full_like(v, 4.0)), k
    assert new["personal"] == {} and not new["phi"].any()
    assert (
        algo.eval_view(senv, new, None, ServerContext(2)).get("weights") is new["weights"]
    )  # scored during the warm-up


def hand_phi(a: torch.Tensor, b: torch.Tensor) -> float:
    """Eq. 3 written out: per class row c, cos_c = <a_c, b_c> / (|a_c| |b_c| + 1e-8), clipped at
    0; then the mean over classes of -log(1 - cos_c)."""
    vals = []
    for ac, bc in zip(a.double(), b.double(), strict=True):
        cos = float(ac @ bc) / (float(ac.norm()) * float(bc.norm()) + 1e-8)
        vals.append(-math.log(1 - max(cos, 0.0)))
    return sum(vals) / len(vals)


HEADS = {  # class rows of three clients' classifiers (3 classes x 2 features)
    0: torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]]),
    1: torch.tensor([[1.0, 1.0], [0.0, -1.0], [2.0, 0.5]]),
    3: torch.tensor([[3.0, 1.0], [1.0, 2.0], [-1.0, 0.0]]),
}


def test_personalization_round_stores_models_and_updates_phi_by_hand():
    algo, senv, _ = hand_pfedsim()
    server = algo.server_init(senv)
    server["phi"][0, 2] = server["phi"][2, 0] = 0.7  # a pair from an earlier round
    uploads = {}
    for cid, head in HEADS.items():
        w = filled(server, float(cid))
        w["head.weight"] = head
        uploads[cid] = {"weights": w, "num_samples": 2}
    new = algo.aggregate(senv, server, uploads, ServerContext(3, "train"))
    assert {c: new["personal"][c] for c in HEADS} == {c: u["weights"] for c, u in uploads.items()}
    phi = new["phi"]
    want = torch.zeros(4, 4, dtype=torch.float64)
    want[0, 2] = want[2, 0] = 0.7  # not co-sampled this round: unchanged
    for i in HEADS:
        for j in HEADS:
            if i != j:
                want[i, j] = hand_phi(HEADS[i], HEADS[j])
    assert torch.allclose(phi, want, atol=1e-9), (phi, want)
    assert want[0, 3] > 0 and want[1, 3] > 0  # a negative cosine among them, clipped


def test_personalized_download_mixes_extractors_and_keeps_own_classifier():
    algo, senv, _ = hand_pfedsim()
    server = algo.server_init(senv)
    server = {
        **server,
        "weights": filled(server, 10.0),  # the warm-up model; client 3 not stored since
        "personal": {0: filled(server, 1.0), 1: filled(server, 2.0), 2: filled(server, 3.0)},
    }
    server["phi"][0, 1] = server["phi"][1, 0] = 2.0
    server["phi"][0, 3] = server["phi"][3, 0] = 0.5
    payload = algo.configure(senv, server, 0, ServerContext(3, "train"))["weights"]
    # Eq. 4 with Phi_00 = 1: (1 * 1 + 2 * 2 + 0 * 3 + 0.5 * 10) / (1 + 2 + 0.5) = 10 / 3.5
    assert set(payload) == set(server["weights"])
    for k, v in payload.items():
        want = 1.0 if k.startswith("head.") else 10 / 3.5
        assert torch.allclose(v, torch.full_like(v, want)), k
    # the code's self weight: Phi_00 = -log(1 - 0.9999)
    algo_code, _, _ = hand_pfedsim(self_weight="code")
    s = -math.log(1e-4)
    payload = algo_code.configure(senv, server, 0, ServerContext(3, "train"))["weights"]
    v = payload["body.1.weight"]
    assert torch.allclose(v, torch.full_like(v, (s * 1 + 4 + 5) / (s + 2.5)))
    # during the warm-up, the global model
    warm = algo.configure(senv, server, 0, ServerContext(2, "train"))["weights"]
    assert all(torch.equal(warm[k], server["weights"][k]) for k in warm)


def test_the_model_scored_is_the_clients_stored_model():
    algo, senv, envs = hand_pfedsim()
    server = algo.server_init(senv)
    server = {**server, "weights": filled(server, 10.0), "personal": {1: filled(server, 2.0)}}
    for cid, want in ((1, 2.0), (2, 10.0)):  # client 2: not trained since the warm-up
        view = algo.eval_view(senv, server, cid, ServerContext(3))
        scored = personal_weights(algo, envs[cid], view, {}, RoundContext(3, "evaluate"))
        assert all(torch.equal(v, torch.full_like(v, want)) for v in scored.values()), cid
    assert (
        algo.eval_view(senv, server, None, ServerContext(2)).get("weights") is server["weights"]
    )  # the warm-up's last round
    assert (
        algo.eval_view(senv, server, None, ServerContext(3)).get("weights") is None
    )  # no global model after the warm-up
