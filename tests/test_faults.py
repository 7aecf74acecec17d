"""Fault injection (issue 17): a run, or a resume, killed at any of the points where it writes
(tests/faults.py), then resumed until it finishes, ends with the metrics and summary of an
uninterrupted run. The kills are ``os._exit`` calls, as abrupt as SIGKILL."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from conftest import tiny_config

TESTS = Path(__file__).parent
KILLED = 137


def pflkit(*args: str, cwd: Path, fault: str = "") -> subprocess.CompletedProcess:
    env = os.environ | {
        "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])
    }
    if fault:
        env["PFLKIT_FAULT"] = fault
    return subprocess.run(
        [sys.executable, "-m", "pflkit", *args, "--import", "faults", "-q"],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )


def results(run_dir: Path) -> tuple[list[dict], dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rows = [{k: v for k, v in r.items() if not k.startswith("seconds_")} for r in rows]
    summary = json.loads((run_dir / "summary.json").read_text())
    summary.pop("seconds")  # wall-clock time: the one field that differs between runs
    return rows, summary


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """The config (6 rounds, a checkpoint every 2) and its uninterrupted run."""
    tmp = tmp_path_factory.mktemp("faults")
    raw = tiny_config(train={"rounds": 6, "client_fraction": 0.5})
    raw["output"] = {"checkpoint_every": 2, "progress": False}
    (tmp / "cfg.yaml").write_text(yaml.safe_dump(raw))
    r = pflkit("run", "cfg.yaml", "--out", "ref", cwd=tmp)
    assert r.returncode == 0, r.stderr
    return tmp, results(tmp / "ref")


def finish(tmp: Path, out: str) -> None:
    """Resume until the run completes (each resume here must succeed)."""
    r = pflkit("run", "--resume", out, cwd=tmp)
    assert r.returncode == 0, r.stderr
    assert not list((tmp / out).glob("*.tmp")) and not (tmp / out / ".lock").exists()


def slow(fault: str):
    return pytest.param(fault, marks=pytest.mark.slow)


# the default suite kills at one point of each kind; `-m slow` adds the rest
@pytest.mark.parametrize(
    "fault",
    ["round:1", slow("round:4"), "metrics:3", "ckpt:2", slow("ckpt_replace:2"), slow("summary:1")],
)
def test_a_run_killed_anywhere_resumes_to_the_uninterrupted_result(setup, fault):
    tmp, reference = setup
    out = f"run-{fault.replace(':', '-')}"
    r = pflkit("run", "cfg.yaml", "--out", out, cwd=tmp, fault=fault)
    assert r.returncode == KILLED, (r.returncode, r.stderr)
    finish(tmp, out)
    assert results(tmp / out) == reference


@pytest.mark.parametrize(
    "fault", ["truncate:1", slow("config:1"), slow("metrics:1"), slow("ckpt:1")]
)
def test_a_resume_killed_anywhere_resumes_to_the_uninterrupted_result(setup, fault):
    tmp, reference = setup
    out = f"resume-{fault.replace(':', '-')}"
    r = pflkit("run", "cfg.yaml", "--out", out, cwd=tmp, fault="round:6")  # after ckpt 4
    assert r.returncode == KILLED, r.stderr
    r = pflkit("run", "--resume", out, cwd=tmp, fault=fault)
    assert r.returncode == KILLED, (r.returncode, r.stderr)
    finish(tmp, out)
    assert results(tmp / out) == reference


def test_a_run_killed_before_it_wrote_anything_can_be_started_again_into_its_folder(setup):
    tmp, reference = setup
    r = pflkit("run", "cfg.yaml", "--out", "early", cwd=tmp, fault="config:1")
    assert r.returncode == KILLED
    assert not (tmp / "early" / "config.yaml").exists()  # only the lock and a torn .tmp
    r = pflkit("run", "--resume", "early", cwd=tmp)
    assert r.returncode == 2 and "start it again with --out early" in r.stderr
    r = pflkit("run", "cfg.yaml", "--out", "early", cwd=tmp)
    assert r.returncode == 0, r.stderr
    assert results(tmp / "early") == reference


def test_a_checkpoint_whose_bytes_changed_is_refused_in_one_sentence(setup):
    tmp, _ = setup
    r = pflkit("run", "cfg.yaml", "--out", "flipped", cwd=tmp, fault="round:6")  # after ckpt 4
    assert r.returncode == KILLED, r.stderr
    ckpt = tmp / "flipped" / "checkpoints" / "latest.pt"
    data = bytearray(ckpt.read_bytes())
    middle = len(data) // 2
    data[middle : middle + 64] = bytes(b ^ 0xFF for b in data[middle : middle + 64])
    ckpt.write_bytes(bytes(data))
    r = pflkit("run", "--resume", "flipped", cwd=tmp)
    assert r.returncode == 2, r.stderr
    assert r.stderr.count("\n") == 1 and "Traceback" not in r.stderr
    assert "latest.pt' fails its checksum" in r.stderr


def _session(sid: int) -> list[int]:
    """The live processes of session ``sid`` (zombies, already dead, left out)."""
    pids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # it has just exited
            continue
        if int(fields[3]) == sid and fields[0] != "Z":
            pids.append(int(stat.parent.name))
    return pids


def _parallel_compare(tmp: Path, out: str) -> subprocess.Popen:
    """A two-job compare of long runs, in its own session, once both runs have started."""
    import time

    cmd = [sys.executable, "-m", "pflkit", "compare", "cfg.yaml", "--out", out, "--jobs", "2"]
    cmd += ["--algorithms", "fedavg,local", "--seeds", "0", "--set", "train.rounds=100000", "-q"]
    proc = subprocess.Popen(cmd, cwd=tmp, start_new_session=True, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while len(list((tmp / out).glob("*-s0/metrics.jsonl"))) < 2 or any(
        p.stat().st_size == 0 for p in (tmp / out).glob("*-s0/metrics.jsonl")
    ):
        assert time.monotonic() < deadline and proc.poll() is None, "the runs did not start"
        time.sleep(0.2)
    return proc


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc")
def test_a_parallel_compare_killed_with_sigkill_leaves_no_process_behind(setup):
    import signal
    import time

    tmp, _ = setup
    proc = _parallel_compare(tmp, "killed-compare")
    assert len(_session(proc.pid)) >= 3  # the compare, two job workers, the resource tracker
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    deadline = time.monotonic() + 10
    while _session(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = _session(proc.pid)
    for pid in left:  # do not leave them running whatever the outcome
        os.kill(pid, signal.SIGKILL)
    assert left == []


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc")
def test_a_job_worker_killed_is_one_sentence(setup):
    import signal

    tmp, _ = setup
    proc = _parallel_compare(tmp, "worker-killed")
    workers = [p for p in _session(proc.pid) if p != proc.pid]
    cmdlines = {p: Path(f"/proc/{p}/cmdline").read_bytes() for p in workers}
    job = next(p for p, c in cmdlines.items() if b"spawn_main" in c)
    os.kill(job, signal.SIGKILL)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 2, err
    assert "Traceback" not in err
    assert err.strip().splitlines()[-1].startswith("error: a job worker process died while")
