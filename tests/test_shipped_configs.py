"""Every config shipped in configs/ validates, and every algorithm entry of its compare
section resolves (a known algorithm with valid parameters), so a reproduction command does not
stop at its tenth method."""

from __future__ import annotations

from pathlib import Path

import pytest

from pflkit.algorithms import resolve_params
from pflkit.engine.compare import compare_plan
from pflkit.experiment import load_config

CONFIGS = sorted(Path(__file__).parent.parent.glob("configs/**/*.yaml"))


def test_configs_are_found():
    assert len(CONFIGS) >= 20


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: str(p.relative_to(p.parents[1])))
def test_shipped_config_and_its_compare_entries_resolve(path):
    cfg = load_config(path)
    resolve_params(cfg.algorithm, cfg.train.weighting)
    for _label, entry, _sets in compare_plan(cfg):
        assert resolve_params(entry, cfg.train.weighting)["name"] == entry["name"]


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: str(p.relative_to(p.parents[1])))
def test_every_method_of_a_shipped_compare_averages_by_one_rule(path):
    """A reproduction compares methods under the same rules: the compare entries that average
    resolve to one ``weighting`` (set ``train.weighting`` where their defaults differ)."""
    cfg = load_config(path)
    rules = {
        label: rule
        for label, entry, _sets in compare_plan(cfg)
        if (rule := resolve_params(entry, cfg.train.weighting).get("weighting")) is not None
    }
    assert len(set(rules.values())) <= 1, f"{path.name} mixes averaging rules: {rules}"
