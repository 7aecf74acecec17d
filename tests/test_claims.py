"""benchmarks/claims.py (docs/claims.md) on hand-made runs: each verdict worked out by hand from
per-seed numbers, the paper arm's reuse of the fair arm's runs, the best-round statistic, the
"first" claim's rival, the traffic ratio, the cross-check column; and docs/claims.md is what the
kept runs give, byte for byte."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(BENCH))

import claims  # noqa: E402
from paper_table import Column  # noqa: E402

# the paper: a 90, b 85, c 80 (a above both: paper Deltas +5 and +10)
COLUMN = Column("test", "a", (("acc", "accuracy"),), {"a": (90.0,), "b": (85.0,), "c": (80.0,)})


def run(folder: Path, label: str, mean_last: list[float], best: list[float] | None = None):
    """Seeds 0.. of ``label``: summary.json's mean_last, and metrics.jsonl with a worse round
    and a best round of ``best`` (default: mean_last)."""
    for seed, v in enumerate(mean_last):
        d = folder / f"{label}-s{seed}"
        d.mkdir(parents=True)
        top = (best or mean_last)[seed]
        summary = {"final": {"acc": v}, "mean_last": {"acc": v}, "comm": {}}
        summary["comm"]["bytes_up_per_client_round"] = 4000 if label.startswith("b") else 40
        (d / "summary.json").write_text(json.dumps(summary))
        rows = [{"round": 1, "acc": top - 0.05}, {"round": 2, "acc": top}, {"round": 3}]
        (d / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")


@pytest.fixture
def world(tmp_path, monkeypatch):
    """Fair runs of a, b(...) and c in F; the paper config runs only a (into P); b and c are
    reused from F."""
    monkeypatch.setitem(claims.COLUMNS, "test", COLUMN)
    results, root = tmp_path / "results", tmp_path / "repo"
    run(results / "F", "a", [0.90, 0.91, 0.92], best=[0.93, 0.93, 0.93])
    run(results / "F", "b(mu=1)", [0.88, 0.88, 0.88], best=[0.90, 0.90, 0.90])
    run(results / "F", "c", [0.89, 0.92, 0.91])
    run(results / "P", "a", [0.50, 0.50, 0.50], best=[0.80, 0.81, 0.82])
    (root / "configs").mkdir(parents=True)
    (root / "configs" / "p.yaml").write_text("compare:\n  algorithms: [{name: a, x: 1}]\n")
    fair = claims.Arm("F")
    paper = claims.Arm("P", "best", config="configs/p.yaml", reuse="F")
    return results, root, fair, paper


def claim(against, fair, paper, **kw):
    return claims.Claim("T", "t", "test", "acc", "a", against, fair, paper, **kw)


def test_each_verdict_by_hand(world):
    results, root, fair, paper = world
    # a - b, fair: 2, 3, 4 -> mean 3 > std 0.82, the paper's sign: reproduced
    j = claims.judge(results, claim("b", fair, paper), fair, root)
    assert j.verdict == "reproduced"
    assert "91.00 vs 88.00; Δ +3.00 ± 0.82 (n=3, mean_last)" in j.cell
    # a - c, fair: 1, -1, 1 -> mean 0.33 < std 0.94, the paper's sign: within noise
    j = claims.judge(results, claim("c", fair, paper), fair, root)
    assert j.verdict == "same direction, within noise"
    assert "Δ +0.33 ± 0.94" in j.cell
    # paper arm: a's best rounds from P (80, 81, 82), b's reused from F (90 each): reversed
    j = claims.judge(results, claim("b", fair, paper), paper, root)
    assert j.verdict == "reversed"
    assert "81.00 vs 90.00; Δ -9.00 ± 0.82 (n=3, best)" in j.cell
    # paper arm, a - c: c's best rounds are its mean_last values (89, 92, 91): -9, -11, -9
    assert claims.judge(results, claim("c", fair, paper), paper, root).verdict == "reversed"


def test_opposite_sign_within_noise_is_not_reproduced(world, tmp_path):
    results, root, fair, _ = world
    run(results / "G", "a", [0.50, 0.52, 0.50])
    run(results / "G", "b", [0.51, 0.51, 0.51])  # -1, +1, -1: mean -0.33, std 0.94
    assert claims.judge(results, claim("b", fair, None), claims.Arm("G"), root).verdict == (
        "not reproduced"
    )


def test_first_is_judged_against_the_best_other_method_by_our_mean(world):
    results, root, fair, paper = world
    c = claim(None, fair, paper)
    j = claims.judge(results, c, fair, root)  # b: 88 on average, c: 90.67 -> c is the rival
    assert "(best other: c)" in j.cell and j.verdict == "same direction, within noise"
    assert claims.paper_cell(c) == "90.00 vs 85.00 (b); Δ +5.00"  # the paper's best other: b
    assert claims.rivals(claim(None, fair, paper, besides=("c",))) == ["b"]


def test_a_paper_arm_without_its_config_or_runs_is_not_run_yet(world):
    results, root, fair, paper = world
    missing = claims.Arm("P", "best", config="configs/none.yaml", reuse="F")
    j = claims.judge(results, claim("b", fair, missing), missing, root)
    assert j.verdict == "not run yet" and "configs/none.yaml" in j.cell
    (root / "configs" / "p.yaml").write_text("compare:\n  algorithms: [a, b]\n")  # b not in P
    j = claims.judge(results, claim("b", fair, paper), paper, root)
    assert (j.verdict, j.cell) == ("not run yet", "no finished runs of b")


def test_traffic_ratio_and_crosscheck_cell(world):
    results, root, fair, paper = world
    t = claims.TrafficClaim("T", "t", "a", "b", 100, "F")
    assert claims.judge_traffic(results, t).verdict == "reproduced"  # 4000 / 40 = 100x
    assert "100x" in claims.judge_traffic(results, t).cell
    strict = claims.TrafficClaim("T", "t", "a", "b", 101, "F")
    assert claims.judge_traffic(results, strict).verdict == "not reproduced"
    (results / "crosscheck").mkdir()
    rows = [
        {"algorithm": "a", "library": "pfllib", "verdict": "within noise"},
        {"algorithm": "b-flbench", "library": "flbench", "verdict": "differs"},
    ]
    (results / "crosscheck" / "results.jsonl").write_text(
        "".join(json.dumps(r) + "\n" for r in rows)
    )
    cell = claims.crosscheck_cell(results, claim("b", fair, paper, crosscheck="pfllib"))
    assert cell == "a: within noise; b: not run yet"
    cell = claims.crosscheck_cell(results, claim("b", fair, paper, crosscheck="flbench"))
    assert cell == "a: not run yet; b: differs"


def test_check_and_bad_results_folder(tmp_path, capsys):
    out = tmp_path / "claims.md"
    assert claims.main(["--results", str(tmp_path / "none"), "--out", str(out)]) == 2
    assert "is not a folder of kept runs" in capsys.readouterr().err
    assert claims.main(["--out", str(out), "--check"]) == 1
    assert claims.main(["--out", str(out)]) == 0
    assert claims.main(["--out", str(out), "--check"]) == 0


def test_docs_claims_md_is_what_the_kept_runs_give():
    """docs/claims.md rebuilds byte for byte from results/ (rerun benchmarks/claims.py
    after keeping runs)."""
    assert claims.main(["--check"]) == 0


def test_best_every_n_takes_only_the_rounds_that_are_multiples_of_n(tmp_path):
    d = tmp_path / "a-s0"
    d.mkdir()
    rows = [{"round": 10, "acc": 0.9}, {"round": 20, "acc": 0.7}, {"round": 30, "acc": 0.8}]
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert claims._value(d, "best", "acc") == 0.9
    assert claims._value(d, "best_every:20", "acc") == 0.7
    assert claims._value(d, "best_every:15", "acc") == 0.8


def test_fewer_than_three_paired_seeds_give_no_verdict(world):
    results, root, fair, _ = world
    run(results / "H", "a", [0.60, 0.61])
    run(results / "H", "b", [0.50, 0.50])  # +10, +11: clear, but two seeds
    j = claims.judge(results, claim("b", fair, None), claims.Arm("H"), root)
    assert j.verdict == "too few seeds" and "(n=2, mean_last)" in j.cell
