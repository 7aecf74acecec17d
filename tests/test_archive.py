"""Run archives (:mod:`pflkit.report.archive`): a folder of runs packed into one deterministic
zip and read in place, with the same files, order and table as the folder."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from pflkit.errors import PflkitError
from pflkit.report.archive import files, pack, tree, unpack


def _runs(root: Path) -> None:
    for name in ("fedavg-s1", "fedavg-s0", "local-s0", "notes"):
        (root / name).mkdir(parents=True)
        (root / name / "summary.json").write_text(f'{{"run": "{name}"}}\n')
    (root / "local-s0" / "metrics.jsonl").write_text('{"round": 1}\n')
    (root / "compare.yaml").write_text("name: x\n")


def test_pack_is_deterministic_and_keeps_every_file(tmp_path):
    _runs(tmp_path / "t")
    first = pack(tmp_path / "t").read_bytes()
    os.utime(tmp_path / "t" / "compare.yaml", (0, 1e9))  # another mtime: the same bytes
    assert pack(tmp_path / "t").read_bytes() == first
    with zipfile.ZipFile(tmp_path / "t.zip") as z:
        assert z.namelist() == sorted(z.namelist())
        assert set(z.namelist()) == {
            "compare.yaml",
            "fedavg-s0/summary.json",
            "fedavg-s1/summary.json",
            "local-s0/metrics.jsonl",
            "local-s0/summary.json",
            "notes/summary.json",
        }
        assert z.read("local-s0/metrics.jsonl") == b'{"round": 1}\n'


def test_files_in_an_archive_are_the_folders_glob_in_the_same_order(tmp_path):
    _runs(tmp_path / "t")
    folder = sorted((tmp_path / "t").glob("*-s*/summary.json"))
    pack(tmp_path / "t")
    packed = files(tmp_path / "t.zip", "summary.json")
    assert [p.parent.name for p in packed] == [p.parent.name for p in folder]
    assert [p.read_text() for p in packed] == [p.read_text() for p in folder]
    assert [p.parent.name for p in files(tmp_path / "t.zip", "metrics.jsonl", "*")] == ["local-s0"]


def test_a_folder_name_reads_its_archive_only_when_the_folder_is_gone(tmp_path):
    _runs(tmp_path / "t")
    pack(tmp_path / "t")
    assert tree(tmp_path / "t") == tmp_path / "t"  # the folder is there: it wins
    (tmp_path / "t" / "compare.yaml").unlink()
    (tmp_path / "t" / "fedavg-s0" / "summary.json").unlink()
    (tmp_path / "t" / "fedavg-s0").rmdir()
    assert [p.parent.name for p in files(tmp_path / "t", "summary.json")] == [
        "fedavg-s1",
        "local-s0",
    ]
    os.rename(tmp_path / "t", tmp_path / "gone")
    inside = tree(tmp_path / "t")
    assert isinstance(inside, zipfile.Path) and (inside / "compare.yaml").is_file()
    assert tree(tmp_path / "missing") == tmp_path / "missing"  # not there: unchanged


def test_a_damaged_archive_is_one_sentence(tmp_path):
    (tmp_path / "t.zip").write_bytes(b"PK\x03\x04 not a zip")
    with pytest.raises(PflkitError, match=r"^the run archive '.*t\.zip' cannot be read"):
        tree(tmp_path / "t")


def test_unpack_refuses_a_member_outside_the_folder(tmp_path):
    with zipfile.ZipFile(tmp_path / "evil.zip", "w") as z:
        z.writestr("../escaped.txt", "x")
    with pytest.raises(PflkitError, match="outside it"):
        unpack(tmp_path / "evil.zip", tmp_path / "out")
    assert not (tmp_path / "escaped.txt").exists()


def test_the_command_line_packs_and_unpacks_and_names_its_usage(tmp_path):
    _runs(tmp_path / "t")

    def archive(*args: str) -> subprocess.CompletedProcess:
        cmd = [sys.executable, "-m", "pflkit.report.archive", *args]
        return subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path)

    assert archive("pack", "t", "kept.zip").returncode == 0
    assert archive("unpack", "kept.zip", "back").returncode == 0
    assert (tmp_path / "back" / "local-s0" / "metrics.jsonl").read_text() == '{"round": 1}\n'
    bad = archive("pack", "nowhere")
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "got: pack nowhere" in bad.stderr
