"""engine.runner: ray (pflkit.engine.ray_runner) on a real two-node Ray cluster on this
machine: the numbers equal the process pool's bit for bit, jobs run on both nodes, and bad
input (Ray missing, an address nothing answers at, a diverging client, a dead worker) is one
sentence. One cluster for the module, started and stopped by the ``cluster`` fixture."""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from conftest import tiny_config
from pflkit.engine import run_experiment
from pflkit.engine.clients import ProcessPool
from pflkit.engine.simulation import runner_for
from pflkit.errors import PflkitError, WorkerLost
from pflkit.experiment import validate


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rows_of(result) -> list[dict]:
    return [{k: v for k, v in r.items() if not k.startswith("seconds_")} for r in result.rows]


def _ours(temp_dir: str, port: int) -> set[int]:
    """The processes of the cluster in ``temp_dir`` (every Ray daemon names its session folder
    or the head's port on its command line) and all their descendants (workers and agents
    rename themselves): this cluster's only, not another Ray on this machine."""
    parent: dict[int, int] = {}
    roots = set()
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmd = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            parent[int(proc.name)] = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        if temp_dir in cmd or ("ray" in cmd and f":{port} " in cmd + " "):
            roots.add(int(proc.name))
    ours, grew = set(roots), True
    while grew:
        kids = {pid for pid, pp in parent.items() if pp in ours and pid not in ours}
        ours |= kids
        grew = bool(kids)
    return ours - {os.getpid()}


def _alive(pid: int) -> bool:
    try:  # a zombie (an orphan whose new parent does not reap it) counts as gone
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _stop(temp_dir: str, port: int) -> None:
    """Stop the cluster by its processes' ids (``ray stop`` would stop every Ray of this user)."""
    pids = _ours(temp_dir, port)
    for sig, wait in ((signal.SIGTERM, 2.0), (signal.SIGKILL, 2.0)):
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        end = time.monotonic() + wait
        while time.monotonic() < end and any(_alive(p) for p in pids):
            time.sleep(0.1)
        pids = {p for p in pids if _alive(p)}
        if not pids:
            break


@pytest.fixture(scope="module")
def cluster():
    """A head and a second node, one CPU each, small object stores, no dashboard, no usage
    stats, on free ports with a session folder of their own (safe under pytest-xdist and
    next to other Ray clusters), with the test process's Ray token (conftest.py); both
    stopped at the end."""
    pytest.importorskip("ray", reason="Ray is not installed (pip install 'pflkit[ray]')")
    ray_cli = str(Path(sys.executable).with_name("ray"))
    temp_dir = tempfile.mkdtemp(prefix="pflray", dir="/tmp")  # short: socket paths
    port = free_port()
    env = dict(os.environ)
    common = ["--num-cpus=1", "--object-store-memory=80000000", "--disable-usage-stats"]
    common += [f"--temp-dir={temp_dir}", "--node-ip-address=127.0.0.1"]
    head = [ray_cli, "start", "--head", f"--port={port}", "--include-dashboard=false"]
    head += [f"--ray-client-server-port={free_port()}", f"--dashboard-port={free_port()}"]
    node = [ray_cli, "start", f"--address=127.0.0.1:{port}"]
    node += [f"--dashboard-agent-listen-port={free_port()}"]
    try:
        for cmd in (head + common, node + common):
            r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180)
            assert r.returncode == 0, f"{' '.join(cmd)}:\n{r.stdout}\n{r.stderr}"
        yield SimpleNamespace(address=f"127.0.0.1:{port}", temp_dir=temp_dir)
    finally:
        _stop(temp_dir, port)
        shutil.rmtree(temp_dir, ignore_errors=True)


def ray_config(address: str | None, **sections):
    engine = {"runner": "ray", "ray_address": address, "workers": "auto"}
    return validate(tiny_config(engine=engine, **sections))


@pytest.mark.parametrize("algorithm", ["fedavg", "fedrep"])
def test_ray_numbers_equal_the_pools_and_run_on_both_nodes(cluster, tmp_path, algorithm):
    """A FedAvg-like and a stateful personalized method (its heads live in the engine's client
    states, so states travel to the actors and back): every metric of every round as
    ProcessPool(2, 1) computes it, with jobs on both nodes."""
    train = {"rounds": 3, "client_fraction": 0.75}
    cfg = ray_config(cluster.address, algorithm={"name": algorithm}, train=train)
    pool_cfg = validate(tiny_config(algorithm={"name": algorithm}, train=train))
    pool = run_experiment(pool_cfg, out=tmp_path / "pool", runner=ProcessPool(2, 1))
    runner = runner_for(cfg)
    on_ray = run_experiment(cfg, out=tmp_path / "ray", runner=runner)
    assert rows_of(on_ray) == rows_of(pool)
    assert on_ray.summary["final"] == pool.summary["final"]
    # auto: one actor per CPU of the cluster, spread over its two nodes, both used
    assert len(runner.jobs_per_node) == 2, runner.jobs_per_node
    assert all(n > 0 for n in runner.jobs_per_node.values())
    assert not runner.actors and not runner.owns_ray  # closed: actors gone, disconnected
    import ray

    assert not ray.is_initialized()


def test_a_dead_ray_worker_is_one_sentence_not_a_hang(cluster):
    import ray

    from pflkit.engine.simulation import Simulation

    sim = Simulation(ray_config(cluster.address))
    try:
        sim.run_round(1)
        ray.kill(sim.runner.actors[0])
        with pytest.raises(WorkerLost, match="a Ray worker died while training in round 2") as err:
            sim.run_round(2)
        assert err.value.setting == "engine.runner=pool"  # what a run's sentence tells to set
        assert not sim.runner.actors  # the other actor was stopped too
    finally:
        sim.close()
    assert not ray.is_initialized()


def test_a_pflkit_error_in_a_job_is_the_same_sentence(cluster, tmp_path):
    """A client that diverges raises a PflkitError in its actor: the same sentence here."""
    train = {"lr": 1e12, "rounds": 1}
    with pytest.raises(PflkitError) as here:
        run_experiment(validate(tiny_config(train=train)), out=tmp_path / "here")
    assert "diverged" in str(here.value)
    with pytest.raises(PflkitError) as there:
        run_experiment(ray_config(cluster.address, train=train), out=tmp_path / "ray")
    assert str(there.value) == str(here.value)


def test_too_many_workers_for_the_cluster_is_one_sentence(cluster, tmp_path):
    cfg = validate(
        tiny_config(engine={"runner": "ray", "ray_address": cluster.address, "workers": 3})
    )
    with pytest.raises(PflkitError, match="3 Ray workers of 1 CPUs and 0 GPUs each do not fit"):
        run_experiment(cfg, out=tmp_path / "r")


def test_without_ray_it_is_one_sentence(cli, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError
    with pytest.raises(PflkitError) as err:
        runner_for(ray_config(None))
    assert str(err.value) == "engine.runner: ray needs Ray: pip install 'pflkit[ray]'"
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(tiny_config(engine={"runner": "ray"})))
    r = cli("run", str(path), "--out", "r", cwd=tmp_path)
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert len(r.stderr.strip().splitlines()) == 1 and str(err.value) in r.stderr, r.stderr
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize(
    ("address", "message"),
    [
        ("127.0.0.1:@", "no Ray cluster answers at engine.ray_address 127.0.0.1:@"),
        ("nonsense", "engine.ray_address 'nonsense' is not HOST:PORT"),
    ],
)
def test_an_unreachable_address_is_one_sentence_quickly(tmp_path, address, message):
    pytest.importorskip("ray", reason="Ray is not installed (pip install 'pflkit[ray]')")
    port = str(free_port())  # nothing listens there
    address, message = address.replace("@", port), re.escape(message.replace("@", port))
    began = time.monotonic()
    with pytest.raises(PflkitError, match=message) as err:
        run_experiment(ray_config(address), out=tmp_path / "r")
    assert time.monotonic() - began < 30
    assert "\n" not in str(err.value)
    import ray

    assert not ray.is_initialized()


def test_gpus_and_device_must_agree(monkeypatch):
    pytest.importorskip("ray", reason="Ray is not installed (pip install 'pflkit[ray]')")
    from pflkit.engine import ray_runner

    with pytest.raises(PflkitError, match="engine.ray_gpus is 0.5 but device cpu is the CPU"):
        runner_for(validate(tiny_config(device="cpu", engine={"runner": "ray", "ray_gpus": 0.5})))
    monkeypatch.setattr(ray_runner, "resolve_device", lambda name: "cuda")
    with pytest.raises(PflkitError, match="engine.ray_gpus is 0, so the Ray workers would train"):
        runner_for(validate(tiny_config(engine={"runner": "ray"})))
    runner = runner_for(validate(tiny_config(engine={"runner": "ray", "ray_gpus": 0.25})))
    assert (runner.gpus, runner.cpus, runner.workers) == (0.25, 1.0, 1)


def test_without_an_address_a_ray_instance_runs_for_the_run_only(tmp_path):
    """engine.ray_address null: Ray started on this machine for the run (even next to the
    module's cluster) and stopped at its end; the numbers are the in-process runner's."""
    pytest.importorskip("ray", reason="Ray is not installed (pip install 'pflkit[ray]')")
    import ray

    train = {"rounds": 1}
    here = run_experiment(validate(tiny_config(train=train)), out=tmp_path / "here")
    runner = runner_for(ray_config(None, train=train))
    local = run_experiment(ray_config(None, train=train), out=tmp_path / "ray", runner=runner)
    assert rows_of(local) == rows_of(here)
    assert sum(runner.jobs_per_node.values()) == 8  # 4 clients trained, 4 evaluated
    assert not ray.is_initialized()
