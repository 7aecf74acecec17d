"""FedRoD by value: client_update as one SGD step of L_BSM (body and G-head) plus the
personalized CE on G-head(f).detach() + P-head(f.detach()) (P-head only), computed by hand with
plain torch ops; the aggregation of body and G-head; the scored models (personalized:
G-head + P-head on the latest generic model; global: the generic model)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from pflkit.algorithms.context import RoundContext, ServerContext
from pflkit.algorithms.fedrod import fedrod_loss, generic_logits
from split_helpers import data, np_ce_grad, np_softmax, one_client

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
    new = algo.aggregate(senv, {"weights": w}, ups, ServerContext(1, "train"))["weights"]
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
    server = algo.aggregate(senv, {"weights": w}, ups, ServerContext(1, "train"))
    agg = {k: ((upd.upload["weights"][k] + other[k]) / 2).double() for k in w}
    f = h_feat(agg, X.double())
    zg = h_head(agg["head.weight"], agg["head.bias"], f)
    p = {k: v.double() for k, v in upd.state["phead"].items()}
    zp = h_head(p["head.weight"], p["head.bias"], f)
    want = zg + zp if variant == "paper" else (zg + zp) / 2
    weights = algo.personal_model(
        env, algo.eval_view(senv, server, 0, ServerContext(1)), upd.state, RoundContext(1)
    )
    got = weights(X)
    assert torch.allclose(got.double(), want, atol=1e-6)
    assert_close(
        algo.eval_view(senv, server, None, ServerContext(1)).get("weights"), agg
    )  # global_acc: the generic model


# -- FedRoD ---------------------------------------------------------------------------------------


def test_fedrod_balanced_softmax_by_hand():
    z = np.array([[1.0, 2.0, 0.5], [0.0, -1.0, 3.0]])
    n = np.array([6.0, 2.0, 0.0])  # class 2 absent: no probability mass
    y = np.array([0, 1])
    # -log(n_y e^{z_y} / sum_c n_c e^{z_c}), computed term by term
    r0 = -np.log(6 * np.e**1 / (6 * np.e**1 + 2 * np.e**2))
    r1 = -np.log(2 * np.e**-1 / (6 * np.e**0 + 2 * np.e**-1))
    got = F.cross_entropy(
        generic_logits(torch.tensor(z), torch.tensor(n), "paper", 1.0), torch.tensor(y)
    )
    assert got.item() == pytest.approx((r0 + r1) / 2, rel=1e-12)
    scaled = generic_logits(torch.tensor(z), torch.tensor(n), "map_code", 0.5)
    assert np.allclose(scaled.numpy(), z * np.sqrt(4 * n / 8))  # (4 p_c)^gamma, p = n / 8


def test_fedrod_personal_loss_sends_no_gradient_to_the_body_or_generic_head():
    torch.manual_seed(0)
    x, y = data(6, 4, 3)
    body, ghead, phead = torch.nn.Linear(4, 5), torch.nn.Linear(5, 3), torch.nn.Linear(5, 3)

    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.body, self.head = body, ghead

        def features(self, x):
            return torch.relu(self.body(x))

    counts = torch.tensor([2.0, 2.0, 2.0])
    fedrod_loss(phead, counts, "paper", 1.0)(M(), x, y).backward()
    # hand: the body and G-head gradients are those of the BSM term alone (equal counts: the
    # log-prior is a constant shift, so BSM = CE), the P-head's is (softmax(zg + zp) - onehot)^T f
    f = torch.relu(body(x)).detach().numpy().astype(np.float64)
    Wg, bg = ghead.weight.detach().numpy(), ghead.bias.detach().numpy()
    Wp, bp = phead.weight.detach().numpy(), phead.bias.detach().numpy()
    gW, gb = np_ce_grad(Wg, bg, f, y.numpy())
    assert np.allclose(ghead.weight.grad.numpy(), gW, atol=1e-6)
    assert np.allclose(ghead.bias.grad.numpy(), gb, atol=1e-6)
    p = np_softmax(f @ Wg.T + bg + f @ Wp.T + bp)
    p[np.arange(6), y.numpy()] -= 1
    assert np.allclose(phead.weight.grad.numpy(), p.T @ f / 6, atol=1e-6)
    # body: gradient of the generic CE only, through the ReLU features (by hand)
    q = np_softmax(f @ Wg.T + bg)
    q[np.arange(6), y.numpy()] -= 1
    df = (q @ Wg) / 6 * (f > 0)
    assert np.allclose(body.weight.grad.numpy(), df.T @ x.numpy(), atol=1e-6)
