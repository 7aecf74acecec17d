"""Client-level DP of the uploads (pflkit.privacy.client_dp, pflkit.privacy.accountant): the
clipping and the noise by value, the accountant against dp-accounting's and Opacus's own
numbers, Flower's DP wrappers on the same updates, adaptive clipping, resume, refusals."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from conftest import tiny_config
from pflkit.algorithms import build_algorithm
from pflkit.algorithms.context import ServerContext
from pflkit.engine import Simulation, run_experiment
from pflkit.errors import PflkitError
from pflkit.experiment import validate
from pflkit.privacy import accountant
from pflkit.privacy.client_dp import ClientDP

dp_accounting = pytest.importorskip("dp_accounting")


def mechanism(algo="fedavg", clients=4, fraction=1.0, **dp):
    cfg = validate(
        tiny_config(
            algorithm={"name": algo},
            data={"num_clients": clients},
            train={"client_fraction": fraction},
            privacy={"client_dp": {"clip": 1.0, "noise_multiplier": 0.0, **dp}},
        )
    )
    a = build_algorithm(cfg.algorithm)
    return ClientDP(cfg, a, clients), a


def vec(*xs):
    return {"w": torch.tensor(xs, dtype=torch.float32)}


def test_central_clips_each_update_and_divides_the_sum_by_the_cohort():
    dp, algo = mechanism(clients=2)
    ref = vec(1.0, 1.0)
    # updates (3, 4): norm 5, scaled to (0.6, 0.8); (0.3, 0.4): norm 0.5, kept
    uploads = {
        0: {"weights": vec(4.0, 5.0), "num_samples": 7},
        1: {"weights": vec(1.3, 1.4), "num_samples": 100},
    }
    out = dp.release(algo, uploads, {0: {"weights": ref}, 1: {"weights": ref}}, 1, 0)
    for cid in (0, 1):
        assert torch.allclose(out[cid]["weights"]["w"], torch.tensor([1.45, 1.6]))
        assert out[cid]["num_samples"] == 1  # equal weights: n_k is not released
    # the algorithm's own aggregate of the released uploads is the DP mean
    server = algo.aggregate(None, {}, out, ServerContext(1, "train"))
    assert torch.allclose(server["weights"]["w"], torch.tensor([1.45, 1.6]))


def test_a_client_that_drops_out_keeps_the_fixed_denominator():
    dp, algo = mechanism(clients=2)  # a cohort of 2, one upload arrives: its update / 2
    ref = vec(0.0, 0.0)
    out = dp.release(algo, {1: {"weights": vec(0.3, 0.4)}}, {1: {"weights": ref}}, 1, 0)
    assert torch.allclose(out[1]["weights"]["w"], torch.tensor([0.15, 0.2]))


def test_the_norm_is_taken_over_every_released_tensor_together():
    dp, algo = mechanism(algo="scaffold", clients=1)  # two released keys, no reference
    up = {"delta_y": vec(3.0), "delta_c": vec(4.0), "num_samples": 1}
    out = dp.release(algo, {0: up}, {0: {}}, 1, 0)
    assert out[0]["delta_y"]["w"].item() == pytest.approx(0.6)
    assert out[0]["delta_c"]["w"].item() == pytest.approx(0.8)


def test_local_mode_keeps_each_clients_clipped_update():
    dp, algo = mechanism(clients=2, mode="local")
    ref = vec(0.0, 0.0)
    uploads = {0: {"weights": vec(3.0, 4.0)}, 1: {"weights": vec(0.3, 0.4)}}
    out = dp.release(algo, uploads, {0: {"weights": ref}, 1: {"weights": ref}}, 1, 0)
    assert torch.allclose(out[0]["weights"]["w"], torch.tensor([0.6, 0.8]))
    assert torch.allclose(out[1]["weights"]["w"], torch.tensor([0.3, 0.4]))


def test_integer_buffers_are_not_released():
    dp, algo = mechanism(clients=1)
    ref = {"w": torch.zeros(2), "steps": torch.tensor(5)}
    up = {"weights": {"w": torch.ones(2), "steps": torch.tensor(9)}}
    out = dp.release(algo, {0: up}, {0: {"weights": ref}}, 1, 0)
    assert out[0]["weights"]["steps"].item() == 5  # the payload's value, not the client's


@pytest.mark.parametrize("mode,std", [("central", 2.0 * 0.5 / 4), ("local", 2.0 * 0.5)])
def test_noise_std_is_z_times_c_on_the_sum(mode, std):
    dp, algo = mechanism(clients=4, mode=mode, noise_multiplier=2.0, clip=0.5)
    zeros = {"w": torch.zeros(200_000)}
    uploads = {c: {"weights": dict(zeros)} for c in range(4)}
    out = dp.release(algo, uploads, {c: {"weights": zeros} for c in range(4)}, 1, 0)
    noise = out[0]["weights"]["w"].double()
    # the sample std of 200,000 normal draws is within 0.5% of the true one (> 6 SEs)
    assert noise.std().item() == pytest.approx(std, rel=0.005)
    assert abs(noise.mean().item()) < 5 * std / math.sqrt(noise.numel())
    if mode == "local":  # independent noise per client
        assert not torch.equal(out[0]["weights"]["w"], out[1]["weights"]["w"])


def test_noise_is_seeded_by_round_and_phase():
    dp, algo = mechanism(clients=1, noise_multiplier=1.0)
    up = {0: {"weights": vec(0.0, 0.0)}}
    pay = {0: {"weights": vec(0.0, 0.0)}}
    a = dp.release(algo, up, pay, 1, 0)[0]["weights"]["w"]
    assert torch.equal(a, dp.release(algo, up, pay, 1, 0)[0]["weights"]["w"])
    assert not torch.equal(a, dp.release(algo, up, pay, 2, 0)[0]["weights"]["w"])


# -- the accountant --------------------------------------------------------------------------------
@pytest.mark.parametrize("q,z,rounds", [(1.0, 1.1, 1), (1.0, 2.0, 50), (0.05, 1.0, 200)])
def test_epsilon_equals_dp_accountings_round_by_round(q, z, rounds):
    delta = 1e-5
    acc = dp_accounting.rdp.RdpAccountant()
    event = dp_accounting.GaussianDpEvent(z)
    if q < 1:
        event = dp_accounting.PoissonSampledDpEvent(q, event)
    for _ in range(rounds):  # one composition per round: an independent path to the same event
        acc.compose(event)
    assert accountant.epsilon(z, q, rounds, delta) == pytest.approx(
        acc.get_epsilon(delta), rel=1e-9
    )


def test_epsilon_agrees_with_opacus_and_the_pld_accountant():
    opacus = pytest.importorskip("opacus.accountants")
    q, z, rounds, delta = 0.1, 1.0, 100, 1e-5
    theirs = opacus.RDPAccountant()
    theirs.history = [(z, q, rounds)]
    ours = accountant.epsilon(z, q, rounds, delta)
    # RDP over different orders grids: within 3%; PLD is tighter than RDP
    assert ours == pytest.approx(theirs.get_epsilon(delta), rel=0.03)
    assert accountant.epsilon(z, q, rounds, delta, "pld") < ours


def test_one_gaussian_release_has_the_gaussian_mechanisms_epsilon():
    # the exact epsilon of one Gaussian mechanism (Balle & Wang 2018), a closed form
    z, delta = 1.0, 1e-3
    exact = dp_accounting.get_epsilon_gaussian(z, delta)
    assert accountant.epsilon(z, 1.0, 1, delta, "pld") == pytest.approx(exact, rel=1e-2)


def test_calibrate_spends_the_target_exactly():
    z = accountant.calibrate(3.0, 0.2, 40, 1e-4)
    assert accountant.epsilon(z, 0.2, 40, 1e-4) == pytest.approx(3.0, rel=1e-3)
    assert accountant.epsilon(z * 0.99, 0.2, 40, 1e-4) > 3.0


def test_every_row_reports_the_epsilon_of_the_rounds_so_far(tmp_path):
    cfg = validate(
        tiny_config(
            train={"rounds": 3, "client_fraction": 0.5},
            privacy={"client_dp": {"clip": 1.0, "noise_multiplier": 1.5, "target_delta": 1e-3}},
        )
    )
    rows = run_experiment(cfg, out=tmp_path / "run").rows
    for r, row in enumerate(rows, 1):
        assert row["dp_epsilon"] == pytest.approx(accountant.epsilon(1.5, 0.5, r, 1e-3))
        assert row["dp_delta"] == 1e-3
    # the default delta is 1/N
    dp, _ = mechanism(clients=4)
    assert dp.delta == 0.25


# -- Flower's DP wrappers on the same updates --------------------------------------------------------
def test_clipping_and_noise_std_equal_flowers_fixed_clipping_wrapper():
    fdp = pytest.importorskip("flwr.supercore.differential_privacy")
    rng = np.random.default_rng(0)
    ref = [rng.normal(size=(3, 4)).astype(np.float32), rng.normal(size=5).astype(np.float32)]
    ups = [
        [r + rng.normal(scale=s, size=r.shape).astype(np.float32) for r in ref] for s in (0.1, 2.0)
    ]
    dp, algo = mechanism(clients=2, mode="local", clip=1.5)

    def as_tree(arrs):
        return {"weights": {"a": torch.from_numpy(arrs[0]), "b": torch.from_numpy(arrs[1])}}  # noqa: E731

    out = dp.release(
        algo, {c: as_tree(u) for c, u in enumerate(ups)}, {c: as_tree(ref) for c in range(2)}, 1, 0
    )
    for c, u in enumerate(ups):
        theirs = [a.copy() for a in u]
        fdp.compute_clip_model_update(theirs, ref, 1.5)  # param1 <- param2 + clipped update
        ours = out[c]["weights"]
        np.testing.assert_allclose(ours["a"].numpy(), theirs[0], rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(ours["b"].numpy(), theirs[1], rtol=1e-6, atol=1e-6)
    # the server-side wrapper's noise std on the mean: z C / m
    central, _ = mechanism(clients=8, noise_multiplier=1.3, clip=1.5)
    assert fdp.compute_stdv(1.3, 1.5, 8) == pytest.approx(
        central.z_update * central.clip / central.cohort
    )
    # adaptive clipping's update noise, Andrew et al. Thm. 1 (Flower's computation of it)
    adaptive, _ = mechanism(clients=40, noise_multiplier=0.9, adaptive=True)
    _, z_update = fdp.compute_adaptive_noise_params(0.9, 40, None)
    assert adaptive.z_update == pytest.approx(z_update)


def test_adaptive_clipping_moves_c_geometrically_toward_the_quantile():
    # almost no noise: b is the unclipped fraction (1 of 4), C <- C exp(-eta (b - gamma))
    dp, algo = mechanism(
        clients=4, noise_multiplier=1e-3, count_noise=1e-3, adaptive=True, clip=1.0, clip_lr=0.5
    )
    ref = vec(0.0)
    uploads = {c: {"weights": vec(x)} for c, x in enumerate([0.5, 2.0, 3.0, 4.0])}
    dp.release(algo, uploads, {c: {"weights": ref} for c in range(4)}, 1, 0)
    assert dp.clip == pytest.approx(math.exp(-0.5 * (0.25 - 0.5)), rel=1e-3)


def test_resume_continues_the_adaptive_clipping_norm(tmp_path):
    dp = {"clip": 0.5, "noise_multiplier": 0.2, "adaptive": True, "count_noise": 1.0}
    cfg = validate(
        tiny_config(train={"rounds": 4}, privacy={"client_dp": dp}, output={"checkpoint_every": 1})
    )
    whole = run_experiment(cfg, out=tmp_path / "whole").rows
    assert len({r["dp_clip"] for r in whole}) > 1  # C moves
    states = tmp_path / "states"  # the checkpoint's client states live here
    with Simulation(cfg, state_dir=states) as sim:
        for r in (1, 2):
            sim.run_round(r)
        sim.save(tmp_path / "ckpt.pt")
    with Simulation(cfg, state_dir=states) as sim:
        sim.restore(tmp_path / "ckpt.pt")
        rows = [sim.run_round(r) for r in (3, 4)]
    for a, b in zip(rows, whole[2:], strict=True):
        assert a["dp_clip"] == b["dp_clip"] and a["pers_acc_mean"] == b["pers_acc_mean"]


# -- refusals ---------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "algo,dp,words",
    [
        ("fedfomo", {}, "mixing weights"),
        ("fedproto", {}, "classes the client holds"),
        ("pfedsim", {}, "mode: local"),
        ("local", {}, "releases nothing"),
        ("fedavg", {"mode": "local", "adaptive": True}, "adaptive"),
        ("fedavg", {"adaptive": True, "noise_multiplier": 5.0}, "count_noise"),
    ],
)
def test_unboundable_runs_are_refused_in_one_sentence(algo, dp, words):
    with pytest.raises(PflkitError, match=words):
        mechanism(algo=algo, **{"noise_multiplier": 1.0, **dp})


def test_a_range_of_client_fractions_is_refused():
    with pytest.raises(PflkitError, match="one train.client_fraction"):
        mechanism(fraction=[0.2, 0.5])


@pytest.mark.parametrize(
    "dp,words",
    [
        ({"clip": 1.0, "noise_multiplier": -1.0}, "noise_multiplier"),
        ({"clip": 1.0, "noise_multiplier": 1.0, "target_delta": 1.0}, "target_delta"),
        ({"clip": 1.0}, "exactly one of noise_multiplier"),
        ({"clip": 0, "noise_multiplier": 1.0}, "clip"),
    ],
)
def test_bad_privacy_config_exits_2_with_one_sentence(cli, tmp_path, dp, words):
    import yaml

    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(tiny_config(privacy={"client_dp": dp})))
    r = cli("run", str(path), "--out", str(tmp_path / "out"), cwd=tmp_path)
    assert r.returncode == 2 and words in r.stderr and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "out").exists()


def test_dp_with_an_unsupported_algorithm_exits_2(cli, tmp_path):
    import yaml

    raw = tiny_config(
        algorithm={"name": "fedfomo"}, privacy={"client_dp": {"noise_multiplier": 1.0}}
    )
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(raw))
    r = cli("run", str(path), "--out", str(tmp_path / "out"), cwd=tmp_path)
    assert r.returncode == 2 and "fedfomo" in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "out").exists()
