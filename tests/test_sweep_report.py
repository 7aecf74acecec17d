"""Sweeps, validation-based selection and the results tooling (issue 16, items 1, 2 and 5):
``pflkit sweep``, ``pflkit report``, :mod:`pflkit.report.results`, ``summary.json``'s
``val_round``."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from conftest import tiny_config
from pflkit import load_runs, make_report, run_experiment, run_sweep
from pflkit.errors import PflkitError
from pflkit.experiment import validate
from pflkit.report.archive import tree
from pflkit.report.results import build_report, choose, find_settings, paired_p
from pflkit.report.summary import summarize
from test_cli import pflkit
from test_engine import strip_timing


def test_a_2x2_sweep_equals_the_four_individual_runs(tmp_path):
    """A grid over an algorithm parameter and a data key (a new partition per value): each
    sweep run equals the run of its own config, started on its own."""
    cfg = validate(
        tiny_config(
            algorithm={"name": "fedprox"},
            train={"rounds": 2},
            compare={"algorithms": ["fedprox", "local"], "seeds": [1]},
            sweep={
                "grid": {"algorithm.mu": [0.001, 0.5], "data.num_clients": [3, 4]},
                "select": "none",
            },
        )
    )
    res = run_sweep(cfg, tmp_path / "sw", progress=False)
    # local has no mu: it repeats over the data key only
    assert list(res["results"]) == [
        "fedprox(mu=0.001)[data.num_clients=3]",
        "fedprox(mu=0.001)[data.num_clients=4]",
        "fedprox(mu=0.5)[data.num_clients=3]",
        "fedprox(mu=0.5)[data.num_clients=4]",
        "local[data.num_clients=3]",
        "local[data.num_clients=4]",
    ]
    seen = set()
    for mu in (0.001, 0.5):
        for n in (3, 4):
            alone = run_experiment(
                validate(
                    tiny_config(
                        seed=1,
                        algorithm={"name": "fedprox", "mu": mu},
                        train={"rounds": 2},
                        data={"num_clients": n},
                    )
                ),
                out=tmp_path / f"alone-{mu}-{n}",
            )
            rows = [
                json.loads(line)
                for line in (
                    tmp_path / "sw" / f"fedprox(mu={mu})[data.num_clients={n}]-s1" / "metrics.jsonl"
                )
                .read_text()
                .splitlines()
            ]
            assert strip_timing(rows) == strip_timing(alone.rows)
            seen.add(json.dumps(strip_timing(rows)))
    assert len(seen) == 4  # the four points really differ


def _fake_run(folder: Path, algo: str, seed: int, test: float, val: float) -> None:
    """A finished run folder written by hand: one evaluated round with these accuracies."""
    folder.mkdir(parents=True)
    cfg = tiny_config(seed=seed, algorithm={"name": algo})
    (folder / "config.yaml").write_text(yaml.safe_dump(cfg))
    row = {
        "round": 1,
        "clients": [0],
        "bytes_down": [1024],
        "bytes_up": [1024],
        "seconds_train": 0.5,
        "seconds_eval": 0.5,
        "pers_acc_mean": test,
        "val_pers_acc_mean": val,
    }
    (folder / "metrics.jsonl").write_text(json.dumps(row) + "\n")
    summary = {"name": "tiny", "algorithm": algo, "seed": seed} | summarize([row])
    (folder / "summary.json").write_text(json.dumps(summary))


def _selection(report) -> list[str]:
    table = report.tables[1]
    return table.rows


def test_select_val_chooses_on_validation_only(tmp_path):
    """Two settings whose validation and test rankings disagree: the validation choice is A
    (its test number is reported), the best on test is B, shown apart and labelled; and no
    change of the test numbers changes the choice."""

    def sweep(name: str, test_a: tuple, test_b: tuple) -> Path:
        out = tmp_path / name
        for seed in (0, 1, 2):
            _fake_run(out / f"fedprox(mu=A)-s{seed}", "fedprox", seed, test_a[seed], 0.9)
            _fake_run(out / f"fedprox(mu=B)-s{seed}", "fedprox", seed, test_b[seed], 0.5)
        return out

    out = sweep("one", (0.60, 0.62, 0.64), (0.80, 0.81, 0.82))
    report = build_report(find_settings([out])[0], select="val")
    [row] = _selection(report)
    assert row == ["fedprox", "fedprox(mu=A)", "62.00 ± 1.63", "fedprox(mu=B)", "81.00 ± 0.82"]
    assert report.tables[1].columns[3] == "best on test (optimistic)"
    assert "chosen on validation" in report.tables[1].title
    # test numbers shuffled and scaled: the validation choice does not move
    other = sweep("two", (0.10, 0.99, 0.30), (0.95, 0.96, 0.97))
    [row2] = _selection(build_report(find_settings([other])[0], select="val"))
    assert row2[1] == "fedprox(mu=A)"
    # select on test: the optimistic choice only, and the title says so
    on_test = build_report(find_settings([out])[0], select="test")
    assert on_test.tables[1].rows == [["fedprox", "fedprox(mu=B)", "81.00 ± 0.82"]]
    assert "optimistic" in on_test.tables[1].title
    # a setting without the number never wins; the first of tied best ones does
    assert choose({"a": math.nan, "b": 0.1}) == "b" and choose({"a": math.nan}) is None
    assert choose({"a": 0.5, "b": 0.7, "c": 0.7}) == "b"


def test_paired_t_test_by_hand():
    """df = 2: the two-sided p-value is 1 - t / sqrt(2 + t^2) (closed form of Student's t)."""
    a = {0: 0.80, 1: 0.82, 2: 0.85}
    b = {0: 0.70, 1: 0.75, 2: 0.80}
    d = [0.10, 0.07, 0.05]
    mean = sum(d) / 3
    sd = math.sqrt(sum((x - mean) ** 2 for x in d) / 2)
    t = mean / (sd / math.sqrt(3))
    assert paired_p(a, b) == pytest.approx(1 - t / math.sqrt(2 + t * t), rel=1e-9)
    assert paired_p(a, b) == pytest.approx(paired_p(b, a))
    assert paired_p({0: 0.5, 1: 0.6}, {0: 0.5, 1: 0.6}) == 1.0  # identical runs
    assert paired_p({0: 0.6, 1: 0.7}, {0: 0.5, 1: 0.6}) == 0.0  # a constant gain
    assert paired_p({0: 0.5, 7: 0.6}, {0: 0.5, 1: 0.6}) is None  # one common seed
    # only common seeds pair
    assert paired_p(a | {9: 0.1}, b) == paired_p(a, b)


def test_val_round_picks_the_best_validation_round_and_reports_its_test_number():
    rows = [
        {"round": r, "bytes_down": [], "bytes_up": [], "seconds_train": 0, "seconds_eval": 0}
        | {"pers_acc_mean": test, "val_pers_acc_mean": val, "global_acc": g}
        for r, test, val, g in [(1, 0.5, 0.4, 0.3), (2, 0.9, 0.6, 0.2), (3, 0.6, 0.6, 0.4)]
    ]
    s = summarize(rows)
    # round 2 has the best validation value (the first of the tied best); its test is 0.9
    assert s["val_round"] == {"pers_acc_mean": {"round": 2, "value": 0.9, "val": 0.6}}
    assert s["final"]["val_pers_acc_mean"] == 0.6 and s["final"]["pers_acc_mean"] == 0.6
    assert "val_round" not in summarize(
        [{k: v for k, v in r.items() if not k.startswith("val_")} for r in rows]
    )


def test_report_reproduces_the_compare_table_and_writes_every_format(tmp_path):
    cfg = tmp_path / "tiny.yaml"
    cfg.write_text(yaml.safe_dump(tiny_config(train={"rounds": 2})))
    args = ["--algorithms", "local,fedavg", "--seeds", "0,1", "-q", "--out", "cmp"]
    r = pflkit("compare", str(cfg), *args, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    cmp = tmp_path / "cmp"
    rep = pflkit("report", "cmp", cwd=tmp_path)
    assert rep.returncode == 0, rep.stderr
    assert rep.stdout == (cmp / "results.md").read_text()
    assert "| local |" in rep.stdout and "p vs best" in rep.stdout
    # the same runs given one by one, in another order: the same rows
    folders = ["cmp/fedavg-s1", "cmp/local-s0", "cmp/fedavg-s0", "cmp/local-s1"]
    alone = pflkit("report", *folders, cwd=tmp_path)
    lines = lambda text: sorted(x for x in text.splitlines() if x.startswith("| "))  # noqa: E731
    assert lines(alone.stdout) == lines(rep.stdout)
    written = pflkit("report", "cmp", "--out", "again", "--format", "csv", cwd=tmp_path)
    assert written.returncode == 0, written.stderr
    again = tmp_path / "again"
    for name in ("results.md", "results.csv", "results.tex", "results.json"):
        assert (again / name).read_text() == (cmp / name).read_text(), name
    assert (again / "accuracy.png").stat().st_size > 1000
    assert written.stdout == (cmp / "results.csv").read_text()
    assert len(written.stdout.splitlines()) == 5  # a header and one line per run
    assert "$\\pm$" in (cmp / "results.tex").read_text()
    df = load_runs(cmp)
    assert sorted(df["label"]) == ["fedavg", "fedavg", "local", "local"]
    got = df.set_index(["label", "seed"])["final.pers_acc_mean"]
    for label in ("local", "fedavg"):
        for seed in (0, 1):
            summary = json.loads((cmp / f"{label}-s{seed}" / "summary.json").read_text())
            assert got[(label, seed)] == summary["final"]["pers_acc_mean"]
    per_round = load_runs(cmp, per_round=True)
    assert len(per_round) == 4 * 2 and set(per_round["round"]) == {1, 2}
    assert make_report(cmp).markdown() == rep.stdout


def test_sweep_from_the_cli_selects_on_validation(tmp_path):
    cfg = tmp_path / "tiny.yaml"
    cfg.write_text(yaml.safe_dump(tiny_config(train={"rounds": 2}, data={"val_fraction": 0.2})))
    r = pflkit(
        "sweep", str(cfg), "--grid", "train.lr=[0.01,0.05]", "--algorithms", "fedavg",
        "--seeds", "0,1", "-q", "--out", "sw", cwd=tmp_path,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert "## Selected settings, per algorithm, chosen on validation" in r.stdout
    assert "fedavg[train.lr=0.01]" in r.stdout and "fedavg[train.lr=0.05]" in r.stdout
    numbers = json.loads((tmp_path / "sw" / "results.json").read_text())
    val = {k: sum(v["val_pers_acc_mean"]) for k, v in numbers.items()}
    chosen = [k for k, v in numbers.items() if v.get("chosen_on_validation")]
    assert chosen == [max(val, key=val.get)]
    # the plan keeps the options: report shows the same tables
    assert pflkit("report", "sw", cwd=tmp_path).stdout == (tmp_path / "sw/results.md").read_text()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["sweep", "CFG", "--out", "o"], "a sweep needs a grid"),
        (["sweep", "CFG", "--grid", "train.lr=0.1", "--out", "o"], "invalid --grid 'train.lr=0.1'"),
        (
            ["sweep", "CFG", "--grid", "algorithm.muu=[1]", "--select", "none", "--out", "o"],
            "has a parameter 'muu': check its spelling",
        ),
        (["sweep", "CFG", "--grid", "seed=[1,2]", "--select", "none", "--out", "o"], "--seeds"),
        (["sweep", "CFG", "--grid", "train.lr=[0.1]", "--out", "o"], "no validation split"),
        (
            ["sweep", "CFG", "--grid", "train.lr=[-1]", "--select", "none", "--out", "o"],
            "train.lr",
        ),
        (["sweep", "CFG", "--grid", "train.lr=[1]", "--select", "maybe"], "sweep.select"),
        (["report", "nowhere"], "'nowhere' is neither a run folder"),
        (["report"], "needs run folders"),
    ],
)
def test_sweep_and_report_bad_input_is_one_sentence(cli, tmp_path, args, message):
    cfg = tmp_path / "tiny.yaml"
    cfg.write_text(yaml.safe_dump(tiny_config(train={"rounds": 1})))
    r = cli(*[str(cfg) if a == "CFG" else a for a in args], cwd=tmp_path)
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert message in r.stderr and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "o").exists()  # nothing half-made


def test_report_refuses_unfinished_runs_and_missing_numbers(cli, tmp_path):
    run = tmp_path / "r"
    _fake_run(run, "fedavg", 0, 0.5, 0.5)
    for args, message in [
        (["r", "--at", "mean_last"], "needs runs with eval.last > 0"),
        (["r", "--format", "pdf"], "unknown --format 'pdf'"),
        (["r", "--metric", "acc"], "unknown metric 'acc'"),
    ]:
        r = cli("report", *args, cwd=tmp_path)
        assert r.returncode == 2 and message in r.stderr, (args, r.stderr)
    (run / "summary.json").unlink()
    r = cli("report", "r", cwd=tmp_path)
    assert r.returncode == 2 and "has not finished: finish it with pflkit run --resume" in r.stderr
    with pytest.raises(PflkitError, match="validation split"):
        _fake_run(tmp_path / "n", "fedavg", 0, 0.5, 0.5)
        noval = json.loads((tmp_path / "n" / "summary.json").read_text())
        del noval["val_round"]
        (tmp_path / "n" / "summary.json").write_text(json.dumps(noval))
        make_report(tmp_path / "n", select="val")


def test_keep_runs_copies_the_record_of_finished_runs_only(tmp_path):
    """benchmarks/keep_runs.sh: the kept archive reports the same table as the compare folder;
    checkpoints, logs and unfinished runs stay behind; a clashing run name is exit 2."""
    script = Path(__file__).parents[1] / "benchmarks" / "keep_runs.sh"
    src = tmp_path / "cmp"
    for seed, acc in ((0, 0.6), (1, 0.7)):
        _fake_run(src / f"fedavg-s{seed}", "fedavg", seed, acc, acc)
        (src / f"fedavg-s{seed}" / "checkpoints").mkdir()
        (src / f"fedavg-s{seed}" / "run.log").write_text("log\n")
    (src / "local-s0").mkdir()
    (src / "local-s0" / "config.yaml").write_text("seed: 0\n")  # unfinished: no summary.json
    (src / "compare.yaml").write_text("name: tiny\n")  # the compare's manifest
    dest = tmp_path / "kept"

    def keep(*folders: Path) -> subprocess.CompletedProcess:
        args = ["bash", str(script), str(dest), *map(str, folders)]
        env = {**os.environ, "PYTHON": sys.executable}
        return subprocess.run(args, capture_output=True, text=True, env=env)

    first = keep(src)
    assert first.returncode == 0 and "kept 2 new run(s)" in first.stdout, first.stderr
    assert not dest.exists() and dest.with_name("kept.zip").is_file()  # one archive
    kept = tree(dest)
    assert sorted(p.name for p in kept.iterdir()) == ["compare.yaml", "fedavg-s0", "fedavg-s1"]
    assert sorted(p.name for p in (kept / "fedavg-s0").iterdir()) == [
        "config.yaml",
        "metrics.jsonl",
        "summary.json",
    ]
    assert (
        make_report(dest).markdown() == make_report(src / "fedavg-s0", src / "fedavg-s1").markdown()
    )
    assert "kept 0 new run(s)" in keep(src).stdout  # the same runs again: nothing to do
    (src / "fedavg-s0" / "relation.json").write_text("{}\n")  # written after it was kept
    assert "kept 0 new run(s)" in keep(src).stdout
    assert (tree(dest) / "fedavg-s0" / "relation.json").read_text() == "{}\n"
    other = tmp_path / "other"
    _fake_run(other / "fedavg-s0", "fedavg", 0, 0.9, 0.9)
    clash = keep(other)
    assert clash.returncode == 2 and "already holds a different run" in clash.stderr
    (other / "compare.yaml").write_text("name: another\n")
    assert "runs of another config" in keep(other).stderr
    assert keep(tmp_path / "missing").returncode == 2


PAPER_TABLE = Path(__file__).parents[1] / "benchmarks" / "paper_table.py"


def _summaries(root: Path, label: str, key: str, accs: tuple[float, ...]) -> None:
    """``root/<label>-s<seed>/summary.json`` with ``key`` = accs[seed] at the last round and as
    the last-rounds mean (rewritten when it exists)."""
    for seed, acc in enumerate(accs):
        folder = root / f"{label}-s{seed}"
        folder.mkdir(parents=True, exist_ok=True)
        summary = {"final": {key: acc}, "mean_last": {key: acc}}
        (folder / "summary.json").write_text(json.dumps(summary))


def _paper_table(column: str, *args: Path | str) -> tuple[str, dict[str, list[str]]]:
    """benchmarks/paper_table.py's output for ``column`` on ``args`` (folders, options) and its
    table rows by their first cell (cells split on ' | ')."""
    cmd = [sys.executable, str(PAPER_TABLE), column, *map(str, args)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    rows = {line.split(" | ")[0][2:]: line.split(" | ") for line in out.splitlines() if "|" in line}
    return out, rows


def test_paper_table_verdicts_by_hand(tmp_path):
    """benchmarks/paper_table.py, KT-pFL's Table 2 column: Delta = method - KT-pFL (ktpfl_homo)
    on the last-rounds mean, paired by seed, against the paper's Delta (FedAvg 80.69 - 93.93 =
    -13.24, pFedHN 92.22 - 93.93 = -1.71, FedAMP 90.79 - 93.93 = -3.14)."""

    def run(label: str, accs: tuple[float, ...]) -> None:
        _summaries(tmp_path, label, "pers_acc_mean", accs)

    run("ktpfl_homo(temperature=1.0)", (0.80, 0.82, 0.84))
    run("fedavg", (0.70, 0.73, 0.75))  # Delta -10, -9, -9: mean -9.33, std 0.47: reproduced
    run("pfedhn", (0.85, 0.86, 0.88))  # +5, +4, +4: opposite sign, beyond the std: reversed
    run("fedamp", (0.81, 0.83, 0.83))  # +1, +1, -1: mean +0.33 < std 0.94: not reproduced
    run("perfedavg", (0.79, 0.83, 0.83))  # -1, +1, -1: mean -0.33 < std 0.94: within noise
    out, rows = _paper_table("ktpfl/fmnist20", tmp_path)
    assert rows["fedavg"][5:8] == ["-9.3 ± 0.5 (n=3)", "-13.2", "reproduced |"]
    assert rows["pfedhn"][5:8] == ["+4.3 ± 0.5 (n=3)", "-1.7", "reversed |"]
    assert rows["fedamp"][7] == "not reproduced |"
    assert rows["perfedavg"][7] == "same direction, within noise |"
    assert rows["ktpfl_homo(temperature=1.0)"][1:5] == ["3", "82.0 ± 1.6", "82.0 ± 1.6", "93.93"]
    assert "ours (mean of last rounds): pfedhn > fedamp > ktpfl_homo > perfedavg > fedavg\n" in out
    assert "paper: ktpfl_homo > pfedhn > fedamp > perfedavg > fedavg\n" in out
    bad = subprocess.run(
        [sys.executable, str(PAPER_TABLE), "nope", "x"], capture_output=True, text=True
    )
    assert bad.returncode == 2 and "COLUMN one of map/fmnist_lenet" in bad.stderr


def test_paper_table_takes_a_label_whole_from_the_last_folder(tmp_path):
    """A partial paper-protocol arm given after the fair arm: its method shows the paper arm's
    two seeds (mean 80.0 ± 1.0), not those two plus the fair arm's third (the mixed 76.7)."""
    fair, paper = tmp_path / "fair", tmp_path / "paper"
    _summaries(fair, "ktpfl_homo(temperature=1.0)", "pers_acc_mean", (0.80, 0.82, 0.84))
    _summaries(fair, "fedavg", "pers_acc_mean", (0.70, 0.70, 0.70))
    _summaries(paper, "fedavg", "pers_acc_mean", (0.79, 0.81))
    _, rows = _paper_table("ktpfl/fmnist20", fair, paper)
    assert rows["fedavg"][1:4] == ["2", "80.0 ± 1.0", "80.0 ± 1.0"]
    assert rows["fedavg"][5] == "-1.0 ± 0.0 (n=2)"  # paired with ktpfl_homo's seeds 0 and 1


def test_paper_table_pfedsim_pattern_line(tmp_path):
    """pFedSim's column reads the pooled accuracy and says whether our order shows the paper's
    claim: pFedSim first and FedAvg, FedProx, FedDyn, FedGen, FedBN the five last (Dir 0.1)."""
    names = ["pfedsim", "fedrep", "local", "fedbn", "fedavg", "fedprox", "feddyn", "fedgen"]

    def table(accs: list[float]) -> str:
        for name, acc in zip(names, accs, strict=False):
            _summaries(tmp_path, name, "pers_acc_weighted", (acc, acc))  # seeds 0 and 1
        return _paper_table("pfedsim/dir01", tmp_path)[0]

    out = table([0.9, 0.8, 0.85])  # FedBN and the FedAvg family not run yet
    first = "pfedsim first: yes so far (9 of the paper's 12 methods not run yet); "
    assert first + "fedavg, fedprox, feddyn, fedgen, fedbn last: not all run yet" in out
    out = table([0.9, 0.8, 0.85, 0.7, 0.6, 0.5, 0.4, 0.3])  # 8 of the 12
    assert "paper: pfedsim > fedrep > local > fedbn > fedgen > fedavg > fedprox > feddyn" in out
    first = "pfedsim first: yes so far (4 of the paper's 12 methods not run yet); "
    assert first + "fedavg, fedprox, feddyn, fedgen, fedbn last: yes" in out
    out = table([0.8, 0.9, 0.5, 0.7, 0.6, 0.55, 0.4, 0.3])  # Local below FedBN, FedAvg, FedProx
    assert "pfedsim first: no; fedavg, fedprox, feddyn, fedgen, fedbn last: no (ours last: " in out
    assert "(ours last: fedavg, fedprox, local, feddyn, fedgen)" in out


def test_paper_table_pfedpm_column_by_hand(tmp_path):
    """pFedPM's n = 4 column: the mean over clients, Deltas against pFedPM, the paper's Deltas
    from Table I's MNIST n = 4 (FedAvg 94.32 - 97.52 = -3.20, pFedPM-mh 97.70 - 97.52 = +0.18)
    and FedProto's own 96.80; pFedPM-mh's runs are found under their compare label."""
    for label, accs in {
        "pfedpm(lam=1.0,a=0.4)": (0.90, 0.92),
        "pfedpm-mh": (0.91, 0.94),  # Delta +1, +2
        "fedproto(lam=1.0)": (0.89, 0.92),  # Delta -1, 0
        "fedavg": (0.70, 0.72),  # Delta -20, -20
    }.items():
        _summaries(tmp_path, label, "pers_acc_mean", accs)
    out, rows = _paper_table("pfedpm/fmnist_n4", tmp_path)
    assert rows["fedavg"][4:8] == ["94.32", "-20.0 ± 0.0 (n=2)", "-3.2", "reproduced |"]
    assert rows["pfedpm-mh"][4:8] == ["97.7", "+1.5 ± 0.5 (n=2)", "+0.2", "reproduced |"]
    assert rows["fedproto(lam=1.0)"][4:7] == ["96.8", "-0.5 ± 0.5 (n=2)", "-0.7"]
    assert "paper: pfedpm-mh > pfedpm > fedproto > fedavg" in out


def test_paper_table_lead_by_round_by_hand(tmp_path):
    """--by-round: at each round every method evaluated, the reference's seed mean minus the
    best other method's seed mean, and the round from which the reference stays first."""
    curves = {  # label -> seed -> pooled accuracy at rounds 10, 20, 30, 40
        "gpfl": {0: (0.50, 0.80, 0.70, 0.90), 1: (0.60, 0.90, 0.80, 0.92)},
        "fedrep": {0: (0.70, 0.80, 0.74, 0.85), 1: (0.70, 0.80, 0.80, 0.85)},
        "fedavg": {0: (0.40, 0.50, 0.60, 0.88), 1: (0.40, 0.50, 0.60, 0.88)},
    }
    for label, by_seed in curves.items():
        _summaries(tmp_path, label, "pers_acc_weighted", (0.9, 0.9))
        for seed, accs in by_seed.items():
            rows = [{"round": 10 * (i + 1), "pers_acc_weighted": a} for i, a in enumerate(accs)]
            rows.insert(0, {"round": 5, "train_loss": 1.0})  # a round without evaluation
            text = "".join(json.dumps(r) + "\n" for r in rows)
            (tmp_path / f"{label}-s{seed}" / "metrics.jsonl").write_text(text)
    out, _ = _paper_table("gpfl/fmnist_prac", tmp_path, "--by-round")
    rows = [line for line in out.splitlines() if line.startswith("| ") and line[2].isdigit()]
    # round 10: 55 vs FedRep 70; 20: 85 vs 80; 30: 75 vs FedRep 77; 40: 91 vs FedAvg 88
    assert rows == [
        "| 10 | 55.00 | fedrep | 70.00 | -15.00 |",
        "| 20 | 85.00 | fedrep | 80.00 | +5.00 |",
        "| 30 | 75.00 | fedrep | 77.00 | -2.00 |",
        "| 40 | 91.00 | fedavg | 88.00 | +3.00 |",
    ]
    assert "gpfl is above every other method from round 40 on." in out


def test_pfedpm_relation_reports_kept_scores_by_folder_and_setting(tmp_path):
    """benchmarks/pfedpm_relation.py on kept runs (relation.json, no checkpoint): head and
    relation accuracy per run, mean ± population std over each folder's seeds and their
    difference paired by seed; a pFedPM run with neither relation.json of its last round nor a
    checkpoint is one sentence, exit 2."""
    script = Path(__file__).parents[1] / "benchmarks" / "pfedpm_relation.py"

    def run(folder: str, label: str, head: float, rel: float, rel_round: int = 100) -> None:
        d = tmp_path / folder / label
        d.mkdir(parents=True)
        summary = {"algorithm": "pfedpm", "rounds": 100, "final": {"pers_acc_mean": head}}
        (d / "summary.json").write_text(json.dumps(summary))
        (d / "relation.json").write_text(json.dumps({"round": rel_round, "pers_acc_mean": rel}))

    run("n3", "pfedpm-s0", 0.90, 0.80)
    run("n3", "pfedpm-s1", 0.92, 0.85)  # head 91 ± 1, relation 82.5 ± 2.5, paired -8.5 ± 1.5
    run("mh", "pfedpm-s0", 0.50, 0.40)  # another folder: not pooled with n3
    cmd = [sys.executable, str(script), str(tmp_path / "n3"), str(tmp_path / "mh")]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    assert "| n3: pfedpm | 2 | 91.00 ± 1.00 | 82.50 ± 2.50 | -8.50 ± 1.50 |" in out
    assert "| mh: pfedpm | 1 | 50.00 | 40.00 | -10.00 |" in out
    run("old", "pfedpm-s0", 0.9, 0.8, rel_round=50)  # scores of another round, no checkpoint
    bad = subprocess.run([*cmd[:2], str(tmp_path / "old")], capture_output=True, text=True)
    assert bad.returncode == 2
    assert "no relation.json of its last round and no checkpoint" in bad.stderr


def test_compare_kept_goes_on_from_the_kept_runs(tmp_path):
    """benchmarks/compare_kept.sh: a compare kept in KEEP and lost from runs/ is continued from
    KEEP (its finished runs are not run again: their summaries are byte for byte the kept ones)
    and the new runs are kept."""
    script = Path(__file__).parents[1] / "benchmarks" / "compare_kept.sh"
    cfg = tiny_config(train={"rounds": 2}, compare={"algorithms": ["local"], "seeds": [0]})
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cfg))
    env = {
        "PFLKIT": str(Path(sys.executable).parent / "pflkit"),
        "PYTHON": sys.executable,
        "PATH": "/usr/bin:/bin",
    }

    def compare(algorithms: str) -> subprocess.CompletedProcess:
        args = ["bash", str(script), "kept", "runs/c", "c.yaml", "-q", "--algorithms", algorithms]
        return subprocess.run(args, cwd=tmp_path, env=env, capture_output=True, text=True)

    assert "kept 1 new run(s)" in compare("local").stdout
    kept = (tree(tmp_path / "kept") / "local-s0" / "summary.json").read_text()
    shutil.rmtree(tmp_path / "runs")  # a new checkout: only what was kept is left
    second = compare("local,fedavg")
    assert second.returncode == 0 and "kept 1 new run(s)" in second.stdout
    assert (tmp_path / "runs" / "c" / "local-s0" / "summary.json").read_text() == kept
    assert not (tmp_path / "runs" / "c" / "local-s0" / "run.log").exists()  # not run again
    assert sorted(p.name for p in tree(tmp_path / "kept").iterdir()) == [
        "compare.yaml",
        "fedavg-s0",
        "local-s0",
    ]


def test_compare_kept_runs_a_sweep_with_pflkit_command_sweep(tmp_path):
    """``PFLKIT_COMMAND=sweep``: the same keeping and continuing for a ``pflkit sweep``; the
    second call runs only the grid point the first did not (its first point is kept)."""
    script = Path(__file__).parents[1] / "benchmarks" / "compare_kept.sh"
    cfg = tiny_config(
        train={"rounds": 2},
        compare={"algorithms": ["fedprox"], "seeds": [0]},
        sweep={"grid": {"algorithm.mu": [0.1]}, "select": "none"},
    )
    (tmp_path / "s.yaml").write_text(yaml.safe_dump(cfg))
    env = {
        "PFLKIT": str(Path(sys.executable).parent / "pflkit"),
        "PYTHON": sys.executable,
        "PATH": "/usr/bin:/bin",
        "PFLKIT_COMMAND": "sweep",
    }

    def sweep(*extra: str) -> subprocess.CompletedProcess:
        args = ["bash", str(script), "kept", "runs/s", "s.yaml", "-q", *extra]
        return subprocess.run(args, cwd=tmp_path, env=env, capture_output=True, text=True)

    first = sweep()
    assert first.returncode == 0 and "kept 1 new run(s)" in first.stdout, first.stderr
    shutil.rmtree(tmp_path / "runs")
    second = sweep("--grid", "algorithm.mu=[0.1,0.5]")
    assert second.returncode == 0 and "kept 1 new run(s)" in second.stdout, second.stderr
    assert not (tmp_path / "runs" / "s" / "fedprox(mu=0.1)-s0" / "run.log").exists()
    assert sorted(p.name for p in tree(tmp_path / "kept").iterdir() if p.is_dir()) == [
        "fedprox(mu=0.1)-s0",
        "fedprox(mu=0.5)-s0",
    ]


def test_paper_table_rows_by_label_for_a_sweep_and_an_ablation(tmp_path):
    """Columns whose rows are settings of one method (pFedSim's rho, Table 6; GPFL's
    ablations, Table 6) match runs by their whole label: each swept value gets its own paper
    number and Delta against the default setting (rho 0.7: 95.81 - 95.70 = +0.11; rho 1:
    75.27 - 95.70 = -20.43); the GPFL column mixes ablation labels with FedPer's method row."""
    sim = tmp_path / "rho"
    _summaries(sim, "pfedsim(warmup_ratio=0.5)", "pers_acc_weighted", (0.90, 0.92))
    _summaries(sim, "pfedsim(warmup_ratio=0.7)", "pers_acc_weighted", (0.91, 0.94))  # +1, +2
    _summaries(sim, "pfedsim(warmup_ratio=1.0)", "pers_acc_weighted", (0.60, 0.62))  # -30, -30
    _, rows = _paper_table("pfedsim/rho_dir01", sim)
    assert rows["pfedsim(warmup_ratio=0.7)"][4:8] == [
        "95.81", "+1.5 ± 0.5 (n=2)", "+0.1", "reproduced |"
    ]  # fmt: skip
    assert rows["pfedsim(warmup_ratio=1.0)"][4:8] == [
        "75.27", "-30.0 ± 0.0 (n=2)", "-20.4", "reproduced |"
    ]  # fmt: skip
    assert rows["pfedsim(warmup_ratio=0.5)"][4] == "95.7"
    gp = tmp_path / "gpfl"
    _summaries(gp, "gpfl(lam=0.01,mu=0.1)", "pers_acc_weighted", (0.90, 0.90))
    _summaries(gp, "gpfl(lam=0.01,mu=0.1,use_gce=False)", "pers_acc_weighted", (0.91, 0.91))
    _summaries(gp, "fedper", "pers_acc_weighted", (0.80, 0.82))
    _, rows = _paper_table("gpfl/ablation_prac", gp)
    assert rows["gpfl(lam=0.01,mu=0.1,use_gce=False)"][4:8] == [
        "39.48", "+1.0 ± 0.0 (n=2)", "-4.2", "reversed |"
    ]  # fmt: skip
    assert rows["fedper"][4:7] == ["38.45", "-9.0 ± 1.0 (n=2)", "-5.2"]
