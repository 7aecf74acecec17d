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
