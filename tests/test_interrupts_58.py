"""Issue 58, interrupts of a parallel compare: Ctrl-C (SIGINT) or SIGTERM to the terminal's
process group, at different moments, prints exactly one line (the compare's) and exits with
130 or 143, leaving no process; a failed or killed job prints no false "SIGTERM received".
Real processes: the compare runs in a session of its own, as a terminal's foreground process
group would, and each moment is found from a marker (a file, a line), never from a sleep."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from conftest import tiny_config

WAIT = 600  # seconds for a marker: generous for a loaded machine; a pass takes seconds


def start(tmp_path: Path, *args: str, rounds: int = 400, command="compare") -> subprocess.Popen:
    """``pflkit COMMAND long.yaml --seeds 0 --jobs 2 --out cut ARGS`` (the console script's
    module), stderr piped."""
    path = tmp_path / "long.yaml"
    path.write_text(yaml.safe_dump(tiny_config(train={"rounds": rounds}, eval={"every": 50})))
    cmd = [sys.executable, "-m", "pflkit", command, str(path), "--seeds", "0", "--jobs", "2",
           "--out", "cut", *args]  # fmt: skip
    return subprocess.Popen(
        cmd, cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        start_new_session=True,  # its own process group: the terminal's, in these tests
    )  # fmt: skip


def children(pid: int) -> list[int]:
    found = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True)
    return [int(p) for p in found.stdout.split()]


def alive(pid: int) -> bool:
    try:  # a zombie counts as gone
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def wait_for(check, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + WAIT
    while not check():
        assert proc.poll() is None, proc.stderr.read()
        assert time.monotonic() < deadline, "the marker never came"
        time.sleep(0.02)


def finish(proc: subprocess.Popen, pids: list[int]) -> tuple[int, list[str]]:
    """The compare's exit code and stderr lines; every process it started is checked gone."""
    try:
        _, err = proc.communicate(timeout=WAIT)
        deadline = time.monotonic() + 20  # the resource tracker exits once its pipe closes
        while any(alive(p) for p in pids):
            assert time.monotonic() < deadline, f"left behind: {[p for p in pids if alive(p)]}"
            time.sleep(0.05)
    finally:
        for pid in [proc.pid, *pids]:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
    return proc.returncode, err.splitlines()


def job_workers(proc: subprocess.Popen) -> list[int]:
    return [
        p for p in children(proc.pid)
        if b"spawn_main" in Path(f"/proc/{p}/cmdline").read_bytes()
    ]  # fmt: skip


CONTINUE = "run the same command with --out cut to continue it"


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_while_the_jobs_import_is_one_line(tmp_path, sig):
    """A KeyboardInterrupt traceback of ~50 lines from a job process that was importing."""
    proc = start(tmp_path, "--algorithms", "local,fedavg", "-q")
    plan = tmp_path / "cut" / "plan.json"
    wait_for(lambda: plan.exists() and len(job_workers(proc)) == 2, proc)
    assert not list((tmp_path / "cut").glob("*/metrics.jsonl"))  # still starting
    pids = children(proc.pid)
    os.killpg(proc.pid, sig)
    code, lines = finish(proc, pids)
    assert code == (130 if sig == signal.SIGINT else 143), lines
    assert len(lines) == 1 and lines[0].startswith("error: interrupted") and CONTINUE in lines[0]


def test_ctrl_c_mid_run_is_one_line(tmp_path):
    proc = start(tmp_path, "--algorithms", "local,fedavg", "-q")
    rows = [tmp_path / "cut" / f"{a}-s0" / "metrics.jsonl" for a in ("local", "fedavg")]
    wait_for(lambda: all(r.exists() and r.read_text().count("\n") >= 2 for r in rows), proc)
    pids = children(proc.pid)
    os.killpg(proc.pid, signal.SIGINT)
    code, lines = finish(proc, pids)
    assert code == 130 and len(lines) == 1, lines
    assert lines[0].startswith("error: interrupted") and CONTINUE in lines[0]
    for r in rows:  # each run stopped at its round's end with a checkpoint
        assert (r.parent / "checkpoints" / "latest.pt").exists()


def test_ctrl_c_while_the_report_is_written_is_one_line(tmp_path):
    """It ended by the signal, with no message (SIGTERM), or with "stopped at once"."""
    proc = start(tmp_path, "--algorithms", "local,fedavg", rounds=2)
    progress = []
    deadline = time.monotonic() + WAIT
    while not any(line.startswith("[2/2]") for line in progress):  # the last run finished
        assert time.monotonic() < deadline and proc.poll() is None, progress
        progress.append(proc.stderr.readline())
    pids = children(proc.pid)
    os.killpg(proc.pid, signal.SIGINT)
    code, lines = finish(proc, pids)
    assert code == 130 and len(lines) == 1, lines
    assert lines[0].startswith("error: interrupted") and CONTINUE in lines[0]
    assert not (tmp_path / "cut" / "results.md").exists() or code == 0


def test_a_killed_job_is_one_line_without_a_false_sigterm(tmp_path):
    """The pool stops the other job with SIGTERM, which printed "SIGTERM received: ..." from
    that job before the compare's sentence."""
    proc = start(tmp_path, "--algorithms", "local,fedavg", "-q")
    rows = [tmp_path / "cut" / f"{a}-s0" / "metrics.jsonl" for a in ("local", "fedavg")]
    wait_for(lambda: all(r.exists() and r.read_text().count("\n") >= 2 for r in rows), proc)
    pids = children(proc.pid)
    os.kill(job_workers(proc)[0], signal.SIGKILL)
    code, lines = finish(proc, pids)
    assert code == 2 and len(lines) == 1, lines
    assert lines[0].startswith("error: a job worker process died while running")


def test_a_failed_run_is_one_line_without_a_false_sigterm(tmp_path):
    """pFedMe's loss turns NaN in round 1 of the third run, while the second (400 rounds) is
    mid-way: the compare stops that one with SIGTERM, which printed "SIGTERM received"."""
    sweep_args = ["--algorithms", "fedavg,{name: pfedme, personal_lr: 1e10}", "--grid",
                  "train.rounds=[3,400]", "--select", "none", "-q"]  # fmt: skip
    proc = start(tmp_path, *sweep_args, command="sweep")
    code, lines = finish(proc, [])
    assert code == 2 and len(lines) == 1, lines
    assert "local training diverged" in lines[0] and "SIGTERM" not in lines[0]
    fedavg = tmp_path / "cut" / "fedavg[train.rounds=400]-s0"
    assert (fedavg / "checkpoints" / "latest.pt").exists()  # it was stopped mid-way
