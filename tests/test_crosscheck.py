"""The cross-check harness's parsing and verdict (benchmarks/crosscheck/crosscheck.py), on a
hand-written PFLlib log and hand-computed statistics."""

import importlib.util
import math
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parents[1] / "benchmarks" / "crosscheck"


@pytest.fixture(scope="module")
def xc():
    sys.path.insert(0, str(HERE))
    spec = importlib.util.spec_from_file_location("crosscheck_under_test", HERE / "crosscheck.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    yield module
    sys.path.remove(str(HERE))


PFLLIB_LOG = """
============= Running time: 0th =============
Creating server and clients ...
-------------Round number: 0-------------
Evaluate global models
Averaged Test Accuracy: 0.1000
-------------Round number: 1-------------
Evaluate global models
Averaged Test Accuracy: 0.2000
Evaluate personalized models
Averaged Test Accuracy: 0.3000
Best accuracy.
0.3
============= Running time: 1th =============
-------------Round number: 0-------------
Averaged Test Accuracy: 0.1500
-------------Round number: 1-------------
Averaged Test Accuracy: 0.2500
============= Running time: 2th =============
-------------Round number: 0-------------
Evaluate personalized model
Average Test Accuracy: 0.3500
"""


def test_pfllib_log_gives_one_curve_per_repetition_with_the_last_accuracy_of_a_round(xc):
    assert xc.parse_pfllib(PFLLIB_LOG) == [{0: 0.1, 1: 0.3}, {0: 0.15, 1: 0.25}, {0: 0.35}]


def test_verdict_is_welch_two_standard_errors(xc):
    a, b = [0.70, 0.72, 0.74], [0.75, 0.76, 0.77]
    # means 0.72 and 0.76; sample variances 0.0004 and 0.0001; se = sqrt(0.0004/3 + 0.0001/3)
    se = math.sqrt(0.0005 / 3)
    diff, got_se, verdict = xc.verdict(a, b)
    assert diff == pytest.approx(0.04) and got_se == pytest.approx(se)
    assert verdict == "differs"  # 0.04 > 2 * 0.0129
    assert xc.verdict(a, [0.71, 0.73, 0.75])[2] == "within noise"  # 0.01 <= 2 * se


def test_last_mean_takes_the_last_rounds(xc):
    assert xc.last_mean({1: 0.1, 2: 0.2, 3: 0.3, 4: 0.5}, 2) == pytest.approx(0.4)


def test_pfllib_command_passes_the_shared_settings_and_the_case_arguments(xc):
    import yaml

    cfg = yaml.safe_load((HERE / "fmnist_practical_xc.yaml").read_text())
    cmd = xc.pfllib_command(xc.CASES["fedrep"], cfg, "FMNIST-xc", 3)
    args = dict(zip(cmd[1::2], cmd[2::2], strict=False))
    assert args["-algo"] == "FedRep" and args["-pls"] == "1"
    assert (args["-nc"], args["-lbs"], args["-lr"], args["-ls"]) == ("20", "10", "0.005", "1")
    assert (args["-gr"], args["-eg"], args["-t"], args["-jr"]) == ("50", "1", "3", "1.0")
    assert xc.CASES["fedrep"].pflkit == {"name": "fedrep", "head_epochs": 1}


def test_an_unknown_case_exits_2_with_one_sentence(xc, tmp_path, capsys):
    assert xc.main(["--algorithms", "fedavgg", "--out", str(tmp_path / "x")]) == 2
    assert "unknown case(s) fedavgg" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


def test_summary_row_from_a_results_file(xc, tmp_path):
    row = {
        "algorithm": "fedrep",
        "reference": [0.80, 0.82, 0.84],
        "pflkit": [0.81, 0.83, 0.85],
        "diff": 0.01,
        "se": 0.0163,
        "verdict": "within noise",
        "seconds_reference": 300.4,
        "seconds_pflkit": 200.6,
        "ref_commit": "d832e76",
    }
    path = tmp_path / "results.jsonl"
    path.write_text(__import__("json").dumps(row) + "\n")
    line = xc.summary([path]).splitlines()[-1]
    assert line == (
        "| fedrep | pfllib FedRep (d832e76) | head_epochs=1 | 82.00 ± 2.00 | 83.00 ± 2.00 | "
        "+1.00 ± 1.63 | within noise | 300 / 201 |"
    )
    # a case run again (here with PFLlib's drop_last): its last row is the table's
    again = {**row, "verdict": "differs", "options": "head_epochs=1, train.drop_last=True"}
    path.write_text("".join(__import__("json").dumps(r) + "\n" for r in (row, again)))
    lines = xc.summary([path]).splitlines()
    assert len(lines) == 3 and "| head_epochs=1, train.drop_last=True |" in lines[-1]
    assert "| differs |" in lines[-1]


def test_pflkit_options_name_the_case_settings_and_drop_last(xc):
    cfg = {"train": {"drop_last": True}}
    assert xc.pflkit_options(xc.CASES["perfedavg"], cfg) == (
        "weighting=samples, train.local_epochs=2, train.drop_last=True"
    )
    assert xc.pflkit_options(xc.CASES["fedavg"], {"train": {}}) == ""


def test_a_case_with_other_settings_reaches_the_pflkit_config(xc, tmp_path, monkeypatch):
    import yaml

    written = {}
    monkeypatch.setattr(xc.subprocess, "run", lambda *a, **k: written.setdefault("cmd", a))
    cfg = {"train": {"lr": 0.01, "rounds": 2}, "algorithm": {"name": "fedavg"}}
    with pytest.raises(RuntimeError, match="0 run folders for seed 0"):  # the fake wrote none
        (tmp_path / "feddyn-pflkit").mkdir()
        xc.run_pflkit(xc.CASES["feddyn"], cfg, tmp_path, 2)
    got = yaml.safe_load((tmp_path / "feddyn-pflkit.yaml").read_text())
    assert got["train"] == {"lr": 0.01, "rounds": 2, "grad_clip": 10.0, "max_loss": None}
    assert got["algorithm"] == xc.CASES["feddyn"].pflkit
    assert got["algorithm"]["clip_on"] == "total"  # FL-bench clips after FedDyn's terms
    assert got["compare"]["algorithms"] == [got["algorithm"]] and got["compare"]["seeds"] == [0, 1]


def test_every_case_gives_a_pflkit_config_that_plans(xc):
    """Each case's pflkit side (its library's config, settings and options) is a valid compare:
    a clash such as an algorithm's weighting against the config's train.weighting fails here,
    not an hour into a cross-check."""
    import yaml

    from pflkit.engine.compare import compare_plan
    from pflkit.experiment import validate

    for key, case in xc.CASES.items():
        shared = yaml.safe_load(xc.CONFIGS[case.library].read_text())
        cfg = validate(xc.pflkit_config(case, shared, 3))
        assert [a for _, a, _ in compare_plan(cfg)] == [case.pflkit], key


FLBENCH_LOG = """
==================== FedAvg Experiment Results: ====================
{
    "1": {
        "all_clients": {
            "test": {
                "loss": "2.2667 -> 0.0000",
                "accuracy": "20.25% -> 0.00%"
            }
        }
    },
    "2": {
        "all_clients": {
            "test": {
                "loss": "2.2168 -> 0.0000",
                "accuracy": "18.78% -> 0.00%"
            }
        }
    }
}
(test) before fine-tuning: 20.25% at epoch 1
"""


def test_flbench_log_gives_the_accuracy_before_fine_tuning_per_round(xc):
    assert xc.parse_flbench(FLBENCH_LOG) == pytest.approx({1: 0.2025, 2: 0.1878})


def test_flbench_command_maps_the_shared_settings(xc):
    import yaml

    cfg = yaml.safe_load((HERE / "fmnist_dir01_xc.yaml").read_text())
    cmd = xc.flbench_command(xc.CASES["pfedsim"], cfg, 2)
    for arg in ("method=pfedsim", "model.name=lenet5", "common.seed=2", "common.join_ratio=0.1",
                "common.global_epoch=100", "common.local_epoch=5", "common.batch_size=32",
                "optimizer.lr=0.01", "pfedsim.warmup_round=0.5"):  # fmt: skip
        assert arg in cmd
    cfg["model"]["options"] = {}
    with pytest.raises(xc.Usage, match="fc_relu"):
        xc.flbench_command(xc.CASES["pfedsim"], cfg, 0)


def test_a_reference_that_scores_after_training_is_shifted_one_round(xc):
    """PFLlib's FedPHP prints round r for the model pflkit scores at round r + 1; its extra
    round (r = rounds) has no pflkit counterpart."""
    assert xc.CASES["fedphp"].round_shift == 1 and xc.CASES["fedavg"].round_shift == 0
    curve = {0: 0.1, 1: 0.5, 2: 0.6, 3: 0.7}
    assert xc.aligned(curve, 1, 3) == {1: 0.1, 2: 0.5, 3: 0.6}
    assert xc.aligned(curve, 0, 3) == curve


def _fake_pfllib_system(root: Path, main_calls: int = 1) -> Path:
    system = root / "system"
    (system / "flcore" / "clients").mkdir(parents=True)
    (system / "main.py").write_text("import torch\n" + "torch.manual_seed(0)\n" * main_calls)
    (system / "flcore" / "clients" / "clientbase.py").write_text(
        "class Client:\n    def __init__(self):\n        torch.manual_seed(0)\n"
    )
    return system


def test_seeded_copy_seeds_both_of_pfllibs_calls_and_leaves_the_original(xc, tmp_path):
    system = _fake_pfllib_system(tmp_path)
    copy = xc.seeded_copy(system, 4)
    assert copy == tmp_path / "system-seed4"
    assert (copy / "main.py").read_text() == "import torch\ntorch.manual_seed(4)\n"
    assert "        torch.manual_seed(4)\n" in (copy / "flcore/clients/clientbase.py").read_text()
    assert "torch.manual_seed(0)" in (system / "main.py").read_text()


def test_seeded_copy_refuses_a_checkout_whose_seed_call_is_not_there_once(xc, tmp_path):
    system = _fake_pfllib_system(tmp_path, main_calls=2)
    with pytest.raises(xc.Usage, match="main.py does not call torch.manual_seed"):
        xc.seeded_copy(system, 1)


def test_independent_seeds_with_an_flbench_case_exits_2(xc, tmp_path, capsys):
    argv = ["--algorithms", "local,fedbn", "--independent-seeds", "--out", str(tmp_path / "x")]
    assert xc.main(argv) == 2
    err = capsys.readouterr().err
    assert "--independent-seeds applies to PFLlib cases only (fedbn run FL-bench" in err
    assert not (tmp_path / "x").exists()


def test_a_row_with_independent_seeds_is_its_own_line_of_the_summary(xc, tmp_path):
    import json

    row = {
        "algorithm": "local",
        "reference": [0.90, 0.92],
        "pflkit": [0.91, 0.93],
        "diff": 0.01,
        "se": 0.02,
        "verdict": "within noise",
        "seconds_reference": 1.0,
        "seconds_pflkit": 1.0,
    }
    path = tmp_path / "results.jsonl"
    path.write_text(json.dumps(row) + "\n" + json.dumps({**row, "reference_seeds": "independent"}))
    lines = xc.summary([path]).splitlines()[2:]
    assert [x.split(" | ")[0] for x in lines] == ["| local", "| local (independent seeds)"]


def test_a_reference_curve_may_start_late_but_not_stop_early_or_skip(xc):
    assert xc.complete({r: 0.5 for r in range(1, 101)}, 100)
    assert xc.complete({r: 0.5 for r in range(51, 101)}, 100)  # f-FedAP after pre-training
    assert not xc.complete({r: 0.5 for r in range(1, 100)}, 100)  # stopped at round 99
    assert not xc.complete({r: 0.5 for r in range(1, 101) if r != 60}, 100)  # a gap
    assert not xc.complete({}, 100)


def test_commit_names_only_a_checkout_of_its_own(xc, tmp_path):
    """A reference folder copied inside another repository is "unknown", not that
    repository's commit."""
    import subprocess

    repo = tmp_path / "ref"
    (repo / "system").mkdir(parents=True)
    git = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git[:3], "init", "-q"], check=True)
    (repo / "system" / "main.py").write_text("")
    subprocess.run([*git, "add", "."], check=True)
    subprocess.run([*git, "commit", "-qm", "x"], check=True)
    head = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    assert xc.commit(repo) == head.stdout.strip()
    assert xc.commit(repo / "system") == "unknown"
    assert xc.commit(tmp_path) == "unknown"


def test_commit_of_a_copy_is_its_commit_file(xc, tmp_path):
    """A copy carried without git (benchmarks/gpu_kit.sh's PFLlib/) names the commit its
    COMMIT file records, also inside another repository."""
    copy = tmp_path / "kit" / "PFLlib"
    (copy / "system").mkdir(parents=True)
    (copy / "COMMIT").write_text("d832e76\n")
    assert xc.commit(copy) == "d832e76"
    (copy / "COMMIT").write_text("\n")
    assert xc.commit(copy) == "unknown"


def test_pflkit_option_changes_one_cases_pflkit_side(xc, tmp_path, capsys):
    """``--pflkit-option KEY=VALUE`` (values as YAML) changes the algorithm section of one
    case's pflkit side; more cases, or an item that is not KEY=VALUE, exit 2 before anything
    runs."""
    assert xc.pflkit_overrides(["gen_labels=seen", "gen_lr_decay=1.0"]) == {
        "gen_labels": "seen",
        "gen_lr_decay": 1.0,
    }
    for argv, message in (
        (["--algorithms", "fedgen,fedavg", "--pflkit-option", "eta=1"], "give one case"),
        (["--algorithms", "fedgen", "--pflkit-option", "eta"], "'eta' is not KEY=VALUE"),
        (["--algorithms", "fedgen", "--pflkit-option", "name=fedavg"], "is not KEY=VALUE"),
    ):
        assert xc.main([*argv, "--out", str(tmp_path / "x")]) == 2
        assert message in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


def test_pflkit_option_reaches_the_pflkit_config_and_the_row(xc, tmp_path, monkeypatch):
    import json

    import yaml

    monkeypatch.setattr(xc, "load_reference", lambda path: ([{1: 0.5}, {1: 0.6}], 1.0))
    monkeypatch.setattr(xc, "run_pflkit", lambda case, cfg, out, seeds: ([{1: 0.5}, {1: 0.6}], 1.0))
    out = tmp_path / "x"
    out.mkdir()
    (out / "fedgen-reference.json").write_text("{}")
    argv = ["--algorithms", "fedgen", "--flbench", str(tmp_path), "--seeds", "2", "--out", str(out)]
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump({"train": {"rounds": 1}, "algorithm": {"name": "fedavg"}}))
    assert xc.main([*argv, "--config", str(cfg), "--pflkit-option", "gen_labels=seen"]) == 0
    row = json.loads((out / "results.jsonl").read_text())
    assert "gen_labels=seen" in row["options"] and "client_gen_mode=train" in row["options"]
