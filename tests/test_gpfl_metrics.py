"""The metrics GPFL (Zhang et al., ICCV 2023) reports, next to pflkit's own (issue 11, item 4):
the coefficient of variation of per-client accuracy (Table 3), the paper protocol's best-round
pooled accuracy with the std and CV at that round (``--at best_test``), and random
participation (Table 4: a share drawn uniformly from [a, b] each round)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import yaml

from conftest import tiny_config
from pflkit.engine import Simulation
from pflkit.engine.simulation import round_fraction, sample_clients
from pflkit.errors import PflkitError
from pflkit.eval import personal_metrics, summarize_clients, val_metrics
from pflkit.experiment import validate
from pflkit.report.results import build_report, find_settings, make_report
from pflkit.report.summary import summarize

pytestmark = pytest.mark.usefixtures("one_thread")

# -- fairness: std and coefficient of variation over clients -------------------------------------


def test_cv_is_population_std_over_unweighted_mean():
    acc = np.array([0.5, 0.7, 0.9, 0.9])
    counts = np.array([10.0, 20.0, 30.0, 40.0])  # weights must not enter std or CV
    s = summarize_clients(acc, counts)
    # mean 0.75; squared deviations 0.0625, 0.0025, 0.0225, 0.0225 sum to 0.11; population: / 4
    std = math.sqrt(0.11 / 4)
    assert s["pers_acc_mean"] == pytest.approx(0.75)
    assert s["pers_acc_std"] == pytest.approx(std, abs=1e-12)  # not sqrt(0.11 / 3) (sample)
    assert s["pers_acc_cv"] == pytest.approx(std / 0.75, abs=1e-12)  # 0.22111
    assert s["pers_acc_weighted"] == pytest.approx((5 + 14 + 27 + 36) / 100)
    assert summarize_clients(np.zeros(3), np.ones(3))["pers_acc_cv"] == 0.0  # no 0 / 0
    # a missing client is left out; validation rows keep their keys (no val_pers_acc_cv)
    row = personal_metrics({0: 0.2, 2: 0.6}, 3, np.array([1.0, 1.0, 1.0]))
    assert row["pers_acc_cv"] == pytest.approx(0.2 / 0.4)
    assert "val_pers_acc_cv" not in val_metrics({0: 0.2, 2: 0.6}, np.ones(3))


# -- the paper protocol: the best round on test, with std and CV there ---------------------------


def _row(rnd: int, weighted=None, mean=None, std=None, **extra) -> dict:
    row = {"round": rnd, "clients": [0], "bytes_down": [8], "bytes_up": [8]}
    row |= {"seconds_train": 0.5, "seconds_eval": 0.5} | extra
    if weighted is not None:
        row |= {"pers_acc_weighted": weighted, "pers_acc_mean": mean, "pers_acc_std": std}
        row |= {"pers_acc_cv": std / mean, "pers_acc_worst10": mean - std, "global_acc": 0.5}
    return row


ROWS = [
    _row(1, 0.60, 0.65, 0.10),
    _row(2),  # not evaluated (eval.every 2): never chosen
    _row(3, 0.80, 0.70, 0.14),  # the best pooled accuracy, first of two
    _row(4, 0.80, 0.72, 0.20),
    _row(5, 0.70, 0.90, 0.30),  # the best unweighted mean: not what the protocol picks
    _row(6, 0.75, 0.74, 0.12),  # the last round
]


def test_best_test_is_the_round_of_best_pooled_accuracy_with_its_std_and_cv():
    s = summarize(ROWS)
    best = s["best_test"]
    assert best["round"] == 3
    assert best["pers_acc_weighted"] == 0.80 and best["pers_acc_mean"] == 0.70
    assert best["pers_acc_std"] == 0.14 and best["pers_acc_cv"] == pytest.approx(0.2)
    assert s["final"]["round"] == 6 and s["final"]["pers_acc_cv"] == pytest.approx(0.12 / 0.74)
    assert s["best_on_test"]["pers_acc_mean"] == {"value": 0.90, "round": 5}  # unchanged


def _run(folder: Path, seed: int, rows: list[dict], with_best: bool = True) -> None:
    folder.mkdir(parents=True)
    (folder / "config.yaml").write_text(yaml.safe_dump(tiny_config(seed=seed)))
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    summary = {"name": "tiny", "algorithm": "fedavg", "seed": seed} | summarize(rows)
    if not with_best:  # a summary written before best_test existed
        del summary["best_test"]
    (folder / "summary.json").write_text(json.dumps(summary))


def test_report_at_best_test_shows_the_paper_numbers_labelled(tmp_path):
    other = [_row(1, 0.50, 0.60, 0.06), _row(2, 0.70, 0.80, 0.16), _row(3, 0.60, 0.75, 0.10)]
    _run(tmp_path / "fedavg-s0", 0, ROWS)
    _run(tmp_path / "fedavg-s1", 1, other, with_best=False)  # computed from its rows
    settings, _ = find_settings([tmp_path / "fedavg-s0", tmp_path / "fedavg-s1"])
    last = build_report(settings)
    assert "std over clients (%)" not in last.tables[0].columns  # the default table: unchanged
    rep = build_report(settings, at="best_test")
    table = rep.tables[0]
    columns = dict(zip(table.columns, table.rows[0], strict=True))
    # seed 0: round 3 (0.80, std 0.14, CV 0.2); seed 1: round 2 (0.70, std 0.16, CV 0.2);
    # mean ± population std over seeds, in %
    assert columns["weighted (%)"] == "75.00 ± 5.00"
    assert columns["personalized acc (%)"] == "75.00 ± 5.00"  # 0.70 and 0.80 at those rounds
    assert columns["std over clients (%)"] == "15.00 ± 1.00"
    assert columns["CV over clients (×100)"] == "20.00 ± 0.00"
    assert "optimistic" in rep.head and "eval.every" in rep.head
    numbers = rep.numbers["fedavg"]["best_test"]
    assert numbers["pers_acc_cv"] == pytest.approx([0.2, 0.2])
    # the last-round report of the same runs: seed 0 round 6, seed 1 round 3
    cells = dict(zip(last.tables[0].columns, last.tables[0].rows[0], strict=True))
    assert cells["weighted (%)"] == "67.50 ± 7.50"
    assert "CV over clients (x100)" in rep.latex()


# -- random participation ------------------------------------------------------------------------


def test_a_range_draws_a_new_share_each_round_from_the_seed():
    n, a, b = 50, 0.1, 0.9
    counts = [len(sample_clients(7, r, n, [a, b])) for r in range(1, 101)]
    assert all(round(a * n) <= c <= round(b * n) for c in counts)
    assert len(set(counts)) > 10 and min(counts) < 15 and max(counts) > 35  # spread over [5, 45]
    shares = [round_fraction(7, r, [a, b]) for r in range(1, 101)]
    assert all(a <= x <= b for x in shares)
    assert [len(sample_clients(7, r, n, x)) for r, x in enumerate(shares, 1)] == counts
    # seeded by (seed, round) only: the same in any order (a resume, another runner)
    again = [sample_clients(7, r, n, [a, b]) for r in reversed(range(1, 101))][::-1]
    assert again == [sample_clients(7, r, n, [a, b]) for r in range(1, 101)]
    assert [round_fraction(8, r, [a, b]) for r in range(1, 101)] != shares  # other seed


def test_a_fixed_share_keeps_the_selection_of_before():
    def before(seed, rnd, num, fraction):  # pflkit's sampling before ranges existed
        m = max(int(round(fraction * num)), 1)
        if m >= num:
            return list(range(num))
        rng = np.random.default_rng([seed, rnd, 0x5A])
        return sorted(int(c) for c in rng.choice(num, m, replace=False))

    assert sample_clients(3, 1, 20, 0.25) == [1, 4, 5, 14, 19]
    assert sample_clients(7, 2, 10, 0.5) == [0, 4, 5, 6, 7]
    for rnd in range(1, 20):
        assert sample_clients(5, rnd, 30, 0.3) == before(5, rnd, 30, 0.3)
        assert sample_clients(5, rnd, 30, [0.3, 0.3]) == before(5, rnd, 30, 0.3)


def test_a_run_with_a_range_records_each_rounds_share():
    cfg = validate(tiny_config(train={"rounds": 4, "client_fraction": [0.25, 1.0]}))
    assert cfg.train.client_fraction == [0.25, 1.0]
    with Simulation(cfg) as sim:
        rows = [sim.run_round(r) for r in range(1, 5)]
    for r in rows:
        assert 0.25 <= r["client_fraction"] <= 1.0
        assert len(r["clients"]) == max(round(r["client_fraction"] * 4), 1)
    assert len({len(r["clients"]) for r in rows}) > 1
    fixed = validate(tiny_config(train={"rounds": 1, "client_fraction": 0.5}))
    with Simulation(fixed) as sim:
        assert "client_fraction" not in sim.run_round(1)  # rows of a fixed share: as before


@pytest.mark.parametrize("bad", [[0.5, 0.2], [0, 1], [0.1, 1.5], [0.1], [0.1, 0.2, 0.3], 1.5])
def test_a_bad_share_or_range_is_one_sentence(bad):
    with pytest.raises(PflkitError) as err:
        validate(tiny_config(train={"client_fraction": bad}))
    text = str(err.value)
    assert "train.client_fraction" in text and repr(bad) in text and "0 < a <= b <= 1" in text
    assert "\n" not in text


def test_cli_bad_range_exits_2(cli, tmp_path):
    cfg = tmp_path / "tiny.yaml"
    cfg.write_text(yaml.safe_dump(tiny_config()))
    r = cli("run", str(cfg), "--set", "train.client_fraction=[0.9, 0.1]", cwd=tmp_path)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and "[0.9, 0.1]" in r.stderr


def test_make_report_at_best_test_and_bad_at(tmp_path):
    _run(tmp_path / "fedavg-s0", 0, ROWS)
    text = make_report(tmp_path / "fedavg-s0", at="best_test").markdown()
    assert "| fedavg | 70.00 ± 0.00 | 80.00 ± 0.00 |" in text and "optimistic" in text
    with pytest.raises(PflkitError, match="use one of last, mean_last, val_round, best_test"):
        make_report(tmp_path / "fedavg-s0", at="best")
