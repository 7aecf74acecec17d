"""The example configs bundled with pflkit (pflkit.examples): listed with a description,
copied, run by name; shipped in the wheel (package data); the version the wheel, --version and
provenance show. The wheel itself is installed and run by make wheel-check (.ci/wheel-check)."""

from __future__ import annotations

import fnmatch
import json
import subprocess
import tomllib
from pathlib import Path

import pytest

import pflkit
from pflkit.examples import EXAMPLES_DIR, examples
from pflkit.experiment import load_config

REPO = Path(__file__).resolve().parents[1]
FILES = sorted(EXAMPLES_DIR.rglob("*.yaml"))


def test_the_repositorys_configs_folder_is_the_bundled_one():
    assert (REPO / "configs").is_symlink()
    assert (REPO / "configs").resolve() == EXAMPLES_DIR
    assert len(FILES) >= 50


def test_every_example_is_listed_with_its_first_line():
    listed = examples()
    assert list(listed) == sorted(
        p.relative_to(EXAMPLES_DIR).with_suffix("").as_posix() for p in FILES
    )
    for path in FILES:
        first = path.read_text(encoding="utf-8").splitlines()[0]
        name = path.relative_to(EXAMPLES_DIR).with_suffix("").as_posix()
        assert first.startswith("# ") and len(first) <= 102, f"{name}: {first!r}"
        assert listed[name] == first[2:]
    assert listed["quickstart_digits"].startswith("The quick start offline")


def test_every_example_is_package_data_of_the_wheel():
    """pyproject's package-data globs (what the wheel holds) match every bundled file."""
    globs = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"][
        "package-data"
    ]["pflkit"]
    package = EXAMPLES_DIR.parent
    for path in FILES:
        rel = path.relative_to(package).as_posix()
        assert any(fnmatch.fnmatch(rel, g) and rel.count("/") == g.count("/") for g in globs), rel


def test_the_version_comes_from_one_place():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    assert "version" in project["project"]["dynamic"]
    assert project["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "pflkit.__version__"}


def test_a_name_loads_the_bundled_file():
    assert load_config("quickstart") == load_config(REPO / "configs" / "quickstart.yaml")
    assert (
        load_config("gpfl/fmnist_practical_cpu").name
        == load_config(EXAMPLES_DIR / "gpfl" / "fmnist_practical_cpu.yaml").name
    )


def test_examples_lists_names_and_descriptions(cli, tmp_path):
    r = cli("examples", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert len(lines) == len(FILES)
    width = max(map(len, examples()))
    assert f"{'quickstart':<{width}}  {examples()['quickstart']}" in lines


def test_copy_writes_the_file_and_never_overwrites(cli, tmp_path):
    r = cli("examples", "copy", "gpfl/har", "mine", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    copied = tmp_path / "mine" / "har.yaml"
    assert copied.read_bytes() == (EXAMPLES_DIR / "gpfl" / "har.yaml").read_bytes()
    copied.write_text("edited")
    r = cli("examples", "copy", "gpfl/har", "mine", cwd=tmp_path)
    assert r.returncode == 2
    assert r.stderr.strip() == (
        f"error: '{Path('mine') / 'har.yaml'}' exists already: remove it, or copy into another folder"
    )
    assert copied.read_text() == "edited"


@pytest.mark.parametrize("command", [("examples", "copy", "quickstrt", "d"), ("run", "quickstrt")])
def test_an_unknown_example_is_one_sentence(cli, tmp_path, command):
    r = cli(*command, cwd=tmp_path)
    assert r.returncode == 2
    assert r.stderr.strip() == (
        "error: unknown example 'quickstrt': did you mean 'quickstart'? (`pflkit examples` shows all)"
    )
    assert list(tmp_path.iterdir()) == []


def test_a_repository_path_outside_a_clone_names_the_example(cli, tmp_path):
    r = cli("run", "configs/pfedsim/fmnist_dir01.yaml", cwd=tmp_path)
    assert r.returncode == 2
    assert r.stderr.strip() == (
        "error: config file 'configs/pfedsim/fmnist_dir01.yaml' does not exist here; it is the "
        "bundled example 'pfedsim/fmnist_dir01': give that name instead (e.g. pflkit run "
        "pfedsim/fmnist_dir01)"
    )


def test_a_local_file_wins_over_an_example_of_the_same_name(cli, tmp_path):
    (tmp_path / "quickstart").write_text("name: [not a name\n")
    r = cli("run", "quickstart", cwd=tmp_path)
    assert r.returncode == 2 and "config file 'quickstart' is not valid YAML" in r.stderr


def test_run_by_name_from_anywhere(cli, tmp_path):
    r = cli(
        "run", "quickstart_digits", "--set", "train.rounds=1", "--set", "engine.workers=1",
        "--out", "run", "-q", cwd=tmp_path,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["name"] == "quickstart-digits" and summary["rounds"] == 1


def test_version(cli, tmp_path):
    r = cli("--version", cwd=tmp_path)
    assert r.returncode == 0 and r.stdout.strip() == f"pflkit {pflkit.__version__}"


def test_provenance_has_no_commit_for_files_another_repository_does_not_track(
    tmp_path, monkeypatch
):
    """An installed pflkit inside a venv inside some git repository: that repository's commit
    is not pflkit's. Once the files are tracked, the commit is reported."""
    from pflkit.report import provenance

    def git(*args):
        subprocess.run(["git", *args], cwd=tmp_path, check=True, capture_output=True)

    git("init", "-q")
    git("-c", "user.email=t@t", "-c", "user.name=t", "commit", "-q", "--allow-empty", "-m", "x")
    package = tmp_path / "venv" / "site-packages" / "pflkit"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    monkeypatch.setattr(pflkit, "__file__", str(package / "__init__.py"))
    assert provenance.git_commit() is None
    git("add", ".")
    git("-c", "user.email=t@t", "-c", "user.name=t", "commit", "-q", "-m", "y")
    head = subprocess.run(
        ["git", "rev-parse", "HEAD"], cwd=tmp_path, capture_output=True, text=True
    ).stdout.strip()
    assert provenance.git_commit() == {"commit": head, "dirty": False}
