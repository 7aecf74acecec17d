"""Every config shipped in configs/ validates, and every algorithm entry of its compare
section resolves (a known algorithm with valid parameters), so a reproduction command does not
stop at its tenth method."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from pflkit.algorithms import resolve_params
from pflkit.engine.compare import compare_plan, sweep_plan
from pflkit.experiment import load_config
from pflkit.report.archive import files, tree

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


RESULTS = Path(__file__).parent.parent / "results"


# the kept compares: run archives (results/<table>.zip) or folders holding a compare.yaml
KEPT_COMPARES = sorted(p for p in RESULTS.iterdir() if (tree(p) / "compare.yaml").is_file())
CONFIG_NAMES = [(p, yaml.safe_load(p.read_text()).get("name")) for p in CONFIGS]


def _config_named(name: str) -> Path:
    found = [p for p, n in CONFIG_NAMES if n == name]
    assert len(found) == 1, f"the kept compare '{name}' has {len(found)} configs: {found}"
    return found[0]


@pytest.mark.parametrize("folder", KEPT_COMPARES, ids=lambda p: p.name)
def test_every_kept_run_is_its_configs_entry(folder):
    """Each kept run under results/ is one of its config's compare (or sweep) settings, with
    that setting's parameters: a run kept under a config whose entry it is not (the GPFL
    paper arm's first runs, made when ``--algorithms gpfl`` dropped the entry's parameters)
    fails here. Keys the run's config.yaml lacks (options added after the run) are not
    compared."""
    name = folder.name.removesuffix(".zip")
    folder = tree(folder)
    cfg = load_config(_config_named(yaml.safe_load((folder / "compare.yaml").read_text())["name"]))
    plan = sweep_plan(cfg) if cfg.sweep.grid else compare_plan(cfg)
    settings = {label: resolve_params(entry, cfg.train.weighting) for label, entry, _ in plan}
    runs = files(folder, "config.yaml")
    assert runs or name.endswith("_paper_protocol")  # a paper arm may have just begun
    for run in runs:
        label = run.parent.name.rsplit("-s", 1)[0]
        assert label in settings, f"{run.parent.name} is no setting of {name}'s config"
        ran = yaml.safe_load(run.read_text())["algorithm"]
        differ = {k: (v, ran[k]) for k, v in settings[label].items() if k in ran and ran[k] != v}
        assert not differ, f"{run.parent.name}: config vs run {differ}"
