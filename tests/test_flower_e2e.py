"""End to end on a real Flower deployment: a ``flower-superlink`` and three
``flower-supernode`` processes on 127.0.0.1 (free ports, telemetry and update checks off,
bounded waits, every process stopped by PID), driven through ``pflkit.flower.local``."""

from __future__ import annotations

import json
import time

import pytest

from conftest import tiny_config
from pflkit.engine.runner import run_experiment
from pflkit.experiment import validate
from pflkit.flower.local import Federation
from pflkit.flower.watchdog import alive
from test_flower import CASES, assert_rows_close

NODES = ["0", "1", "2"]


def e2e_config(case: str):
    raw = tiny_config(**CASES[case])
    raw["data"]["num_clients"] = 3
    raw["threads"] = 1  # the same kernels in the test process and in every ClientApp
    raw["eval"] = {**raw.get("eval", {}), "every": 3}  # evaluate the last round only
    return validate(raw)


def assert_all_stopped(fed: Federation) -> None:
    for name, proc in fed.procs.items():
        assert proc.poll() is not None, f"{name} still running"
        assert not alive(proc.pid), f"{name}'s process group still has processes"


def report(capsys, line: str) -> None:
    with capsys.disabled():
        print(f"\n[flower e2e] {line}")


@pytest.mark.parametrize(
    "cases",
    [("map",), pytest.param(("fedavg", "ktpfl"), marks=pytest.mark.slow)],
    ids=["map", "fedavg+ktpfl"],
)
def test_flower_deployment_with_tls_and_node_auth_equals_the_embedded_engine(
    cases, tmp_path, capsys
):
    """MAP (stateful clients; the default suite), FedAvg and KT-pFL (soft-prediction payloads;
    ``-m slow``): 3 rounds each, over TLS with authenticated SuperNodes; final metrics equal
    the embedded engine's. Flower starts a fresh ClientApp process (imports included) for
    every message, so each case takes minutes here; every algorithm's payloads are
    checked through the same codec and round loop in test_conformance (a fake grid)."""
    with Federation(NODES, tmp_path / "fed", auth=True) as fed:
        assert (tmp_path / "fed" / "certs" / "ca.pem").exists()
        for case in cases:
            cfg = e2e_config(case)
            t0 = time.perf_counter()
            embedded = run_experiment(cfg, out=tmp_path / f"{case}-embedded")
            t1 = time.perf_counter()
            fed.run(cfg.to_yaml(), tmp_path / f"{case}-flower", timeout=300)
            t2 = time.perf_counter()
            report(capsys, f"{case}: flower {t2 - t1:.1f} s, embedded {t1 - t0:.1f} s (3 rounds)")
            rows = [json.loads(x) for x in (tmp_path / f"{case}-flower" / "metrics.jsonl").open()]
            assert len(rows) == 3
            for a, b in zip(rows, embedded.rows, strict=True):
                assert_rows_close(a, b)
            assert (tmp_path / f"{case}-flower" / "summary.json").exists()
    assert_all_stopped(fed)


@pytest.mark.slow  # Flower waits two missed 30-s heartbeats: about 3 minutes of the suite
def test_a_killed_supernode_fails_its_client_and_the_run_finishes(tmp_path, capsys):
    """A SuperNode SIGKILLed in round 2 on a real deployment (tests/test_flower.py checks the
    same failure handling on a fake grid in the default suite)."""
    cfg = e2e_config("map")  # stateful clients, full participation
    killed = []

    def kill_in_round_2(row: dict) -> None:
        if row["round"] == 1 and not killed:  # the server is now sending round 2
            fed.kill_node(2)
            killed.append(time.perf_counter())

    t0 = time.perf_counter()
    with Federation(NODES, tmp_path / "fed") as fed:
        fed.run(cfg.to_yaml(), tmp_path / "out", timeout=400, progress=kill_in_round_2)
    report(
        capsys,
        f"fault run: {time.perf_counter() - t0:.1f} s (Flower declares a killed "
        "node unavailable after 2 missed 30-s heartbeats)",
    )
    assert_all_stopped(fed)
    rows = [json.loads(x) for x in (tmp_path / "out" / "metrics.jsonl").open()]
    r1, r2, r3 = rows
    assert "failed_clients" not in r1
    assert r2["failed_clients"] == [2]
    assert r2["failures"][0]["client"] == 2 and r2["failures"][0]["step"] == "train"
    assert r3["failed_clients"] == [2] and r3["eval_failed_clients"] == [2]
    # the other clients lost no state: it saw all 3 rounds on their nodes
    assert r2["node_state_rounds"] == {"0": 2, "1": 2}
    assert r3["node_state_rounds"] == {"0": 3, "1": 3}
    assert r3["pers_acc_clients"][2] is None
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["rounds"] == 3


def test_sigkill_of_flower_local_takes_its_federation_down(tmp_path, capsys):
    import signal
    import subprocess
    import sys
    import time

    import yaml

    from pflkit.flower.watchdog import groups_below

    raw = tiny_config(train={"rounds": 500})
    raw["data"]["num_clients"] = 2
    (tmp_path / "long.yaml").write_text(yaml.safe_dump(raw))
    work = tmp_path / "work"
    proc = subprocess.Popen(
        [sys.executable, "-m", "pflkit.cli", "flower", "local", "long.yaml", "--nodes", "2",
         "--workdir", str(work), "--out", "run"],
        cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    listed = work / "processes.txt"
    deadline = time.monotonic() + 240
    while not (listed.exists() and len(listed.read_text().split()) >= 3):  # SuperLink + 2 nodes
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.2)
    roots = [int(p) for p in listed.read_text().split()]
    groups = set(roots)
    for pid in roots:
        groups |= groups_below(pid)
    proc.send_signal(signal.SIGKILL)  # no chance to stop anything itself
    proc.wait()
    deadline = time.monotonic() + 60
    while any(alive(g) for g in groups) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = [g for g in groups if alive(g)]
    report(capsys, f"SIGKILL of flower local: {len(groups)} process groups, {len(left)} left")
    assert not left
