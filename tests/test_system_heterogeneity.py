"""Simulated system heterogeneity (``system.dropout``, ``system.stragglers``,
``system.straggler_work``): seeded draws that every runner agrees on, dropped clients left out
of the aggregate, stragglers running a share of their local steps, and defaults that change
nothing."""

from __future__ import annotations

import math

import pytest
import torch

from conftest import tiny_config
from pflkit.engine import Simulation
from pflkit.engine.clients import InProcess, ProcessPool, TrainJob, system_draw
from pflkit.errors import PflkitError
from pflkit.experiment import validate
from pflkit.primitives.training import steps_per_epoch


def rows(cfg, runner=None) -> list[dict]:
    with Simulation(cfg, runner=runner) as sim:
        out = [sim.run_round(r) for r in range(1, cfg.train.rounds + 1)]
    return [{k: v for k, v in r.items() if not k.startswith("seconds_")} for r in out]


class Recording(InProcess):
    """The in-process runner, recording each round's uploads and each client's SGD steps."""

    def __init__(self):
        self.uploads: dict[int, dict] = {}
        self.steps: dict[tuple[int, int], int] = {}

    def run(self, algo, envs, jobs, meanwhile=None):
        if not jobs or not isinstance(jobs[0], TrainJob):
            return super().run(algo, envs, jobs, meanwhile)
        rnd, out = jobs[0].ctx.round, {}
        for job in jobs:
            before = Counting.calls
            out |= super().run(algo, envs, [job])
            self.steps[rnd, job.cid] = Counting.calls - before
        self.uploads[rnd] = {cid: update.upload for cid, update in out.items()}
        return out


class Counting:
    calls = 0


@pytest.fixture
def count_sgd_steps(monkeypatch):
    real = torch.optim.SGD.step

    def step(self, *args, **kwargs):
        Counting.calls += 1
        return real(self, *args, **kwargs)

    monkeypatch.setattr(torch.optim.SGD, "step", step)


def test_defaults_change_nothing(tiny):
    plain = rows(tiny())
    assert rows(tiny(system={"dropout": 0, "stragglers": 0, "straggler_work": 0.25})) == plain
    assert not any("dropped_clients" in r or "straggler_clients" in r for r in plain)
    assert validate(tiny_config()).system.model_dump() == {
        "dropout": 0.0,
        "stragglers": 0.0,
        "straggler_work": 0.5,
    }


def test_dropped_clients_are_seeded_and_the_same_in_every_runner(tiny):
    cfg = tiny(train={"rounds": 4}, system={"dropout": 0.5})
    first = rows(cfg)
    expected = [
        [c for c in r["clients"] if system_draw(cfg.system, cfg.seed, r["round"], c)[0]]
        for r in first
    ]
    assert [r.get("dropped_clients", []) for r in first] == expected
    assert any(expected) and not all(len(e) == 4 for e in expected)  # the case is not trivial
    for r in first:  # a dropped client downloads and uploads nothing
        for c, down, up in zip(r["clients"], r["bytes_down"], r["bytes_up"], strict=True):
            assert (down == up == 0) == (c in r.get("dropped_clients", []))
    assert rows(cfg) == first
    assert rows(cfg, runner=ProcessPool(2, 1)) == first
    other_seed = rows(cfg.model_copy(update={"seed": 1}))
    assert [r.get("dropped_clients") for r in other_seed] != [
        r.get("dropped_clients") for r in first
    ]


def test_flower_drops_the_same_clients(tiny, tmp_path):
    pytest.importorskip("flwr")
    from flower_fakes import FakeGrid, assert_rows_close, flower_run, task_identity

    gen = task_identity()
    next(gen)
    try:
        cfg = tiny(system={"dropout": 0.4, "stragglers": 0.5})
        nodes = {101: {"client-ids": "0,1"}, 202: {"client-ids": "2,3"}}
        flower, _ = flower_run(cfg, tmp_path, nodes, grid=FakeGrid(nodes))
    finally:
        next(gen, None)
    embedded = rows(cfg)
    assert any("dropped_clients" in r for r in embedded)
    assert any("straggler_clients" in r for r in embedded)
    for a, b in zip(flower.rows, embedded, strict=True):
        assert_rows_close(a, b)


def test_a_dropped_client_is_left_out_of_the_fedavg_mean(tiny):
    cfg = tiny(train={"rounds": 4, "weighting": "samples"}, system={"dropout": 0.5})
    runner = Recording()
    with Simulation(cfg, runner=runner) as sim:
        for rnd in range(1, 5):
            row = sim.run_round(rnd)
            dropped = row.get("dropped_clients", [])
            if dropped and len(dropped) < len(row["clients"]):
                break
        else:
            pytest.fail("no round with some but not all clients dropped")
        uploads = runner.uploads[rnd]
        assert sorted(uploads) == sorted(set(row["clients"]) - set(dropped))
        total = sum(u["num_samples"] for u in uploads.values())
        for key, value in sim.server["weights"].items():
            mean = sum(u["num_samples"] * u["weights"][key] for u in uploads.values()) / total
            torch.testing.assert_close(value, mean)


def test_a_straggler_runs_its_share_of_the_steps(tiny, count_sgd_steps):
    cfg = tiny(
        train={"rounds": 3, "local_epochs": 2},
        system={"stragglers": 0.5, "straggler_work": 0.3},
    )
    runner = Recording()
    with Simulation(cfg, runner=runner) as sim:
        all_rows = [sim.run_round(r) for r in range(1, 4)]
        full = {
            c: 2 * steps_per_epoch(env.num_train, cfg.train.batch_size)
            for c, env in enumerate(sim.envs)
        }
    slow = {(r["round"], c) for r in all_rows for c in r.get("straggler_clients", [])}
    assert slow and len(slow) < len(runner.steps)  # some stragglers, some not
    for (rnd, cid), steps in runner.steps.items():
        want = max(1, math.floor(0.3 * full[cid])) if (rnd, cid) in slow else full[cid]
        assert steps == want, (rnd, cid)


@pytest.mark.parametrize(
    "key, value",
    [
        ("dropout", 1.0),
        ("dropout", -0.1),
        ("stragglers", 1.0),
        ("straggler_work", 0),
        ("straggler_work", 1.5),
    ],
)
def test_bad_values_are_one_sentence(key, value):
    with pytest.raises(PflkitError, match=f"system.{key}") as err:
        validate(tiny_config(system={key: value}))
    assert "\n" not in str(err.value)


def test_scaffold_counts_a_stragglers_steps_in_its_control_update(tiny):
    """c_i+ - c_i = -c + (x - y) / (K lr) with K the steps the client ran (round 1: c = 0)."""
    cfg = tiny(
        algorithm={"name": "scaffold"},
        train={"rounds": 1, "local_epochs": 2},
        system={"stragglers": 0.5, "straggler_work": 0.3},
    )
    runner = Recording()
    with Simulation(cfg, runner=runner) as sim:
        row = sim.run_round(1)
        slow = row.get("straggler_clients", [])
        assert slow and len(slow) < 4
        for cid, upload in runner.uploads[1].items():
            full = 2 * steps_per_epoch(sim.envs[cid].num_train, cfg.train.batch_size)
            k = max(1, math.floor(0.3 * full)) if cid in slow else full
            for key, delta_c in upload["delta_c"].items():
                want = -upload["delta_y"][key] / (k * cfg.train.lr)
                torch.testing.assert_close(delta_c, want)


def test_the_draws_vary_with_round_and_client_at_the_configured_rates():
    system = validate(tiny_config(system={"dropout": 0.3, "stragglers": 0.5})).system
    torch_state = torch.get_rng_state()
    draws = {(r, c): system_draw(system, 7, r, c) for r in range(1, 201) for c in range(10)}
    assert torch.equal(torch.get_rng_state(), torch_state)  # torch's stream is untouched
    assert draws == {(r, c): system_draw(system, 7, r, c) for r, c in draws}
    dropped = [d for d, _ in draws.values()]
    slow = [s for d, s in draws.values() if not d]
    assert abs(sum(dropped) / len(dropped) - 0.3) < 0.03
    assert abs(sum(slow) / len(slow) - 0.5) < 0.03
    assert not any(d and s for d, s in draws.values())
    per_round = {r: tuple(draws[r, c][0] for c in range(10)) for r in range(1, 201)}
    assert len(set(per_round.values())) > 100  # a fresh draw every round
