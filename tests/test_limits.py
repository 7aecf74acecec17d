"""Requests past the machine (issue 58): workers, threads, memory and disk beyond what this
machine has are refused before anything is written, in one sentence naming the value, the
limit and the fix; ``--force`` / ``force=True`` goes on (pflkit.engine.limits)."""

from __future__ import annotations

import sys

import pytest
import yaml

from conftest import tiny_config
from pflkit.engine import Simulation, limits, run_experiment
from pflkit.errors import PflkitError
from pflkit.experiment import validate


def refused(tmp_path, **sections) -> str:
    """The sentence a run of the tiny config with ``sections`` is refused with; nothing is
    written."""
    with pytest.raises(PflkitError) as err:
        run_experiment(validate(tiny_config(**sections)), out=tmp_path / "run")
    assert not (tmp_path / "run").exists()
    message = str(err.value)
    assert "\n" not in message and "--force" in message
    return message


def test_ten_thousand_workers_are_refused_before_the_run_folder(tmp_path):
    """Before: a run folder, then thousands of forked processes and BlockingIOError."""
    most = 4 * limits.cores()
    message = refused(tmp_path, engine={"workers": 10_000})
    assert "engine.workers 10000 is more than 4 worker processes per core" in message
    assert f"({most})" in message


def test_the_rule_allows_four_workers_per_core_and_refuses_one_more(tmp_path, monkeypatch):
    monkeypatch.setattr(limits, "cores", lambda: 1)
    Simulation(validate(tiny_config(engine={"workers": 4}))).close()  # no worker starts
    assert "engine.workers 5 is more than" in refused(tmp_path, engine={"workers": 5})


def test_workers_beyond_the_process_limit_are_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(limits, "process_headroom", lambda: (2, "ulimit -u 100"))
    message = refused(tmp_path, engine={"workers": 3})
    assert "needs 3 new processes but only 2 may start here (ulimit -u 100)" in message
    Simulation(validate(tiny_config(engine={"workers": 2}))).close()


def test_process_headroom_counts_this_users_tasks_against_rlimit_nproc(monkeypatch):
    monkeypatch.setattr(limits.resource, "getrlimit", lambda _: (50, 100))
    monkeypatch.setattr(limits.os, "geteuid", lambda: 1234)
    monkeypatch.setattr(limits, "_user_tasks", lambda: 45)
    monkeypatch.setattr(limits, "Path", lambda p: _NoFile())  # no cgroup limit
    assert limits.process_headroom() == (5, "ulimit -u 50")


class _NoFile:
    def read_text(self):
        raise OSError


def test_threads_beyond_four_per_core_are_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(limits, "cores", lambda: 1)
    assert "threads 5 is more than 4 torch threads per core" in refused(tmp_path, threads=5)
    message = refused(tmp_path, engine={"workers": 2, "threads_per_worker": 3})
    assert "= 2 x 3 = 6 torch threads is more than 4 per core of this machine's 1 (4)" in message


def test_the_memory_estimate_is_measured_and_refused_above_what_is_available(tmp_path, monkeypatch):
    """The MLP has 2,410 float32 parameters (64x32 + 32 + 32x10 + 10); FedRep keeps its head
    per client (32x10 + 10); a batch of 16 keeps 64 + 32 + 32 + 10 floats of activations per
    sample (flatten, linear, relu, linear)."""
    raw = tiny_config(algorithm={"name": "fedrep"}, engine={"workers": 3})
    sim = Simulation(validate(raw))
    fp = limits.footprint(sim.cfg, sim.algo, sim.envs, sim.stateful_clients())
    sim.close()
    model, head = (64 * 32 + 32 + 32 * 10 + 10) * 4, (32 * 10 + 10) * 4
    assert fp == limits.Footprint(model, head, 16 * (64 + 32 + 32 + 10) * 4, 4)
    per_worker = limits.WORKER_BASE + 4 * model + head + fp.act_bytes
    need = 4 * head + 3 * per_worker
    monkeypatch.setattr(limits, "available_memory", lambda: need)
    Simulation(validate(raw)).close()  # exactly enough
    monkeypatch.setattr(limits, "available_memory", lambda: need - 1)
    message = refused(tmp_path, algorithm={"name": "fedrep"}, engine={"workers": 3})
    assert "the run needs about" in message and "lower engine.state_memory" in message
    # the states kept in memory are bounded by engine.state_memory
    small = {"workers": 3, "state_memory": 0}
    monkeypatch.setattr(limits, "available_memory", lambda: 3 * per_worker)
    Simulation(validate(tiny_config(algorithm={"name": "fedrep"}, engine=small))).close()


def test_states_beyond_the_free_disk_are_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(limits, "free_disk", lambda folder: (100, tmp_path))
    message = refused(
        tmp_path, algorithm={"name": "fedrep"}, output={"checkpoint_every": 1, "progress": False}
    )
    assert "writes about 5.2 KiB of client states to disk (4 clients x 1.3 KiB)" in message
    assert "has 100 B free" in message
    # without checkpoints the states stay in memory (engine.state_memory): nothing to refuse
    Simulation(validate(tiny_config(algorithm={"name": "fedrep"}))).close()


def test_force_goes_on_in_python_and_on_the_command_line(tmp_path, monkeypatch, capsys):
    from pflkit.cli import main

    monkeypatch.setattr(limits, "available_memory", lambda: 1)
    refused(tmp_path)
    res = run_experiment(validate(tiny_config()), out=tmp_path / "forced", force=True)
    assert len(res.rows) == 3
    (tmp_path / "cfg.yaml").write_text(yaml.safe_dump(tiny_config()))
    args = ["pflkit", "run", str(tmp_path / "cfg.yaml"), "-q", "--out", str(tmp_path / "cli")]
    monkeypatch.setattr(sys, "argv", args)
    with pytest.raises(SystemExit) as exit_:
        main()
    assert exit_.value.code == 2 and not (tmp_path / "cli").exists()
    assert "--force" in capsys.readouterr().err
    monkeypatch.setattr(sys, "argv", [*args, "--force"])
    main()
    assert (tmp_path / "cli" / "summary.json").exists()


def test_a_compare_checks_its_jobs_before_its_folder_is_written(tmp_path, monkeypatch):
    from pflkit.engine.compare import run_compare

    monkeypatch.setattr(limits, "cores", lambda: 1)
    cfg = validate(tiny_config(compare={"seeds": [0, 1, 2, 3, 4]}))
    with pytest.raises(PflkitError, match=r"--jobs 5 is more than 4 worker processes per core"):
        run_compare(cfg, tmp_path / "cmp", progress=False, jobs=5)
    assert not (tmp_path / "cmp").exists()
    workers = validate(tiny_config(engine={"workers": 5}))
    with pytest.raises(PflkitError, match="engine.workers 5 is more than"):
        run_compare(workers, tmp_path / "cmp", progress=False)
    assert not (tmp_path / "cmp").exists()
