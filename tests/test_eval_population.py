"""Evaluation whose cost is set by what is asked (issue 53): a seeded sample of ``eval.clients``
clients with standard errors checked by value, the trained / untrained split, held-out clients
(``data.holdout_clients``) scored after ``Algorithm.adapt_holdout`` (FedAvg, Ditto and FedRep
computed by hand on toy tensors), the report and summary, and the bad inputs."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from conftest import tiny_config
from pflkit.algorithms import ALGORITHMS, build_algorithm
from pflkit.algorithms.context import ServerContext
from pflkit.engine import Simulation, run_experiment, sample_clients
from pflkit.engine.clients import (
    EVALUATE,
    InProcess,
    ProcessPool,
    evaluate_client,
    init_client,
    round_context,
    scored_model,
)
from pflkit.engine.population import (
    TrainedClients,
    eval_sample,
    holdout_clients,
    trained_clients,
)
from pflkit.errors import PflkitError
from pflkit.eval.evaluate import (
    accuracy,
    mean_se,
    personal_metrics,
    ratio_se,
    sampled_metrics,
    trained_split,
)
from pflkit.experiment import validate
from pflkit.report.results import make_report
from pflkit.testing import toy_envs

# shorter than FedDF's defaults (the same code paths run)
FAST = {n: {"server_steps": 5, "eval_every": 5, "patience": 5} for n in ("feddf", "pfeddf")}

# -- the estimators, by value ----------------------------------------------------------------------

# a toy population of N = 10 clients; the sample: 3 of them, with known accuracies and sizes
ACC = {2: 0.5, 5: 1.0, 7: 0.25}
COUNTS = np.array([9, 9, 2, 9, 9, 4, 9, 4, 9, 9], dtype=float)


def test_mean_se_is_the_finite_population_corrected_srs_error_by_hand():
    # ybar = 7/12; s^2 = ((0.5-7/12)^2 + (1-7/12)^2 + (0.25-7/12)^2) / 2 = 0.14583333...
    s2 = ((0.5 - 7 / 12) ** 2 + (1 - 7 / 12) ** 2 + (0.25 - 7 / 12) ** 2) / 2
    assert s2 == pytest.approx(0.1458333333333)
    want = math.sqrt((1 - 3 / 10) * s2 / 3)  # 0.184466...
    assert mean_se(np.array([0.5, 1.0, 0.25]), 10) == pytest.approx(want, rel=1e-12)
    assert want == pytest.approx(0.18446620, abs=1e-8)
    # the whole population: no sampling error; one client of many: none can be given
    assert mean_se(np.array([0.5, 1.0, 0.25]), 3) == 0.0
    assert mean_se(np.array([0.5]), 10) is None


def test_ratio_se_of_the_pooled_accuracy_by_hand():
    # correct c = (1, 4, 1), tests m = (2, 4, 4): R = 6/10; residuals c - R m = (-0.2, 1.6, -1.4)
    # sum of squares 4.56, / (n-1) = 2.28; mbar = 10/3;
    # var = (1 - 3/10) / (3 * (10/3)^2) * 2.28 = 0.04788
    c, m = np.array([1.0, 4.0, 1.0]), np.array([2.0, 4.0, 4.0])
    assert ratio_se(c, m, 10) == pytest.approx(math.sqrt(0.04788), rel=1e-12)
    assert ratio_se(c, m, 3) == 0.0


def test_sampled_metrics_are_the_sample_estimates_with_their_errors():
    out = sampled_metrics(ACC, 10, COUNTS)
    assert out["pers_acc_mean"] == pytest.approx(7 / 12)
    assert out["pers_acc_weighted"] == pytest.approx(6 / 10)  # (1 + 4 + 1) / (2 + 4 + 4)
    assert out["pers_acc_worst10"] == 0.25
    assert out["pers_acc_mean_se"] == pytest.approx(0.18446620, abs=1e-8)
    assert out["pers_acc_weighted_se"] == pytest.approx(math.sqrt(0.04788), rel=1e-12)
    # the same numbers as the full summary of those three clients, plus the errors
    full = personal_metrics(ACC, 10, COUNTS)
    for k in ("pers_acc_mean", "pers_acc_weighted", "pers_acc_std", "pers_acc_worst10"):
        assert out[k] == full[k]


def test_trained_split_by_value():
    trained = np.array([False, False, True, False, False, False, False, True, False, False])
    out = trained_split(ACC, trained)
    assert out == {
        "eval_trained": 2,
        "pers_acc_trained": pytest.approx((0.5 + 0.25) / 2),
        "eval_untrained": 1,
        "pers_acc_untrained": 1.0,
    }
    assert trained_split(ACC, np.ones(10, bool)) == {
        "eval_trained": 3,
        "pers_acc_trained": pytest.approx(7 / 12),
        "eval_untrained": 0,
    }


# -- the sample ----------------------------------------------------------------------------------


def test_eval_sample_depends_on_seed_and_round_only_and_caps():
    pop = list(range(50))
    a = eval_sample(3, 4, pop, 10)
    assert a == eval_sample(3, 4, pop, 10) and len(set(a)) == 10 and a == sorted(a)
    assert a != eval_sample(3, 5, pop, 10)  # a new sample each round
    assert a != eval_sample(4, 4, pop, 10)
    assert eval_sample(3, 4, pop, "all") == pop
    assert eval_sample(3, 4, pop, 50) == pop and eval_sample(3, 4, pop, 80) == pop  # capped


def tiny(**over):
    raw = tiny_config()
    for section, values in over.items():
        if section == "algorithm":
            raw[section] = {"name": values} if isinstance(values, str) else values
        elif isinstance(values, dict):
            raw.setdefault(section, {}).update(values)
        else:
            raw[section] = values
    return validate(raw)


def run_rows(cfg, rounds=None, runner=None):
    with Simulation(cfg, runner=runner) as sim:
        rows = [sim.run_round(r) for r in range(1, (rounds or cfg.train.rounds) + 1)]
        return [{k: v for k, v in r.items() if not k.startswith("seconds_")} for r in rows], sim


def scored_of(row):
    return [c for c, a in enumerate(row["pers_acc_clients"]) if a is not None]


def test_a_sampled_round_scores_the_seeded_sample_and_reports_its_errors():
    cfg = tiny(data={"num_clients": 8}, eval={"clients": 3}, train={"rounds": 3})
    rows, _ = run_rows(cfg)
    samples = [scored_of(r) for r in rows]
    for rnd, (row, got) in enumerate(zip(rows, samples, strict=True), 1):
        assert got == eval_sample(cfg.seed, rnd, list(range(8)), 3)
        assert row["eval_clients"] == 3
        acc = np.array([row["pers_acc_clients"][c] for c in got])
        assert row["pers_acc_mean"] == pytest.approx(acc.mean())
        sd = acc.std(ddof=1)
        assert row["pers_acc_mean_se"] == pytest.approx(math.sqrt((1 - 3 / 8) * sd**2 / 3))
    assert len({tuple(s) for s in samples}) > 1  # the sample changes between rounds
    # another algorithm of a compare scores the same sample
    other, _ = run_rows(tiny(data={"num_clients": 8}, eval={"clients": 3}, algorithm="local"))
    assert [scored_of(r) for r in other] == samples


def test_all_gives_todays_rows_and_a_capped_sample_the_same_numbers():
    rows, _ = run_rows(tiny(train={"rounds": 2}))
    for row in rows:  # nothing new in a run that scores every client, all of them trained
        assert not {k for k in row if k.endswith("_se") or "trained" in k or "holdout" in k}
        assert "eval_clients" not in row
    capped, _ = run_rows(tiny(train={"rounds": 2}, eval={"clients": 99}))
    for a, b in zip(rows, capped, strict=True):
        for k in ("pers_acc_mean", "pers_acc_weighted", "pers_acc_worst10", "global_acc"):
            assert a[k] == b[k]
        assert b["eval_clients"] == 4 and b["pers_acc_mean_se"] == 0.0
        assert b["pers_acc_weighted_se"] == 0.0


# -- trained / untrained -------------------------------------------------------------------------


def test_untrained_clients_are_reported_apart_by_value():
    cfg = tiny(
        data={"num_clients": 8},
        train={"client_fraction": 0.25, "rounds": 3},
        system={"dropout": 0.3},
    )
    rows, _ = run_rows(cfg)
    seen: set[int] = set()
    for row in rows:  # trained so far: the rows' own clients, less those that dropped out
        seen |= set(row["clients"]) - set(row.get("dropped_clients", []))
        acc = row["pers_acc_clients"]
        tr = [acc[c] for c in range(8) if c in seen]
        un = [acc[c] for c in range(8) if c not in seen]
        assert row["eval_trained"] == len(tr) and row["eval_untrained"] == len(un)
        assert row["pers_acc_trained"] == pytest.approx(np.mean(tr))
        assert row["pers_acc_untrained"] == pytest.approx(np.mean(un))
        assert trained_clients(cfg, 8, row["round"], sample_clients).tolist() == [
            c in seen for c in range(8)
        ]
    assert any(r.get("dropped_clients") for r in rows)  # the dropout case is exercised


def test_the_trained_set_needs_no_state_a_resumed_run_gets_the_same():
    cfg = tiny(data={"num_clients": 8}, train={"client_fraction": 0.25, "rounds": 6})
    incremental = TrainedClients(cfg, 8, sample_clients)
    for rnd in (1, 2, 5, 3, 6):  # forwards, and back as a restored checkpoint may go
        assert (
            incremental.upto_round(rnd).tolist()
            == trained_clients(cfg, 8, rnd, sample_clients).tolist()
        )


# -- held-out clients: the protocol by hand --------------------------------------------------------

X = torch.tensor([[1.0, -0.5, 0.3, 2.0], [0.2, 0.1, -1.0, 0.5], [-1.5, 0.4, 0.0, 1.0]])
Y = torch.tensor([0, 2, 1])


def _env(name, params=None, hidden=(), train=None):
    senv, envs = toy_envs([(X, Y)], model_options={"hidden": list(hidden)}, train=train)
    algo = build_algorithm({"name": name, **(params or {})})
    return algo, senv, envs[0]


def _forward(w, x, hidden):
    h = x
    if hidden:
        h = F.relu(h @ w["body.1.weight"].T + w["body.1.bias"])
    return h @ w["head.weight"].T + w["head.bias"]


def _steps(w, keys, n, lr, hidden=(), prox=None):
    """``n`` full-batch SGD steps on cross-entropy (+ lam/2 ||w - w0||^2) over ``keys`` only."""
    w = {k: v.clone() for k, v in w.items()}
    for _ in range(n):
        p = {k: v.clone().requires_grad_(k in keys) for k, v in w.items()}
        loss = F.cross_entropy(_forward(p, X, hidden), Y)
        if prox is not None:
            lam, w0 = prox
            loss = loss + 0.5 * lam * sum((p[k] - w0[k]).pow(2).sum() for k in p)
        grads = torch.autograd.grad(loss, [p[k] for k in keys])
        for k, g in zip(keys, grads, strict=True):
            w[k] = w[k] - lr * g
    return w


def _held_out_model(algo, senv, env, server):
    ctx = round_context(senv.run, 1, EVALUATE)
    steps = tuple(
        (ph, algo.configure(senv, server, env.cid, ServerContext(1, ph))) for ph in algo.phases(1)
    )
    view = algo.eval_view(senv, server, env.cid, ServerContext(1))
    state = init_client(algo, env, senv.run.seed)
    model = scored_model(algo, env, view, state, ctx, adapt=steps)
    acc = evaluate_client(algo, env, view, state, ctx, 100, adapt=steps)["test"]
    return {k: v.detach() for k, v in model.state_dict().items()}, acc, state


def _close(a, b):
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=1e-6)


def test_a_held_out_fedavg_client_is_scored_with_the_global_model():
    algo, senv, env = _env("fedavg")
    server = algo.server_init(senv)
    got, acc, _ = _held_out_model(algo, senv, env, server)
    _close(got, server["weights"])
    model = env.model()
    model.load_state_dict(server["weights"])
    assert acc == accuracy(model, X, Y, 100)


def test_a_held_out_ditto_client_trains_its_personal_model_from_the_global_one():
    # two personal epochs, so the pull lam (v - w) acts in the second step
    algo, senv, env = _env("ditto", {"lam": 1.0, "personal_epochs": 2, "personal_lr": 0.3})
    server = algo.server_init(senv)
    got, acc, state = _held_out_model(algo, senv, env, server)
    w = server["weights"]
    want = _steps(w, list(w), 2, 0.3, prox=(1.0, w))
    _close(got, want)
    assert "personal" not in state  # the adapted state was thrown away
    assert acc == int((_forward(want, X, ()).argmax(1) == Y).sum()) / 3


def test_a_held_out_fedrep_client_trains_its_head_on_the_received_body():
    algo, senv, env = _env("fedrep", {"head_epochs": 3}, hidden=(3,))
    server = algo.server_init(senv)
    got, acc, state = _held_out_model(algo, senv, env, server)
    head = ["head.weight", "head.bias"]
    start = {**server["body"], **state["head"]}  # the received body, the client's first head
    trained = _steps(start, head, 3, 0.1, hidden=(3,))  # the body epoch's body is not kept
    _close(got, {**server["body"], **{k: trained[k] for k in head}})
    assert acc == int((_forward(got, X, (3,)).argmax(1) == Y).sum()) / 3


# -- held-out clients in the engine ----------------------------------------------------------------


def test_held_out_clients_never_train_and_are_the_same_across_seeds_and_algorithms():
    cfg = tiny(data={"num_clients": 8, "holdout_clients": 0.25}, train={"rounds": 3})
    held = holdout_clients(cfg.data.seed, 8, 0.25)
    assert len(held) == 2
    rows, sim = run_rows(cfg)
    for row in rows:
        assert not set(row["clients"]) & set(held)
        assert len(row["clients"]) == 6  # the fraction applies to the training population
        assert row["eval_holdout"] == 2
        assert [c for c, a in enumerate(row["holdout_acc_clients"]) if a is not None] == list(held)
        assert all(row["pers_acc_clients"][c] is None for c in held)
    # FedAvg: each held-out client's score is the global model's accuracy on its test split
    model = sim.envs[0].model()
    model.load_state_dict(sim.server["weights"])
    for c in held:
        d = sim.envs[c].data
        assert rows[-1]["holdout_acc_clients"][c] == accuracy(model, d.test_x, d.test_y, 250)
    assert rows[-1]["holdout_acc_mean"] == pytest.approx(
        np.mean([rows[-1]["holdout_acc_clients"][c] for c in held])
    )
    other_seed = tiny(seed=5, data={"num_clients": 8, "holdout_clients": 0.25})
    assert holdout_clients(other_seed.data.seed, 8, 0.25) == held
    ditto, _ = run_rows(
        tiny(
            data={"num_clients": 8, "holdout_clients": 0.25}, algorithm="ditto", train={"rounds": 1}
        )
    )
    assert not set(ditto[0]["clients"]) & set(held)


def test_held_out_clients_score_alike_in_process_and_in_worker_processes():
    cfg = tiny(
        data={"num_clients": 6, "holdout_clients": 0.34},
        algorithm={"name": "ditto"},
        train={"rounds": 2, "client_fraction": 0.5},
        eval={"clients": 3},
    )
    here, _ = run_rows(cfg, runner=InProcess())
    pool = ProcessPool(2)
    try:
        there, _ = run_rows(cfg, runner=pool)
    finally:
        pool.close()
    assert here == there
    assert here[-1]["eval_holdout"] == 2 and "holdout_acc_mean_se" not in here[-1]


# -- bad input ----------------------------------------------------------------------------------


def test_a_holdout_that_leaves_no_client_to_train_is_one_sentence():
    with pytest.raises(PflkitError) as err:  # refused by the config, before anything runs
        tiny(data={"holdout_clients": 0.9})  # round(0.9 * 4) = 4 of 4
    msg = str(err.value)
    assert "data.holdout_clients" in msg and "0.9" in msg and "leaves none to train" in msg
    assert "\n" not in msg


def test_held_out_clients_on_a_runner_that_keeps_states_on_its_nodes_are_refused():
    class OnNodes(InProcess):  # as the Flower runner: client states live where clients run
        keeps_state = False

    with pytest.raises(PflkitError, match="data.holdout_clients needs client states") as err:
        Simulation(tiny(data={"holdout_clients": 0.25}), runner=OnNodes())
    assert "\n" not in str(err.value)
    Simulation(tiny(), runner=OnNodes()).close()  # without held-out clients it runs


def test_eval_clients_must_be_all_or_positive():
    raw = tiny_config()
    raw["eval"] = {"clients": 0}
    with pytest.raises(PflkitError, match="eval.clients"):
        validate(raw)


# -- summary and report ---------------------------------------------------------------------------


def test_summary_and_report_carry_the_errors_and_the_held_out_numbers(tmp_path):
    folders = []
    for name in ("fedavg", "ditto"):
        cfg = tiny(
            data={"num_clients": 8, "holdout_clients": 0.25},
            algorithm=name,
            train={"rounds": 2, "client_fraction": 0.5},
            eval={"clients": 3},
        )
        out = tmp_path / f"{name}-s0"
        run_experiment(cfg, out=out)
        folders.append(out)
    final = json.loads((folders[0] / "summary.json").read_text())["final"]
    for k in ("pers_acc_mean_se", "pers_acc_weighted_se", "eval_clients", "holdout_acc_mean"):
        assert k in final
    assert final["eval_clients"] == 3 and final["eval_holdout"] == 2
    rep = make_report(*folders, metric="pers_acc_mean")
    table = rep.tables[0]
    assert "sampling SE: personalized acc (%)" in table.columns
    assert "Sampled evaluation (eval.clients: 3 of 8" in rep.head
    i = table.columns.index("sampling SE: personalized acc (%)")
    assert table.rows[0][i] == f"± {100 * final['pers_acc_mean_se']:.2f}"
    held = make_report(*folders, metric="holdout_acc_mean")
    j = held.tables[0].columns.index("held-out acc (%)")
    assert held.tables[0].rows[0][j] == f"{100 * final['holdout_acc_mean']:.2f} ± 0.00"
    with pytest.raises(PflkitError, match="unknown metric"):
        make_report(*folders, metric="holdout_acc")


@pytest.mark.parametrize("name", sorted(ALGORITHMS))
def test_every_algorithm_scores_held_out_clients_and_keeps_them_out(name):
    raw = tiny_config(algorithm={"name": name, **FAST.get(name, {})})
    raw["data"].update(num_clients=5, holdout_clients=0.2)
    raw["data"]["public"] = {"dataset": "digits", "size": 64}
    raw["train"].update(rounds=1, client_fraction=0.5)
    raw["eval"] = {"clients": 3}
    cfg = validate(raw)
    (held,) = holdout_clients(cfg.data.seed, 5, 0.2)
    with Simulation(cfg) as sim:
        before = sim.client_state(held)
        row = sim.run_round(1)
        assert held not in row["clients"] and row["eval_holdout"] == 1
        assert 0 <= row["holdout_acc_clients"][held] <= 1
        assert sim.client_state(held) is before  # the adapted state was thrown away
