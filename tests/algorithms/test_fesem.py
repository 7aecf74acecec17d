"""FeSEM: the E-step (nearest centre by L2 distance), the M-step (mean of the members only), empty
clusters, bad parameters and a short run. Expected values are written by hand or computed with
numpy in the test."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import tiny_config
from pflkit.algorithms.context import ServerContext
from pflkit.algorithms.fesem import fesem_step
from pflkit.engine import Simulation, run_experiment
from pflkit.errors import PflkitError
from pflkit.experiment import validate


def w(x, y, s=0.0):
    """A toy model: parameter ``w`` = (x, y), a float buffer ``s`` and an integer counter."""
    return {"w": torch.tensor([x, y]), "s": torch.tensor([s]), "n": torch.tensor(7)}


def up(x, y, num=1, s=0.0):
    return {"weights": w(x, y, s), "num_samples": num}


CENTERS = {0: w(0.0, 0.0), 1: w(10.0, 10.0, s=20.0), 2: w(100.0, -100.0)}
# client 0 at (1, 0): |.-c0| = 1, |.-c1| = 13.45 -> 0;  client 1 at (9, 11): 14.2 vs 1.41 -> 1
# client 2 at (6, 6): 8.49 vs 5.66 -> 1;  client 3 at (4, 4): 5.66 vs 8.49 -> 0
UPLOADS = {0: up(1.0, 0.0, 1), 1: up(9.0, 11.0, 1), 2: up(6.0, 6.0, 3), 3: up(4.0, 4.0, 3)}


def test_e_step_assigns_each_client_to_its_nearest_center():
    _, assign = fesem_step(CENTERS, UPLOADS, ["w"], uniform=True)
    assert assign == {0: 0, 1: 1, 2: 1, 3: 0}
    # the distance runs over the listed parameters only: buffer s = 20 would flip client 3's
    # choice (sqrt(32 + 400) = 20.8 from c0, sqrt(72 + 0) = 8.49 from c1), but is ignored
    ups = {3: up(4.0, 4.0, s=20.0)}
    assert fesem_step(CENTERS, ups, ["w"], uniform=True)[1] == {3: 0}
    # Euclidean, not L1: (5, 0) is 5 from (0, 0) and sqrt(4 + 16) = 4.47 from (3, 4) (L1: 5 < 6)
    two = {0: w(0.0, 0.0), 1: w(3.0, 4.0)}
    assert fesem_step(two, {9: up(5.0, 0.0)}, ["w"], uniform=True)[1] == {9: 1}
    # by hand: (7, -1) is 7.07 from c0 and 11.40 from c1; (7, 4) is 8.06 and 6.71
    assert fesem_step(CENTERS, {5: up(7.0, -1.0)}, ["w"], uniform=True)[1] == {5: 0}
    assert fesem_step(CENTERS, {5: up(7.0, 4.0)}, ["w"], uniform=True)[1] == {5: 1}


def test_m_step_center_is_the_mean_of_its_members_only():
    centers, _ = fesem_step(CENTERS, UPLOADS, ["w"], uniform=True)
    # cluster 0 = clients 0, 3: ((1 + 4) / 2, (0 + 4) / 2); cluster 1 = clients 1, 2
    np.testing.assert_allclose(centers[0]["w"], [2.5, 2.0])
    np.testing.assert_allclose(centers[1]["w"], [7.5, 8.5])
    assert int(centers[0]["n"]) == 7  # integer buffers are copied, not averaged
    # weighting="samples": cluster 0 weights 1 and 3 -> ((1 + 12) / 4, (0 + 12) / 4)
    weighted, _ = fesem_step(CENTERS, UPLOADS, ["w"], uniform=False)
    np.testing.assert_allclose(weighted[0]["w"], [3.25, 3.0])
    np.testing.assert_allclose(weighted[1]["w"], [(9 + 18) / 4, (11 + 18) / 4])


def test_an_empty_cluster_keeps_its_center():
    centers, assign = fesem_step(CENTERS, UPLOADS, ["w"], uniform=True)
    assert 2 not in assign.values()
    assert centers[2] is CENTERS[2]  # untouched
    np.testing.assert_allclose(centers[2]["w"], [100.0, -100.0])
    # a round where nobody picks centre 1 keeps it too, and moves centre 0 alone
    centers, _ = fesem_step(CENTERS, {0: up(1.0, 1.0)}, ["w"], uniform=True)
    np.testing.assert_allclose(centers[1]["w"], [10.0, 10.0])
    np.testing.assert_allclose(centers[0]["w"], [1.0, 1.0])


@pytest.mark.parametrize(
    ("algo", "match"),
    [({"num_clusters": 0}, "num_clusters"), ({"num_clusters": 5}, "at most 4")],
)
def test_bad_number_of_clusters_is_one_sentence(algo, match):
    with pytest.raises(PflkitError, match=match) as err:
        Simulation(validate(tiny_config(algorithm={"name": "fesem", **algo})))
    assert "\n" not in str(err.value)


def recording(sim):
    """Wrap the algorithm's aggregate to record (centres before, uploads) per round."""
    seen = []
    real = sim.algo.aggregate

    def spy(env, server, uploads, sctx):
        seen.append(({k: dict(v) for k, v in server["centers"].items()}, dict(uploads)))
        return real(env, server, uploads, sctx)

    sim.algo.aggregate = spy
    return seen


def flat(weights, keys):
    return np.concatenate([weights[k].double().numpy().ravel() for k in keys])


def test_short_run_assigns_by_distance_and_averages_members(tiny):
    sim = Simulation(tiny(algorithm={"name": "fesem", "num_clusters": 2}, train={"rounds": 3}))
    seen = recording(sim)
    keys = [k for k, _ in sim.senv.model().named_parameters()]
    w0 = sim.server["weights"]
    # round 1: nobody has a cluster, everybody downloads w^0
    assert all(
        sim.algo.configure(sim.senv, sim.server, c, ServerContext(1, "train"))["weights"] is w0
        for c in range(4)
    )
    rows = [sim.run_round(r) for r in (1, 2, 3)]
    full = sum(v.numel() * v.element_size() for v in w0.values())
    for row in rows:
        assert row["bytes_down"] == [full] * 4 and row["bytes_up"] == [full + 8] * 4
        assert "pers_acc_mean" in row and "global_acc" not in row
    assert sorted(sim.server["centers"]) == [0, 1]
    for rnd in (2, 3):  # the E- and M-steps by numpy on what the clients uploaded
        before, uploads = seen[rnd - 1]
        want_assign = {
            c: int(
                np.argmin(
                    [
                        np.linalg.norm(flat(u["weights"], keys) - flat(before[k], keys))
                        for k in (0, 1)
                    ]
                )
            )
            for c, u in uploads.items()
        }
        after = seen[rnd][0] if rnd < 3 else sim.server["centers"]
        for k in (0, 1):
            members = [c for c, a in want_assign.items() if a == k]
            want = (
                np.mean([flat(uploads[c]["weights"], keys) for c in members], 0)
                if members
                else flat(before[k], keys)
            )
            np.testing.assert_allclose(flat(after[k], keys), want, rtol=1e-6, atol=1e-7)
        if rnd == 3:
            assert sim.server["assign"] == want_assign
    # every client now downloads, and is scored on, the centre of its own cluster
    for c in range(4):
        k = sim.server["assign"][c]
        assert (
            sim.algo.eval_view(sim.senv, sim.server, c, ServerContext(1))["weights"]
            is sim.server["centers"][k]
        )


def test_random_init_builds_k_distinct_centers_before_any_round(tiny, tmp_path):
    cfg = tiny(
        algorithm={"name": "fesem", "num_clusters": 3, "init": "random"}, train={"rounds": 2}
    )
    sim = Simulation(cfg)
    centers = sim.server["centers"]
    assert sorted(centers) == [0, 1, 2]
    key = "head.weight" if "head.weight" in centers[0] else next(iter(centers[0]))
    assert not torch.equal(centers[0][key], centers[1][key])
    assert not torch.equal(centers[0][key], sim.server["weights"][key])
    result = run_experiment(cfg, out=tmp_path / "run")
    assert len(result.rows) == 2 and "pers_acc_mean" in result.rows[-1]


def test_each_client_downloads_and_is_scored_on_its_own_centre(tiny):
    """configure and eval_view send the centre of the client's cluster, by value: (10, 10) for
    a client of cluster 1, (100, -100) for cluster 2, w^0 = (0, 0) for a client without one."""
    sim = Simulation(tiny(algorithm={"name": "fesem", "num_clusters": 3}))
    server = {"weights": w(0.0, 0.0), "centers": CENTERS, "assign": {3: 1, 1: 2}}
    for cid, want in ((3, [10.0, 10.0]), (1, [100.0, -100.0]), (0, [0.0, 0.0])):
        down = sim.algo.configure(sim.senv, server, cid, ServerContext(2, "train"))["weights"]
        np.testing.assert_allclose(down["w"], want)
        view = sim.algo.eval_view(sim.senv, server, cid, ServerContext(1))["weights"]
        np.testing.assert_allclose(view["w"], want)
