"""The client-state store (pflkit.engine.states): the memory bound, the disk format, atomic
writes, incremental checkpoints, and the faults: a kill during a write, a corrupted file, a
full disk. (Bit-identity for every algorithm with the store on disk: tests/test_conformance.py.)"""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import tiny_config
from pflkit.algorithms.base import nbytes
from pflkit.engine import run_experiment
from pflkit.engine.states import ClientStates
from pflkit.errors import PflkitError
from pflkit.experiment import validate

TESTS = Path(__file__).parent


def state(v: float, n: int = 4) -> dict:
    return {"w": torch.full((n,), v), "step": 3, "name": "x"}


def inits() -> tuple[list[int], ClientStates]:
    """A store of 16-byte states whose init records which clients were initialised."""
    called: list[int] = []

    def init(cid: int) -> dict:
        called.append(cid)
        return {"w": torch.zeros(4)}

    return called, init


def rows(result) -> list[dict]:
    return [{k: v for k, v in r.items() if not k.startswith("seconds_")} for r in result.rows]


def test_a_state_read_back_from_disk_is_the_state_written_bit_for_bit(tmp_path):
    store = ClientStates(lambda cid: {}, memory=0, folder=tmp_path)
    odd = {
        "bf16": torch.randn(3, 2).to(torch.bfloat16),
        "view": torch.arange(12.0).reshape(3, 4).t(),  # not contiguous
        "int": torch.tensor([1, 2], dtype=torch.int64),
        "bool": torch.tensor(True),
        "array": np.arange(5, dtype=np.float32),
        "scalar": np.float64(0.25),
        "nested": [{"a": torch.ones(2)}, (1, "two", None, 3.5)],
        "empty": torch.empty(0),
    }
    odd["alias"] = odd["int"]  # the same tensor twice (safetensors refuses shared memory)
    odd["slice"] = odd["int"][1:]  # a view into the same storage at another offset
    store[7] = odd
    assert store.bytes_in_memory == 0 and store.writes == 1
    back = store[7]
    assert store.reads == 1
    assert list(back) == list(odd)
    for k in ("bf16", "view", "int", "bool", "empty", "alias", "slice"):
        assert back[k].dtype == odd[k].dtype and torch.equal(back[k], odd[k]), k
    assert isinstance(back["array"], np.ndarray) and np.array_equal(back["array"], odd["array"])
    assert isinstance(back["scalar"], np.float64) and back["scalar"] == 0.25
    assert torch.equal(back["nested"][0]["a"], torch.ones(2))
    assert back["nested"][1] == (1, "two", None, 3.5)
    assert [p.suffix for p in tmp_path.glob("c*")] == [".safetensors"]


def test_memory_stays_within_the_bound_least_recently_used_first(tmp_path):
    size = nbytes(state(0.0))  # 16 bytes of tensor + 8 (int) + 1 (string)
    store = ClientStates(lambda cid: {}, memory=2 * size, folder=tmp_path)
    for cid in range(3):
        store[cid] = state(float(cid))
        assert store.bytes_in_memory <= 2 * size
    assert store.writes == 1  # client 0, the least recently used, went to disk
    assert torch.equal(store[1]["w"], torch.full((4,), 1.0))  # from memory: a use
    assert store.reads == 0
    store[3] = state(3.0)  # evicts client 2 (1 was used after it)
    assert store.writes == 2
    assert sorted(int(p.name[1]) for p in tmp_path.glob("c*")) == [0, 2]
    assert torch.equal(store[0]["w"], torch.zeros(4)) and store.reads == 1
    assert list(store) == [0, 1, 2, 3] and len(store) == 4


def test_a_client_that_never_took_part_costs_no_memory_and_no_disk(tmp_path):
    called, init = inits()
    store = ClientStates(init, memory=0, folder=tmp_path)
    torch.manual_seed(5)
    before = torch.get_rng_state()
    assert torch.equal(store.get_or_init(9)["w"], torch.zeros(4)) and called == [9]
    assert torch.equal(torch.get_rng_state(), before)  # init's seeding is undone
    assert 9 not in store and len(store) == 0 and store.bytes_in_memory == 0
    assert store.commit()["clients"] == []
    assert not tmp_path.exists() or not any(tmp_path.glob("c*"))
    with pytest.raises(KeyError):
        store[9]


def test_checkpoints_are_incremental_and_keep_the_versions_they_name(tmp_path):
    store = ClientStates(lambda cid: {}, memory=10**6, folder=tmp_path)
    for cid in range(3):
        store[cid] = state(float(cid))
    first = store.commit()
    store.committed(first)
    assert store.writes == 3 and first["clients"] == [0, 1, 2]
    store[1] = state(10.0)
    second = store.commit()
    assert store.writes == 4  # only the changed state
    assert second["versions"][0] == first["versions"][0]
    assert second["versions"][1] > first["versions"][1]
    old = tmp_path / f"c1-v{first['versions'][1]}.safetensors"
    assert old.exists()  # the standing checkpoint still names it
    store.committed(second)
    assert not old.exists() and len(list(tmp_path.glob("c*"))) == 3
    # a later write, then a resume from the second checkpoint: the write is undone
    store[2] = state(20.0)
    store.commit()
    store.close()  # one store per folder: the resumed one takes the folder's lock
    again = ClientStates(lambda cid: {}, memory=10**6, folder=tmp_path)
    (tmp_path / "c0-v99.safetensors.tmp").write_bytes(b"half")  # a killed write
    again.restore(second)
    assert torch.equal(again[1]["w"], torch.full((4,), 10.0))
    assert torch.equal(again[2]["w"], torch.full((4,), 2.0))
    assert len(list(tmp_path.glob("c*"))) == 3


def test_a_full_disk_while_writing_a_state_is_one_sentence_and_keeps_the_old_version(
    tmp_path, monkeypatch
):
    store = ClientStates(lambda cid: {}, memory=0, folder=tmp_path)
    store[0] = state(1.0)

    real = Path.write_bytes

    def full(self, data):
        real(self, data[:10])
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(Path, "write_bytes", full)
    with pytest.raises(PflkitError) as err:
        store[0] = state(2.0)
    assert "No space left on device" in str(err.value) and "\n" not in str(err.value)
    assert "free disk space" in str(err.value)
    assert [p.name.endswith(".safetensors") for p in tmp_path.glob("c*")] == [True]
    monkeypatch.undo()
    assert torch.equal(store[0]["w"], torch.full((4,), 1.0))


def ditto_on_disk(out: Path, checkpoint_every: int):
    """A finished 2-round Ditto run with every client state on disk (``state_memory: 0``)."""
    cfg = tiny_config(
        algorithm={"name": "ditto"},
        engine={"workers": 1, "state_memory": 0},
        train={"rounds": 2},
        output={"checkpoint_every": checkpoint_every, "progress": False},
    )
    return run_experiment(validate(cfg), out=out)


def test_a_corrupted_state_file_is_one_sentence_exit_2_and_nothing_is_lost(tmp_path, cli):
    run = ditto_on_disk(tmp_path / "run", checkpoint_every=1)
    files = sorted((run.run_dir / "states").glob("*.safetensors"))
    assert len(files) == 4  # ditto: every client keeps its personal model
    blob = bytearray(files[1].read_bytes())
    blob[-3] ^= 0xFF  # one flipped bit pattern in a tensor's bytes
    files[1].write_bytes(bytes(blob))
    before = sorted(p.name for p in run.run_dir.rglob("*"))
    res = cli("run", "--resume", str(run.run_dir), "--set", "train.rounds=3", cwd=tmp_path)
    assert res.returncode == 2, res.stderr
    message = res.stderr.strip()
    assert "fails its checksum" in message and files[1].name in message
    assert len(message.splitlines()) == 1 and "Traceback" not in res.stderr
    assert sorted(p.name for p in run.run_dir.rglob("*")) == before  # nothing removed
    assert len((run.run_dir / "metrics.jsonl").read_text().splitlines()) == 2


KILLED_RUN = """
import os, signal, sys
sys.path.insert(0, {tests!r})
from conftest import tiny_config
from pflkit.engine import Simulation, run_experiment
from pflkit.experiment import validate

real_round, real_replace, now = Simulation.run_round, os.replace, {{}}

def run_round(self, rnd):
    now["round"] = rnd
    return real_round(self, rnd)

def replace(src, dst):  # the process dies between writing a state and renaming it
    if now.get("round") == 3 and str(src).endswith(".safetensors.tmp"):
        os.kill(os.getpid(), signal.SIGKILL)
    return real_replace(src, dst)

Simulation.run_round, os.replace = run_round, replace
run_experiment(validate(tiny_config(**{cfg!r})), out={out!r})
"""


def test_a_kill_during_a_state_write_resumes_bit_identically(tmp_path):
    sections = {
        "algorithm": {"name": "fedrep"},
        "engine": {"workers": 1, "state_memory": 0},
        "train": {"rounds": 4, "client_fraction": 0.75},
        "output": {"checkpoint_every": 2, "progress": False},
    }
    full = run_experiment(validate(tiny_config(**sections)), out=tmp_path / "full")
    out = tmp_path / "killed"
    script = KILLED_RUN.format(tests=str(TESTS), cfg=sections, out=str(out))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(script)], env=env, timeout=300)
    assert proc.returncode == -9  # killed, as by SIGKILL or the OOM killer
    assert any(p.name.endswith(".tmp") for p in (out / "states").iterdir())
    resumed = run_experiment(resume=out)
    assert rows(resumed) == rows(full)
    assert not any(p.name.endswith(".tmp") for p in (out / "states").iterdir())


def test_reading_a_finished_run_removes_no_state_file(tmp_path):
    from pflkit.engine.runner import load_finished

    run = ditto_on_disk(tmp_path / "run", checkpoint_every=2)
    later = run.run_dir / "states" / "c0-v999.safetensors"  # as a resumed run might write
    later.write_bytes(b"x")
    sim = load_finished(run.run_dir)
    sim.close()
    assert later.exists()
