"""Plugins (docs/plugins.md): the documented example module, run as a user would."""

from __future__ import annotations

import importlib
import re
import sys
from pathlib import Path

import pytest
import torch
import yaml

from conftest import tiny_config
from pflkit.algorithms.context import ServerContext
from test_cli import pflkit

DOC = Path(__file__).resolve().parents[1] / "docs" / "plugins.md"


@pytest.fixture
def plugin_dir(tmp_path):
    """The docs' example written to ``my_pflkit.py`` in a fresh folder."""
    code = re.search(r"```python\n(.*?)```", DOC.read_text(), re.S).group(1)
    (tmp_path / "my_pflkit.py").write_text(code)
    return tmp_path


@pytest.fixture
def imported(plugin_dir, monkeypatch):
    """The example imported here; its registrations removed afterwards."""
    from pflkit.algorithms import ALGORITHMS
    from pflkit.data.partition import PARTITIONERS
    from pflkit.models import MODELS

    monkeypatch.syspath_prepend(str(plugin_dir))
    module = importlib.import_module("my_pflkit")
    yield module
    ALGORITHMS.pop("fedavg_trimmed", None)
    MODELS.pop("softmax_regression", None)
    PARTITIONERS.pop("by_parity", None)
    sys.modules.pop("my_pflkit", None)


def test_the_documented_plugin_runs_from_the_command_line(plugin_dir):
    listed = pflkit("list", "--import", "my_pflkit", cwd=plugin_dir)
    assert listed.returncode == 0, listed.stderr
    for name in ("fedavg_trimmed", "softmax_regression", "by_parity"):
        assert name in listed.stdout
    (plugin_dir / "tiny.yaml").write_text(yaml.safe_dump(tiny_config(train={"rounds": 2})))
    r = pflkit(
        "run", "tiny.yaml", "--import", "my_pflkit", "-q", "--out", "r",
        "--set", "algorithm={name: fedavg_trimmed, trim: 0.25}",
        "--set", "model={name: softmax_regression}", "--set", "data.partition={name: by_parity}",
        cwd=plugin_dir,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    saved = yaml.safe_load((plugin_dir / "r" / "config.yaml").read_text())
    assert saved["plugins"] == ["my_pflkit"]  # so --resume and Flower's SuperNodes import it
    assert saved["algorithm"] == {"name": "fedavg_trimmed", "weighting": "samples", "trim": 0.25}
    missing = pflkit("run", "tiny.yaml", "--import", "no_such_plugin", cwd=plugin_dir)
    assert (
        missing.returncode == 2 and "cannot import plugin module 'no_such_plugin'" in missing.stderr
    )
    assert "Traceback" not in missing.stderr


def test_the_documented_trimmed_mean_by_value(imported, tiny):
    from pflkit.engine import Simulation

    sim = Simulation(tiny(algorithm={"name": "fedavg_trimmed", "trim": 0.25}))
    ups = {
        c: {"weights": {"w": torch.tensor([v, -v]), "n": torch.tensor(c)}, "num_samples": 1}
        for c, v in enumerate([1.0, 5.0, 2.0, 100.0])
    }
    out = sim.algo.aggregate(sim.senv, {}, ups, ServerContext(1, "train"))["weights"]
    # four clients, trim 0.25: drop the smallest and largest value of each coordinate
    assert out["w"].tolist() == [3.5, -3.5]  # mean(2, 5) and mean(-5, -2)
    assert out["n"].item() == 0  # integer buffers come from the first upload


def test_the_documented_partitioner_and_a_taken_name(imported):
    import numpy as np

    from pflkit.errors import PflkitError
    from pflkit.plugins import register_model

    labels = np.arange(20) % 4
    parts = imported.by_parity(labels, 4, np.random.default_rng(0))
    assert [sorted(set(labels[p] % 2)) for p in parts] == [[0], [1], [0], [1]]
    assert sorted(np.concatenate(parts).tolist()) == list(range(20))
    with pytest.raises(PflkitError, match="a model named 'mlp' is already registered"):
        register_model("mlp", "again", imported.softmax_regression)


V3_PLUGINS = {
    "a removed evaluation hook": (
        "    def personal_weights(self, env, view, state, ctx):\n        return None\n",
        "defines personal_weights, which contract v4 replaced: define personal_model",
    ),
    "a server hook with (rnd, phase)": (
        "    def aggregate(self, env, server, uploads, rnd, phase):\n        return server\n",
        "defines aggregate with (rnd, phase)",
    ),
}


@pytest.mark.parametrize("case", sorted(V3_PLUGINS))
def test_a_plugin_written_for_contract_v3_is_refused_in_one_sentence(case, plugin_dir):
    method, said = V3_PLUGINS[case]
    (plugin_dir / "old_plugin.py").write_text(
        "from pflkit.algorithms.fedavg import FedAvg\n"
        "from pflkit.plugins import register_algorithm\n\n\n"
        "@register_algorithm\nclass Old(FedAvg):\n    name = 'old_v3'\n\n" + method
    )
    (plugin_dir / "tiny.yaml").write_text(yaml.safe_dump(tiny_config()))
    r = pflkit("run", "tiny.yaml", "--import", "old_plugin", cwd=plugin_dir)
    assert r.returncode == 2, r.stderr
    assert said in r.stderr and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
