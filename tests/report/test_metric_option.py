"""``pflkit report --metric`` and ``pflkit compare --metric`` with the metrics of eval.metrics
(pflkit.report.results.canonical_metric): names and fields, lower-is-better, bad names."""

from __future__ import annotations

import json

import pytest
import yaml

from conftest import tiny_config
from pflkit.engine.runner import run_experiment
from pflkit.experiment import validate

pytestmark = pytest.mark.usefixtures("one_thread")

METRICS = ["accuracy", "loss", "f1_macro"]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("metric") / "run"
    run_experiment(validate(tiny_config(eval={"metrics": METRICS})), out=out)
    return out


def table_cells(text: str, column: str) -> list[str]:
    """The cells of ``column`` in the first markdown table of ``text``."""
    lines = [line for line in text.splitlines() if line.startswith("|")]
    head = [c.strip() for c in lines[0].strip("|").split("|")]
    i = head.index(column)
    return [[c.strip() for c in line.strip("|").split("|")][i] for line in lines[2:]]


def test_report_metric_by_name_and_by_field(cli, run_dir, tmp_path):
    final = json.loads((run_dir / "summary.json").read_text())["final"]
    res = cli("report", str(run_dir), "--metric", "loss", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    # a loss is shown as it is, not in %
    assert table_cells(res.stdout, "personalized loss") == [f"{final['pers_loss_mean']:.2f} ± 0.00"]
    assert "best setting on personalized loss" in res.stdout
    res = cli("report", str(run_dir), "--metric", "pers_f1_macro_weighted", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    cells = table_cells(res.stdout, "pooled f1 macro (%)")
    assert cells == [f"{100 * final['pers_f1_macro_weighted']:.2f} ± 0.00"]
    res = cli("report", str(run_dir), "--metric", "global_loss", "--format", "json", cwd=tmp_path)
    numbers = json.loads(res.stdout)
    (setting,) = numbers.values()
    assert setting["final"]["global_loss"] == [final["global_loss"]]


@pytest.mark.parametrize("bad", ["f1", "pers_ece_mean"])  # ece: registered, not in these runs
def test_report_refuses_a_metric_it_cannot_show(cli, run_dir, tmp_path, bad):
    res = cli("report", str(run_dir), "--metric", bad, cwd=tmp_path)
    if bad == "f1":
        assert res.returncode == 2
        assert f"unknown metric '{bad}': use a metric name (accuracy, balanced_accuracy" in (
            res.stderr
        )
        assert len(res.stderr.strip().splitlines()) == 1
    else:  # a registered metric the runs did not choose: an empty column, not an error
        assert res.returncode == 0 and table_cells(res.stdout, "personalized ece (%)") == ["–"]


def test_compare_metric_picks_the_lowest_loss(cli, tmp_path):
    raw = tiny_config(
        eval={"metrics": ["accuracy", "loss"]},
        compare={"algorithms": ["local", "fedavg"], "seeds": [0, 1]},
    )
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(raw))
    out = tmp_path / "cmp"
    res = cli(
        "compare", "c.yaml", "--metric", "pers_loss_weighted", "--out", str(out), cwd=tmp_path
    )
    assert res.returncode == 0, res.stderr
    losses = {}
    for label in ("local", "fedavg"):
        finals = [
            json.loads((out / f"{label}-s{s}" / "summary.json").read_text())["final"]
            for s in (0, 1)
        ]
        losses[label] = sum(f["pers_loss_weighted"] for f in finals) / 2
    best = min(losses, key=losses.get)
    lines = {line.split("|")[1].strip(): line for line in res.stdout.splitlines() if "|" in line}
    assert "| best |" in lines[best]
    assert json.loads((out / "plan.json").read_text())["options"] == {
        "metric": "pers_loss_weighted"
    }
    # the folder's report keeps the compare's metric
    again = cli("report", str(out), cwd=tmp_path)
    assert "pooled loss" in again.stdout


def test_compare_refuses_an_unknown_metric_before_running(cli, tmp_path):
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(tiny_config()))
    res = cli("compare", "c.yaml", "--metric", "macro_f1", "--out", "cmp", cwd=tmp_path)
    assert res.returncode == 2 and "unknown metric 'macro_f1'" in res.stderr
    assert not (tmp_path / "cmp").exists()


def test_run_prints_a_loss_as_it_is_and_accuracy_in_percent(cli, tmp_path):
    raw = tiny_config(eval={"metrics": ["accuracy", "loss"]})
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(raw))
    res = cli("run", "c.yaml", "--out", "run", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    final = json.loads((tmp_path / "run" / "summary.json").read_text())["final"]
    assert f"pers_loss_mean {final['pers_loss_mean']:g}," in res.stdout
    assert f"pers_acc_mean {100 * final['pers_acc_mean']:.2f}%" in res.stdout
