"""FedPHP's PFLlib options (docs/crosscheck.md, "FedPHP"), by value against hand computations:
PFLlib's MMD (``mmd_form: pfllib``), knowledge transfer from the first selection with the
download as the teacher (``hpm_init: start``), PFLlib's momentum as ``mu_schedule: code`` and
scoring the model right after local training (``personal: trained``)."""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from map_helpers import kt_ce
from pflkit.algorithms.base import parse_params
from pflkit.algorithms.blocks.hpm import HPMParams, hpm_momentum, kt_loss, mmd_pfllib
from pflkit.algorithms.context import RoundContext
from pflkit.engine import Simulation
from pflkit.testing import personal_weights, same_weights
from split_helpers import assert_close, hand_sgd, mlp_logits

BANDWIDTHS = (10.0, 15.0, 20.0, 50.0)  # PFLlib clientphp.py line 124


def rbf_sum(d2):
    """PFLlib's kernel of a squared distance: sum over the bandwidths of exp(-0.5 d2 / s)."""
    return sum(math.exp(-0.5 * d2 / s) for s in BANDWIDTHS)


def mmd_by_hand(h, hp):
    """mean over the B x B entries of k(h_i, h_j) + k(p_i, p_j) - 2 k(h_i, p_j), with the
    squared distances taken as plain sums of squared differences (loops, numpy)."""
    h, hp = np.asarray(h, dtype=np.float64), np.asarray(hp, dtype=np.float64)
    b = len(h)
    total = 0.0
    for i in range(b):
        for j in range(b):
            total += rbf_sum(((h[i] - h[j]) ** 2).sum())
            total += rbf_sum(((hp[i] - hp[j]) ** 2).sum())
            total -= 2 * rbf_sum(((h[i] - hp[j]) ** 2).sum())
    return total / (b * b)


# -- PFLlib's MMD ----------------------------------------------------------------------------------
def test_pfllib_mmd_of_two_2x2_batches_by_hand():
    h = [[0.0, 0.0], [3.0, 4.0]]
    hp = [[1.0, 0.0], [0.0, 2.0]]
    # squared distances: within h 0 and 25, within hp 0 and 5, across 1, 4 (row 0) and 20, 13
    # (row 1); k(0) = 4 (four kernels), so the mean over the 2 x 2 entries is
    want = (4 * 4 + 2 * rbf_sum(25) + 2 * rbf_sum(5) - 2 * sum(map(rbf_sum, (1, 4, 20, 13)))) / 4
    assert mmd_by_hand(h, hp) == pytest.approx(want, rel=1e-12)
    got = mmd_pfllib(torch.tensor(h, dtype=torch.float64), torch.tensor(hp, dtype=torch.float64))
    assert got.item() == pytest.approx(want, rel=1e-10)
    # with k(d) = e^(-d/20) + e^(-d/30) + e^(-d/40) + e^(-d/100): k(25) = 2.03516,
    # k(5) = 3.45901, k(1) + k(4) + k(20) + k(13) = 12.52093 (by calculator):
    # (16 + 4.07032 + 6.91802 - 25.04186) / 4 = 0.48662
    assert want == pytest.approx(0.48662, abs=2e-5)


def test_pfllib_mmd_of_identical_batches_is_zero_and_random_batches_match_the_loops():
    torch.manual_seed(0)
    h, hp = 3 * torch.randn(5, 4, dtype=torch.float64), 3 * torch.randn(5, 4, dtype=torch.float64)
    assert mmd_pfllib(h, h).item() == pytest.approx(0.0, abs=1e-12)
    assert mmd_pfllib(h, hp).item() == pytest.approx(mmd_by_hand(h, hp), rel=1e-10)


class TwoLinear(torch.nn.Module):
    """features = B x (bias-free), logits = W features: a student and a teacher whose features
    differ, so the MMD term is not zero."""

    def __init__(self, body, head):
        super().__init__()
        self.body = torch.nn.Linear(2, 2, bias=False)
        self.head = torch.nn.Linear(2, 3, bias=False)
        with torch.no_grad():
            self.body.weight.copy_(torch.tensor(body))
            self.head.weight.copy_(torch.tensor(head))

    def features(self, x):
        return self.body(x)

    def forward(self, x):
        return self.head(self.body(x))


def test_eq13_with_pfllib_mmd_by_hand():
    x = torch.tensor([[1.0, 2.0], [-1.0, 0.5]])
    y = torch.tensor([2, 0])
    bs, ws = [[1.0, 0.0], [0.5, 2.0]], [[1.0, -1.0], [0.0, 1.0], [2.0, 0.5]]
    bt = [[3.0, 1.0], [0.0, -2.0]]
    student, teacher = TwoLinear(bs, ws), TwoLinear(bt, ws)
    xn = x.numpy().astype(np.float64)
    h, hp = xn @ np.array(bs).T, xn @ np.array(bt).T
    g = h @ np.array(ws).T
    logp = g - np.log(np.exp(g).sum(1, keepdims=True))
    ce = -np.mean(logp[[0, 1], y.numpy()])
    lam = 0.3
    want = (1 - lam) * ce + lam * mmd_by_hand(h, hp)
    assert mmd_by_hand(h, hp) > 0.1  # the teacher's features are far enough to matter
    p = HPMParams(lam=lam, kt="mmd", mmd_form="pfllib")
    assert kt_loss(teacher, p)(student, x, y).item() == pytest.approx(want, rel=1e-5)


# -- knowledge transfer from the first selection ---------------------------------------------------
def mlp_features(w, x):
    return torch.relu(x.flatten(1) @ w["body.1.weight"].T + w["body.1.bias"])


def pfllib_kt(teacher, lam):
    """(1 - lam) CE + lam MMD(features(w), features(teacher)), PFLlib's MMD written with
    broadcast differences (not the |a|^2 + |b|^2 - 2 a.b expansion)."""

    def k(a, b):
        d2 = ((a[:, None, :] - b[None, :, :]) ** 2).sum(-1)
        return sum(torch.exp(-0.5 * d2 / s) for s in BANDWIDTHS)

    def loss(w, x, y):
        h, hp = mlp_features(w, x), mlp_features(teacher, x)
        mmd = (k(h, h) + k(hp, hp) - 2 * k(h, hp)).mean()
        return (1 - lam) * F.cross_entropy(mlp_logits(w, x), y) + lam * mmd

    return loss


def pfllib_algo(**kw):
    return {"name": "fedphp", "kt": "mmd", "mmd_form": "pfllib", "hpm_init": "start", **kw}


@pytest.mark.parametrize(("schedule", "m"), [("paper", 0.9 / (0.5 * 10)), ("code", 0.0)])
def test_first_selection_distils_from_the_download_by_hand(tiny, schedule, m):
    """hpm_init: start, first selection (empty state): E epochs of SGD from the download on
    (1 - lam) CE + lam MMD against the download itself (PFLlib's model_p, a copy of the initial
    model), then HPM = (1 - m) trained + m download with z = 1: paper m = 0.9 / (Q T), code 0."""
    lam = 0.5
    cfg = tiny(
        algorithm=pfllib_algo(lam=lam, mu_schedule=schedule),
        train={"rounds": 10, "client_fraction": 0.5},
    )
    sim = Simulation(cfg)
    env, d, w0 = sim.envs[1], sim.data.clients[1], sim.server["weights"]
    torch.manual_seed(4)
    up = sim.algo.client_update(env, {"weights": w0}, {}, RoundContext(1))
    torch.manual_seed(4)
    sent = hand_sgd(w0, d.train_x, d.train_y, pfllib_kt(w0, lam), lr=0.05)
    assert_close(up.upload["weights"], sent)
    assert_close(up.state["hpm"], {k: (1 - m) * sent[k] + m * w0[k] for k in w0})
    assert up.state["selected"] == 1
    # the KT term changed the result: plain CE from the same start lands elsewhere
    torch.manual_seed(4)
    plain = hand_sgd(w0, d.train_x, d.train_y, lr=0.05)
    assert max((plain[k] - sent[k]).abs().max().item() for k in w0) > 1e-3


def test_default_first_selection_still_trains_plain_ce(tiny):
    cfg = tiny(algorithm={"name": "fedphp", "lam": 0.5, "kt": "mmd", "mmd_form": "pfllib"})
    sim = Simulation(cfg)
    env, d, w0 = sim.envs[1], sim.data.clients[1], sim.server["weights"]
    torch.manual_seed(4)
    up = sim.algo.client_update(env, {"weights": w0}, {}, RoundContext(1))
    torch.manual_seed(4)
    sent = hand_sgd(w0, d.train_x, d.train_y, lr=0.05)
    assert_close(up.upload["weights"], sent)
    assert_close(up.state["hpm"], sent)


# -- momentum ----------------------------------------------------------------------------------------
def test_code_schedule_is_pfllibs_momentum_under_full_participation():
    # PFLlib (clientphp.py lines 12, 48): mu_R = (mu / T) * R, R = 0, 1, ... the round; with
    # every client selected every round, round R is a client's (R + 1)-th selection
    t, mu = 50, 0.9
    for r in range(t):
        assert hpm_momentum(r + 1, 1.0, t, mu, "code") == pytest.approx(mu / t * r, abs=1e-12)


def test_the_crosscheck_model_has_no_buffers():
    # PFLlib's HPM update moves parameters only (clientphp.py lines 49-50), pflkit's floating
    # entries of the state dict: the same for cnn4, which has no buffers
    from pflkit.models import build_model

    model = build_model("cnn4", (1, 28, 28), 10)
    assert list(model.buffers()) == []


# -- scoring the model right after local training --------------------------------------------------
def test_personal_trained_scores_the_uploaded_model_not_the_hpm(tiny):
    sim = Simulation(
        tiny(
            algorithm=pfllib_algo(personal="trained"), train={"rounds": 10, "client_fraction": 0.5}
        )
    )
    env, w0 = sim.envs[2], sim.server["weights"]
    hpm = {k: v + 0.3 for k, v in w0.items()}
    up = sim.algo.client_update(env, {"weights": w0}, {"hpm": hpm, "selected": 2}, RoundContext(3))
    scored = personal_weights(sim.algo, env, {"weights": w0}, up.state, RoundContext(1))
    assert_close(scored, up.upload["weights"], atol=0)
    assert any(not torch.allclose(scored[k], up.state["hpm"][k]) for k in w0)
    # MAP's protocol scores the same model; a client never selected, the global model
    assert_close(
        personal_weights(sim.algo, env, {}, up.state, RoundContext(1), upload=up.upload),
        up.upload["weights"],
        0,
    )
    assert same_weights(personal_weights(sim.algo, env, {"weights": w0}, {}, RoundContext(1)), w0)
    # the default scores the HPM
    default = Simulation(tiny(algorithm={"name": "fedphp"})).algo
    assert same_weights(
        personal_weights(default, env, {}, up.state, RoundContext(1)), up.state["hpm"]
    )


def test_a_round_reports_the_pooled_accuracy_of_the_trained_models(tiny):
    sim = Simulation(
        tiny(algorithm=pfllib_algo(personal="trained"), train={"rounds": 3, "client_fraction": 1.0})
    )
    sim.run_round(1)
    row = sim.run_round(2)

    def pooled(key):
        correct = total = 0
        for c in range(sim.data.num_clients):
            d = sim.data.clients[c]
            with torch.no_grad():
                pred = mlp_logits(sim.clients[c][key], d.test_x).argmax(1)
            correct += int((pred == d.test_y).sum())
            total += len(d.test_y)
        return correct / total

    assert row["pers_acc_weighted"] == pytest.approx(pooled("weights"), abs=1e-12)
    assert pooled("hpm") != pytest.approx(pooled("weights"), abs=1e-9)


# -- the cross-check case ------------------------------------------------------------------------------
def test_the_crosscheck_case_is_pfllibs_form_with_the_recommended_mu_and_lambda():
    here = Path(__file__).resolve().parents[2] / "benchmarks" / "crosscheck"
    spec = importlib.util.spec_from_file_location("crosscheck_cases_fedphp", here / "cases.py")
    cases = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = cases  # dataclasses look their module up while building
    try:
        spec.loader.exec_module(cases)
    finally:
        del sys.modules[spec.name]
    case = cases.CASES["fedphp"]
    assert (case.library, case.ref_name, case.ref_args) == (
        "pfllib",
        "FedPHP",
        ("-mu", "0.9", "-lam", "0.01"),
    )
    _, p = parse_params(case.pflkit)
    assert (p.kt, p.mmd_form, p.hpm_init, p.mu_schedule, p.personal) == (
        "mmd",
        "pfllib",
        "start",
        "code",
        "trained",
    )
    assert (p.lam, p.mu, p.weighting) == (0.01, 0.9, "samples")
    keys = list(cases.CASES)
    assert keys.index("fedphp") == keys.index("fedamp") + 1


# -- the client step and the HPM update, by hand ---------------------------------------------------
def test_fedphp_uploads_the_fine_tuned_model_and_folds_it_into_the_hpm(tiny):
    # FedPHP: the upload is the model fine-tuned from the download; the HPM becomes
    # (1 - mu_k) upload + mu_k old HPM with mu_k = 0.9 z / (Q T) = 0.9 * 3 / (0.5 * 10) = 0.54
    sim = Simulation(
        tiny(algorithm={"name": "fedphp"}, train={"rounds": 10, "client_fraction": 0.5})
    )
    env, w0 = sim.envs[1], sim.server["weights"]
    old = {k: v + 0.3 for k, v in w0.items()}
    up = sim.algo.client_update(env, {"weights": w0}, {"hpm": old, "selected": 2}, RoundContext(3))
    new, sent = up.state["hpm"], up.upload["weights"]
    assert up.state["selected"] == 3
    for k in w0:
        assert torch.allclose(new[k], 0.46 * sent[k] + 0.54 * old[k], atol=1e-6)
    assert any(not torch.allclose(sent[k], new[k]) for k in w0)


def test_fedphp_client_step_distils_from_the_hpm_by_hand(tiny):
    """FedPHP with an HPM: the upload is E epochs of SGD from the download on Eq. 13 (KD from
    the frozen HPM, lambda = 0.3, tau = 4); the HPM becomes (1 - mu_k) upload + mu_k HPM with
    mu_k = 0.9 z / (Q T) = 0.9 * 2 / (0.5 * 10) = 0.36 (second selection)."""
    lam = 0.3
    cfg = tiny(
        algorithm={"name": "fedphp", "lam": lam}, train={"rounds": 10, "client_fraction": 0.5}
    )
    sim = Simulation(cfg)
    env, d, w = sim.envs[2], sim.data.clients[2], sim.server["weights"]
    torch.manual_seed(0)
    hpm = {k: v + 0.3 * torch.randn_like(v) for k, v in w.items()}
    torch.manual_seed(5)
    up = sim.algo.client_update(env, {"weights": w}, {"hpm": hpm, "selected": 1}, RoundContext(4))
    torch.manual_seed(5)
    sent = hand_sgd(w, d.train_x, d.train_y, kt_ce(hpm, lam), lr=0.05)
    assert_close(up.upload["weights"], sent)
    assert_close(up.state["hpm"], {k: 0.64 * sent[k] + 0.36 * hpm[k] for k in w})
    assert up.state["selected"] == 2
