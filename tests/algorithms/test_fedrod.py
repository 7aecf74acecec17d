"""FedRoD by value: client_update as one SGD step of L_BSM (body and G-head) plus the
personalized CE on G-head(f).detach() + P-head(f.detach()) (P-head only), computed by hand with
plain torch ops; the aggregation of body and G-head; the scored models (personalized:
G-head + P-head on the latest generic model; global: the generic model)."""

from __future__ import annotations

import pytest
import torch

from pflkit.algorithms.context import RoundContext
from split_helpers import one_client

# inputs of 2 numbers, 3 classes with counts (3, 1, 1); mlp [2]
X = torch.tensor([[1.0, -0.5], [0.3, 0.8], [-0.6, 0.4], [0.9, 0.1], [-0.2, -0.7]])
Y = torch.tensor([0, 0, 1, 0, 2])
COUNTS = torch.tensor([3.0, 1.0, 1.0], dtype=torch.float64)


def start():
    gen = torch.Generator().manual_seed(5)

    def r(*shape, lo=-1.0, hi=1.0):
        return lo + (hi - lo) * torch.rand(*shape, generator=gen)

    w = {"body.1.weight": r(2, 2), "body.1.bias": r(2, lo=0.5, hi=1.0),
         "head.weight": r(3, 2), "head.bias": r(3, lo=-0.3, hi=0.3)}  # fmt: skip
    phead = {"head.weight": r(3, 2), "head.bias": r(3, lo=-0.3, hi=0.3)}
    return w, phead


def h_ce(logits, y):
    return (torch.logsumexp(logits, 1) - logits[torch.arange(len(y)), y]).mean()


def h_feat(t, x):
    return torch.relu(x @ t["body.1.weight"].T + t["body.1.bias"])


def h_head(w, b, f):
    return f @ w.T + b


def assert_close(got, want, atol=1e-6):
    assert got.keys() == want.keys()
    for k in want:
        assert torch.allclose(got[k].double(), want[k].double(), atol=atol), k


def hand_step(w, phead, lr=0.1, map_code=False, gamma=1.0):
    """One full-batch step: body and G-head on L_BSM = CE(z + log n, y) (MAP code: CE(z (4 p)
    ^gamma, y)); P-head on CE(z.detach() + P-head(f.detach()), y) (MAP code: the mean)."""
    t = {k: v.double().clone().requires_grad_() for k, v in w.items()}
    ph = {k: v.double().clone().requires_grad_() for k, v in phead.items()}
    x = X.double()
    f = h_feat(t, x)
    z = h_head(t["head.weight"], t["head.bias"], f)
    if map_code:
        generic = h_ce(z * (4 * COUNTS / COUNTS.sum()) ** gamma, Y)
    else:
        generic = h_ce(z + torch.log(COUNTS), Y)
    zp = h_head(ph["head.weight"], ph["head.bias"], f.detach())
    mixed = (z.detach() + zp) / 2 if map_code else z.detach() + zp
    personal = h_ce(mixed, Y)
    g_w = torch.autograd.grad(generic, list(t.values()))
    g_p = torch.autograd.grad(personal, list(ph.values()))
    new_w = {k: (v - lr * g).detach() for (k, v), g in zip(t.items(), g_w, strict=True)}
    new_p = {k: (v - lr * g).detach() for (k, v), g in zip(ph.items(), g_p, strict=True)}
    return new_w, new_p, (generic + personal).item()


@pytest.mark.parametrize("variant", ["paper", "map_code"])
def test_client_update_is_one_step_of_bsm_plus_the_detached_personal_loss_by_hand(variant):
    params = {
        "name": "fedrod",
        "variant": variant,
        **({"gamma": 0.5} if variant != "paper" else {}),
    }
    algo, senv, env = one_client(params, X, Y, 3, hidden=(2,))
    w, phead = start()
    upd = algo.client_update(env, {"weights": w}, {"phead": phead}, RoundContext(1))
    want_w, want_p, want_loss = hand_step(w, phead, map_code=variant == "map_code", gamma=0.5)
    assert_close(upd.upload["weights"], want_w)
    assert_close(upd.state["phead"], want_p)
    assert upd.upload["num_samples"] == 5
    assert upd.metrics["train_loss"] == pytest.approx(want_loss, rel=1e-6)


def test_the_p_head_starts_as_the_initial_g_head():
    algo, senv, env = one_client({"name": "fedrod"}, X, Y, 3, hidden=(2,))
    g = algo.server_init(senv)["weights"]
    p = algo.client_init(env)["phead"]
    assert_close(p, {"head.weight": g["head.weight"], "head.bias": g["head.bias"]})


def test_aggregate_averages_body_and_g_head_by_samples():
    algo, senv, _ = one_client({"name": "fedrod"}, X, Y, 3, hidden=(2,))
    w, _ = start()
    ups = {
        0: {"weights": {k: torch.full_like(v, 4.0) for k, v in w.items()}, "num_samples": 1},
        1: {"weights": {k: torch.full_like(v, 0.0) for k, v in w.items()}, "num_samples": 3},
    }
    new = algo.aggregate(senv, {"weights": w}, ups, 1, "train")["weights"]
    assert_close(new, {k: torch.full_like(v, 1.0) for k, v in w.items()})


@pytest.mark.parametrize("variant", ["paper", "map_code"])
def test_the_scored_models_by_hand(variant):
    """Personalized: G-head(f) + P-head(f) (MAP code: their mean) with the latest aggregated
    body and G-head and the client's own P-head; global: the generic model (body and G-head)."""
    algo, senv, env = one_client({"name": "fedrod", "variant": variant}, X, Y, 3, hidden=(2,))
    w, phead = start()
    upd = algo.client_update(env, {"weights": w}, {"phead": phead}, RoundContext(1))
    other = {k: v + 0.2 for k, v in w.items()}
    ups = {0: upd.upload, 1: {"weights": other, "num_samples": 5}}
    server = algo.aggregate(senv, {"weights": w}, ups, 1, "train")
    agg = {k: ((upd.upload["weights"][k] + other[k]) / 2).double() for k in w}
    f = h_feat(agg, X.double())
    zg = h_head(agg["head.weight"], agg["head.bias"], f)
    p = {k: v.double() for k, v in upd.state["phead"].items()}
    zp = h_head(p["head.weight"], p["head.bias"], f)
    want = zg + zp if variant == "paper" else (zg + zp) / 2
    weights = algo.personal_weights(
        env, algo.eval_view(senv, server, 0, 1), upd.state, RoundContext(1)
    )
    got = algo.scoring_model(env, weights)(X)
    assert torch.allclose(got.double(), want, atol=1e-6)
    assert_close(algo.global_weights(senv, server, 1), agg)  # global_acc: the generic model
