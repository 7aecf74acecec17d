"""SCAFFOLD / ScaRS: defining math and end-to-end behaviour."""

from __future__ import annotations

import math

import pytest
import torch

from pflkit.algorithms.base import nbytes, parse_params, train_from
from pflkit.algorithms.context import RoundContext, ServerContext
from pflkit.algorithms.scaffold import (
    Scaffold,
    scaffold_local_steps,
    scaffold_server_update,
    zero_control,
)
from pflkit.engine import Simulation
from pflkit.engine.simulation import seed_torch
from pflkit.errors import PflkitError
from pflkit.primitives.training import (
    get_weights,
)
from pflkit.testing import personal_weights, same_weights
from split_helpers import (
    PATHOLOGICAL,
    assert_close,
    hand_sgd,
    missing_classes,
    randn_like,
    rs_ce,
    trains_end_to_end,
)


def _quadratic(a):
    """0.5 * ||w - a||^2 over the parameters, ignoring the data: gradient w - a."""

    def loss_fn(model, x, y):
        return sum(0.5 * (p - a[k]).pow(2).sum() for k, p in model.named_parameters())

    return loss_fn


# -- SCAFFOLD: client step -----------------------------------------------------------------------
@pytest.mark.parametrize("factor", [1.0, 0.1])
def test_scaffold_client_step_matches_option_ii_on_a_quadratic(tiny, factor):
    """``factor``: the round's train.lr_schedule factor (the engine passes it in each client
    step's round context): the steps run at lr x factor, and the control divides by that step
    size."""
    sim = Simulation(tiny(algorithm={"name": "scaffold"}))
    env = sim.envs[0]
    torch.manual_seed(0)
    x = sim.server["weights"]
    params = zero_control(env.model())
    a, c, ci = (randn_like(params) for _ in range(3))
    ctx = RoundContext(1, lr_factor=factor)
    step = scaffold_local_steps(env, x, c, ci, ctx, loss_fn=_quadratic(a), lr=0.05)
    lr = 0.05 * factor
    n = len(env.data.train_y)
    k_steps = math.ceil(n / env.run.train.batch_size)  # one epoch
    assert k_steps > 3
    for k in params:  # K steps of y <- y - lr (g(y) + c - c_i) with g(y) = y - a, by hand
        y = x[k].clone()
        for _ in range(k_steps):
            y = y - lr * ((y - a[k]) + c[k] - ci[k])
        new_ci = ci[k] - c[k] + (x[k] - y) / (k_steps * lr)
        assert torch.allclose(step.weights[k], y, atol=1e-5)
        assert torch.allclose(step.delta_y[k], y - x[k], atol=1e-5)
        assert torch.allclose(step.control[k], new_ci, atol=1e-4)
        assert torch.allclose(step.delta_c[k], new_ci - ci[k], atol=1e-4)
    assert step.control.keys() == step.delta_c.keys() == params.keys()  # parameters only
    # the reported loss is the task loss alone (the correction term is not in it)
    assert step.loss > 0


def test_scaffold_with_zero_controls_is_fedavg_step_without_momentum(tiny):
    sim = Simulation(tiny(algorithm={"name": "scaffold"}, train={"momentum": 0.9}))
    env, x = sim.envs[0], sim.server["weights"]
    zero = zero_control(env.model())
    seed_torch(0, 1, 0, 0)
    ctx = RoundContext(1)
    step = scaffold_local_steps(env, x, zero, None, ctx)
    seed_torch(0, 1, 0, 0)
    plain, loss = train_from(env, x, ctx, momentum=0.0)  # FedAvg's client step, no momentum
    for k in x:
        assert torch.equal(step.weights[k], plain[k])
    assert step.loss == pytest.approx(loss)
    seed_torch(0, 1, 0, 0)
    with_momentum, _ = train_from(env, x, ctx)  # the config's momentum is not used
    assert any(not torch.equal(step.weights[k], with_momentum[k]) for k in x)


def test_scaffold_correction_moves_an_unused_row_by_exactly_k_lr_c_minus_ci(tiny):
    """ScaRS with alpha = 0: a missing class's head row gets no gradient from the RS loss, so it
    moves only by the correction: -K lr (c - c_i). Plain SCAFFOLD (softmax) moves it."""
    cfg = tiny(algorithm={"name": "scars", "alpha": 0.0}, data=PATHOLOGICAL)
    sim = Simulation(cfg)
    algo, x = sim.algo, sim.server["weights"]
    cid = 0
    env = sim.envs[cid]
    missing = missing_classes(sim, cid)
    assert missing
    zero = zero_control(env.model())
    payload = {"weights": x, "control": zero}
    up = algo.client_update(env, payload, {}, RoundContext(1)).upload
    for key in ("head.weight", "head.bias"):
        assert torch.equal(up["delta_y"][key][missing], torch.zeros_like(x[key][missing]))
        assert up["delta_y"][key].abs().sum() > 0  # observed classes do learn
    plain = Scaffold(Scaffold.Params()).client_update(env, payload, {}, RoundContext(1)).upload
    assert plain["delta_y"]["head.weight"][missing].abs().sum() > 0

    torch.manual_seed(1)
    c, ci = randn_like(zero), randn_like(zero)
    state = {"control": ci}
    update = algo.client_update(env, {"weights": x, "control": c}, state, RoundContext(1))
    k_steps = math.ceil(len(env.data.train_y) / cfg.train.batch_size)
    lr = cfg.train.lr
    for key in ("head.weight", "head.bias"):
        expect = -k_steps * lr * (c[key] - ci[key])[missing]
        assert torch.allclose(update.upload["delta_y"][key][missing], expect, atol=1e-5)
    # the new client control is c_i - c + (x - y) / (K lr), kept as private state
    new_ci = update.state["control"]
    for k in zero:
        expect = ci[k] - c[k] - update.upload["delta_y"][k] / (k_steps * lr)
        assert torch.allclose(new_ci[k], expect, atol=1e-4)
    # ScaRS scores the global model by default, like FedRS; MAP's protocol and
    # personal="local" score the client's model after local training, y = x + delta y
    assert same_weights(
        personal_weights(algo, env, {"weights": x}, update.state, RoundContext(1)), x
    )
    algo.params.personal = "local"
    update = algo.client_update(env, {"weights": x, "control": c}, state, RoundContext(1))
    pw = personal_weights(algo, env, {}, update.state, RoundContext(1))
    assert all(torch.allclose(pw[k], x[k] + update.upload["delta_y"][k]) for k in x)


def test_scaffold_client_update_by_hand(tiny):
    """SCAFFOLD's client (option II) through the algorithm, E = 2: K = 2 ceil(n / B) steps of
    y <- y - lr (grad CE(y) + c - c_i) from x; c_i+ = c_i - c + (x - y) / (K lr); upload
    Delta y = y - x and Delta c = c_i+ - c_i; keep c_i+."""
    sim = Simulation(tiny(algorithm={"name": "scaffold"}, train={"local_epochs": 2}))
    env, d, x = sim.envs[3], sim.data.clients[3], sim.server["weights"]
    torch.manual_seed(1)
    c, ci = randn_like(x, 0.3), randn_like(x, 0.3)
    torch.manual_seed(6)
    update = sim.algo.client_update(
        env, {"weights": x, "control": c}, {"control": ci}, RoundContext(1)
    )
    torch.manual_seed(6)
    shift = {k: c[k] - ci[k] for k in x}
    y = hand_sgd(x, d.train_x, d.train_y, lr=0.05, epochs=2, shift=shift)
    k_steps = 2 * math.ceil(len(d.train_y) / 16)
    new_ci = {k: ci[k] - c[k] + (x[k] - y[k]) / (k_steps * 0.05) for k in x}
    assert_close(update.upload["delta_y"], {k: y[k] - x[k] for k in x})
    assert_close(update.upload["delta_c"], {k: new_ci[k] - ci[k] for k in x})
    assert_close(update.state["control"], new_ci)
    assert update.upload["num_samples"] == len(d.train_y)


def test_scars_client_update_is_scaffold_on_the_rs_loss_by_hand(tiny):
    alpha = 0.5
    sim = Simulation(tiny(algorithm={"name": "scars", "alpha": alpha}, data=PATHOLOGICAL))
    env, d, x = sim.envs[2], sim.data.clients[2], sim.server["weights"]
    assert missing_classes(sim, 2)
    torch.manual_seed(2)
    c, ci = randn_like(x, 0.3), randn_like(x, 0.3)
    torch.manual_seed(8)
    update = sim.algo.client_update(
        env, {"weights": x, "control": c}, {"control": ci}, RoundContext(1)
    )
    torch.manual_seed(8)
    shift = {k: c[k] - ci[k] for k in x}
    y = hand_sgd(x, d.train_x, d.train_y, rs_ce(d.train_y, alpha), lr=0.05, shift=shift)
    k_steps = math.ceil(len(d.train_y) / 16)
    assert_close(update.upload["delta_y"], {k: y[k] - x[k] for k in x})
    new_ci = {k: ci[k] - c[k] + (x[k] - y[k]) / (k_steps * 0.05) for k in x}
    assert_close(update.state["control"], new_ci)


# -- SCAFFOLD: server step -----------------------------------------------------------------------
def _fake_uploads(n_clients=3):
    torch.manual_seed(2)
    ups = {}
    for i in range(n_clients):
        ups[i] = {
            "delta_y": {
                "w": torch.randn(3, 2),
                "bn.running_mean": torch.randn(2),
                "bn.num_batches_tracked": torch.tensor(i + 1),
            },
            "delta_c": {"w": torch.randn(3, 2)},
            "num_samples": 10 * (i + 1),
        }
    server = {
        "weights": {
            "w": torch.randn(3, 2),
            "bn.running_mean": torch.randn(2),
            "bn.num_batches_tracked": torch.tensor(5),
        },
        "control": {"w": torch.randn(3, 2)},
        "other": 7,
    }
    return server, ups


@pytest.mark.parametrize("control_scale", ["paper", "code"])
def test_scaffold_server_update(control_scale):
    server, ups = _fake_uploads()
    n_total, eta_g = 10, 0.5
    new = scaffold_server_update(server, ups, eta_g, n_total, control_scale=control_scale)
    mean = {k: sum(u["delta_y"][k] for u in ups.values()) / 3 for k in ("w", "bn.running_mean")}
    mean_dc = sum(u["delta_c"]["w"] for u in ups.values()) / 3
    x = server["weights"]
    assert torch.allclose(new["weights"]["w"], x["w"] + eta_g * mean["w"])
    # buffers are not scaled by eta_g: x + mean(delta) = FedAvg's mean of the client buffers
    assert torch.allclose(
        new["weights"]["bn.running_mean"], x["bn.running_mean"] + mean["bn.running_mean"]
    )
    assert new["weights"]["bn.num_batches_tracked"].item() == 6  # integer: first client's
    scale = 3 / n_total if control_scale == "paper" else 1.0
    assert torch.allclose(new["control"]["w"], server["control"]["w"] + scale * mean_dc)
    assert new["other"] == 7
    # sample weighting applies to the model deltas, never to the controls
    new_s = scaffold_server_update(
        server, ups, eta_g, n_total, control_scale=control_scale, weighting="samples"
    )
    wmean = sum(u["delta_y"]["w"] * u["num_samples"] for u in ups.values()) / 60
    assert torch.allclose(new_s["weights"]["w"], x["w"] + eta_g * wmean)
    assert torch.allclose(new_s["control"]["w"], new["control"]["w"])


def test_scaffold_aggregate_uses_its_parameters(tiny):
    sim = Simulation(tiny(algorithm={"name": "scaffold", "eta_g": 0.5, "control_scale": "code"}))
    server, ups = _fake_uploads()
    got = sim.algo.aggregate(sim.senv, server, ups, ServerContext(1, "train"))
    expect = scaffold_server_update(server, ups, 0.5, 4, control_scale="code")
    for part in ("weights", "control"):
        for k, v in expect[part].items():
            assert torch.equal(got[part][k], v)


@pytest.mark.parametrize("control_scale", ["paper", "code"])
def test_server_control_is_mean_of_client_controls_only_with_paper_scale(tiny, control_scale):
    """With the paper's |S|/N factor, c = (1/N) sum_i c_i holds under partial participation."""
    cfg = tiny(
        algorithm={"name": "scaffold", "control_scale": control_scale},
        train={"client_fraction": 0.5, "rounds": 3},
        eval={"every": 100},
    )
    sim = Simulation(cfg)
    for rnd in (1, 2):
        sim.run_round(rnd)
    n = sim.data.num_clients
    c = sim.server["control"]
    zero = zero_control(sim.senv.model())
    mean_ci = {
        k: sum(sim.clients.get(i, {}).get("control", zero)[k] for i in range(n)) / n for k in c
    }
    close = all(torch.allclose(c[k], mean_ci[k], atol=1e-6) for k in c)
    assert close == (control_scale == "paper")
    assert any(v.abs().sum() > 0 for v in c.values())


# -- end to end ----------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["scaffold", "scars"])
def test_trains_end_to_end(tiny, tmp_path, name):
    res = trains_end_to_end(tiny, tmp_path, name)
    if name == "scaffold":  # downloads x and c, uploads delta y, delta c and n_i
        fedavg_payload = nbytes({"weights": get_weights(Simulation(tiny()).senv.model())})
        assert all(r["bytes_down"] == [2 * fedavg_payload] * 4 for r in res.rows)
        assert all(r["bytes_up"] == [2 * fedavg_payload + 8] * 4 for r in res.rows)


# -- bad input -----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "cfg, key",
    [
        ({"name": "scars", "alpha": 1.5}, "scars.alpha"),
        ({"name": "scars", "alpha": -0.1}, "scars.alpha"),
        ({"name": "scaffold", "eta_g": 0}, "scaffold.eta_g"),
        ({"name": "scars", "eta_g": -1}, "scars.eta_g"),
        ({"name": "scaffold", "control_scale": "papr"}, "scaffold.control_scale"),
    ],
)
def test_bad_parameters(cfg, key):
    with pytest.raises(PflkitError, match=key.replace(".", r"\.")):
        parse_params(cfg)
