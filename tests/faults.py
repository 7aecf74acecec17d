"""A pflkit plugin that kills its own process (``os._exit``, as abrupt as SIGKILL: no cleanup,
no ``finally``) at one chosen point, for tests/test_faults.py. ``PFLKIT_FAULT=POINT:N`` picks
the N-th time the process reaches POINT:

- ``round``: the start of round N;
- ``metrics``: in the middle of the N-th line written to metrics.jsonl (half of it written);
- ``ckpt``: in the middle of writing the N-th checkpoint's temporary file;
- ``ckpt_replace``: after the N-th checkpoint's temporary file is complete, before it
  replaces ``latest.pt``;
- ``config`` / ``summary``: in the middle of writing config.yaml / summary.json's temporary file;
- ``truncate``: before a resume cuts metrics.jsonl after the checkpoint's rounds;
- ``state``: in the middle of writing the N-th client-state file's temporary file;
- ``commit``: after the N-th checkpoint's client states are written, before the checkpoint;
- ``committed``: after the N-th checkpoint is written, before the state files it replaced
  are removed;
- ``enospc``: the N-th client-state write fails with "No space left on device" (no kill).
"""

from __future__ import annotations

import errno
import io
import os
import pathlib

from pflkit.engine import checkpoint, runner, states
from pflkit.engine.simulation import Simulation

POINT, _, NTH = os.environ.get("PFLKIT_FAULT", "none:0").partition(":")
seen: dict[str, int] = {}


def hit(point: str) -> bool:
    seen[point] = seen.get(point, 0) + 1
    return point == POINT and seen[point] == int(NTH)


def die() -> None:
    os._exit(137)


real_round = Simulation.run_round


def run_round(self, rnd):
    if POINT == "round" and rnd == int(NTH):
        die()
    return real_round(self, rnd)


class TornWrites:
    def __init__(self, f):
        self.f = f

    def write(self, text):
        if hit("metrics"):
            self.f.write(text[: len(text) // 2])
            self.f.flush()
            die()
        return self.f.write(text)

    def __getattr__(self, name):
        return getattr(self.f, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return self.f.__exit__(*exc)


real_open = pathlib.Path.open


def open_(self, mode="r", *args, **kwargs):
    f = real_open(self, mode, *args, **kwargs)
    return TornWrites(f) if self.name == "metrics.jsonl" and "a" in mode else f


def open_checkpoint(path, mode):
    f = io.FileIO(path, mode)
    if hit("ckpt"):
        f.write(checkpoint.MAGIC + b"0 torn")
        die()
    return f


real_replace = os.replace


def replace(src, dst):
    if str(dst).endswith(".pt") and hit("ckpt_replace"):
        die()
    return real_replace(src, dst)


real_truncate = os.truncate


def truncate(path, length):
    if hit("truncate"):
        die()
    return real_truncate(path, length)


real_write_atomic = runner.write_atomic


def write_atomic(path, text):
    point = pathlib.Path(path).stem  # config or summary
    if hit(point):
        path.with_name(path.name + ".tmp").write_text(text[: len(text) // 2])
        die()
    return real_write_atomic(path, text)


real_state_write = states.write_atomic


def state_write(path, data, fix):
    if hit("state"):
        path.with_name(path.name + ".tmp").write_bytes(data[: len(data) // 2])
        die()
    if hit("enospc"):
        return _enospc(path, fix)
    return real_state_write(path, data, fix)


def _enospc(path, fix):
    real_write_bytes = pathlib.Path.write_bytes

    def full(self, data):
        real_write_bytes(self, data[:10])
        raise OSError(errno.ENOSPC, "No space left on device")

    pathlib.Path.write_bytes = full
    try:
        return real_state_write(path, b"", fix)
    finally:
        pathlib.Path.write_bytes = real_write_bytes


real_commit, real_committed = states.ClientStates.commit, states.ClientStates.committed


def commit(self):
    index = real_commit(self)
    if hit("commit"):
        die()
    return index


def committed(self, index):
    if hit("committed"):
        die()
    return real_committed(self, index)


states.write_atomic = state_write
states.ClientStates.commit = commit
states.ClientStates.committed = committed
Simulation.run_round = run_round
pathlib.Path.open = open_
checkpoint.open = open_checkpoint
os.replace = replace
os.truncate = truncate
runner.write_atomic = write_atomic
