"""pflkit.testing: toy environments built from in-memory tensors, no config file."""

from __future__ import annotations

import pytest
import torch

from pflkit.algorithms import ClientEnv, RoundContext, ServerEnv
from pflkit.engine.schedule import lr_factor
from pflkit.errors import PflkitError
from pflkit.models import build_model
from pflkit.testing import round_ctx, toy_data, toy_envs


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
