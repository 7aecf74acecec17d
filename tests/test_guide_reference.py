"""docs/guide.md's config reference (its first YAML block, "Configuration"): a valid config
that names every key of :class:`~pflkit.config.ExperimentConfig` (the Ray keys in their own
block, "Ray: more than one machine") with its default value, apart from the example's name and
algorithm."""

from __future__ import annotations

import re
from pathlib import Path

import yaml
from pydantic import BaseModel

from pflkit.config import ExperimentConfig
from pflkit.experiment import validate

GUIDE = Path(__file__).resolve().parents[1] / "docs" / "guide.md"
EXAMPLE_VALUES = {"name", "algorithm"}  # the reference's own experiment: fedprox, mu 0.01


def _blocks() -> list[dict]:
    return [yaml.safe_load(b) for b in re.findall(r"```yaml\n(.*?)```", GUIDE.read_text(), re.S)]


def _keys(model: type[BaseModel], prefix: str = "") -> set[str]:
    out = set()
    for name, field in model.model_fields.items():
        out.add(prefix + name)
        kind = field.annotation
        if isinstance(kind, type) and issubclass(kind, BaseModel):
            out |= _keys(kind, f"{prefix}{name}.")
    return out


def _leaves(tree: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict) and value and key not in ("algorithm", "options", "grid"):
            out |= _leaves(value, f"{prefix}{key}.")
        else:
            out[prefix + key] = value
    return out


def _has(tree: dict, key: str) -> bool:
    for part in key.split("."):
        if not isinstance(tree, dict) or part not in tree:
            return False
        tree = tree[part]
    return True


def test_the_reference_names_every_key_with_its_default():
    reference, *others = _blocks()
    ray = next(b for b in others if b.get("engine", {}).get("runner") == "ray")
    missing = [
        key for key in sorted(_keys(ExperimentConfig))
        if not _has(reference, key) and not _has(ray, key)
    ]  # fmt: skip
    assert missing == [], f"docs/guide.md's config reference lacks {missing}"
    documented = _leaves(validate(reference).model_dump(mode="json"))
    default = _leaves(ExperimentConfig().model_dump(mode="json"))
    differ = {
        key: (documented[key], default.get(key))
        for key in documented
        if key.split(".")[0] not in EXAMPLE_VALUES and documented[key] != default.get(key)
    }
    assert differ == {}, "the reference's value, then the default"
