"""MAP and ScaMAP (pflkit.algorithms.map): the two stages, the selected-client protocol, MAP's
incomplete-class partition; FedRS and FedPHP trained on that federation. The restricted softmax
and the inherited private model: blocks/test_rs.py, blocks/test_hpm.py; FedRS and FedPHP by
value: test_fedrs.py, test_fedphp.py."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from map_helpers import kt_ce
from pflkit.algorithms.base import parse_params
from pflkit.algorithms.blocks.rs import class_counts, rs_loss, rs_scale
from pflkit.algorithms.context import RoundContext, ServerContext
from pflkit.engine import Simulation, run_experiment
from pflkit.engine.simulation import seed_torch
from pflkit.errors import PflkitError
from pflkit.primitives.training import get_weights, set_weights
from pflkit.testing import personal_weights, same_weights
from split_helpers import assert_close, hand_sgd, rs_ce


# -- MAP ---------------------------------------------------------------------------------------------
def incomplete(tiny, **algo):
    return tiny(
        algorithm={"name": "map", **algo},
        data={"num_clients": 6, "partition": {"name": "incomplete", "min_classes": 2}},
        train={"rounds": 4, "local_epochs": 2, "client_fraction": 0.5},
        eval={"selected_clients": True},
    )


def test_map_stage_lengths(tiny):
    sim = Simulation(incomplete(tiny))
    n = len(sim.data.clients[0].train_y)
    total = 2 * math.ceil(n / 16)
    ctx = RoundContext(1)
    assert sim.algo.stage_steps(sim.envs[0], ctx) == (total - total // 2, total // 2)  # E/2 + E/2
    sim = Simulation(incomplete(tiny, stage_b_fraction=0.1, stage_b_lr_scale=0.2))
    assert sim.algo.stage_steps(sim.envs[0], ctx) == (total, max(int(0.1 * total), 5))  # code


def test_map_uploads_the_stage_a_rs_model_and_keeps_stage_b_private(tiny):
    sim = Simulation(incomplete(tiny, alpha=0.0))
    env, algo = sim.envs[1], sim.algo
    payload = {"weights": sim.server["weights"]}
    seed_torch(9)
    ctx = RoundContext(1)
    up = algo.client_update(env, payload, {}, ctx)
    # stage A alone, same seed: RS loss for steps_A steps
    model = env.model(slot="check")
    set_weights(model, sim.server["weights"])
    seed_torch(9)
    y = sim.data.clients[1].train_y
    loss_fn = rs_loss(rs_scale(class_counts(y, 10), 0.0))
    env.train(model, ctx, loss_fn=loss_fn, steps=algo.stage_steps(env, ctx)[0])
    for k, v in get_weights(model).items():
        assert torch.equal(up.upload["weights"][k], v)
    # the HPM (stage B result) differs from the upload and is the personalized model
    hpm = up.state["hpm"]
    assert any(not torch.equal(hpm[k], up.upload["weights"][k]) for k in hpm)
    assert same_weights(personal_weights(algo, env, {}, up.state, RoundContext(1)), hpm)


def test_map_trains_on_incomplete_classes(tiny, tmp_path):
    res = run_experiment(incomplete(tiny), out=tmp_path / "map")
    final = res.summary["final"]
    assert final["pers_acc_mean"] > 0.5 and final["global_acc"] > 0.3  # chance: 0.1
    assert "pers_acc_selected" in final
    res_mmd = run_experiment(incomplete(tiny, lam=0.1, kt="mmd"), out=tmp_path / "mmd")
    assert res_mmd.summary["final"]["pers_acc_mean"] > 0.5


@pytest.mark.parametrize("name", ["fedrs", "fedphp"])
def test_fedrs_and_fedphp_train(tiny, tmp_path, name):
    cfg = incomplete(tiny).model_copy(update={"algorithm": {"name": name}})
    res = run_experiment(cfg, out=tmp_path / name)
    assert res.summary["final"]["pers_acc_mean"] > 0.5


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"alpha": 1.5}, "map.alpha"),
        ({"alpha": -0.1}, "map.alpha"),
        ({"lam": 1.2}, "map.lam"),
        ({"lam": -0.5}, "map.lam"),
        ({"kt": "cosine"}, "map.kt"),
        ({"tau": 0}, "map.tau"),
    ],
)
def test_bad_map_parameters(params, message):
    with pytest.raises(PflkitError, match=message):
        parse_params({"name": "map", **params})


def test_scamap_stage_a_is_scaffold_on_the_rs_loss(tiny, tmp_path):
    from pflkit.algorithms.scaffold import scaffold_local_steps

    sim = Simulation(incomplete(tiny).model_copy(update={"algorithm": {"name": "scamap"}}))
    env, algo = sim.envs[2], sim.algo
    payload = algo.configure(sim.senv, sim.server, 2, ServerContext(1, "train"))
    payload["control"] = {k: torch.full_like(v, 0.01) for k, v in payload["control"].items()}
    seed_torch(5)
    ctx = RoundContext(1)
    up = algo.client_update(env, payload, {}, ctx)
    seed_torch(5)
    y = sim.data.clients[2].train_y
    ref = scaffold_local_steps(
        env, payload["weights"], payload["control"], None, ctx,
        loss_fn=rs_loss(rs_scale(class_counts(y, 10), 0.9)), steps=algo.stage_steps(env, ctx)[0],
    )  # fmt: skip
    for k in ref.delta_y:
        assert torch.equal(up.upload["delta_y"][k], ref.delta_y[k])
    assert all(torch.equal(up.state["control"][k], ref.control[k]) for k in ref.control)
    assert "hpm" in up.state
    res = run_experiment(
        incomplete(tiny).model_copy(update={"algorithm": {"name": "scamap"}}), out=tmp_path / "s"
    )
    assert res.summary["final"]["pers_acc_mean"] > 0.5


def test_scamap_defaults_to_the_code_stage_split_and_stage_b_never_reaches_the_server(tiny):
    cfg = incomplete(tiny)
    sim = Simulation(cfg.model_copy(update={"algorithm": {"name": "scamap"}}))
    total = cfg.train.local_epochs * -(-len(sim.data.clients[0].train_y) // cfg.train.batch_size)
    assert sim.algo.stage_steps(sim.envs[0], RoundContext(1)) == (total, max(int(0.2 * total), 5))
    assert sim.algo.params.stage_b_lr_scale == 0.5
    assert sim.algo.params.control_scale == "code"
    servers = []
    for lr_scale in (0.5, 2.0):  # stage B at another lr: the same global model and controls
        algo = {"name": "scamap", "stage_b_lr_scale": lr_scale}
        s = Simulation(cfg.model_copy(update={"algorithm": algo}))
        s.run_round(1)
        s.run_round(2)
        servers.append(s.server)
    for part in ("weights", "control"):
        for k, v in servers[0][part].items():
            assert torch.equal(v, servers[1][part][k])


# -- the defining math, by value against hand computations (issue 10) ---------------------------
def test_incomplete_partition_balances_a_clients_classes_with_quantity_skew():
    # MAP §4.2 with fixed draws: n_k = (2, 3, 2), classes {0,1}, {0,1,2}, {1,2}, skew
    # s = (1, 2, 0.5); rows d_k = s_k / n_k on the drawn classes; each class column is shared
    # in proportion to d_k: class 0: 0.5 : 2/3 (3/7, 4/7 of 60 -> 26, 34), class 1:
    # 0.5 : 2/3 : 0.25 (6/17, 8/17, 3/17 -> 21, 28, 11), class 2: 2/3 : 0.25 (8/11, 3/11 -> 44, 16);
    # cumulative rounding of the slice ends
    from pflkit.data.partition import incomplete as incomplete_partition

    class Draws:
        def __init__(self):
            self.sets = [np.array([0, 1]), np.array([0, 1, 2]), np.array([1, 2])]

        def integers(self, lo, hi, size):
            return np.array([2, 3, 2])

        def choice(self, n, size, replace):
            return self.sets.pop(0)

        def lognormal(self, mean, sigma, size):
            return np.array([1.0, 2.0, 0.5])

        def permutation(self, x):
            return np.random.default_rng(0).permutation(x)

        def shuffle(self, x):
            np.random.default_rng(0).shuffle(x)

    labels = np.repeat(np.arange(3), 60)
    parts = incomplete_partition(labels, 3, Draws(), min_classes=2, sigma=0.3)
    counts = np.array([np.bincount(labels[p], minlength=3) for p in parts])
    assert counts.tolist() == [[26, 21, 0], [34, 28, 44], [0, 11, 16]]
    assert sorted(np.concatenate(parts).tolist()) == list(range(180))  # every sample, once


def test_selected_client_protocol_scores_the_hpm_of_the_selected_clients(tiny):
    # MAP's personalization accuracy: the round's selected clients only, each with its HPM
    # right after local training, on its local test split, unweighted mean (specs/map.md §4.4)
    sim = Simulation(incomplete(tiny))
    row = sim.run_round(1)
    selected = row["clients"]
    assert 0 < len(selected) < sim.data.num_clients

    def acc(cid, weights):
        model = sim.envs[cid].model(slot="check")
        set_weights(model, weights)
        model.eval()
        with torch.no_grad():
            pred = model(sim.data.clients[cid].test_x).argmax(1)
        return int((pred == sim.data.clients[cid].test_y).sum()) / len(pred)

    hpm = [acc(c, sim.clients[c]["hpm"]) for c in selected]
    assert row["pers_acc_selected"] == pytest.approx(np.mean(hpm), abs=1e-12)
    # the alternatives the protocol must not compute are different numbers here
    every = [acc(c, sim.client_state(c).get("hpm", sim.server["weights"])) for c in range(6)]
    assert np.mean(every) != pytest.approx(np.mean(hpm), abs=1e-6)


def test_map_stage_b_runs_at_the_scaled_learning_rate(tiny, monkeypatch):
    sim = Simulation(incomplete(tiny, stage_b_lr_scale=0.25))
    env, calls = sim.envs[0], []
    real = type(env).train

    def spy(self, model, ctx, **kw):
        calls.append(kw)
        return real(self, model, ctx, **kw)

    monkeypatch.setattr(type(env), "train", spy)
    state = {"hpm": sim.server["weights"], "selected": 1}
    sim.algo.client_update(env, {"weights": sim.server["weights"]}, state, RoundContext(2))
    steps_a, steps_b = sim.algo.stage_steps(env, RoundContext(2))
    assert [c.get("steps") for c in calls] == [steps_a, steps_b]
    assert "lr" not in calls[0] or calls[0]["lr"] == 0.05  # stage A: train.lr
    assert calls[1]["lr"] == pytest.approx(0.05 * 0.25)  # stage B: 0.25 x train.lr


# -- ScaMAP client and server steps, by hand -----------------------------------------------------
def scamap(tiny):
    return incomplete(tiny).model_copy(update={"algorithm": {"name": "scamap"}})


def test_scamap_client_update_by_hand(tiny):
    """ScaMAP's client with the defaults (authors' code), E = 2, K = 2 ceil(n / B):

    - stage A: K SCAFFOLD steps y <- y - lr (grad RS(y) + c - c_i) from x (RS: alpha = 0.9 on
      the classes the client lacks); upload Delta y = y - x, Delta c = c_i+ - c_i with
      c_i+ = c_i - c + (x - y) / (K lr), keep c_i+;
    - stage B: max(floor(0.2 K), 5) steps at 0.5 lr from y on Eq. 13 (KD from the HPM,
      lambda = 0.01, tau = 4); HPM <- (1 - mu_k) result + mu_k HPM, mu_k = 0.9 * 2 / (0.5 * 4).
    """
    sim = Simulation(scamap(tiny))
    cid = 4
    env, d, x = sim.envs[cid], sim.data.clients[cid], sim.server["weights"]
    assert len(d.train_y.unique()) < 10
    torch.manual_seed(1)
    c = {k: 0.3 * torch.randn_like(v) for k, v in x.items()}
    ci = {k: 0.3 * torch.randn_like(v) for k, v in x.items()}
    hpm = {k: v + 0.3 * torch.randn_like(v) for k, v in x.items()}
    state = {"control": ci, "hpm": hpm, "selected": 1}
    torch.manual_seed(3)
    update = sim.algo.client_update(env, {"weights": x, "control": c}, state, RoundContext(2))
    k_steps = 2 * math.ceil(len(d.train_y) / 16)
    torch.manual_seed(3)
    shift = {k: c[k] - ci[k] for k in x}
    y = hand_sgd(x, d.train_x, d.train_y, rs_ce(d.train_y, 0.9), lr=0.05, steps=k_steps,
                 shift=shift)  # fmt: skip
    b = hand_sgd(y, d.train_x, d.train_y, kt_ce(hpm, 0.01), lr=0.025,
                 steps=max(int(0.2 * k_steps), 5))  # fmt: skip
    new_ci = {k: ci[k] - c[k] + (x[k] - y[k]) / (k_steps * 0.05) for k in x}
    assert_close(update.upload["delta_y"], {k: y[k] - x[k] for k in x})
    assert_close(update.upload["delta_c"], {k: new_ci[k] - ci[k] for k in x})
    assert_close(update.state["control"], new_ci)
    mu = 0.9 * 2 / (0.5 * 4)
    assert_close(update.state["hpm"], {k: (1 - mu) * b[k] + mu * hpm[k] for k in x})


def test_scamap_server_update_by_hand(tiny):
    """ScaMAP's server (defaults): x <- x + 1.0 * mean_S(Delta y), c <- c + mean_S(Delta c)
    (the authors' code: no |S| / N factor; here |S| = 3 of N = 6)."""
    sim = Simulation(scamap(tiny))
    x, c = sim.server["weights"], sim.server["control"]
    gen = torch.Generator().manual_seed(0)
    ups = {
        cid: {
            "delta_y": {k: torch.randn(v.shape, generator=gen) for k, v in x.items()},
            "delta_c": {k: torch.randn(v.shape, generator=gen) for k, v in c.items()},
            "num_samples": 10 * (cid + 1),
        }
        for cid in (0, 2, 5)
    }
    new = sim.algo.aggregate(sim.senv, sim.server, ups, ServerContext(1, "train"))
    mean_dy = {k: sum(u["delta_y"][k] for u in ups.values()) / 3 for k in x}
    mean_dc = {k: sum(u["delta_c"][k] for u in ups.values()) / 3 for k in c}
    assert_close(new["weights"], {k: x[k] + mean_dy[k] for k in x}, atol=1e-6)
    assert_close(new["control"], {k: c[k] + mean_dc[k] for k in c}, atol=1e-6)
