"""FedPer by value: client_update as one joint SGD step on body and head (computed by hand with
plain torch ops), the sample-weighted average of the body, and the scored model (the latest
aggregated body with the client's own head)."""

from __future__ import annotations

import pytest
import torch

from conftest import tiny_config
from pflkit.algorithms.context import RoundContext, ServerContext
from pflkit.engine import run_experiment
from pflkit.errors import PflkitError
from pflkit.experiment import validate
from split_helpers import one_client

# inputs of 2 numbers, 3 classes; mlp [2, 2]: body layers 1 and 3, then the head
X = torch.tensor([[1.0, -0.5], [0.3, 0.8], [-0.6, 0.4]])
Y = torch.tensor([0, 1, 2])


def start():
    """Hand-set weights of the tiny mlp (body biases positive: every unit active)."""
    gen = torch.Generator().manual_seed(3)

    def r(*shape, lo=-1.0, hi=1.0):
        return lo + (hi - lo) * torch.rand(*shape, generator=gen)

    return {
        "body.1.weight": r(2, 2), "body.1.bias": r(2, lo=0.5, hi=1.0),
        "body.3.weight": r(2, 2), "body.3.bias": r(2, lo=0.5, hi=1.0),
        "head.weight": r(3, 2), "head.bias": r(3, lo=-0.2, hi=0.2),
    }  # fmt: skip


def h_logits(t, x):
    f = torch.relu(x @ t["body.1.weight"].T + t["body.1.bias"])
    f = torch.relu(f @ t["body.3.weight"].T + t["body.3.bias"])
    return f @ t["head.weight"].T + t["head.bias"]


def h_ce(logits, y):
    return (torch.logsumexp(logits, 1) - logits[torch.arange(len(y)), y]).mean()


def hand_steps(w, train: list[str], steps: int, lr: float = 0.1):
    """``steps`` full-batch gradient steps of the cross-entropy on the keys ``train`` (the
    others held fixed), in float64."""
    t = {k: v.double() for k, v in w.items()}
    for _ in range(steps):
        leaves = {k: t[k].clone().requires_grad_() for k in train}
        grads = torch.autograd.grad(
            h_ce(h_logits({**t, **leaves}, X.double()), Y), list(leaves.values())
        )
        t.update({k: (leaves[k] - lr * g).detach() for (k, g) in zip(leaves, grads, strict=True)})
    return t


def split(w, private=()):
    body = {k: v for k, v in w.items() if k.startswith("body.") and k.split(".")[1] not in private}
    return body, {k: v for k, v in w.items() if k not in body}


def assert_close(got, want, atol=1e-6):
    assert got.keys() == want.keys()
    for k in want:
        assert torch.allclose(got[k].double(), want[k].double(), atol=atol), k


@pytest.mark.parametrize("private", [[], ["3"]])
def test_client_update_trains_body_and_head_jointly_by_hand(private):
    """E = 2 epochs of full-batch SGD on the joint cross-entropy: the shared part (the body less
    ``private_layers``) is uploaded, the private part kept."""
    algo, senv, env = one_client(
        {"name": "fedper", "private_layers": private}, X, Y, 3, hidden=(2, 2), local_epochs=2
    )
    body, head = split(start(), private)
    upd = algo.client_update(env, {"body": body}, {"head": head}, RoundContext(1))
    want = hand_steps({**body, **head}, list(start()), steps=2)
    want_body, want_head = split(want, private)
    assert_close(upd.upload["body"], want_body)
    assert_close(upd.state["head"], want_head)
    assert upd.upload["num_samples"] == 3


def test_aggregate_averages_the_body_by_samples_and_uniform_on_request():
    algo, senv, _ = one_client({"name": "fedper"}, X, Y, 3, hidden=(2, 2))
    body, _ = split(start())
    ups = {
        0: {"body": {k: torch.full_like(v, 2.0) for k, v in body.items()}, "num_samples": 1},
        3: {"body": {k: torch.full_like(v, -2.0) for k, v in body.items()}, "num_samples": 3},
    }
    new = algo.aggregate(senv, {"body": body}, ups, ServerContext(1, "train"))["body"]
    assert_close(new, {k: torch.full_like(v, (2.0 - 3 * 2.0) / 4) for k, v in body.items()})
    uni, senv_u, _ = one_client({"name": "fedper", "weighting": "uniform"}, X, Y, 3, hidden=(2, 2))
    new_u = uni.aggregate(senv_u, {"body": body}, ups, ServerContext(1, "train"))["body"]
    assert_close(new_u, {k: torch.zeros_like(v) for k, v in body.items()})


def test_the_scored_model_is_the_aggregated_body_with_the_own_head_by_hand():
    algo, senv, env = one_client({"name": "fedper"}, X, Y, 3, hidden=(2, 2))
    body, head = split(start())
    upd = algo.client_update(env, {"body": body}, {"head": head}, RoundContext(1))
    other = {k: v - 0.3 for k, v in body.items()}
    server = algo.aggregate(
        senv,
        {"body": body},
        {0: upd.upload, 1: {"body": other, "num_samples": 1}},
        ServerContext(1, "train"),
    )
    weights = algo.personal_model(
        env, algo.eval_view(senv, server, 0, ServerContext(1)), upd.state, RoundContext(1)
    )
    agg = {k: (3 * upd.upload["body"][k] + other[k]) / 4 for k in body}  # n = 3 and 1
    want = h_logits({k: v.double() for k, v in {**agg, **upd.state["head"]}.items()}, X.double())
    got = weights(X)
    assert torch.allclose(got.double(), want, atol=1e-6)
    assert algo.eval_view(senv, server, None, ServerContext(1)).get("weights") is None


@pytest.mark.parametrize("name", ["fedper", "fedrep"])
def test_maps_protocol_scores_the_body_just_trained_with_the_own_head_by_hand(name):
    """eval.selected_clients (MAP's protocol) scores the client's model right after its local
    training: the body it trained and uploaded with its trained head, not this round's
    aggregate of every participant's body (which the engine has computed by then)."""
    algo, senv, env = one_client({"name": name}, X, Y, 3, hidden=(2, 2))
    body, head = split(start())
    upd = algo.client_update(env, {"body": body}, {"head": head}, RoundContext(1))
    other = {k: v - 0.3 for k, v in body.items()}
    server = algo.aggregate(
        senv,
        {"body": body},
        {0: upd.upload, 1: {"body": other, "num_samples": 3}},
        ServerContext(1, "train"),
    )
    view = algo.eval_view(senv, server, 0, ServerContext(1))
    trained = algo.personal_model(env, view, upd.state, RoundContext(1), upload=upd.upload)
    t = {k: v.double() for k, v in {**upd.upload["body"], **upd.state["head"]}.items()}
    got = trained(X)
    assert torch.allclose(got.double(), h_logits(t, X.double()), atol=1e-6)


@pytest.mark.parametrize(
    "layers, match",
    [
        (["fc1"], r"'fc1' is not a layer of the model's body \(its layers: 1\)"),
        (["1"], "leaves nothing shared"),
    ],
)
def test_private_layers_bad_input_is_one_sentence(tmp_path, layers, match):
    cfg = validate(tiny_config(algorithm={"name": "fedper", "private_layers": layers}))
    with pytest.raises(PflkitError, match=match):
        run_experiment(cfg, out=tmp_path / "r")
    assert not (tmp_path / "r").exists()
