"""Divergence that stays finite (issue 40): a round whose mean training loss exceeds
``train.max_loss``, or whose every selected client dropped out or diverged, stops the run with
one sentence after a checkpoint of that round; resuming with the named setting goes on to the
result of a run that never stopped."""

from __future__ import annotations

import json

import pytest

from conftest import tiny_config
from pflkit.algorithms.fedavg import FedAvg
from pflkit.engine import run_experiment
from pflkit.engine.runner import diverged
from pflkit.errors import PflkitError
from pflkit.experiment import validate


def rows_of(folder):
    lines = (folder / "metrics.jsonl").read_text().splitlines()
    return [{k: v for k, v in json.loads(x).items() if not k.startswith("seconds_")} for x in lines]


@pytest.mark.parametrize(
    ("row", "train", "stops"),
    [
        ({"round": 3, "clients": [0, 1], "train_loss": 1e4}, {}, None),  # at the bound: goes on
        ({"round": 3, "clients": [0, 1], "train_loss": 10001.0}, {}, "train.max_loss=null"),
        ({"round": 3, "clients": [0, 1], "train_loss": 2e10}, {"max_loss": None}, None),
        ({"round": 3, "clients": [0, 1], "train_loss": 51.0}, {"max_loss": 50}, "train.max_loss"),
        ({"round": 3, "clients": [0, 1], "dropped_clients": [1]}, {}, None),
        ({"round": 3, "clients": [0, 1], "dropped_clients": [0, 1]}, {}, "on_empty_round"),
        ({"round": 3, "clients": [4], "diverged_clients": [4]}, {}, "on_empty_round"),
        (
            {"round": 3, "clients": [0, 1], "dropped_clients": [0], "diverged_clients": [1]},
            {},
            "train.on_empty_round=continue",
        ),
        (
            {"round": 3, "clients": [0, 1], "dropped_clients": [0, 1]},
            {"on_empty_round": "continue"},
            None,
        ),
    ],
)
def test_which_rounds_stop_a_run(row, train, stops):
    why = diverged(row, validate(tiny_config(train=train)).train)
    assert (why is None) if stops is None else (stops in why[1])


def test_a_finite_blow_up_stops_with_a_checkpoint_and_resumes_to_the_unstopped_run(
    tmp_path, monkeypatch
):
    real = FedAvg.client_update

    def blows_up_in_round_2(self, env, payload, state, ctx):
        update = real(self, env, payload, state, ctx)
        if ctx.round == 2:  # finite, far above the bound
            update.metrics["train_loss"] *= 1e9
        return update

    monkeypatch.setattr(FedAvg, "client_update", blows_up_in_round_2)
    cfg = validate(tiny_config(train={"rounds": 3}))
    with pytest.raises(PflkitError) as err:
        run_experiment(cfg, out=tmp_path / "stopped")
    assert str(err.value).startswith("round 2's mean training loss ")
    assert str(err.value).endswith(
        "exceeds train.max_loss (10000): training diverged; lower train.lr or set "
        f"train.grad_clip; stopped after round 2: to go on, pflkit run --resume "
        f"{tmp_path / 'stopped'} --set train.max_loss=null"
    )
    assert [r["round"] for r in rows_of(tmp_path / "stopped")] == [1, 2]
    resumed = run_experiment(resume=tmp_path / "stopped", overrides=["train.max_loss=null"])
    unbounded = validate(tiny_config(train={"rounds": 3, "max_loss": None}))
    whole = run_experiment(unbounded, out=tmp_path / "whole")
    assert resumed.summary["rounds"] == 3
    assert rows_of(tmp_path / "stopped") == rows_of(tmp_path / "whole")
    assert whole.rows[1]["train_loss"] > 1e4


def test_every_client_dropped_stops_unless_told_to_go_on(tmp_path):
    cfg = validate(tiny_config(system={"dropout": 0.99}))
    with pytest.raises(PflkitError, match="in round 1 every selected client dropped out"):
        run_experiment(cfg, out=tmp_path / "empty")
    go_on = validate(tiny_config(system={"dropout": 0.99}, train={"on_empty_round": "continue"}))
    assert run_experiment(go_on, out=tmp_path / "on").summary["rounds"] == 3


def test_every_client_skipped_by_on_nan_stops(tmp_path, monkeypatch):
    def nan_everywhere(self, env, payload, state, ctx):
        update = real(self, env, payload, state, ctx)
        update.metrics["train_loss"] = float("nan")
        return update

    real = FedAvg.client_update
    monkeypatch.setattr(FedAvg, "client_update", nan_everywhere)
    cfg = validate(tiny_config(train={"on_nan": "skip_client"}))
    with pytest.raises(PflkitError, match=r"every selected client .* diverged \(train.on_nan"):
        run_experiment(cfg, out=tmp_path / "skipped")


def test_a_stopped_run_prints_its_sentence_once_and_run_log_keeps_it(cli, tmp_path):
    """With plain progress (stdout not a terminal), the stop sentence is the CLI's error line
    only, not also a progress line before it; run.log records it."""
    cfg = tmp_path / "tiny.yaml"
    cfg.write_text(json.dumps(tiny_config(system={"dropout": 0.99}, output={"progress": True})))
    r = cli("run", str(cfg), "--out", "empty", cwd=tmp_path)
    sentence = "in round 1 every selected client dropped out"
    assert r.returncode == 2
    assert (r.stdout + r.stderr).count(sentence) == 1, r.stdout + r.stderr
    assert f"error: {sentence}" in r.stderr.replace("\n", " ")
    assert f"stopped: {sentence}" in (tmp_path / "empty" / "run.log").read_text()
