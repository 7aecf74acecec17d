"""The body/head split of FedPer, FedRep, FedRoD, Per-FedAvg and pFedMe: exact byte counts (only
shared parts cross the wire) and their parameters' bad values. Each algorithm's own math is
tested in tests/algorithms/test_<module>.py."""

from __future__ import annotations

import pytest

from conftest import tiny_config
from pflkit.algorithms import parse_params
from pflkit.engine import run_experiment
from pflkit.errors import PflkitError
from pflkit.experiment import validate


@pytest.mark.parametrize("name", ["fedper", "fedrep"])
def test_private_layers_do_not_go_over_the_wire(tmp_path, name):
    """mlp [32, 16] with private_layers [3]: only the first layer crosses, 64 * 32 + 32
    numbers each way (plus the 8-byte sample count up)."""
    algo = {
        "name": name,
        "private_layers": ["3"],
        **({"head_epochs": 1} if name == "fedrep" else {}),
    }
    model = {"name": "mlp", "options": {"hidden": [32, 16]}}
    cfg = validate(tiny_config(algorithm=algo, model=model, train={"rounds": 1}))
    row = run_experiment(cfg, out=tmp_path / "r").rows[0]
    assert set(row["bytes_down"]) == {4 * BODY} and set(row["bytes_up"]) == {4 * BODY + 8}


# -- bytes and parameters ---------------------------------------------------------------------


BODY = 64 * 32 + 32  # digits (64 features), mlp [32]
HEAD = 32 * 10 + 10


@pytest.mark.parametrize(
    "name, shared",
    [
        ("fedper", BODY),
        ("fedrep", BODY),
        ("fedrod", BODY + HEAD),  # body + generic head; the personalized head stays
        ("perfedavg", BODY + HEAD),
        ("pfedme", BODY + HEAD),
    ],
)
def test_only_shared_parts_go_over_the_wire(tmp_path, name, shared):
    cfg = validate(
        tiny_config(algorithm={"name": name, **({"head_epochs": 1} if name == "fedrep" else {})},
                    train={"rounds": 1})
    )  # fmt: skip
    result = run_experiment(cfg, out=tmp_path / "r")
    row = result.rows[0]
    assert set(row["bytes_down"]) == {4 * shared} and set(row["bytes_up"]) == {4 * shared + 8}
    if name == "fedrod":  # FedRoD's private head gives a personalized model unlike the generic one
        assert row["global_acc"] != row["pers_acc_weighted"]


@pytest.mark.parametrize(
    "algo, match",
    [
        ({"name": "fedrep", "head_epochs": 0, "body_epochs": 0}, "cannot both be 0"),
        ({"name": "fedrod", "variant": "bsm"}, "fedrod.variant"),
        ({"name": "perfedavg", "variant": "so"}, "perfedavg.variant"),
        ({"name": "pfedme", "inner_steps": 0}, "pfedme.inner_steps"),
        ({"name": "fedper", "lam": 1}, "has no parameter 'lam'"),
    ],
)
def test_bad_parameters_are_one_sentence(algo, match):
    with pytest.raises(PflkitError, match=match):
        parse_params(algo)
