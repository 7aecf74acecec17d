"""The one worker start-up (pflkit.engine.worker.start_worker): this process, a pool's
workers, a Ray actor and a Flower node all build their algorithm and environments with it,
from the config validated once, and none of them parses the algorithm section again."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import types

import pytest

from conftest import tiny_config
from pflkit.data.federated import build_federated
from pflkit.engine import Simulation, run_experiment, worker
from pflkit.engine.clients import InProcess, ProcessPool
from pflkit.experiment import algorithm_of, validate


def strip_timing(rows):
    return [{k: v for k, v in r.items() if not k.startswith("seconds_")} for r in rows]


@pytest.fixture
def startups(tmp_path, monkeypatch):
    """start_worker wrapped to append "pid threads device" per call to a file (pool workers
    are forked from this process with the wrapper in place); returns a reader of the lines."""
    path, real = tmp_path / "startups.txt", worker.start_worker

    def spy(spec, data):
        with path.open("a") as f:
            f.write(f"{os.getpid()} {spec.threads} {spec.device}\n")
        return real(spec, data)

    monkeypatch.setattr(worker, "start_worker", spy)
    return lambda: [line.split() for line in path.read_text().splitlines()] if path.exists() else []


def test_this_process_and_the_pool_workers_start_with_it(startups, tiny, tmp_path):
    cfg = tiny(train={"rounds": 2})
    with Simulation(cfg, runner=InProcess()) as sim:
        sim.run_round(1)
    assert startups() == [[str(os.getpid()), "None", "None"]]
    run_experiment(cfg, out=tmp_path / "pool", runner=ProcessPool(2, 1))
    workers = [line for line in startups()[1:] if line[0] != str(os.getpid())]
    assert len(startups()) == 2 + len(workers) and 1 <= len(workers) <= 2
    assert all(threads == "1" for _, threads, _ in workers)  # engine.threads_per_worker


def test_a_ray_actor_starts_with_it(startups, tiny, monkeypatch):
    """ClientActor.setup (the body of every Ray actor), without a cluster: Ray's node id
    comes from a stand-in module."""
    from pflkit.engine.clients import unpack_replies
    from pflkit.engine.ray_runner import ClientActor

    context = types.SimpleNamespace(get_node_id=lambda: "node-7")
    monkeypatch.setitem(
        sys.modules, "ray", types.SimpleNamespace(get_runtime_context=lambda: context)
    )
    cfg = tiny()
    actor = ClientActor()
    reply = actor.setup(worker.WorkerSpec(cfg, 2, "cpu"), build_federated(cfg.data))
    assert unpack_replies({0: reply}, "a Ray worker", "starting", 0, lambda: None) == {0: "node-7"}
    assert startups() == [[str(os.getpid()), "2", "cpu"]]
    assert actor.algo.name == "fedavg" and len(actor.envs) == cfg.data.num_clients


def test_a_flower_node_starts_with_it(startups, tiny, tmp_path, monkeypatch):
    pytest.importorskip("flwr")
    from flower_fakes import flower_run, task_identity
    from pflkit.flower import client

    monkeypatch.setattr(client.Worker, "_cache", {})  # a node process's first message
    identity = task_identity()
    next(identity)
    try:
        flower_run(tiny(train={"rounds": 1}), tmp_path, {1: {"client-ids": "0-3"}})
    finally:
        next(identity, None)
    # the server's simulation, then the node (one process here), with the config's threads
    pid = str(os.getpid())
    assert startups() == [[pid, "None", "None"], [pid, "1", "None"]]


@pytest.fixture
def parses(tmp_path, monkeypatch):
    """FedProx's Params validation (what parse_params, build_algorithm and resolve_params
    all end in) wrapped to append the pid per call to a file; returns the lines."""
    from pflkit.algorithms.fedprox import FedProx

    path, real = tmp_path / "parses.txt", FedProx.Params.model_validate

    def spy(cls, raw, *args, **kw):
        with path.open("a") as f:
            f.write(f"{os.getpid()}\n")
        return real(raw, *args, **kw)

    monkeypatch.setattr(FedProx.Params, "model_validate", classmethod(spy))
    return lambda: path.read_text().split() if path.exists() else []


@pytest.mark.parametrize("weighting", [None, "uniform"])
def test_the_algorithm_section_is_parsed_once_per_run(parses, tmp_path, weighting):
    """validate parses it; the simulation, the checkpoint's fingerprint and the pool's
    workers (forked, so the spy would see them) use what validate parsed."""
    raw = tiny_config(
        algorithm={"name": "fedprox", "mu": 0.1},
        train={"rounds": 2, "weighting": weighting},
        engine={"workers": 2},
        output={"checkpoint_every": 1},
    )
    cfg = validate(raw)
    assert parses() == [str(os.getpid())]
    assert algorithm_of(cfg).params.mu == 0.1
    assert cfg.algorithm["weighting"] == (weighting or "samples")  # the record: all defaults
    result = run_experiment(cfg, out=tmp_path / "r")
    assert isinstance(result.rows, list) and len(result.rows) == 2
    assert parses() == [str(os.getpid())]


def test_a_config_typed_another_way_or_edited_is_parsed_on_use(parses, tiny):
    from pflkit.config import parse

    raw = tiny_config(algorithm={"name": "fedprox", "mu": 0.1})
    cfg = parse(raw)  # not through validate: nothing parsed yet
    assert algorithm_of(cfg).params.mu == 0.1 and algorithm_of(cfg).cls.name == "fedprox"
    assert len(parses()) == 1  # once, then kept
    cfg.algorithm = {"name": "fedprox", "mu": 0.5}
    assert algorithm_of(cfg).params.mu == 0.5 and len(parses()) == 2


PLUGIN = '''
from pflkit.algorithms.fedavg import FedAvg
from pflkit.plugins import register_algorithm


@register_algorithm
class Scaled(FedAvg):
    """FedAvg with a parameter of a plug-in's own Params class."""

    name = "scaled_fedavg"
    description = "FedAvg (a plug-in's test algorithm)"

    class Params(FedAvg.Params):
        scale: float = 1.0
'''

CHILD = """
import os, pickle, sys
from pflkit.algorithms import base
calls = []
real = base.parse_params
base.parse_params = lambda a: calls.append(a) or real(a)
spec = pickle.loads(open(sys.argv[1], "rb").read())  # imports the plug-in first
from pflkit.data.federated import build_federated
from pflkit.engine.worker import start_worker
built = start_worker(spec, build_federated(spec.cfg.data))
print(type(built.algo).__module__, built.algo.name, built.algo.params.scale, len(calls))
"""


def test_a_pickled_spec_imports_the_plugins_before_the_typed_parameters(tmp_path, monkeypatch):
    """A worker process that does not have the plug-in imported (a fork server's, a Ray
    actor's) unpickles the spec: the plug-in module is imported from the config's plugins
    list first, then the parameters typed by its class; nothing is parsed there. ``-P``: the
    worker's folder is not on its path until load_plugins puts it there."""
    (tmp_path / "my_scaled.py").write_text(PLUGIN)
    monkeypatch.syspath_prepend(str(tmp_path))
    from pflkit.algorithms import ALGORITHMS

    try:
        raw = tiny_config(plugins=["my_scaled"], algorithm={"name": "scaled_fedavg", "scale": 3.0})
        cfg = validate(raw)
        assert type(algorithm_of(cfg).params).__module__ == "my_scaled"
        (tmp_path / "spec.pkl").write_bytes(pickle.dumps(worker.WorkerSpec(cfg, 1)))
    finally:
        ALGORITHMS.pop("scaled_fedavg", None)
        sys.modules.pop("my_scaled", None)
    src = os.path.join(os.path.dirname(worker.__file__), "..", "..")
    r = subprocess.run(
        [sys.executable, "-P", "-c", CHILD, str(tmp_path / "spec.pkl")],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        env=os.environ | {"PYTHONPATH": os.path.abspath(src)},
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["my_scaled", "scaled_fedavg", "3.0", "0"]


def test_a_fork_server_pool_runs_a_plugin_algorithm_as_this_process(tmp_path, monkeypatch):
    (tmp_path / "my_scaled.py").write_text(PLUGIN)
    monkeypatch.syspath_prepend(str(tmp_path))
    from pflkit.algorithms import ALGORITHMS

    try:
        raw = tiny_config(
            plugins=["my_scaled"], algorithm={"name": "scaled_fedavg"}, train={"rounds": 2}
        )
        cfg = validate(raw)
        here = run_experiment(cfg, out=tmp_path / "here")
        fresh = ProcessPool(2, 1, fresh=True)
        pool = run_experiment(cfg, out=tmp_path / "pool", runner=fresh)
    finally:
        ALGORITHMS.pop("scaled_fedavg", None)
        sys.modules.pop("my_scaled", None)
    assert strip_timing(pool.rows) == strip_timing(here.rows)
