"""``pflkit analyze privacy`` (issue 39, item 1): DLG against what each algorithm uploads
(GPFL §3.3, §4.7, Table 5; src/pflkit/analysis/privacy.py)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
import yaml
from torch import nn

from conftest import tiny_config
from pflkit.algorithms.gpfl import TABLE, alg_loss, cov_apply, cov_params
from pflkit.analysis.privacy import (
    dlg,
    known_gradient,
    match_order,
    privacy_study,
    psnr,
    victim_update,
)
from pflkit.engine.clients import InProcess
from pflkit.engine.simulation import Simulation
from pflkit.errors import PflkitError
from pflkit.experiment import validate
from pflkit.primitives.training import set_weights

FAST = dict(iterations=1, victims=1, batches=1, batch_size=1)


# -- the score -----------------------------------------------------------------------------------


def test_psnr_by_hand():
    zeros = torch.zeros(1, 1, 2, 2)
    assert psnr(zeros, torch.full_like(zeros, 0.1)) == pytest.approx(20.0)  # MSE 0.01, peak 1
    a = torch.tensor([[0.0, 0.5], [1.0, 1.0]])
    b = torch.tensor([[0.5, 0.5], [1.0, 0.0]])  # MSE (0.25 + 0 + 0 + 1) / 4 = 0.3125
    assert psnr(a, b) == pytest.approx(10 * math.log10(1 / 0.3125))  # 5.05 dB
    assert psnr(a, a) == 100.0


def test_reconstructions_are_matched_to_originals_whatever_their_order():
    x = torch.rand(4, 1, 3, 3)
    assert torch.equal(match_order(x, x[[2, 0, 3, 1]]), x)


# -- the attack ----------------------------------------------------------------------------------


def test_dlg_recovers_one_sample_from_a_linear_models_gradient():
    """One sample through Linear(16, 4): the weight gradient is e x^T, so DLG with MSE on a
    dummy output finds x; above 30 dB after 30 L-BFGS iterations (seeded, deterministic)."""
    torch.manual_seed(0)
    model = nn.Linear(16, 4)
    x = 0.1 + 0.8 * torch.rand(1, 16)
    z = torch.randn(1, 4)
    params = list(model.parameters())
    delta = torch.autograd.grad(F.mse_loss(model(x), z), params)
    gen = torch.Generator().manual_seed(1)
    rec, loss = dlg(model, params, delta, x.shape, (1, 4), iterations=30, gen=gen)
    assert psnr(x, rec) > 30, psnr(x, rec)
    assert loss < 1e-8


# -- what the server observes ----------------------------------------------------------------------


def tiny_sim(**algorithm) -> Simulation:
    cfg = validate(tiny_config(algorithm=algorithm or {"name": "fedavg"}))
    return Simulation(cfg, runner=InProcess())


def test_delta_is_the_victims_batch_gradient_at_the_received_weights():
    """FedAvg in round 1: Delta = (received - uploaded) / lr is grad CE(model(x), y) at the
    global weights, for every parameter (not the negative, not scaled by lr)."""
    sim = tiny_sim()
    c = sim.data.clients[1]
    x, y = c.train_x[:3], c.train_y[:3]
    received, delta = victim_update(sim, 1, 1, x, y)
    model = sim.envs[1].model("check")
    set_weights(model, sim.server["weights"])
    names = [k for k, _ in model.named_parameters()]
    grads = torch.autograd.grad(F.cross_entropy(model(x), y), list(model.parameters()))
    assert sorted(delta) == sorted(names)
    for k, g in zip(names, grads, strict=True):
        torch.testing.assert_close(delta[k], g, rtol=1e-3, atol=1e-6)


def test_gpfl_table_update_less_the_regulariser_is_the_angle_loss_gradient():
    """GPFL's GCE table gets its data gradient from L^alg only (Eq. 8; L^mlg uses the frozen
    copy): Delta minus the server-computable regulariser (Eq. 11) must be exactly that, which
    is also what the pseudo model's cosine logits (Eq. 13) differentiate."""
    sim = tiny_sim(name="gpfl")
    c = sim.data.clients[0]
    x, y = c.train_x[:4], c.train_y[:4]
    received, delta = victim_update(sim, 0, 1, x, y)
    known = known_gradient(sim.algo, received)
    assert set(known) == {k for k in received if k.startswith("cov.")} | {TABLE}
    model = sim.envs[0].model("check")
    set_weights(model, {k: v for k, v in received.items() if k.startswith("body.")}, strict=False)
    cov = {k: v for k, v in received.items() if k.startswith("cov.")}
    table = received[TABLE].clone().requires_grad_()
    with torch.no_grad():
        f_g = cov_apply(model.features(x), *cov_params(cov, received[TABLE].mean(0)))
    (grad,) = torch.autograd.grad(alg_loss(f_g, table, y), [table])
    torch.testing.assert_close(delta[TABLE] - known[TABLE], grad, rtol=1e-3, atol=1e-5)


@pytest.mark.parametrize(
    ("algorithm", "targets"),
    [
        ("fedavg", ["full", "fe"]),
        ("fedrod", ["full", "fe"]),
        ("fedper", ["fe"]),
        ("fedrep", ["fe"]),
        ("gpfl", ["fe", "sfe", "sm"]),
    ],
)
def test_targets_follow_what_the_algorithm_uploads(tiny, tmp_path, algorithm, targets):
    res = privacy_study(tiny(algorithm={"name": algorithm}), tmp_path / "p", **FAST)
    assert [r["target"] for r in res["rows"]] == targets
    assert all(r["psnr_mean"] > 0 for r in res["rows"])
    assert sorted(p.name for p in (tmp_path / "p").iterdir()) == [
        "privacy.json",
        "privacy.md",
        "privacy.png",
    ]


def test_an_algorithm_that_uploads_nothing_is_refused(tiny, tmp_path):
    with pytest.raises(PflkitError, match="algorithm 'local' uploads no trainable tensor"):
        privacy_study(tiny(algorithm={"name": "local"}), tmp_path / "p", **FAST)
    assert not (tmp_path / "p").exists()


# -- the command -----------------------------------------------------------------------------------


@pytest.fixture
def cfg_file(tmp_path):
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(tiny_config()))
    return path


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--attack", "ig"], "unknown --attack 'ig': use --attack dlg"),
        (["--round", "4"], "--round 4 is outside the config's 3 rounds: choose --round from 1 to 3"),
        (["--targets", "fe,head"], "unknown --targets entry 'head': choose from full, fe, sfe, sm"),
        (["--algorithms", "fedper", "--targets", "full"],
         "--targets full needs parameters that algorithm 'fedper' does not upload: choose from fe"),
        (["--algorithms", "fedavg,local"], "algorithm 'local' uploads no trainable tensor"),
        (["--victims", "9,"], "--victims 9 is not a client: give ids between 0 and 3"),
        (["--victims", "5"], "--victims 5 exceeds the 4 clients with training data"),
        (["--victims", "a,b"], "--victims 'a,b' is not a count or a list of client ids"),
        (["--iterations", "0"], "--iterations must be at least 1, got 0"),
    ],
)  # fmt: skip
def test_bad_input_is_one_sentence_and_leaves_no_folder(cli, cfg_file, tmp_path, args, message):
    r = cli("analyze", "privacy", str(cfg_file), *args, "--out", "pv", cwd=tmp_path)
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    assert message in r.stderr, r.stderr
    assert "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert not (tmp_path / "pv").exists()


def test_the_command_writes_the_table(cli, cfg_file, tmp_path):
    r = cli("analyze", "privacy", str(cfg_file), "--algorithms", "fedavg,gpfl", "--round", "2",
            "--iterations", "2", "--victims", "0,2", "--batches", "1", "--batch-size", "2",
            "--seeds", "0,1", "--out", "pv", cwd=tmp_path)  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert "fedavg-full: PSNR" in r.stdout and "gpfl-sm: PSNR" in r.stdout
    assert "[20/20," in r.stderr  # progress: 5 targets x 2 victims x 1 batch x 2 seeds
    table = (tmp_path / "pv" / "privacy.md").read_text()
    assert "| gpfl | sfe |" in table and "| 6.41 |" in table  # with the paper's column
    assert "Reference: the dummy's random start" in table
    assert (tmp_path / "pv" / "privacy.png").read_bytes()[:4] == b"\x89PNG"


def test_the_study_recovers_one_sample_from_fedper_s_body_update(tiny, tmp_path):
    """End to end (round 1, one sample of client 1, 20 iterations): the body's first Linear
    layer gets the gradient e x^T, so the reconstruction is exact (above 40 dB)."""
    res = privacy_study(
        tiny(algorithm={"name": "fedper"}),
        tmp_path / "p",
        iterations=20,
        victims=[1],
        batches=1,
        batch_size=1,
    )
    assert res["rows"][0]["psnr_mean"] > 40, res["rows"]
