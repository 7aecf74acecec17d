"""The client-state store under faults (issue 58): real ``pflkit run`` processes with every
client state on disk (FedRep, ``engine.state_memory: 0``), killed during a state write, after
the states of a checkpoint are written but before the checkpoint, and after the checkpoint
but before the old states are removed; a full disk while states are written; a state file
deleted or truncated; two runs on one store. Each either resumes to the uninterrupted run's
metrics bit for bit or stops with one sentence; nothing is silently reinitialised.
(tests/faults.py holds the kill points; flipped bytes of a state file: tests/test_corrupt_files.py.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import yaml

from conftest import tiny_config
from pflkit.engine import Simulation
from pflkit.errors import PflkitError
from pflkit.experiment import validate
from test_faults import KILLED, pflkit, results

SECTIONS = {
    "algorithm": {"name": "fedrep"},
    "engine": {"workers": 1, "state_memory": 0},
    "train": {"rounds": 6, "client_fraction": 0.5},
    "output": {"checkpoint_every": 2, "progress": False},
}


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("store-faults")
    (tmp / "cfg.yaml").write_text(yaml.safe_dump(tiny_config(**SECTIONS)))
    r = pflkit("run", "cfg.yaml", "--out", "ref", cwd=tmp)
    assert r.returncode == 0, r.stderr
    assert len(list((tmp / "ref" / "states").glob("*.safetensors"))) == 4  # every client's
    return tmp, results(tmp / "ref")


def one_sentence(r: subprocess.CompletedProcess) -> str:
    assert r.returncode == 2, (r.returncode, r.stderr)
    message = r.stderr.strip()
    assert len(message.splitlines()) == 1 and "Traceback" not in message, message
    return message


def slow(fault: str):
    return pytest.param(fault, marks=pytest.mark.slow)


# state:3: the third state file (round 2's checkpoint) half-written; commit:2: the second
# checkpoint's states written, the checkpoint not; committed:2: the checkpoint written, the
# files it replaced not yet removed
@pytest.mark.parametrize("fault", ["state:3", "commit:2", slow("committed:2"), slow("state:7")])
def test_a_kill_around_a_state_write_or_checkpoint_resumes_bit_identically(setup, fault):
    tmp, reference = setup
    out = f"kill-{fault.replace(':', '-')}"
    r = pflkit("run", "cfg.yaml", "--out", out, cwd=tmp, fault=fault)
    assert r.returncode == KILLED, (r.returncode, r.stderr)
    lock = tmp / out / "states" / ".lock"
    assert json.loads(lock.read_text())["pid"] != os.getpid()  # left by the killed process
    r = pflkit("run", "--resume", out, cwd=tmp)  # takes the dead process's locks over
    assert r.returncode == 0, r.stderr
    assert results(tmp / out) == reference
    assert not lock.exists() and not list((tmp / out / "states").glob("*.tmp"))


def test_a_full_disk_while_states_are_written_stops_in_one_sentence_then_resumes(setup):
    tmp, reference = setup
    r = pflkit("run", "cfg.yaml", "--out", "full", cwd=tmp, fault="enospc:5")
    message = one_sentence(r)
    assert "No space left on device" in message and "pflkit run --resume" in message
    assert not list((tmp / "full" / "states").glob("*.tmp"))  # the torn write is removed
    r = pflkit("run", "--resume", "full", cwd=tmp)
    assert r.returncode == 0, r.stderr
    assert results(tmp / "full") == reference


@pytest.mark.parametrize("damage", ["deleted", "truncated", "folder deleted"])
def test_a_missing_or_cut_state_file_is_refused_and_nothing_is_reinitialised(setup, damage):
    tmp, _ = setup
    out = f"damaged-{damage.replace(' ', '-')}"
    r = pflkit("run", "cfg.yaml", "--out", out, cwd=tmp, fault="round:5")  # after ckpt 4
    assert r.returncode == KILLED
    folder = tmp / out / "states"
    victim = sorted(folder.glob("*.safetensors"))[0]
    if damage == "deleted":
        victim.unlink()
    elif damage == "truncated":
        victim.write_bytes(victim.read_bytes()[:100])
    else:
        for p in folder.iterdir():
            p.unlink()
        folder.rmdir()
    before = sorted(p.name for p in (tmp / out).rglob("*"))
    message = one_sentence(pflkit("run", "--resume", out, cwd=tmp))
    assert ("missing" if damage != "truncated" else "fails its checksum") in message
    assert victim.name in message
    rows = (tmp / out / "metrics.jsonl").read_text().splitlines()
    assert len(rows) == 4  # the checkpoint's rounds kept, no round run on a fresh state
    # every file the checkpoint names is still there (a truncated file is found when read,
    # mid-round, after other clients' new versions were written: the next resume removes them)
    after = {p.name for p in (tmp / out).rglob("*")}
    assert {n for n in before if n != ".lock"} <= after


def test_two_runs_on_one_store_the_second_is_refused_in_one_sentence(setup):
    """CLI: a run folder (and so its store) held by a live process is refused; the store's
    own lock too, when only it is held."""
    tmp, reference = setup
    r = pflkit("run", "cfg.yaml", "--out", "busy", cwd=tmp, fault="round:3")
    assert r.returncode == KILLED
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        for lock, what in [("busy/.lock", "run folder"), ("busy/states/.lock", "client-state")]:
            (tmp / lock).write_text(json.dumps({"pid": holder.pid, "host": os.uname().nodename}))
            message = one_sentence(pflkit("run", "--resume", "busy", cwd=tmp))
            assert what in message and str(holder.pid) in message
            (tmp / lock).unlink()
    finally:
        holder.kill()
        holder.wait()
    for lock in ("busy/.lock", "busy/states/.lock"):  # a dead process's locks: taken over
        (tmp / lock).write_text(json.dumps({"pid": holder.pid, "host": os.uname().nodename}))
    r = pflkit("run", "--resume", "busy", cwd=tmp)
    assert r.returncode == 0, r.stderr
    assert results(tmp / "busy") == reference


def test_two_simulations_on_one_state_folder_the_second_is_refused(tmp_path):
    """Python API: before the lock, the second store's start removed the first one's state
    files, and the first failed a round later."""
    cfg = validate(tiny_config(**{**SECTIONS, "train": {"rounds": 3}}))
    folder = tmp_path / "states"
    with Simulation(cfg, state_dir=folder) as first:
        first.restore(None)
        first.run_round(1)
        written = sorted(folder.glob("*.safetensors"))
        second = Simulation(cfg, state_dir=folder)
        with pytest.raises(PflkitError) as err:
            second.restore(None)
        second.close()
        assert "client-state folder" in str(err.value) and str(os.getpid()) in str(err.value)
        assert sorted(folder.glob("*.safetensors")) == written  # nothing of the first removed
        first.run_round(2)
    again = Simulation(cfg, state_dir=folder)  # the first released it on close
    again.restore(None)
    again.close()
