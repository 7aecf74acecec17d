"""benchmarks/gpu_kit.sh and benchmarks/gpu_env.sh: the kit a lent GPU machine is given (the
wheels, data and PFLlib it lacks) and its use there. Nothing here downloads: the refusals come
before any download, and gpu_env.sh is sourced with a kit that holds no wheels."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _kit(tmp_path: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(ROOT / "benchmarks" / "gpu_kit.sh"), *args],
        cwd=ROOT,
        env={**os.environ, "PYTHON": sys.executable, **env},
        capture_output=True,
        text=True,
    )


def _fmnist(folder: Path) -> Path:
    folder.mkdir(parents=True)
    for name in ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz"):
        (folder / name).write_bytes(b"")
    return folder


def test_a_folder_without_pfllibs_code_is_refused_before_anything_is_written(tmp_path):
    data = tmp_path / "data"
    _fmnist(data / "fashion_mnist")
    kit = tmp_path / "kit"
    r = _kit(tmp_path, str(kit), PFLLIB=str(tmp_path), PFLKIT_DATA=str(data))
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [
        f"gpu_kit.sh: PFLLIB={tmp_path} has no system/main.py: give a PFLlib checkout "
        "(git clone https://github.com/TsingZ0/PFLlib)"
    ]
    assert not kit.exists()


def test_no_fashion_mnist_is_refused_in_one_sentence(tmp_path):
    kit = tmp_path / "kit"
    r = _kit(
        tmp_path,
        str(kit),
        PFLKIT_DATA=str(tmp_path / "empty"),
        FMNIST_SYSTEM=str(tmp_path / "none"),
    )
    assert r.returncode == 2
    assert len(r.stderr.strip().splitlines()) == 1
    assert "no Fashion-MNIST files found" in r.stderr and "dataset-fashion-mnist" in r.stderr
    assert not kit.exists()


def _source_env(tmp_path: Path, kit: Path, **env: str) -> dict[str, str]:
    """The variables gpu_env.sh leaves, sourced from the repository's root as the scripts do."""
    script = f'PY="{sys.executable}"; source benchmarks/gpu_env.sh; env -0'
    r = subprocess.run(
        ["bash", "-c", script],
        cwd=ROOT,
        env={**os.environ, "GPUKIT": str(kit), **env},
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stderr
    return dict(line.split("=", 1) for line in r.stdout.split("\0") if "=" in line)


def test_the_carried_kit_gives_the_data_pfllib_and_pflkit_from_src(tmp_path):
    kit = tmp_path / "kit"
    _fmnist(kit / "data" / "fashion_mnist")
    (kit / "PFLlib" / "system").mkdir(parents=True)
    (kit / "PFLlib" / "system" / "main.py").write_text("")
    link = tmp_path / "share" / "fashion-mnist"
    env = _source_env(tmp_path, kit, FMNIST_SYSTEM=str(link), PFLLIB="")
    assert env["PFLKIT_DATA"] == str(kit / "data")
    assert env["PFLLIB"] == str(kit / "PFLlib")
    assert env["PYTHONPATH"].split(":")[0] == str(ROOT / "src")
    assert link.is_symlink() and link.resolve() == (kit / "data" / "fashion_mnist").resolve()
    # a PFLlib given wins over the kit's, and data already in the system location stays
    other = _source_env(tmp_path, kit, FMNIST_SYSTEM=str(link), PFLLIB="/elsewhere")
    assert other["PFLLIB"] == "/elsewhere"
    assert link.resolve() == (kit / "data" / "fashion_mnist").resolve()


def test_without_a_kit_only_src_is_added(tmp_path):
    env = _source_env(tmp_path, tmp_path / "absent", PFLKIT_DATA="/keep", PFLLIB="")
    assert env["PFLKIT_DATA"] == "/keep"
    assert env.get("PFLLIB", "") == ""
    assert env["PYTHONPATH"].split(":")[0] == str(ROOT / "src")
