"""Property test: any value for any config key is either accepted or refused with one
sentence (a PflkitError, which the CLI prints as one line with exit code 2), and an accepted
config builds its simulation or is refused the same way; never another exception."""

from __future__ import annotations

import copy

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel

from conftest import tiny_config
from pflkit.config import ExperimentConfig
from pflkit.engine import Simulation
from pflkit.errors import PflkitError
from pflkit.experiment import validate


def _keys(model: type[BaseModel], prefix: str = "") -> list[str]:
    out = []
    for name, field in model.model_fields.items():
        sub = field.annotation
        if isinstance(sub, type) and issubclass(sub, BaseModel):
            out += _keys(sub, f"{prefix}{name}.")
        else:
            out.append(f"{prefix}{name}")
    return out


# every config key, plus algorithm and partition parameters and model options
KEYS = sorted(
    set(_keys(ExperimentConfig))
    | {"algorithm.name", "algorithm.mu", "algorithm.weighting", "data.partition.name",
       "data.partition.alpha", "model.options.hidden", "data.public.size"}
)  # fmt: skip

VALUES = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(10**6), 10**6),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12),
    st.lists(st.one_of(st.integers(-5, 50), st.text(max_size=4)), max_size=3),
    st.dictionaries(st.text(max_size=6), st.integers(-3, 3), max_size=2),
)


def _set(raw: dict, key: str, value) -> dict:
    raw = copy.deepcopy(raw)
    node = raw
    *path, last = key.split(".")
    for part in path:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            return raw
    node[last] = value
    return raw


@pytest.mark.filterwarnings("ignore")
@settings(
    max_examples=150,
    deadline=None,
    derandomize=True,  # the same 150 examples on every CI run (no flaky builds)
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(key=st.sampled_from(KEYS), value=VALUES)
def test_any_value_for_any_key_is_accepted_or_one_sentence(key, value, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # a random relative data.root or output.dir lands here
    raw = _set(tiny_config(train={"rounds": 1}), key, value)
    raw["output"] = {**raw.get("output", {}), "dir": str(tmp_path / "runs"), "progress": False}
    try:
        cfg = validate(raw)
        Simulation(cfg).close()
    except PflkitError as err:
        assert "\n" not in str(err) and str(err).strip(), repr(err)
