"""benchmarks/vectorize_accuracy.py: its "within noise" rule by value against hand
computations, the row it prints from canned accuracies, its bad-input exits (all without
training), and ``--jobs 2`` against one process on tiny real runs."""

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.fixture(scope="module")
def va():
    spec = importlib.util.spec_from_file_location(
        "vectorize_accuracy_under_test", BENCH / "vectorize_accuracy.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_within_noise_is_twice_the_standard_error_of_the_difference(va):
    # sd 0.02 on both sides, n = 3: se = sqrt(2 * 0.0004 / 3) = 0.01633, 2 se = 0.03266
    assert va.within_noise([0.90, 0.92, 0.94], [0.93, 0.95, 0.97], 10_000)  # diff 0.03
    assert not va.within_noise([0.90, 0.92, 0.94], [0.94, 0.96, 0.98], 10_000)  # diff 0.04
    # the sign of the difference does not matter
    assert not va.within_noise([0.94, 0.96, 0.98], [0.90, 0.92, 0.94], 10_000)


def test_within_noise_allows_one_test_sample_where_the_seeds_agree(va):
    # sd 0 on both sides: only the one-sample floor 1 / pooled_test is left (diff 0.001)
    assert va.within_noise([0.5, 0.5, 0.5], [0.501, 0.501, 0.501], 500)  # floor 0.002
    assert not va.within_noise([0.5, 0.5, 0.5], [0.501, 0.501, 0.501], 2_000)  # floor 0.0005


def test_row_from_canned_runs(va, monkeypatch, capsys):
    seen = []
    canned = {(0, False): 0.90, (1, False): 0.92, (2, False): 0.94}
    canned |= {(0, True): 0.91, (1, True): 0.92, (2, True): 0.96}

    def fake(raw, vectorize, graphs=False):
        assert not graphs
        seen.append((raw["seed"], raw["algorithm"]["name"], raw["train"]["rounds"], vectorize))
        return canned[raw["seed"], vectorize], 10.0 + vectorize, 1_000

    monkeypatch.setattr(va, "final_accuracy", fake)
    argv = ["--configs", "fmnist_practical_xc", "--algorithms", "fedavg", "--rounds", "3"]
    assert va.main(argv) == 0
    assert seen == [(s, "fedavg", 3, v) for s in (0, 1, 2) for v in (False, True)]
    out, err = capsys.readouterr()
    row = out.strip().splitlines()[-1]
    # means 0.92 and 0.93: diff +0.01; per-client sd 0.02; 2 se = 2 sqrt(0.0004/3 + 0.0007/3)
    # = 0.0383 >= 0.01: within noise; seconds 3 x 10 and 3 x 11
    assert row == (
        "| fmnist_practical_xc | fedavg | 0.9000, 0.9200, 0.9400 | 0.9100, 0.9200, 0.9600 | "
        "+0.0100 | 0.0200 | yes | 30 / 33 |"
    )
    assert "fmnist_practical_xc fedavg seed 2 vectorised: 0.9600 in 11 s" in err


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--algorithms", "fedavg,gpfl"], "gpfl is not covered by engine.vectorize"),
        (["--configs", "cifar_xc"], "cifar_xc is not a cross-check config"),
        (["--seeds", "0,one"], "--seeds '0,one' is not a comma-separated list of integers"),
        (["--jobs", "0"], "--jobs 0 is not a positive number of processes"),
    ],
)
def test_bad_input_exits_2_with_one_sentence_and_no_table(va, monkeypatch, capsys, argv, words):
    monkeypatch.setattr(va, "final_accuracy", lambda *a: pytest.fail("trained"))
    assert va.main(argv) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.startswith("error: ") and words in err and err.count("\n") == 1


def test_graphs_run_the_second_path_graphed(va, monkeypatch, capsys):
    seen = []

    def fake(raw, vectorize, graphs=False):
        seen.append((vectorize, graphs))
        return 0.5, 1.0, 1_000

    monkeypatch.setattr(va, "final_accuracy", fake)
    argv = ["--configs", "fmnist_practical_xc", "--algorithms", "fedavg", "--seeds", "0,1"]
    assert va.main([*argv, "--graphs"]) == 0
    assert seen == [(False, False), (True, True)] * 2
    out, err = capsys.readouterr()
    assert "| graphed |" in out.splitlines()[0] and "seed 1 graphed: 0.5000" in err


def test_graphs_equal_the_per_client_path_on_a_tiny_real_run(va, capsys):
    """The masked steps (uncaptured on cpu) against the per-client path: one round, the
    same accuracy seed by seed."""
    argv = ["--configs", "fmnist_practical_xc", "--algorithms", "fedavg", "--rounds", "1"]
    argv += ["--subset", "300", "--clients", "3", "--seeds", "0", "--graphs"]
    assert va.main(argv) == 0
    row = capsys.readouterr().out.strip().splitlines()[-1].split("|")
    assert row[3].strip() == row[4].strip() and row[5].strip() in ("+0.0000", "-0.0000")


def test_jobs_give_the_rows_of_one_process_seed_by_seed(va, capsys):
    """--jobs 2 (two spawned processes) against this process, on tiny real runs: the same
    accuracies for every seed, in the same order (the seconds differ)."""
    argv = ["--configs", "fmnist_practical_xc", "--algorithms", "fedavg", "--rounds", "1"]
    argv += ["--subset", "300", "--clients", "2", "--seeds", "1,0"]
    two = subprocess.run(
        [sys.executable, str(BENCH / "vectorize_accuracy.py"), *argv, "--jobs", "2"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert va.main(argv) == 0
    one = capsys.readouterr().out

    def accuracies(table):
        row = table.strip().splitlines()[-1].split("|")
        return row[3:8]

    assert accuracies(two.stdout) == accuracies(one)
    per_client = [float(a) for a in accuracies(one)[0].split(",")]
    assert per_client[0] != per_client[1]  # the seeds differ, so an order swap would show
