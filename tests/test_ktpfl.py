"""KT-pFL and the knowledge-distillation baselines (FedMD, FedDF, pFedDF, Sim-pFD, TopK-pFD),
heterogeneous client models, and KT-pFL's model zoo (specs/ktpfl.md)."""

from __future__ import annotations

import math
import subprocess
import sys

import numpy as np
import pytest
import torch
import yaml

from conftest import tiny_config
from pflkit.algorithms import make_envs, parse_params
from pflkit.algorithms.base import nbytes
from pflkit.algorithms.blocks.distill import cosine_matrix, kd_loss, mix, project_simplex, restrict
from pflkit.algorithms.ktpfl import (
    coef_objective,
    coef_step_official,
    coef_step_paper,
    teacher_weights,
    update_coefficients,
)
from pflkit.algorithms.simpfd import similarity_weights, topk_weights
from pflkit.config import validate
from pflkit.data.federated import build_federated
from pflkit.engine import Simulation
from pflkit.errors import PflkitError
from pflkit.models import build_model


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """These models are tiny: one intra-op thread is fastest and immune to a busy machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# digits are 1x8x8: four distinct architectures that accept that input (ShuffleNetV2 would
# reach 1x1 before its last BatchNorm, which a 1-sample last batch cannot train)
ZOO = [
    {"name": "mlp", "options": {"hidden": [32]}},
    {"name": "resnet8", "options": {"width": 4}},
    {"name": "mlp", "options": {"hidden": [16, 16]}},
    {"name": "mlp", "options": {"hidden": []}},
]


def hetero_cfg(algorithm: dict, rounds: int = 2, **sections):
    raw = tiny_config(
        model={"name": "mlp", "options": {"hidden": [32]}, "per_client": ZOO},
        algorithm=algorithm,
        train={"rounds": rounds, "batch_size": 16, "lr": 0.05, "local_epochs": 1},
        **sections,
    )
    return validate(raw)


@pytest.fixture(scope="module")
def digits_with_public():
    """The tiny digits federation (4 clients) plus a 64-sample public set of the same shape."""
    data = build_federated(validate(tiny_config()).data)
    data.public_x = data.test_x[:64].clone()
    return data


def soft(a: int, b: int, c: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.softmax(torch.randn(a, b, c, generator=g, dtype=torch.float64) * 2, dim=-1)


def np_project(v: np.ndarray) -> np.ndarray:
    """Independent simplex projection (per column), for checking."""
    out = np.empty_like(v)
    for j in range(v.shape[1]):
        u = np.sort(v[:, j])[::-1]
        css = np.cumsum(u) - 1
        r = np.nonzero(u - css / np.arange(1, len(u) + 1) > 0)[0][-1]
        out[:, j] = np.maximum(v[:, j] - css[r] / (r + 1), 0)
    return out


# -- the knowledge-coefficient matrix --------------------------------------------------------------


def test_c_update_matches_hand_computed_gradient_step():
    n, b, k = 3, 4, 3
    s = soft(n, b, k).numpy()
    c = np.array([[0.5, 0.2, 0.3], [0.3, 0.6, 0.3], [0.2, 0.2, 0.4]])  # columns on the simplex
    d = np.array([10.0, 20.0, 30.0])
    lam, rho, lr = 0.5, 0.7, 0.01
    w = d / d.sum()
    # d/dc_mn = lam * w_n * sum_x sum_k S_m (log P_n - log S_n + 1) + 2 rho (c_mn - 1/N)
    grad = np.zeros_like(c)
    for m in range(n):
        for j in range(n):
            p = sum(c[i, j] * s[i] for i in range(n))
            grad[m, j] = lam * w[j] * (s[m] * (np.log(p) - np.log(s[j]) + 1)).sum()
            grad[m, j] += 2 * rho * (c[m, j] - 1 / n)
    expected = np_project(c - lr * grad)
    got = coef_step_paper(
        torch.tensor(c), torch.tensor(s), torch.tensor(w), lam=lam, rho=rho, lr=lr
    )
    np.testing.assert_allclose(got.numpy(), expected, rtol=0, atol=1e-12)
    np.testing.assert_allclose(got.sum(0).numpy(), 1.0, atol=1e-12)
    # the same through the algorithm's entry point (full participation, D_n as sample counts)
    p = parse_params({"name": "ktpfl", "lam": lam, "rho": rho, "coef_lr": lr})[1]
    via = update_coefficients(torch.tensor(c), torch.arange(3), torch.tensor(s), torch.tensor(d), p)
    np.testing.assert_allclose(via.numpy(), expected, atol=1e-12)
    # coef_kl: mean divides the KL part by B
    grad_mean = grad - 2 * rho * (c - 1 / n)
    grad_mean = grad_mean / b + 2 * rho * (c - 1 / n)
    got_mean = coef_step_paper(
        torch.tensor(c), torch.tensor(s), torch.tensor(w), lam=lam, rho=rho, lr=lr, reduction="mean"
    )
    np.testing.assert_allclose(got_mean.numpy(), np_project(c - lr * grad_mean), atol=1e-12)


def test_objective_value_and_teacher_indexing():
    s = soft(3, 5, 4, seed=1)
    c = torch.tensor([[0.6, 0.1, 0.2], [0.3, 0.8, 0.2], [0.1, 0.1, 0.6]], dtype=torch.float64)
    w = torch.tensor([0.2, 0.3, 0.5], dtype=torch.float64)
    kl = 0.0
    for j in range(3):
        p = sum(c[i, j] * s[i] for i in range(3))
        kl += w[j] * (p * (p.log() - s[j].log())).sum()
    reg = ((c - 1 / 3) ** 2).sum()
    assert coef_objective(c, s, w, 2.0, 0.3) == pytest.approx(float(2 * kl + 0.3 * reg))
    assert torch.equal(teacher_weights(c, 1), c[:, 1])  # column n = student n


def test_rho_large_keeps_c_uniform_and_rho_zero_drifts_to_self():
    s = soft(4, 8, 5, seed=2)
    w = torch.full((4,), 0.25, dtype=torch.float64)
    uniform = torch.full((4, 4), 0.25, dtype=torch.float64)
    big = coef_step_paper(uniform, s, w, lam=1.0, rho=1e4, lr=1e-5, steps=200)
    assert (big - 0.25).abs().max() < 1e-3
    # ... so the teacher is FedMD's consensus (the plain mean of the soft predictions)
    assert torch.allclose(mix(big, s), s.mean(0).expand(4, -1, -1), atol=1e-3)
    free = coef_step_paper(uniform, s, w, lam=1.0, rho=0.0, lr=0.5, steps=300)
    assert free.diag().min() > 0.9  # the trivial solution: self-teaching (spec §8.4)


def test_simplex_projection():
    v = torch.tensor([[0.5, 2.0, -1.0], [0.5, 0.0, -1.0], [0.2, -3.0, -1.0]], dtype=torch.float64)
    got = project_simplex(v)
    np.testing.assert_allclose(got.numpy(), np_project(v.numpy()), atol=1e-12)
    assert torch.allclose(got[:, 1], torch.tensor([1.0, 0.0, 0.0], dtype=torch.float64))
    assert torch.allclose(got[:, 2], torch.full((3,), 1 / 3, dtype=torch.float64))
    on = torch.tensor([[0.2], [0.3], [0.5]], dtype=torch.float64)
    assert torch.allclose(project_simplex(on), on)  # already on the simplex: unchanged


def test_official_coef_update_is_the_codes_normalised_step_and_softmax():
    n = 3
    s = soft(n, 6, 4, seed=3)
    c = torch.full((n, n), 1 / n, dtype=torch.float64)
    rho = 0.7
    got = coef_step_official(c, s, rho=rho)
    for j in range(n):
        teacher = sum(c[m, j] * s[m] for m in range(n))
        g = torch.stack(
            [
                -2 * ((s[j] - teacher) * s[m]).mean() + 2 * rho / n * (c[m, j] - 1 / n)
                for m in range(n)
            ]
        )
        avg, step = float(g.abs().sum()) / n, 1.0
        for _ in range(5):
            if avg > 0.01:
                avg, step = avg / 5, step / 5
            if avg < 0.01:
                avg, step = avg * 5, step * 5
        assert 0.01 <= float(g.abs().mean()) * step < 0.05 + 1e-12
        assert torch.allclose(got[:, j], torch.softmax(5 * (c[:, j] - step * g), 0), atol=1e-12)


def test_partial_participation_updates_only_the_sub_block():
    n = 5
    c = torch.full((n, n), 1 / n, dtype=torch.float64)
    active = torch.tensor([0, 2, 3])
    p = parse_params({"name": "ktpfl", "lam": 50.0})[1]
    new = update_coefficients(c, active, soft(3, 6, 4, seed=4), torch.ones(3), p)
    untouched = torch.ones(n, n, dtype=torch.bool)
    untouched[active.view(-1, 1), active.view(1, -1)] = False
    assert torch.equal(new[untouched], c[untouched])
    assert not torch.allclose(new, c)
    assert torch.allclose(new.sum(0), torch.ones(n, dtype=torch.float64))
    sub = restrict(new, active)  # the round's mixing weights: renormalised columns
    assert torch.allclose(sub.sum(0), torch.ones(3, dtype=torch.float64))


# -- teachers, Sim-pFD, TopK-pFD, the distillation loss ------------------------------------------------


def test_teacher_for_client_n_is_exactly_the_c_weighted_mix(tiny, digits_with_public):
    cfg = hetero_cfg({"name": "ktpfl", "lam": 20.0}, rounds=2)
    sim = Simulation(cfg, data=digits_with_public)
    sim.run_round(1)
    c_before = sim.server["c"].clone()
    assert not torch.allclose(c_before, torch.full_like(c_before, 0.25))  # c was learned
    sim.run_round(2)
    s = sim.server["soft"]  # round 2's uploads
    for n in range(4):
        expected = sum(c_before[m, n] * s[m].double() for m in range(4)).float()
        assert torch.allclose(sim.server["teachers"][n], expected, atol=1e-6)
        assert torch.allclose(sim.server["teachers"][n].sum(1), torch.ones(64), atol=1e-5)
        payload = sim.algo.configure(sim.senv, sim.server, n, 2, "distill")
        assert torch.equal(payload["teacher"], sim.server["teachers"][n])


def test_sim_pfd_weights_are_the_cosine_similarities():
    s = soft(3, 5, 4, seed=5)
    flat = s.reshape(3, -1).numpy()
    cos = np.array([[a @ b / np.linalg.norm(a) / np.linalg.norm(b) for b in flat] for a in flat])
    np.testing.assert_allclose(cosine_matrix(s).numpy(), cos, atol=1e-12)
    np.testing.assert_allclose(similarity_weights(s).numpy(), cos / cos.sum(0), atol=1e-12)
    shifted = cos - cos.min(0)  # the authors' code: least similar client gets 0
    np.testing.assert_allclose(
        similarity_weights(s, "code").numpy(), shifted / shifted.sum(0), atol=1e-12
    )


def test_topk_pfd_averages_the_k_most_similar_clients_including_itself():
    s = soft(5, 6, 4, seed=6)
    cos = cosine_matrix(s)
    w = topk_weights(s, 3)
    for n in range(5):
        chosen = set(torch.nonzero(w[:, n]).flatten().tolist())
        others = sorted((m for m in range(5) if m != n), key=lambda m: -float(cos[m, n]))
        assert chosen == {n, *others[:2]}
        assert torch.allclose(w[list(chosen), n], torch.full((3,), 1 / 3, dtype=torch.float64))
    assert torch.allclose(topk_weights(s, 10).sum(0), torch.ones(5, dtype=torch.float64))


def test_kd_loss_is_kl_teacher_student():
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 4)
    x, t = torch.randn(5, 3), 4.0
    teacher = torch.softmax(torch.randn(5, 4), 1)
    q = torch.softmax(model(x) / t, 1)
    kl = (teacher * (teacher.log() - q.log())).sum(1).mean()
    assert kd_loss(t)(model, x, teacher).item() == pytest.approx(kl.item(), rel=1e-5)
    assert kd_loss(t, "kl_t2")(model, x, teacher).item() == pytest.approx(
        t * t * kl.item(), rel=1e-5
    )
    assert kd_loss(t, "kl_mean")(model, x, teacher).item() == pytest.approx(kl.item() / 4, rel=1e-5)


# -- end to end: heterogeneous clients ---------------------------------------------------------------


@pytest.mark.parametrize(
    "algorithm",
    [
        {"name": "ktpfl"},
        {"name": "ktpfl", "order": "distill_then_train", "coef_timing": "before_mix",
         "coef_update": "official", "local_epoch_schedule": "ramp", "public_per_round": 32},
        {"name": "fedmd"},
        {"name": "simpfd", "sim_weights": "code"},
        {"name": "topkpfd", "k": 2},
        {"name": "feddf"},
        {"name": "pfeddf", "ft_epochs": 1},
    ],
    ids=["ktpfl", "ktpfl-code-order", "fedmd", "simpfd", "topkpfd", "feddf", "pfeddf"],
)  # fmt: skip
def test_heterogeneous_clients_train_together_end_to_end(algorithm, digits_with_public):
    cfg = hetero_cfg(algorithm)
    sim = Simulation(cfg, data=digits_with_public)
    assert len({sim.senv.arch(c) for c in range(4)}) == 4
    rows = [sim.run_round(r) for r in (1, 2)]
    for row in rows:
        assert 0 <= row["pers_acc_mean"] <= 1 and math.isfinite(row["train_loss"])
        assert "global_acc" not in row  # no single global model across architectures
    b = algorithm.get("public_per_round", 64) * 10 * 4  # B x C float32 soft predictions / teacher
    if algorithm["name"] in ("feddf", "pfeddf"):
        for cid, down in zip(rows[0]["clients"], rows[0]["bytes_down"], strict=True):
            assert down == nbytes(sim.envs[cid].model().state_dict())
    else:
        extra_down = 32 * 8 if "public_per_round" in algorithm else 0  # the round's indices
        assert rows[0]["bytes_down"] == [b + extra_down] * 4
        assert rows[0]["bytes_up"] == [b + 8] * 4  # soft predictions + D_n
    # every client's personalized model has its own architecture's state-dict
    for cid in range(4):
        view = sim.algo.eval_view(sim.senv, sim.server, cid)
        w = sim.algo.personal_weights(sim.envs[cid], view, sim.clients[cid])
        assert w.keys() == sim.envs[cid].model().state_dict().keys()


def test_reupload_doubles_the_upload(digits_with_public):
    sim = Simulation(
        hetero_cfg({"name": "ktpfl", "coef_timing": "after_distill_reupload"}),
        data=digits_with_public,
    )
    row = sim.run_round(1)
    assert row["bytes_up"] == [2 * 64 * 10 * 4 + 8] * 4


def test_fedmd_teacher_is_the_plain_mean(digits_with_public):
    sim = Simulation(hetero_cfg({"name": "fedmd"}), data=digits_with_public)
    sim.run_round(1)
    mean = sim.server["soft"].mean(0)
    for n in range(4):
        assert torch.allclose(sim.server["teachers"][n], mean, atol=1e-6)
    assert sim.algo.order == "distill_then_train"  # FedMD: digest, then revisit


def test_feddf_distils_the_logit_ensemble_into_each_group_average(digits_with_public):
    cfg = hetero_cfg({"name": "feddf"})
    sim = Simulation(cfg, data=digits_with_public)
    algo = sim.algo
    payloads = {c: algo.configure(sim.senv, sim.server, c, 1, "train") for c in range(4)}
    uploads = {
        c: algo.client_update(sim.envs[c], payloads[c], {}, 1, "train").upload for c in range(4)
    }
    teacher = algo.ensemble_teacher(sim.senv, uploads)
    logits = []
    for c, up in uploads.items():
        m = sim.senv.models.new_model(sim.senv.arch(c))
        m.load_state_dict(up["weights"])
        m.eval()
        with torch.no_grad():
            logits.append(m(digits_with_public.public_x))
    expected = torch.softmax(torch.stack(logits).mean(0), 1)
    assert torch.allclose(teacher, expected, atol=1e-5)
    server = algo.aggregate(sim.senv, sim.server, uploads, 1, "train")
    # each prototype moved from its group's upload (one client per group) by distillation
    for c in range(4):
        proto = server["protos"][sim.senv.arch(c)]
        assert proto.keys() == uploads[c]["weights"].keys()
        assert any(not torch.equal(proto[k], uploads[c]["weights"][k]) for k in proto)
        view = algo.eval_view(sim.senv, server, c)
        assert torch.equal(
            algo.personal_weights(sim.envs[c], view, {})["head.weight"], proto["head.weight"]
        )


def test_pfeddf_fine_tunes_the_prototype(digits_with_public):
    sim = Simulation(hetero_cfg({"name": "pfeddf", "ft_epochs": 1}), data=digits_with_public)
    sim.run_round(1)
    proto = sim.server["protos"][sim.senv.arch(0)]
    view = sim.algo.eval_view(sim.senv, sim.server, 0)
    personal = sim.algo.personal_weights(sim.envs[0], view, {})
    assert not torch.equal(personal["head.weight"], proto["head.weight"])


def test_homogeneous_ktpfl_mixes_parameters_with_c(tiny, digits_with_public):
    cfg = tiny(algorithm={"name": "ktpfl_homo", "lam": 20.0})
    sim = Simulation(cfg, data=digits_with_public)
    row = sim.run_round(1)
    assert 0 <= row["pers_acc_mean"] <= 1
    w = nbytes(sim.senv.model().state_dict())
    assert row["bytes_up"] == [w + 64 * 10 * 4 + 8] * 4 and row["bytes_down"] == [w] * 4
    # the personalised models of round 1 were mixed with the initial (uniform) c
    for n in range(4):
        mixed = sim.server["personal"][n]["head.bias"]
        mean = torch.stack([sim.clients[m]["weights"]["head.bias"] for m in range(4)]).mean(0)
        assert torch.allclose(mixed, mean, atol=1e-6)
    assert not torch.allclose(sim.server["c"], torch.full((4, 4), 0.25, dtype=torch.float64))
    sim.run_round(2)


# -- bad input ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "algorithm, match",
    [
        ({"name": "ktpfl", "temperature": 0}, "ktpfl.temperature"),
        ({"name": "ktpfl", "temperature": -1.0}, "ktpfl.temperature"),
        ({"name": "fedmd", "temperature": 0}, "fedmd.temperature"),
        ({"name": "feddf", "temperature": 0}, "feddf.temperature"),
        ({"name": "ktpfl", "rho": -0.1}, "ktpfl.rho"),
        ({"name": "ktpfl", "coef_update": "magic"}, "ktpfl.coef_update"),
        ({"name": "topkpfd", "k": 0}, "topkpfd.k"),
        ({"name": "ktpfl", "tmperature": 3}, "has no parameter 'tmperature'"),
    ],
)
def test_bad_parameters_are_one_sentence_errors(algorithm, match):
    with pytest.raises(PflkitError, match=match):
        parse_params(algorithm)


def test_missing_public_set_says_how_to_configure_it(tiny):
    for name in ("ktpfl", "fedmd", "feddf", "ktpfl_homo"):
        with pytest.raises(PflkitError, match=r"data\.public: \{dataset: mnist5k"):
            Simulation(tiny(algorithm={"name": name}))


def test_public_set_with_other_class_count_is_refused(mnist5k_with_26_classes):
    cfg = validate(
        tiny_config(
            data={"dataset": "fashion_mnist", "subset": 400, "num_clients": 2,
                  "partition": {"name": "iid"}, "public": {"dataset": "mnist5k", "size": 100}},
            algorithm={"name": "ktpfl"},
        )
    )  # fmt: skip
    with pytest.raises(PflkitError, match="has 26 classes but the task"):
        Simulation(cfg)


def test_other_bad_combinations(tiny, digits_with_public):
    with pytest.raises(PflkitError, match="public_per_round 100 exceeds"):
        Simulation(hetero_cfg({"name": "ktpfl", "public_per_round": 100}), data=digits_with_public)
    with pytest.raises(PflkitError, match="needs the same architecture"):
        Simulation(hetero_cfg({"name": "ktpfl_homo"}), data=digits_with_public)


def test_unknown_client_architecture_is_a_clear_error(tmp_path, digits_with_public):
    bad = [{"name": "mlp", "count": 2}, {"name": "lenet55", "count": 2}]
    cfg = validate(tiny_config(model={"per_client": bad}, algorithm={"name": "ktpfl"}))
    with pytest.raises(PflkitError, match="unknown model 'lenet55'"):
        make_envs(cfg, digits_with_public)
    with pytest.raises(PflkitError, match="unknown model 'lenet55'"):
        Simulation(cfg, data=digits_with_public)
    path = tmp_path / "bad.yaml"
    raw = tiny_config(model={"per_client": bad}, algorithm={"name": "local"})
    path.write_text(yaml.safe_dump(raw))
    r = subprocess.run(
        [sys.executable, "-m", "pflkit.cli", "run", str(path), "--out", "r", "-q"],
        cwd=tmp_path, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert r.returncode == 2 and "unknown model 'lenet55'" in r.stderr + r.stdout
    assert "Traceback" not in r.stderr and not (tmp_path / "r").exists()


# -- the zoo ---------------------------------------------------------------------------------------------


def test_paper_zoo_parameter_counts_and_split():
    # specs/ktpfl.md §4: AlexNet about 20.1 M, ShuffleNetV2 1.0x about 1.27 M (3x28x28, 10 classes)
    for name, total, head in (("alexnet", 20_126_538, 40_970), ("shufflenetv2", 1_268_646, 10_250)):
        torch.manual_seed(0)
        m = build_model(name, (3, 28, 28), 10)
        assert sum(p.numel() for p in m.parameters()) == total
        assert sum(p.numel() for p in m.head.parameters()) == head
        assert all(k.startswith(("body.", "head.")) for k in m.state_dict())
        m.eval()
        x = torch.randn(2, 3, 28, 28)
        with torch.no_grad():
            assert torch.equal(m(x), m.head(m.features(x)))
    small = build_model("alexnet", (1, 28, 28), 10, width=0.25, hidden=256, init="kaiming")
    assert small(torch.randn(2, 1, 28, 28)).shape == (2, 10)
    fc = small.body.fc7
    assert torch.all(fc.bias == 0) and abs(fc.weight.std().item() - math.sqrt(2 / 256)) < 0.005
    with pytest.raises(PflkitError, match="option 'init'"):
        build_model("alexnet", (1, 28, 28), 10, init="xavier")
    with pytest.raises(PflkitError, match="H, W >= 15"):
        build_model("alexnet", (1, 14, 14), 10)
    with pytest.raises(PflkitError, match="option 'width'"):
        build_model("shufflenetv2", (1, 28, 28), 10, width=0.75)
    with pytest.raises(PflkitError, match="option 'units'"):
        build_model("shufflenetv2", (1, 28, 28), 10, units=[1, 2])
