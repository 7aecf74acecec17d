"""L2GD: the aggregation step x_i - (alpha lam / (n p)) (x_i - x_bar), the local step size
alpha / (n (1 - p)), the geometric runs of local and aggregation steps, bad parameters and a
short run. Expected values are written by hand or computed with plain torch/numpy formulas."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from conftest import tiny_config
from pflkit.algorithms import l2gd as l2gd_module
from pflkit.algorithms.context import RoundContext, ServerContext
from pflkit.algorithms.l2gd import coin_runs, pull
from pflkit.engine import Simulation, run_experiment
from pflkit.errors import PflkitError
from pflkit.experiment import validate


def perturbed(weights, scale, seed):
    g = torch.Generator().manual_seed(seed)
    return {
        k: v + scale * torch.randn(v.shape, generator=g) if v.is_floating_point() else v.clone()
        for k, v in weights.items()
    }


def test_pull_on_a_tiny_vector_by_hand():
    x = {"w": torch.tensor([1.0, 3.0]), "n": torch.tensor(5)}
    x_bar = {"w": torch.tensor([0.0, 1.0]), "n": torch.tensor(9)}
    # one step, c = 0.25: x - 0.25 (x - x_bar) = (1 - 0.25, 3 - 0.5)
    np.testing.assert_allclose(pull(x, x_bar, 0.25, 1)["w"], [0.75, 2.5])
    # two steps: x_bar is unchanged by a step, so the second pulls (0.75, 2.5) again
    np.testing.assert_allclose(pull(x, x_bar, 0.25, 2)["w"], [0.5625, 2.125])
    assert int(pull(x, x_bar, 0.25, 1)["n"]) == 5  # integer buffers are the client's own


def l2gd_sim(tiny, **algo):
    return Simulation(tiny(algorithm={"name": "l2gd", **algo}, train={"rounds": 3}))


def test_client_pull_uses_alpha_lam_over_n_p(tiny):
    # eta unset: alpha = lr n (1 - p), so c = lr lam (1 - p) / p = 0.05 * 2 * 0.75 / 0.25 = 0.3
    sim = l2gd_sim(tiny, lam=2.0, p=0.25, pulls="one")
    x_bar = sim.server["weights"]
    x = perturbed(x_bar, 0.5, 1)
    out = sim.algo.client_update(
        sim.envs[1], {"weights": x_bar}, {"weights": x}, RoundContext(1, "pull")
    )
    assert out.upload == {}  # the pull uploads nothing
    for k, v in x.items():
        if v.is_floating_point():
            torch.testing.assert_close(out.state["weights"][k], v - 0.3 * (v - x_bar[k]))
    # eta set: c = eta lam / (n p) = 0.2 * 0.5 / (4 * 0.25) = 0.1 (n = 4 clients, sent down)
    sim = l2gd_sim(tiny, eta=0.2, lam=0.5, p=0.25, pulls="one")
    payload = sim.algo.configure(sim.senv, sim.server, 0, ServerContext(1, "local"))
    assert payload == {"num_clients": 4}
    pull_payload = sim.algo.configure(sim.senv, sim.server, 0, ServerContext(1, "pull"))
    assert sorted(pull_payload) == ["num_clients", "weights"] and pull_payload["num_clients"] == 4
    x_bar = pull_payload["weights"]  # this run's x_bar
    out = sim.algo.client_update(sim.envs[1], pull_payload, {"weights": x}, RoundContext(1, "pull"))
    for k, v in x.items():
        if v.is_floating_point():
            torch.testing.assert_close(out.state["weights"][k], v - 0.1 * (v - x_bar[k]))


def test_client_pull_applies_the_run_of_aggregation_steps(tiny):
    sim = l2gd_sim(tiny, lam=2.0, p=0.25)  # c = 0.3, M_r aggregation steps
    x_bar = sim.server["weights"]
    x = perturbed(x_bar, 0.5, 2)
    rnd = next(r for r in range(1, 100) if coin_runs(sim.cfg.seed, r, 0.25)[1] >= 2)
    m = coin_runs(sim.cfg.seed, rnd, 0.25)[1]
    out = sim.algo.client_update(
        sim.envs[0], {"weights": x_bar}, {"weights": x}, RoundContext(rnd, "pull")
    )
    for k, v in x.items():
        if v.is_floating_point():
            want = v.clone()
            for _ in range(m):
                want = want - 0.3 * (want - x_bar[k])
            torch.testing.assert_close(out.state["weights"][k], want)


def test_local_step_is_alpha_over_n_one_minus_p(tiny):
    """One full-batch step (local_steps: epochs, one epoch, one batch): the lr is
    eta / (n (1 - p)) = 0.3 / (4 * 0.75) = 0.1, plain gradient (no momentum)."""
    cfg = tiny(
        algorithm={"name": "l2gd", "eta": 0.3, "p": 0.25, "lam": 0.5, "local_steps": "epochs"},
        train={"batch_size": 100000, "momentum": 0.9},
    )
    sim = Simulation(cfg)
    env = sim.envs[2]
    x = perturbed(sim.server["weights"], 0.1, 3)
    model = env.model("check")
    model.load_state_dict(x)
    loss = nn.functional.cross_entropy(model(env.data.train_x), env.data.train_y)
    names = [k for k, _ in model.named_parameters()]
    grads = dict(zip(names, torch.autograd.grad(loss, list(model.parameters())), strict=True))
    payload = sim.algo.configure(sim.senv, sim.server, 2, ServerContext(1, "local"))
    out = sim.algo.client_update(env, payload, {"weights": x}, RoundContext(1, "local"))
    for k in names:
        torch.testing.assert_close(out.upload["weights"][k], x[k] - 0.1 * grads[k])
    assert out.state["weights"] is out.upload["weights"]


def test_geometric_runs_are_reproducible_and_have_the_right_means():
    p = 0.2
    draws = np.array([coin_runs(7, r, p) for r in range(1, 3001)])
    assert np.array_equal(draws[:300], np.array([coin_runs(7, r, p) for r in range(1, 301)]))
    assert not np.array_equal(draws[:300], np.array([coin_runs(8, r, p) for r in range(1, 301)]))
    local, agg = draws[:, 0], draws[:, 1]
    assert local.min() >= 1 and agg.min() >= 1
    # a run of local steps is Geometric(p): mean 1/p = 5 (sd 4.47, so se 0.08 over 3000)
    assert local.mean() == pytest.approx(5.0, abs=0.3)
    assert (local == 1).mean() == pytest.approx(p, abs=0.03)
    # a run of aggregation steps is Geometric(1 - p): mean 1/(1 - p) = 1.25
    assert agg.mean() == pytest.approx(1.25, abs=0.04)


@pytest.mark.parametrize(
    ("algo", "match"),
    [
        ({"p": 0.0}, "l2gd.p"),
        ({"p": 1.0}, "l2gd.p"),
        ({"p": 1.5}, "l2gd.p"),
        ({"lam": -1.0}, "l2gd.lam"),
        ({"lam": 100.0}, "c <= 1"),  # c = 0.05 * 100 * 0.9 / 0.1 = 45
    ],
)
def test_bad_parameters_are_one_sentence(algo, match):
    with pytest.raises(PflkitError, match=match) as err:
        Simulation(validate(tiny_config(algorithm={"name": "l2gd", **algo})))
    assert "\n" not in str(err.value)


def test_short_run_pulls_every_private_model_toward_the_average(tiny, tmp_path):
    cfg = tiny(algorithm={"name": "l2gd", "lam": 2.0, "p": 0.5}, train={"rounds": 3})
    sim = Simulation(cfg)
    seen = []
    real = sim.algo.aggregate

    def spy(env, server, uploads, sctx):
        if sctx.phase == "local":
            seen.append({c: u["weights"] for c, u in uploads.items()})
        return real(env, server, uploads, sctx)

    sim.algo.aggregate = spy
    full = sum(v.numel() * v.element_size() for v in sim.server["weights"].values())
    c = 0.05 * 2.0 * 0.5 / 0.5  # lr lam (1 - p) / p
    for rnd in (1, 2, 3):
        row = sim.run_round(rnd)
        assert row["bytes_down"] == [full] * 4  # x_bar (the local phase downloads nothing)
        assert row["bytes_up"] == [full + 8] * 4  # x_i and n_i
        ups = seen[-1]
        x_bar = {k: torch.stack([ups[i][k] for i in range(4)]).mean(0) for k in ups[0]}
        m = coin_runs(cfg.seed, rnd, 0.5)[1]
        for i in range(4):
            for k, v in ups[i].items():
                if v.is_floating_point():
                    want = x_bar[k] + (1 - c) ** m * (v - x_bar[k])
                    torch.testing.assert_close(sim.clients[i]["weights"][k], want)
        for k in x_bar:
            if x_bar[k].is_floating_point():
                torch.testing.assert_close(sim.server["weights"][k], x_bar[k])
    # the models stay personal: not equal to each other after the pulls
    a, b = sim.clients[0]["weights"], sim.clients[1]["weights"]
    assert any(not torch.equal(a[k], b[k]) for k in a)
    result = run_experiment(cfg, out=tmp_path / "run")
    assert "pers_acc_mean" in result.rows[-1] and "global_acc" in result.rows[-1]


# -- the phases with fixed coin runs (the round's L_r and M_r set by the test) -------------------


def fixed_runs(monkeypatch, local, aggregation):
    """Make every round's coin runs (L_r, M_r) = (local, aggregation)."""
    monkeypatch.setattr(l2gd_module, "coin_runs", lambda seed, rnd, p: (local, aggregation))


def full_batch_grads(model, weights, x, y):
    """d CE / d w of the full training split at ``weights``, by parameter name."""
    model.load_state_dict(weights)
    names = [k for k, _ in model.named_parameters()]
    loss = nn.functional.cross_entropy(model(x), y)
    return dict(zip(names, torch.autograd.grad(loss, list(model.parameters())), strict=True))


def test_local_phase_runs_L_r_plain_gradient_steps(tiny, monkeypatch):
    """L_r = 3, M_r = 1: the local phase is 3 full-batch gradient steps of lr train.lr (eta
    unset), without the run's momentum 0.9; M_r (1) must not be the step count."""
    fixed_runs(monkeypatch, 3, 1)
    cfg = tiny(
        algorithm={"name": "l2gd", "lam": 0.5, "p": 0.25},
        train={"batch_size": 100000, "momentum": 0.9, "lr": 0.2},
    )
    sim = Simulation(cfg)
    env = sim.envs[1]
    x0 = perturbed(sim.server["weights"], 0.1, 5)
    model = env.model("check")
    want = dict(x0)
    for _ in range(3):  # x <- x - 0.2 grad f_i(x)
        g = full_batch_grads(model, want, env.data.train_x, env.data.train_y)
        want = {k: v - 0.2 * g[k] if k in g else v for k, v in want.items()}
    payload = sim.algo.configure(sim.senv, sim.server, 1, ServerContext(1, "local"))
    out = sim.algo.client_update(env, payload, {"weights": x0}, RoundContext(1, "local"))
    for k, v in want.items():
        torch.testing.assert_close(out.upload["weights"][k], v, rtol=1e-5, atol=1e-6)
    # the three steps moved the model well beyond one step's size
    g0 = full_batch_grads(model, x0, env.data.train_x, env.data.train_y)
    one = {k: x0[k] - 0.2 * g for k, g in g0.items()}
    assert max(float((out.upload["weights"][k] - one[k]).abs().max()) for k in one) > 1e-3


def test_pull_phase_applies_M_r_aggregation_steps(tiny, monkeypatch):
    """L_r = 1, M_r = 3, c = lr lam (1 - p) / p = 0.05 * 2 * 0.75 / 0.25 = 0.3: x_bar is the
    plain mean of the uploads (whatever their n_i), and the pull is three aggregation steps
    x <- x - 0.3 (x - x_bar), i.e. x_bar + 0.7^3 (x - x_bar)."""
    fixed_runs(monkeypatch, 1, 3)
    sim = l2gd_sim(tiny, lam=2.0, p=0.25)
    w = {"w": torch.tensor([1.0, -2.0]), "n": torch.tensor(3)}
    ups = {
        0: {"weights": {"w": torch.tensor([2.0, 0.0]), "n": torch.tensor(3)}, "num_samples": 1},
        2: {"weights": {"w": torch.tensor([0.0, 4.0]), "n": torch.tensor(3)}, "num_samples": 9},
    }
    server = sim.algo.aggregate(sim.senv, {"weights": w}, ups, ServerContext(1, "local"))
    np.testing.assert_allclose(server["weights"]["w"], [1.0, 2.0])  # not (0.2, 3.6)
    x_bar = sim.server["weights"]
    x = perturbed(x_bar, 0.5, 4)
    out = sim.algo.client_update(
        sim.envs[0], {"weights": x_bar}, {"weights": x}, RoundContext(1, "pull")
    )
    for k, v in x.items():
        if v.is_floating_point():
            torch.testing.assert_close(out.state["weights"][k], x_bar[k] + 0.343 * (v - x_bar[k]))


def test_scored_model_is_the_private_x_i(tiny):
    """A client's personalized accuracy is its own x_i's, not x_bar's (by hand: the argmax of
    x_i's logits on the client's test split)."""
    sim = l2gd_sim(tiny, lam=2.0, p=0.25)
    x_bar = sim.server["weights"]
    for cid in range(4):
        sim.clients[cid] = {"weights": perturbed(x_bar, 1.0, 10 + cid)}
    row = sim.evaluate(1, {})
    model = sim.envs[0].model("check")
    differ = 0
    for cid, env in enumerate(sim.envs):
        with torch.no_grad():
            model.load_state_dict(sim.clients[cid]["weights"])
            own = int((model(env.data.test_x).argmax(1) == env.data.test_y).sum())
            model.load_state_dict(x_bar)
            avg = int((model(env.data.test_x).argmax(1) == env.data.test_y).sum())
        assert row["pers_acc_clients"][cid] == pytest.approx(own / len(env.data.test_y))
        differ += own != avg
    assert differ >= 2  # the check tells the two models apart
