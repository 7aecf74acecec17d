"""`pflkit report --overhead` (pflkit.report.overhead): every number from the runs' metrics rows,
checked by hand on hand-written rows; a real run records the aggregation's seconds."""

import json

import pytest

from pflkit.engine import run_experiment
from pflkit.report.overhead import overhead_markdown, run_overhead
from pflkit.report.results import Run, Setting, load_run


def fake_run(rows, seed=0):
    run = Run(folder=None, label="x", seed=seed, config={}, summary={})
    run._rows = rows
    return run


ROWS = [
    # round 1: clients 0 and 2 (10 + 30 samples), 0.5 s in the training phase, 0.1 s of it
    # aggregating; not evaluated
    {"round": 1, "clients": [0, 2], "seconds_train": 0.5, "seconds_aggregate": 0.1,
     "seconds_eval": 0.01, "bytes_down": [1024, 1024], "bytes_up": [2048, 0]},
    # round 2: client 1 (20 samples), 0.3 s, 0.1 s aggregating; evaluated in 0.4 s
    {"round": 2, "clients": [1], "seconds_train": 0.3, "seconds_aggregate": 0.1,
     "seconds_eval": 0.4, "pers_acc_mean": 0.5, "bytes_down": [4096], "bytes_up": [1024]},
]  # fmt: skip


def test_run_overhead_by_hand():
    got = run_overhead(fake_run(ROWS), [10, 20, 30])
    assert got["client_s"] == pytest.approx((0.4 + 0.2) / 2)
    assert got["aggregate_s"] == pytest.approx(0.1)
    assert got["eval_s"] == pytest.approx(0.4)  # the evaluated round only
    assert got["xi_p"] == pytest.approx((0.4 + 0.2) / (10 + 30 + 20))
    assert got["kb_down"] == pytest.approx((1 + 1 + 4) / 3)
    assert got["kb_up"] == pytest.approx((2 + 0 + 1) / 3)


def test_runs_without_aggregation_seconds_count_it_in_training_and_say_so():
    old = [{k: v for k, v in r.items() if k != "seconds_aggregate"} for r in ROWS]
    got = run_overhead(fake_run(old), [10, 20, 30])
    assert got["aggregate_s"] is None and got["client_s"] == pytest.approx(0.4)
    table = overhead_markdown([Setting("old", [fake_run(old)])], lambda run: [10, 20, 30])
    line = table.splitlines()[4]
    # xi_p: (0.5 + 0.3) s over 10 + 30 + 20 samples = 133.33e-4 s
    assert line.startswith("| old | 1 | 0.400 ± 0.000 * | – | 0.400 ± 0.000 | 133.33 ± 0.00 |")


def test_mean_and_std_over_seeds():
    faster = [{**r, "seconds_train": r["seconds_train"] / 2 + 0.05} for r in ROWS]
    s = Setting("fedavg", [fake_run(ROWS), fake_run(faster, seed=1)])
    line = overhead_markdown([s], lambda run: [10, 20, 30]).splitlines()[4]
    # client seconds per round: (0.4 + 0.2) / 2 = 0.3 and (0.2 + 0.1) / 2 = 0.15 -> 0.225 ±
    # 0.106; xi_p: 0.6 / 60 and 0.3 / 60 -> 75e-4 ± 35.36e-4
    assert line.startswith(
        "| fedavg | 2 | 0.225 ± 0.106 | 0.1000 ± 0.0000 | 0.400 ± 0.000 | 75.00 ± 35.36 |"
    )


def test_a_run_records_aggregation_seconds_and_the_report_reads_it(tiny, tmp_path, cli):
    run_experiment(tiny(), out=tmp_path / "run")
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert all(0 <= r["seconds_aggregate"] <= r["seconds_train"] for r in rows)
    assert run_overhead(load_run(tmp_path / "run"), [1] * 4)["aggregate_s"] is not None
    done = cli("report", "--overhead", str(tmp_path / "run"), cwd=tmp_path)
    assert done.returncode == 0 and "| run | 1 |" in done.stdout and " * |" not in done.stdout


def test_overhead_with_another_format_is_one_sentence(tiny, tmp_path, cli):
    run_experiment(tiny(), out=tmp_path / "run")
    done = cli("report", "--overhead", "--format", "csv", str(tmp_path / "run"), cwd=tmp_path)
    assert done.returncode == 2
    assert "--overhead prints one markdown table: drop --format" in done.stderr
