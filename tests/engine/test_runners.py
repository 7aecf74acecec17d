"""The runner registry (pflkit.engine.runners): engine.runner picks a registered runner by
name, an unknown name is one sentence (exit 2 from the command line, nothing written), and a
plug-in registers its own runner without any change to the engine."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from conftest import tiny_config
from pflkit.engine import Simulation, run_experiment
from pflkit.engine import ray_runner as ray_module
from pflkit.engine.clients import InProcess, ProcessPool
from pflkit.engine.runners import RUNNERS
from pflkit.engine.simulation import runner_for
from pflkit.errors import PflkitError
from pflkit.experiment import validate


def strip_timing(rows):
    return [{k: v for k, v in r.items() if not k.startswith("seconds_")} for r in rows]


def test_each_name_builds_its_runner_and_workers_keep_their_meaning():
    assert {"in-process", "pool", "ray"} <= set(RUNNERS)
    assert RUNNERS["ray"].factory is ray_module.ray_runner

    def built(**engine):
        return runner_for(validate(tiny_config(engine=engine)))

    assert type(built(runner="in-process", workers=3)) is InProcess  # workers unused
    assert type(built(workers=1)) is InProcess  # pool, the default, with one worker: here
    pool = built(runner="pool", workers=2, threads_per_worker=2)
    assert isinstance(pool, ProcessPool) and (pool.workers, pool.threads) == (2, 2)
    ray = built(runner="ray", workers=3, ray_cpus=0.5)
    assert isinstance(ray, ray_module.RayRunner) and (ray.workers, ray.cpus) == (3, 0.5)
    assert not ray.actors  # nothing started: Ray starts on first use


def test_flower_registers_its_runner_which_needs_the_server_apps_grid():
    pytest.importorskip("flwr")
    from pflkit.flower.server import FlowerRunner

    entry = RUNNERS.lookup("flower")
    cfg = validate(tiny_config(engine={"runner": "flower"}))
    runner = entry.factory(cfg, object(), node_wait=3.0)
    assert isinstance(runner, FlowerRunner) and runner.node_wait == 3.0
    with pytest.raises(PflkitError, match=r"^engine.runner: flower sends .*`pflkit flower local`"):
        runner_for(cfg)  # a plain run has no grid of SuperNodes


def test_an_unknown_runner_is_one_sentence_listing_the_registered_ones():
    with pytest.raises(PflkitError) as err:
        runner_for(validate(tiny_config(engine={"runner": "rey"})))
    names = ", ".join(sorted(RUNNERS))
    assert str(err.value) == (
        f"unknown engine.runner 'rey': choose one of {names} (a plug-in registers more with "
        "pflkit.plugins.register_runner)"
    )


def test_an_unknown_runner_exits_2_from_the_command_line_and_writes_nothing(cli, tmp_path):
    import yaml

    (tmp_path / "tiny.yaml").write_text(yaml.safe_dump(tiny_config()))
    r = cli("run", "tiny.yaml", "-q", "--out", "r", "--set", "engine.runner=poool", cwd=tmp_path)
    assert r.returncode == 2
    assert "unknown engine.runner 'poool': choose one of " in r.stderr
    assert "in-process, pool, ray" in r.stderr.replace("flower, ", "")
    assert "Traceback" not in r.stderr
    assert not (tmp_path / "r").exists()


PLUGIN = '''
from pflkit.engine.clients import InProcess
from pflkit.plugins import register_runner


class Logged(InProcess):
    """In this process, logging each batch of jobs it is handed."""

    log = []

    def run(self, algo, envs, jobs, meanwhile=None):
        Logged.log.append([(type(job).__name__, job.cid, job.ctx.round) for job in jobs])
        return super().run(algo, envs, jobs, meanwhile)


@register_runner("logged", "this process, logging every job")
def logged(cfg):
    return Logged()
'''


@pytest.fixture
def logged_runner(tmp_path, monkeypatch):
    """A plug-in module (my_runner.py) that registers the runner ``logged``; removed after."""
    (tmp_path / "my_runner.py").write_text(PLUGIN)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    RUNNERS.pop("logged", None)
    sys.modules.pop("my_runner", None)


def test_a_plugin_runner_runs_the_rounds_as_the_built_in_one(logged_runner, tmp_path):
    raw = tiny_config(train={"rounds": 2, "client_fraction": 0.5})
    here = run_experiment(validate(raw), out=tmp_path / "here")
    cfg = validate({**raw, "plugins": ["my_runner"], "engine": {"runner": "logged"}})
    plugged = run_experiment(cfg, out=tmp_path / "plugged")
    assert strip_timing(plugged.rows) == strip_timing(here.rows)
    log = sys.modules["my_runner"].Logged.log
    trained = [batch for batch in log if batch and batch[0][0] == "TrainJob"]
    assert [[cid for _, cid, _ in b] for b in trained] == [r["clients"] for r in here.rows]
    assert [{rnd for *_, rnd in b} for b in trained] == [{1}, {2}]


class CountingReads(InProcess):
    """In this process; counts how often the engine asks where client states live."""

    def __init__(self):
        super().__init__()
        self.reads = 0

    @property
    def keeps_state(self):
        self.reads += 1
        return True


def test_where_client_states_live_is_asked_once_per_run(tiny, tmp_path):
    runner = CountingReads()
    cfg = tiny(train={"rounds": 3}, output={"checkpoint_every": 1})
    result = run_experiment(cfg, out=tmp_path / "r", runner=runner)
    assert len(result.rows) == 3 and (tmp_path / "r" / "checkpoints" / "latest.pt").exists()
    assert runner.reads == 1


def test_a_runner_whose_clients_keep_their_state_gets_jobs_without_one(tiny):
    """keeps_state False (Flower): jobs carry no state and the states results bring are not
    kept; the runner's clients hold their own (here: their first state, every time)."""
    import dataclasses

    from pflkit.engine.clients import init_client

    seen = []

    class OnNodes(InProcess):
        keeps_state = False

        def run(self, algo, envs, jobs, meanwhile=None):
            seen.extend(job.state for job in jobs)
            first = {j.cid: init_client(algo, envs[j.cid], 0) for j in jobs}
            jobs = [dataclasses.replace(j, state=first[j.cid]) for j in jobs]
            return super().run(algo, envs, jobs, meanwhile)

    with Simulation(tiny(train={"rounds": 1}), runner=OnNodes()) as sim:
        row = sim.run_round(1)
    assert "pers_acc_mean" in row and len(seen) == 8  # 4 trained, 4 scored
    assert all(s is None for s in seen)
    assert len(sim.clients) == 0 and sim.clients.get_or_init(0) is None


GUIDE = Path(__file__).resolve().parents[2] / "docs" / "guide.md"


@pytest.fixture
def guide_runner(tmp_path, monkeypatch):
    """docs/guide.md's "Adding a runner" example written to my_runner.py; removed after."""
    section = GUIDE.read_text().split("### Adding a runner", 1)[1]
    code = re.search(r"```python\n(# my_runner\.py.*?)```", section, re.S).group(1)
    (tmp_path / "my_runner.py").write_text(code)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    RUNNERS.pop("my-cluster", None)
    sys.modules.pop("my_runner", None)


def test_the_guides_runner_example_runs_as_the_built_in_one(guide_runner, tmp_path):
    raw = tiny_config(algorithm={"name": "ditto"}, train={"rounds": 2, "client_fraction": 0.5})
    here = run_experiment(validate(raw), out=tmp_path / "here")
    cfg = validate({**raw, "plugins": ["my_runner"], "engine": {"runner": "my-cluster"}})
    plugged = run_experiment(cfg, out=tmp_path / "plugged")
    assert strip_timing(plugged.rows) == strip_timing(here.rows)
