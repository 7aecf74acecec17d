"""Corrupt files never load silently (issue 58): a metrics.jsonl with a corrupt line is refused
by report and compare in one sentence naming the file and the line (or skipped with
--skip-corrupt, said in the table's footnote); every region of a checkpoint and of a
client-state file, flipped in turn, is refused in one sentence."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from conftest import tiny_config
from pflkit.engine import run_experiment
from pflkit.engine.checkpoint import MAGIC, load_checkpoint, save_checkpoint
from pflkit.engine.compare import run_compare
from pflkit.engine.states import ClientStates
from pflkit.errors import PflkitError
from pflkit.experiment import validate
from pflkit.report.results import make_report


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> Path:
    """A finished 3-round compare of FedAvg (seed 0) and its run folder."""
    tmp = tmp_path_factory.mktemp("corrupt")
    cfg = validate(tiny_config(train={"rounds": 3}, compare={"seeds": [0]}))
    run_compare(cfg, tmp / "cmp", progress=False, plan=[("fedavg", {"name": "fedavg"}, [])])
    return tmp / "cmp"


def damaged(finished: Path, tmp_path: Path, how: str) -> Path:
    """A copy of the compare whose run's metrics.jsonl is damaged ``how``; returns the copy."""
    copy = tmp_path / "cmp"
    shutil.copytree(finished, copy)
    path = copy / "fedavg-s0" / "metrics.jsonl"
    lines = path.read_text().splitlines(keepends=True)
    if how == "middle":
        lines[1] = lines[1][:25] + "\n"  # a torn line in the middle
    elif how == "end":
        lines[2] = lines[2][:40]  # a partial last line (the run finished: corruption)
    elif how == "not an object":
        lines[1] = "[1, 2]\n"
    elif how == "cut":
        lines = lines[:2]  # the last line gone whole: summary.json counts 3 rounds
    path.write_text("".join(lines))
    return copy


LINE = {"middle": "line 2", "end": "line 3", "not an object": "line 2", "cut": "holds 2 rows"}


@pytest.mark.parametrize("how", list(LINE))
@pytest.mark.parametrize("at", ["last", "best_test"])
def test_report_refuses_a_corrupt_metrics_file_naming_file_and_line(finished, tmp_path, how, at):
    copy = damaged(finished, tmp_path, how)
    for path in (copy, copy / "fedavg-s0"):  # the compare folder, the run folder
        with pytest.raises(PflkitError) as err:
            make_report(path, at=at)
        message = str(err.value)
        assert str(copy / "fedavg-s0" / "metrics.jsonl") in message and LINE[how] in message
        assert "--skip-corrupt" in message and "\n" not in message


@pytest.mark.parametrize("how", ["middle", "end", "cut"])
def test_skip_corrupt_reports_what_is_readable_and_says_so_in_the_footnote(finished, tmp_path, how):
    clean = make_report(finished, at="best_test")
    rep = make_report(damaged(finished, tmp_path, how), at="best_test", skip_corrupt=True)
    assert rep.tables[0].rows == clean.tables[0].rows  # the numbers: summary.json's
    assert not clean.notes and len(rep.notes) == 1
    expected = {"middle": "corrupt lines 2;", "end": "corrupt lines 3;", "cut": "lines none;"}
    assert expected[how] in rep.notes[0] and "missing rounds: 1" in rep.notes[0]
    assert rep.notes[0] in rep.markdown() and rep.notes[0] in rep.latex()
    assert len(rep.settings[0].runs[0].rows) == 2


def test_compare_refuses_a_corrupt_finished_run_unless_told_to_skip_it(finished, tmp_path):
    copy = damaged(finished, tmp_path, "middle")
    cfg = validate(tiny_config(train={"rounds": 3}, compare={"seeds": [0]}))
    plan = [("fedavg", {"name": "fedavg"}, [])]
    with pytest.raises(PflkitError, match="corrupt line 2"):
        run_compare(cfg, copy, progress=False, plan=plan)
    res = run_compare(cfg, copy, progress=False, plan=plan, skip_corrupt=True)
    assert "Note (--skip-corrupt)" in res["table"] and "corrupt lines 2" in res["table"]


def test_the_cli_says_it_in_one_line_and_exits_2(finished, tmp_path, cli):
    copy = damaged(finished, tmp_path, "end")
    r = cli("report", str(copy), "--at", "best_test", cwd=tmp_path)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "corrupt line 3" in r.stderr and r.stdout == ""
    r = cli("report", str(copy), "--skip-corrupt", cwd=tmp_path)
    assert r.returncode == 0 and "Note (--skip-corrupt)" in r.stdout, r.stderr


# -- checkpoints -------------------------------------------------------------------------------


def checkpoint_regions(data: bytes) -> dict[str, int | None]:
    """Offsets of one byte in each region of a checkpoint file (None: the file cut in half)."""
    newline = data.index(b"\n")
    zip_start = newline + 1
    payload = data[zip_start:]
    tensor = payload.index(torch.arange(64, dtype=torch.float32).numpy().tobytes()[:16])
    central = payload.rindex(b"PK\x01\x02")  # the zip archive's central directory
    return {
        "magic": 2,
        "digest": len(MAGIC) + 10,
        "header newline": newline,
        "zip local header": zip_start + 2,
        "pickled structure": zip_start + payload.index(b"round"),
        "tensor data": zip_start + tensor + 8,
        "zip central directory": zip_start + central + 20,
        "last byte": len(data) - 1,
        "cut in half": None,
    }


def test_every_region_of_a_checkpoint_flipped_is_refused_in_one_sentence(tmp_path):
    path = tmp_path / "latest.pt"
    state = {"round": 3, "server": {"w": torch.arange(64, dtype=torch.float32)}}
    save_checkpoint(path, state)
    data = path.read_bytes()
    assert torch.equal(load_checkpoint(path)["server"]["w"], state["server"]["w"])
    for region, offset in checkpoint_regions(data).items():
        blob = bytearray(data)
        if offset is None:
            blob = blob[: len(blob) // 2]
        else:
            blob[offset] ^= 0x01
        path.write_bytes(bytes(blob))
        with pytest.raises(PflkitError) as err:
            load_checkpoint(path)
        message = str(err.value)
        assert "\n" not in message and str(path) in message, (region, message)
        assert "checksum" in message or "damaged header" in message, (region, message)


# -- client-state files ------------------------------------------------------------------------


def state_regions(data: bytes) -> dict[str, int | None]:
    """Offsets of one byte in each region of a safetensors state file."""
    size = int.from_bytes(data[:8], "little")
    header = data[8 : 8 + size]
    return {
        "header length": 0,
        "header JSON": 8 + header.index(b"dtype") + 1,
        "metadata (schema)": 8 + header.index(b"__metadata__") + 14 + 5,
        "tensor data": 8 + size + 4,
        "last byte": len(data) - 1,
        "cut in half": None,
    }


def test_every_region_of_a_state_file_flipped_is_refused_never_reinitialised(tmp_path):
    inits: list[int] = []

    def init(cid: int) -> dict:
        inits.append(cid)
        return {"w": torch.zeros(16)}

    store = ClientStates(init, memory=0, folder=tmp_path)
    store[0] = {"w": torch.arange(16.0), "note": "x"}
    index = store.commit()
    store.committed(index)
    (path,) = tmp_path.glob("*.safetensors")
    data = path.read_bytes()
    for region, offset in state_regions(data).items():
        blob = bytearray(data)
        if offset is None:
            blob = blob[: len(blob) // 2]
        else:
            blob[offset] ^= 0x01
        path.write_bytes(bytes(blob))
        again = ClientStates(init, memory=0, folder=tmp_path)
        again.restore(index, prune=False)
        with pytest.raises(PflkitError) as err:
            again.get_or_init(0)
        message = str(err.value)
        assert "fails its checksum" in message and "\n" not in message, (region, message)
        again.close()
    path.unlink()
    again = ClientStates(init, memory=0, folder=tmp_path)
    with pytest.raises(PflkitError, match="which is missing"):
        again.restore(index)
    assert inits == []  # no state was replaced by its init
    store.close()


def test_a_run_whose_whole_states_folder_is_gone_is_refused_at_resume(tmp_path):
    """Before: the resume started and failed in the middle of its first round."""
    raw = tiny_config(
        algorithm={"name": "ditto"},
        engine={"state_memory": 0},
        train={"rounds": 2},
        output={"checkpoint_every": 1, "progress": False},
    )
    run = run_experiment(validate(raw), out=tmp_path / "run")
    shutil.rmtree(run.run_dir / "states")
    with pytest.raises(PflkitError, match="which is missing"):
        run_experiment(resume=run.run_dir, overrides=["train.rounds=3"])
    assert len((run.run_dir / "metrics.jsonl").read_text().splitlines()) == 2
