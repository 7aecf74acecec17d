"""benchmarks/vs_libraries.py without the reference libraries: the three libraries' round lines
(hand-written in the formats their code prints), the round times without the pauses, the
bad-input exits, and the interleaving scheduler on dummy children that print PFLlib's lines or
write pflkit's metrics.jsonl (one group computes at a time; no child is left afterwards)."""

import importlib.util
import json
import os
import sys
import time
from pathlib import Path

import pytest
import yaml

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.fixture(scope="module")
def vs():
    saved = list(sys.path)
    spec = importlib.util.spec_from_file_location(
        "vs_libraries_under_test", BENCH / "vs_libraries.py"
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    yield module
    del sys.modules[spec.name]
    sys.path[:] = saved


def lines(text: str, step: float = 1.0) -> list[tuple[float, str]]:
    """The log's lines, seen one ``step`` second apart from t = 0."""
    return [(i * step, x) for i, x in enumerate(text.strip("\n").splitlines())]


# PFLlib d832e76, system/main.py, flcore/servers/serveravg.py train() and serverbase.py
# evaluate(), with -eg 1 (as a run with -gr 2 prints it)
PFLLIB_LOG = """\
============= Running time: 0th =============
Creating server and clients ...
Finished creating server and clients.

-------------Round number: 0-------------

Evaluate global model
Averaged Train Loss: 2.3126
Averaged Test Accuracy: 0.0538
Averaged Test AUC: 0.4365
Std Test Accuracy: 0.0761
Std Test AUC: 0.1930
------------------------- time cost ------------------------- 8.1

-------------Round number: 1-------------

Evaluate global model
Averaged Train Loss: 2.3034
Averaged Test Accuracy: 0.0983
Averaged Test AUC: 0.5170
Std Test Accuracy: 0.1121
Std Test AUC: 0.2218
------------------------- time cost ------------------------- 20.25

-------------Round number: 2-------------

Evaluate global model
Averaged Train Loss: 2.2908
Averaged Test Accuracy: 0.1629
Averaged Test AUC: 0.5769
Std Test Accuracy: 0.1633
Std Test AUC: 0.2490
"""


def test_pfllib_rounds_end_with_time_cost_lines_and_the_run_is_done_after_round_n_is_scored(vs):
    seen = lines(PFLLIB_LOG)
    # "Creating server" is the startup; "Round number: 0" (line 4) starts round 1's turn
    assert not vs.pfllib_progress(seen[:4], 2).started
    p = vs.pfllib_progress(seen, 2)
    assert p.started and p.done
    assert [r["logged"] for r in p.rounds] == [8.1, 20.25]
    assert [r["seen"] for r in p.rounds] == [12, 22]  # the "time cost" lines
    # evaluation: from "Round number: i" to its "Std Test AUC"
    assert [r["eval_lines"] for r in p.rounds] == [(4, 11), (14, 21)]
    # round 2 is scored only once its "Std Test AUC" is printed
    assert not vs.pfllib_progress(seen[:-1], 2).done
    assert len(vs.pfllib_progress(seen[:22], 2).rounds) == 1  # no second "time cost" yet
    assert vs.xc.parse_pfllib(PFLLIB_LOG)[0][2] == pytest.approx(0.1629)


# FL-bench 06e658b, src/server/fedavg.py train() with common.verbose_gap=1: rich pads each
# line with spaces to the console's width (80); one line per trained client
# (src/utils/trainer.py), the results JSON at the end (run_experiment)
FLBENCH_LOG = "\n".join(
    x.ljust(80)
    for x in """\
==================== FedAvg ====================
Experiment Arguments:
}
---------------------------- TRAINING EPOCH: 1 ----------------------------
client [12] (testset)   loss: 0.0000 -> 0.0000  accuracy: 0.00% -> 0.00%
client [1]  (testset)   loss: 0.0000 -> 0.0000  accuracy: 0.00% -> 0.00%
---------------------------- TRAINING EPOCH: 2 ----------------------------
client [3]  (testset)   loss: 0.0000 -> 0.0000  accuracy: 0.00% -> 0.00%
client [2]  (testset)   loss: 0.0000 -> 0.0000  accuracy: 0.00% -> 0.00%
Training... ━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━ 100% 0:00:03
FedAvg's average time taken by each global epoch: 0 min 1.56 sec.
FedAvg's total running time: 0 h 0 m 3 s.
==================== FedAvg Experiment Results: ====================
{
    "1": {
        "all_clients": {
            "test": {
                "loss": "2.2927 -> 0.0000",
                "accuracy": "15.34% -> 0.00%"
            }
        }
    },
    "2": {
        "all_clients": {
            "test": {
                "loss": "2.2530 -> 0.0000",
                "accuracy": "14.27% -> 0.00%"
            }
        }
    }
}""".splitlines()
)


def test_flbench_round_r_ends_with_epoch_r_plus_1_and_the_last_with_the_running_time(vs):
    seen = [(t, x.rstrip()) for t, x in lines(FLBENCH_LOG)]  # the scheduler strips the padding
    assert not vs.flbench_progress(seen[:3], 2).started
    p = vs.flbench_progress(seen, 2)
    assert p.started and not p.done  # done is the process's exit
    assert [r["seen"] for r in p.rounds] == [6, 11]
    assert [r["logged"] for r in p.rounds] == [None, None]  # no per-round time in its log
    # evaluation (and aggregation): the round's last client line to the round's end
    assert [r["eval_lines"] for r in p.rounds] == [(5, 6), (8, 11)]
    assert len(vs.flbench_progress(seen[:11], 2).rounds) == 1
    assert vs.xc.parse_flbench(FLBENCH_LOG) == pytest.approx({1: 0.1534, 2: 0.1427})


def test_pflkit_round_r_is_line_r_of_metrics_jsonl(vs):
    rows = [
        {"round": 1, "seconds_train": 10.0, "seconds_eval": 2.0, "pers_acc_weighted": 0.3},
        {"round": 2, "seconds_train": 9.0, "seconds_eval": 1.5, "pers_acc_weighted": 0.4},
    ]
    seen = [(5.0 * (i + 1), json.dumps(r)) for i, r in enumerate(rows)]
    assert not vs.pflkit_progress([], False).started
    p = vs.pflkit_progress(seen, True)
    assert p.started and [r["logged"] for r in p.rounds] == [12.0, 10.5]
    assert [r["logged_eval"] for r in p.rounds] == [2.0, 1.5]
    assert [r["accuracy"] for r in p.rounds] == [0.3, 0.4]


def test_a_logged_time_that_spans_the_pause_loses_it(vs):
    # stopped after its clock started: the pause (40 s of other jobs) is in the logged 52 s
    assert vs.unpaused(52.0, 12.1, 40.0) == pytest.approx(12.0)
    # stopped before its clock started: the logged time is within the turn
    assert vs.unpaused(11.8, 12.1, 40.0) == 11.8
    assert vs.unpaused(None, 12.1, 40.0) is None


def test_round_times_come_from_the_turns_and_the_log(vs, tmp_path):
    job = vs.Job("PFLlib", "pfllib", [], tmp_path, {}, tmp_path / "l", tmp_path / "l", 2)
    # round 2's lines (from "Round number: 1", line 14) come 10 s later: other jobs' turns
    job.lines = [(t + (10 if t >= 14 else 0), x) for t, x in lines(PFLLIB_LOG)]
    # startup seen at 4 ("Round number: 0", PFLlib's clock for the iteration already running);
    # round 1: resumed at 4.5, "time cost" (8.1 s) seen at 12; round 2: resumed at 23.5 after
    # 11.5 s of other turns, "time cost" (20.25 s) seen at 32
    job.turns = [
        {"label": "startup", "cont": 0.0, "seen": 4.0, "stopped": 4.01},
        {"label": 1, "cont": 4.5, "seen": 12.0, "stopped": 12.01},
        {"label": 2, "cont": 23.5, "seen": 32.0, "stopped": 32.01},
    ]
    rows = vs.rounds_of(job)
    assert [r["wall"] for r in rows] == [7.5, 8.5]
    assert [r["pause_before"] for r in rows] == [0.5, 11.5]
    # 8.1 > 7.5 + 0.25 and 20.25 > 8.5 + 5.75: both span their pause
    assert [r["own"] for r in rows] == pytest.approx([7.6, 8.75])
    assert [r["seconds"] for r in rows] == pytest.approx([7.6, 8.75])
    # evaluation: lines 4..11 clipped at the resume (4.5), and 24..31
    assert [r["eval"] for r in rows] == pytest.approx([6.5, 7.0])
    s = vs.summary(job, 1000, 0.16)
    assert s["seconds_per_round"] == pytest.approx((7.6 + 8.75) / 2)
    assert s["turn_wall_per_round"] == pytest.approx(8.0)
    assert s["eval_share"] == pytest.approx(6.75 / 8.175)
    assert s["source"] == "own log" and s["startup_seconds"] == 4.0
    assert s["seconds_per_sample"] == pytest.approx(s["seconds_per_round"] / 1000)


def test_the_anchor_file_is_bench_fedavgs_config(vs):
    sys.path.insert(0, str(BENCH))
    try:
        spec = importlib.util.spec_from_file_location("bench_fedavg_ut", BENCH / "bench_fedavg.py")
        bench = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(bench)
    finally:
        sys.path.remove(str(BENCH))
    from pflkit.experiment import validate

    ours = validate(yaml.safe_load(vs.ANCHOR.read_text())).dump()
    theirs = validate(bench.CONFIG).dump()
    for d in (ours, theirs):
        d.pop("name"), d["train"].pop("rounds")
    assert ours == theirs


# ---------------------------------------------------------------- bad input


def _checkouts(tmp_path: Path) -> list[str]:
    (tmp_path / "P" / "system").mkdir(parents=True, exist_ok=True)
    (tmp_path / "P" / "system" / "main.py").write_text("")
    (tmp_path / "F" / "src" / "server").mkdir(parents=True, exist_ok=True)
    (tmp_path / "F" / "src" / "server" / "fedavg.py").write_text("")
    (tmp_path / "F" / "main.py").write_text("")
    return ["--pfllib", str(tmp_path / "P"), "--flbench", str(tmp_path / "F")]


@pytest.mark.parametrize(
    "extra, said",
    [
        (["--algorithms", "fedavg,fedprox"], "unknown algorithm fedprox; choose from fedavg"),
        (["--rounds", "0"], "--rounds 0: give at least 1 timed round"),
        (["--rounds", "two"], "argument --rounds: invalid int value: 'two'"),
        (["--subset", "-5"], "--subset -5: give a positive number"),
        (["--pflkit-workers", "2,x"], "--pflkit-workers '2,x': give worker counts"),
        (["--pflkit-workers", "0"], "--pflkit-workers '0'"),
        (["--pflkit-threads", "one"], "--pflkit-threads 'one': give thread counts"),
        (["--pflkit-graphs", "1,-8"], "--pflkit-graphs '1,-8': give worker counts"),
        (["--pflkit-graphs", "1"], "--pflkit-graphs: CUDA graphs need --device cuda"),
        (["--device", "tpu"], "--device 'tpu': choose cpu or cuda"),
        (["--pfllib", "/nonexistent/PFLlib"], "--pfllib /nonexistent/PFLlib is not a PFLlib"),
        (["--flbench", "/nonexistent/FLB"], "--flbench /nonexistent/FLB is not an FL-bench"),
        (["--flbench", "/"], "--flbench / is not an FL-bench checkout (no main.py)"),
        (["--python", "/nonexistent/python"], "--python /nonexistent/python cannot import"),
    ],
)
def test_bad_input_exits_2_with_one_sentence_and_writes_nothing(vs, tmp_path, capsys, extra, said):
    out = tmp_path / "out"
    argv = [*_checkouts(tmp_path), "--out", str(out), *extra]
    assert vs.main(argv) == 2
    err = capsys.readouterr().err
    assert said in err, err
    assert err.count("\n") == 1 and err.startswith("error: ") and "Traceback" not in err
    assert not out.exists()


def test_no_reference_library_or_a_used_out_folder_exits_2(vs, tmp_path, capsys):
    out = tmp_path / "out"
    assert vs.main(["--out", str(out)]) == 2
    assert "no reference library to compare fedavg with: give --flbench and/or --pfllib" in (
        capsys.readouterr().err
    )
    assert not out.exists()
    # pFedSim runs in FL-bench only: a PFLlib checkout alone is refused before anything runs
    argv = [*_checkouts(tmp_path)[:2], "--algorithms", "fedavg,pfedsim", "--out", str(out)]
    assert vs.main(argv) == 2
    assert "no reference library to compare pfedsim with: give --flbench" in (
        capsys.readouterr().err
    )
    assert not out.exists()
    out.mkdir()
    (out / "kept.txt").write_text("an earlier run")
    assert vs.main([*_checkouts(tmp_path), "--out", str(out)]) == 2
    assert "is not an empty folder: choose a new folder" in capsys.readouterr().err
    assert [p.name for p in out.iterdir()] == ["kept.txt"]
    assert vs.main(["--pfllib", "x"]) == 2  # --out is required
    assert "the following arguments are required: --out" in capsys.readouterr().err


# ---------------------------------------------------------------- the scheduler

DUMMY = r"""
import json, os, subprocess, sys, time
mode, folder, rounds, fail_at = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
hb = open(os.path.join(folder, "heartbeats"), "a", buffering=1)
# a grandchild in the job's process group, beating all the time
grand = subprocess.Popen([sys.executable, "-c", "import sys, time\n"
    "hb = open(sys.argv[1], 'a', buffering=1)\n"
    "while True:\n    hb.write(f'{time.monotonic()}\\n'); time.sleep(0.002)",
    os.path.join(folder, "heartbeats")])
open(os.path.join(folder, "pids"), "w").write(f"{os.getpid()} {grand.pid}\n")

def busy(steps):  # a fixed amount of work (about 45 us a step), as a library's round is
    for _ in range(steps):
        hb.write(f"{time.monotonic()}\n")
        sum(range(3000))

busy(4000)  # the startup
if mode == "pfllib":
    print("============= Running time: 0th =============", flush=True)
    for i in range(rounds + 1):
        s = time.time()
        print(f"\n-------------Round number: {i}-------------", flush=True)
        busy(1000)
        print("Averaged Test Accuracy: 0.5000\nStd Test AUC: 0.1000", flush=True)
        if i == fail_at:
            sys.exit(3)
        busy(5000)
        print("-" * 25, "time cost", "-" * 25, time.time() - s, flush=True)
else:  # pflkit: provenance.json, then one metrics.jsonl line per round
    open(os.path.join(folder, "provenance.json"), "w").write("{}")
    with open(os.path.join(folder, "metrics.jsonl"), "a") as f:
        for r in range(1, rounds + 1):
            t0 = time.perf_counter()
            busy(6000)
            row = {"round": r, "seconds_train": time.perf_counter() - t0, "seconds_eval": 0.0}
            f.write(json.dumps(row) + "\n")
            f.flush()
            if r == fail_at:
                sys.exit(3)
    busy(2000)  # summary and plots
"""


def _dummies(vs, tmp_path: Path, kinds: list[str], rounds: int, fail_at: dict | None = None):
    script = tmp_path / "dummy.py"
    script.write_text(DUMMY)
    jobs = []
    for i, kind in enumerate(kinds):
        folder = tmp_path / f"job{i}"
        folder.mkdir()
        fail = (fail_at or {}).get(i, -1)
        cmd = [sys.executable, str(script), kind, str(folder), str(rounds), str(fail)]
        log = folder / "out.log"
        watch = log if kind == "pfllib" else folder / "metrics.jsonl"
        job = vs.Job(f"job{i}", kind, cmd, tmp_path, dict(os.environ), log, watch, rounds)
        if kind == "pflkit":
            job.ready = folder / "provenance.json"
        jobs.append((job, folder))
    return jobs


def _beats(folder: Path) -> list[float]:
    out = []
    for x in (folder / "heartbeats").read_text().split("\n"):
        try:
            out.append(float(x))
        except ValueError:  # a line cut by a kill
            pass
    return out


def _pids(folder: Path) -> list[int]:
    return [int(p) for p in (folder / "pids").read_text().split()]


def _all_gone(pids: list[int], wait: float = 5.0) -> bool:
    """No process left (a zombie awaiting its reaper cannot run: it counts as gone)."""
    deadline = time.monotonic() + wait
    while time.monotonic() < deadline:
        alive = []
        for pid in pids:
            try:
                state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
            except (OSError, IndexError):
                continue
            if state not in "ZX":
                alive.append(pid)
        if not alive:
            return True
        time.sleep(0.05)
    return False


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="Linux /proc")
def test_one_job_computes_at_a_time_and_no_child_is_left(vs, tmp_path):
    jobs = _dummies(vs, tmp_path, ["pfllib", "pfllib", "pflkit"], rounds=3)
    order = []
    vs.interleave([j for j, _ in jobs], 3, lambda job, label: order.append((job.name, label)))
    names = [j.name for j, _ in jobs]
    labels = ["startup", 1, 2, 3, "final"]
    assert order == [(n, label) for label in labels for n in names]
    spans = {j.name: [(t["cont"], t["stopped"]) for t in j.turns] for j, _ in jobs}
    # the scheduler's own record: no two turns overlap
    every = sorted(s for v in spans.values() for s in v)
    assert all(a[1] <= b[0] for a, b in zip(every, every[1:], strict=False))
    for job, folder in jobs:
        beats = _beats(folder)  # the child's and its grandchild's
        assert beats
        outside = [b for b in beats if not any(c <= b <= s for c, s in spans[job.name])]
        assert not outside, f"{job.name} computed outside its turns: {len(outside)} beats"
        for c, s in spans[job.name][1:4]:  # every round turn did compute
            assert any(c <= b <= s for b in beats)
        assert _all_gone(_pids(folder))
        assert job.proc.returncode is not None
        p = job.progress()
        assert len(p.rounds) == 3
        rows = vs.rounds_of(job)
        # a round's own time is its turn, whether or not its logged time spans the pause (the
        # PFLlib dummy's clock starts before it is stopped, as PFLlib's does; the pflkit
        # dummy's after); a turn runs on for at most a poll interval or two after its line
        assert all(r["pause_before"] > 0.15 for r in rows), rows  # two other jobs' turns
        assert all(abs(r["seconds"] - r["wall"]) < 0.1 for r in rows), rows
        if job.kind == "pfllib":
            assert all(r["logged"] > r["wall"] + r["pause_before"] / 2 for r in rows), rows


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="Linux /proc")
def test_a_failing_child_stops_the_run_and_every_child_is_killed(vs, tmp_path):
    jobs = _dummies(vs, tmp_path, ["pfllib", "pflkit"], rounds=3, fail_at={0: 1})
    with pytest.raises(vs.JobFailed, match=r"job0 exited with code 3 during its round 2 turn"):
        vs.interleave([j for j, _ in jobs], 3)
    for job, folder in jobs:
        assert _all_gone(_pids(folder)), job.name


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="Linux /proc")
def test_ctrl_c_kills_every_child(vs, tmp_path):
    jobs = _dummies(vs, tmp_path, ["pflkit", "pfllib"], rounds=3)

    def interrupt(job, label):
        if label == 1 and job.name == "job0":
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        vs.interleave([j for j, _ in jobs], 3, interrupt)
    for job, folder in jobs:
        assert _all_gone(_pids(folder)), job.name


def test_a_turn_past_its_time_limit_fails_with_the_log(vs, tmp_path):
    jobs = _dummies(vs, tmp_path, ["pfllib"], rounds=2)
    with pytest.raises(vs.JobFailed, match=r"did not finish its turn \(startup\) within 0 s"):
        vs.interleave([jobs[0][0]], 2, timeout=0.1)
    assert _all_gone(_pids(jobs[0][1]) if (jobs[0][1] / "pids").exists() else [])


def test_the_table_gives_each_contender_and_the_ratios(vs):
    row = {
        "implementation": "impl",
        "threads": "1",
        "source": "own log",
        "turn_wall_per_round": 1.0,
        "eval_share": 0.25,
        "seconds_per_sample": 2e-5,
        "final_accuracy": 0.5,
    }
    res = {
        "fedavg": {
            "rounds": 2,
            "timed_on": "2 CPUs, device cpu",
            "contenders": [
                {**row, "label": "PFLlib", "seconds_per_round": 30.0},
                {**row, "label": "pflkit (default engine)", "seconds_per_round": 10.0},
            ],
            "ratios": [{"pflkit": "pflkit (default engine)", "reference": "pfllib", "ratio": 3.0}],
            "notes": ["FL-bench skipped: no --flbench given"],
        }
    }
    text = vs.table(res, "cpu")
    assert "| PFLlib | impl | 1 | 30.00 | own log | 1.00 | 20 | 25.0% | 50.00 |" in text
    assert "| pflkit contender | PFLlib / pflkit (goal >= 2.0x) |" in text
    assert "| pflkit (default engine) | 3.00x |" in text
    assert "- FL-bench skipped: no --flbench given" in text


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="Linux /proc")
def test_wait_stopped_returns_once_every_thread_of_the_group_is_stopped(vs, tmp_path):
    import signal
    import subprocess

    # a process with a second, spinning thread, and a child of it: all in one new group
    code = (
        "import subprocess, sys, threading\n"
        "threading.Thread(target=lambda: [0 for _ in iter(int, 1)], daemon=True).start()\n"
        "subprocess.Popen([sys.executable, '-c', 'while True: pass'])\n"
        "[0 for _ in iter(int, 1)]\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], preexec_fn=vs._child_setup)
    try:
        deadline = time.monotonic() + 10
        while len(vs.group_threads(proc.pid)) < 3 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert len(vs.group_threads(proc.pid)) >= 3  # two threads, one child
        with pytest.raises(vs.JobFailed, match="did not stop"):
            vs.wait_stopped(proc.pid, timeout=0.2)  # running: it waits, then says so
        os.kill(proc.pid, signal.SIGSTOP)  # the leader only: its child still runs
        with pytest.raises(vs.JobFailed, match="did not stop"):
            vs.wait_stopped(proc.pid, timeout=0.3)
        os.killpg(proc.pid, signal.SIGSTOP)
        vs.wait_stopped(proc.pid, timeout=10)
        assert {s for _, s in vs.group_threads(proc.pid)} == {"T"}
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def test_the_contenders_of_an_algorithm_and_the_skipped_libraries(vs, tmp_path, monkeypatch):
    import argparse

    monkeypatch.setattr(vs.xc, "prepare_pfllib", lambda *a: "FMNIST-k")
    monkeypatch.setattr(vs.xc, "commit", lambda path: "abc1234")
    args = argparse.Namespace(
        pfllib=tmp_path / "P", flbench=None, python="refpy", device="cpu", out=tmp_path,
        pflkit_workers=[2], pflkit_threads=[1], pflkit_vectorize=[8], pflkit_graphs=[1],
    )  # fmt: skip
    raw = yaml.safe_load(vs.ANCHOR.read_text())
    raw["train"]["rounds"] = 4
    cfg_path = tmp_path / "config.yaml"
    cfg_path.write_text(yaml.safe_dump(raw))
    from pflkit.experiment import validate

    cfg = validate(raw).dump()
    contenders, notes = vs.build("gpfl", args, cfg_path, cfg, tmp_path / "gpfl")
    assert notes == ["FL-bench has no gpfl: skipped"]
    keys = ["pfllib", "pflkit", "pflkit-w2", "pflkit-t1", "pflkit-v8", "pflkit-g1"]
    assert [c.key for c in contenders] == keys
    ref = contenders[0].job
    assert ref.cmd[:3] == ["refpy", "-u", "main.py"] and ref.env["OMP_NUM_THREADS"] == "1"
    opts = dict(zip(ref.cmd[3::2], ref.cmd[4::2], strict=False))
    assert (opts["-algo"], opts["-gr"], opts["-t"], opts["-dev"]) == ("GPFL", "4", "1", "cpu")
    assert opts["-lam"] == "0.01" and contenders[0].implementation.endswith("(abc1234)")
    written = {c.key: yaml.safe_load(Path(c.job.cmd[4]).read_text()) for c in contenders[1:]}
    for got in written.values():
        assert got["algorithm"] == vs.CASES["gpfl"].pflkit and got["train"]["rounds"] == 4
        assert "compare" not in got
    assert "engine" not in written["pflkit"] and "threads" not in written["pflkit"]
    assert written["pflkit-w2"]["engine"] == {"workers": 2}
    assert written["pflkit-t1"]["threads"] == 1
    assert written["pflkit-v8"]["engine"] == {"workers": 8, "vectorize": True}
    assert written["pflkit-g1"]["engine"] == {"workers": 1, "vectorize": True, "cuda_graphs": True}
    # no library has the algorithm on this side: a sentence, not a traceback
    with pytest.raises(vs.Usage, match="no reference library runs pfedsim: give --flbench"):
        vs.build("pfedsim", args, cfg_path, cfg, tmp_path / "pfedsim")
