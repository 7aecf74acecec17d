"""pflkit.testing: toy environments built from in-memory tensors, no config file."""

from __future__ import annotations

import typing
from typing import Literal, NotRequired, TypedDict

import pytest
import torch

from pflkit.algorithms import ALGORITHMS, ClientEnv, RoundContext, ServerEnv
from pflkit.algorithms.records import Empty, WeightsUpload
from pflkit.engine.schedule import lr_factor
from pflkit.errors import PflkitError
from pflkit.models import build_model
from pflkit.testing import check_record, round_ctx, toy_data, toy_envs


def test_random_clients_have_the_asked_counts_and_shapes():
    server, clients = toy_envs(num_clients=3, samples=[2, 5, 4], input_dim=6, num_classes=4)
    assert isinstance(server, ServerEnv) and all(isinstance(c, ClientEnv) for c in clients)
    assert server.num_clients == len(clients) == 3
    assert server.num_samples == [2, 5, 4] == [c.num_train for c in clients]
    assert [c.cid for c in clients] == [0, 1, 2]
    for c, n in zip(clients, [2, 5, 4], strict=True):
        assert c.data.train_x.shape == (n, 6) and c.data.train_y.shape == (n,)
        assert c.data.train_y.max() < 4 and c.num_classes == server.num_classes == 4
    # the default model is softmax regression: only a head
    assert {k: v.shape for k, v in server.init_weights().items()} == {
        "head.weight": (4, 6),
        "head.bias": (4,),
    }


def test_given_tensors_are_the_clients_data_and_samples_are_counted():
    x0, y0 = torch.randn(3, 2), torch.tensor([0, 1, 1])
    x1, y1 = torch.randn(5, 2), torch.tensor([1, 0, 0, 1, 1])
    server, (a, b) = toy_envs([(x0, y0), (x1, y1)], num_classes=2)
    assert a.data.train_x is x0 and b.data.train_y is y1 and a.data.test_x is x0
    assert server.num_samples == [3, 5]
    assert a.run.train.batch_size == 5 and a.run.train.lr == 0.1  # full batch by default


def test_random_data_follows_the_seed():
    first = toy_data(samples=3, seed=1)
    assert all(
        torch.equal(x, x2) for (x, _), (x2, _) in zip(first, toy_data(3, seed=1), strict=True)
    )
    assert not torch.equal(first[0][0], toy_data(3, seed=2)[0][0])


def test_init_weights_are_seeded_and_every_client_shares_the_pool():
    s1, c1 = toy_envs(seed=3)
    w1 = c1[0].init_weights()
    _, c2 = toy_envs(seed=3)
    assert all(torch.equal(w1[k], v) for k, v in c2[0].init_weights().items())
    assert c1[0].model() is c1[1].model() is s1.model()


def test_train_and_system_overrides_and_a_model_by_name_or_factory():
    _, (c,) = toy_envs(
        num_clients=1,
        model_options={"hidden": [5]},
        train={"lr": 0.3, "optimizer": "adam"},
        system={"straggler_work": 0.25},
    )
    assert c.run.train.lr == 0.3 and c.run.system.straggler_work == 0.25
    assert c.model().body[1].out_features == 5
    _, (f,) = toy_envs(num_clients=1, model=lambda s, k: build_model("mlp", s, k, hidden=[7]))
    assert f.model().body[1].out_features == 7


def test_round_ctx_is_the_engines_context_of_the_round():
    _, (c, _) = toy_envs(train={"lr_schedule": "step", "lr_gamma": 0.5, "drop_last": True})
    ctx = round_ctx(c, 3)
    assert isinstance(ctx, RoundContext) and ctx.round == 3 and ctx.phase == "train"
    assert ctx.lr_factor == lr_factor(c.run.train, 3) == 0.25 and ctx.drop_last
    assert round_ctx(c, straggler=True).work == c.run.system.straggler_work


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"num_clients": 0}, "num_clients >= 1"),
        ({"samples": [3]}, "one sample count >= 1 per client"),
        ({"clients": []}, "at least one client"),
        ({"clients": [torch.randn(3, 2)]}, r"client 0 must be an \(x, y\) pair"),
        ({"clients": [(torch.randn(3, 2), torch.tensor([0, 1]))]}, "same n >= 1"),
        ({"clients": [(torch.randn(2, 2), torch.tensor([0, 5]))]}, r"in \[0, 3\)"),
        ({"clients": [(torch.randn(2, 2), torch.tensor([0.0, 1.0]))]}, "torch.long"),
        (
            {
                "clients": [(torch.randn(2, 2), torch.tensor([0, 1]))] * 2
                + [(torch.randn(2, 3), torch.tensor([0, 1]))]
            },  # fmt: skip
            "client 2's inputs have shape",
        ),
        ({"train": {"lr": -1}}, "invalid config value 'train.lr'"),
        ({"train": {"lrr": 0.1}}, "unknown config key 'train.lrr'"),
        ({"model": "nope"}, "unknown model 'nope'"),
        ({"model_options": {"depth": 2}}, "model 'mlp' has no option 'depth'"),
        ({"model": lambda s, k: torch.nn.Linear(2, k)}, "not a pflkit.models.PFLModel"),
    ],
)
def test_bad_input_is_one_sentence(kwargs, match):
    with pytest.raises(PflkitError, match=match):
        toy_envs(**kwargs)


# -- check_record ----------------------------------------------------------------------------------
class _Inner(TypedDict):
    classes: torch.Tensor


class _Rec(TypedDict):
    weights: dict[str, torch.Tensor]
    num_samples: int
    lr: float
    kind: Literal["a", "b"]
    ids: list[int]
    inner: NotRequired[_Inner]
    maybe: NotRequired[int | None]


class _Other(TypedDict):
    soft: torch.Tensor


def _good() -> dict:
    return {
        "weights": {"w": torch.zeros(2)},
        "num_samples": 3,
        "lr": 1,  # an int is a float
        "kind": "a",
        "ids": [1, 2],
        "inner": {"classes": torch.arange(2)},
        "maybe": None,
    }


def test_check_record_accepts_a_value_of_its_record_and_leaves_out_optional_keys():
    check_record(_good(), _Rec, "fedx's upload")
    value = _good()
    del value["inner"], value["maybe"]
    check_record(value, _Rec, "fedx's upload")
    check_record({"soft": torch.ones(1)}, _Rec | _Other, "fedx's upload")  # one per phase
    check_record({}, Empty, "fedx's state")


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda v: v.pop("num_samples"), "fedx's upload: _Rec lacks key 'num_samples'"),
        (
            lambda v: v.update(num_sampels=3),
            "fedx's upload: key 'num_sampels' is not declared in _Rec",
        ),
        (lambda v: v.update(num_samples=3.0), r"_Rec\['num_samples'\] is a float, not int"),
        (lambda v: v.update(num_samples=True), r"_Rec\['num_samples'\] is a bool, not int"),
        (lambda v: v.update(lr="0.1"), r"_Rec\['lr'\] is a str, not float"),
        (lambda v: v.update(kind="c"), r"_Rec\['kind'\] is 'c', not one of \['a', 'b'\]"),
        (lambda v: v.update(ids=[1, "2"]), r"_Rec\['ids'\]\[1\] is a str, not int"),
        (
            lambda v: v.update(weights={"w": [0.0]}),
            r"_Rec\['weights'\]\['w'\] is a list, not Tensor",
        ),
        (lambda v: v.update(weights={1: torch.zeros(1)}), r"a key of _Rec\['weights'\] is a int"),
        (lambda v: v.update(inner={}), "_Inner lacks key 'classes'"),
        (lambda v: v.update(maybe="x"), r"_Rec\['maybe'\] is a str, not int \| None"),
    ],
)
def test_check_record_names_the_algorithm_the_record_and_the_key(change, message):
    value = _good()
    change(value)
    with pytest.raises(PflkitError, match=message):
        check_record(value, _Rec, "fedx's upload")


def test_check_record_says_why_a_value_matches_no_record_of_a_union():
    with pytest.raises(
        PflkitError,
        match=r"_Rec \| _Other matches none of its records \(_Rec lacks key 'weights'.*key 'x' is not declared in _Other",
    ):
        check_record({"soft": 1.0, "x": 1}, _Rec | _Other, "fedx's upload")
    with pytest.raises(PflkitError, match="is a list, not a dict"):
        check_record([], _Rec, "fedx's upload")


def test_every_registered_algorithm_declares_its_four_records():
    for name, cls in ALGORITHMS.items():
        for kind in ("payload", "upload", "state", "server"):
            record = getattr(cls, kind)
            members = typing.get_args(record) or (record,)
            assert all(typing.is_typeddict(m) for m in members), f"{name}.{kind}: {record}"
    assert ALGORITHMS["fedavg"].upload is WeightsUpload


def _documented(code: str) -> dict:
    """Run a documented example as written; its names afterwards."""
    names: dict = {}
    exec(compile(code, "<documented example>", "exec"), names)
    return names


def _sample_weighted(new: dict, uploads: dict, counts: tuple[int, int]) -> None:
    u0, u1 = uploads[0]["weights"], uploads[1]["weights"]
    assert set(new) == set(u0)
    for key, value in new.items():
        want = (counts[0] * u0[key] + counts[1] * u1[key]) / sum(counts)
        assert torch.allclose(value, want, atol=1e-7), key


def test_the_documented_fedavg_rounds_run_as_written_and_average_by_samples():
    """docs/guide.md's "Testing an algorithm on toy tensors" and this module's docstring run as
    written, and their server weights are the sample-weighted means their comments state."""
    import re
    import textwrap
    from pathlib import Path

    import pflkit.testing

    guide = (Path(__file__).resolve().parents[1] / "docs" / "guide.md").read_text()
    section = guide.split("### Testing an algorithm on toy tensors", 1)[1]
    names = _documented(re.search(r"```python\n(.*?)```", section, re.S).group(1))
    _sample_weighted(names["new"], names["uploads"], (1, 3))

    example = pflkit.testing.__doc__.split("One FedAvg round::\n\n", 1)[1].split("\n\n")[0]
    imports = "from pflkit.algorithms import ServerContext, build_algorithm\n"
    imports += "from pflkit.testing import round_ctx, toy_envs\n"
    names = _documented(imports + textwrap.dedent(example))
    _sample_weighted(names["new"]["weights"], names["uploads"], (3, 5))
