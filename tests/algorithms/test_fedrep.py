"""FedRep by value: client_update as head epochs on h_i with phi frozen, then body epochs on phi
with the new h_i frozen (Algorithm 1), computed by hand with plain torch ops; the upload, the
kept head, the aggregation (sample-weighted; uniform: the paper's mean) and the scored model."""

from __future__ import annotations

import pytest
import torch
from test_fedper import X, Y, assert_close, h_logits, hand_steps, split, start

from pflkit.algorithms.context import RoundContext, ServerContext
from split_helpers import data, one_client

BODY = ["body.1.weight", "body.1.bias", "body.3.weight", "body.3.bias"]
HEAD = ["head.weight", "head.bias"]


@pytest.mark.parametrize(
    "params, local_epochs, head_steps, body_steps",
    [
        ({"head_epochs": 2, "body_epochs": 1}, 1, 2, 1),
        ({"head_epochs": 3}, 2, 3, 2),  # body_epochs None: train.local_epochs
        ({"head_epochs": 1, "body_epochs": 3}, 1, 1, 3),
    ],
)
def test_client_update_runs_head_epochs_then_body_epochs_by_hand(
    params, local_epochs, head_steps, body_steps
):
    algo, senv, env = one_client(
        {"name": "fedrep", **params}, X, Y, 3, hidden=(2, 2), local_epochs=local_epochs
    )
    body, head = split(start())
    upd = algo.client_update(env, {"body": body}, {"head": head}, RoundContext(1))
    after_head = hand_steps(start(), HEAD, steps=head_steps)  # phi frozen
    want = hand_steps(after_head, BODY, steps=body_steps)  # the new h_i frozen
    want_body, want_head = split(want)
    assert_close(upd.upload["body"], want_body)
    assert_close(upd.state["head"], want_head)
    # the order matters here: body first, then head, gives other numbers
    other = hand_steps(hand_steps(start(), BODY, steps=body_steps), HEAD, steps=head_steps)
    assert not torch.allclose(other["body.1.weight"], want["body.1.weight"], atol=1e-4)


def test_private_layers_train_in_the_head_epochs_by_hand():
    """private_layers [3]: layer 3 moves into h_i, trained with the head in the head epochs and
    frozen with it in the body epochs; layer 1 alone is uploaded."""
    algo, senv, env = one_client(
        {"name": "fedrep", "head_epochs": 2, "body_epochs": 1, "private_layers": ["3"]},
        X, Y, 3, hidden=(2, 2),
    )  # fmt: skip
    body, private = split(start(), ["3"])
    upd = algo.client_update(env, {"body": body}, {"head": private}, RoundContext(1))
    after_head = hand_steps(start(), BODY[2:] + HEAD, steps=2)
    want_body, want_private = split(hand_steps(after_head, BODY[:2], steps=1), ["3"])
    assert_close(upd.upload["body"], want_body)
    assert_close(upd.state["head"], want_private)


def test_aggregate_is_sample_weighted_and_the_papers_mean_with_uniform():
    body, _ = split(start())
    ups = {
        0: {"body": {k: torch.full_like(v, 1.0) for k, v in body.items()}, "num_samples": 3},
        1: {"body": {k: torch.full_like(v, 3.0) for k, v in body.items()}, "num_samples": 1},
    }
    for weighting, value in [("samples", (3 * 1.0 + 3.0) / 4), ("uniform", 2.0)]:
        algo, senv, _ = one_client(
            {"name": "fedrep", "weighting": weighting}, X, Y, 3, hidden=(2, 2)
        )
        new = algo.aggregate(senv, {"body": body}, ups, ServerContext(1, "train"))["body"]
        assert_close(new, {k: torch.full_like(v, value) for k, v in body.items()})


def test_the_scored_model_is_the_latest_body_with_the_own_head_by_hand():
    algo, senv, env = one_client({"name": "fedrep", "head_epochs": 2}, X, Y, 3, hidden=(2, 2))
    body, head = split(start())
    upd = algo.client_update(env, {"body": body}, {"head": head}, RoundContext(1))
    server = algo.aggregate(senv, {"body": body}, {0: upd.upload}, ServerContext(1, "train"))
    weights = algo.personal_model(
        env, algo.eval_view(senv, server, 0, ServerContext(1)), upd.state, RoundContext(1)
    )
    t = {k: v.double() for k, v in {**upd.upload["body"], **upd.state["head"]}.items()}
    got = weights(X)
    assert torch.allclose(got.double(), h_logits(t, X.double()), atol=1e-6)


# -- FedRep ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("head_epochs, body_epochs", [(2, 0), (0, 2)])
def test_fedrep_freezes_the_body_in_head_epochs_and_the_head_in_body_epochs(
    head_epochs, body_epochs
):
    x, y = data(12, 5, 3)
    algo, senv, env = one_client(
        {"name": "fedrep", "head_epochs": head_epochs, "body_epochs": body_epochs},
        x, y, 3, hidden=(4,), batch_size=4,
    )  # fmt: skip
    server, state = algo.server_init(senv), algo.client_init(env)
    up, new, _ = algo.client_update(
        env, algo.configure(senv, server, 0, ServerContext(1, "train")), state, RoundContext(1, "t")
    )
    body_same = all(torch.equal(up["body"][k], server["body"][k]) for k in server["body"])
    head_same = all(torch.equal(new["head"][k], state["head"][k]) for k in state["head"])
    assert (body_same, head_same) == ((True, False) if body_epochs == 0 else (False, True))


@pytest.mark.parametrize("head_epochs, body_epochs", [(2, 0), (0, 2)])
def test_fedrep_private_layers_train_with_the_head(head_epochs, body_epochs):
    """private_layers: [3] (mlp [4, 3]: body layers 1 and 3): layer 3 is private, trained in
    the head epochs with the head and frozen with it in the body epochs; layer 1 alone is
    uploaded."""
    x, y = data(12, 5, 3)
    algo, senv, env = one_client(
        {"name": "fedrep", "head_epochs": head_epochs, "body_epochs": body_epochs,
         "private_layers": ["3"]},
        x, y, 3, hidden=(4, 3), batch_size=4,
    )  # fmt: skip
    server, state = algo.server_init(senv), algo.client_init(env)
    assert sorted(server["body"]) == ["body.1.bias", "body.1.weight"]
    assert sorted(state["head"]) == ["body.3.bias", "body.3.weight", "head.bias", "head.weight"]
    up, new, _ = algo.client_update(
        env, algo.configure(senv, server, 0, ServerContext(1, "train")), state, RoundContext(1, "t")
    )
    assert sorted(up["body"]) == sorted(server["body"])
    body_same = all(torch.equal(up["body"][k], server["body"][k]) for k in server["body"])
    private_same = [torch.equal(new["head"][k], state["head"][k]) for k in state["head"]]
    if body_epochs == 0:
        assert body_same and not any(private_same)
    else:
        assert not body_same and all(private_same)
