"""FedPer, FedRep, FedRoD, Per-FedAvg and pFedMe: each one's defining math against a hand (numpy)
computation, FedRep's freezing, and exact byte counts (only shared parts cross the wire)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from conftest import tiny_config
from pflkit.algorithms import parse_params
from pflkit.algorithms.context import RoundContext
from pflkit.algorithms.fedrod import fedrod_loss, generic_logits
from pflkit.algorithms.perfedavg import meta_loss
from pflkit.algorithms.pfedme import moreau_steps, pfedme_loss
from pflkit.engine import run_experiment
from pflkit.errors import PflkitError
from pflkit.experiment import validate
from split_helpers import data, np_ce_grad, np_softmax, one_client

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
        env, algo.configure(senv, server, 0, 1, "train"), state, RoundContext(1, "t")
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
        env, algo.configure(senv, server, 0, 1, "train"), state, RoundContext(1, "t")
    )
    assert sorted(up["body"]) == sorted(server["body"])
    body_same = all(torch.equal(up["body"][k], server["body"][k]) for k in server["body"])
    private_same = [torch.equal(new["head"][k], state["head"][k]) for k in state["head"]]
    if body_epochs == 0:
        assert body_same and not any(private_same)
    else:
        assert not body_same and all(private_same)


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


# -- Per-FedAvg -------------------------------------------------------------------------------


def test_perfedavg_personal_model_is_one_sgd_step_of_size_alpha():
    x, y = data(8, 3, 2)
    algo, senv, env = one_client({"name": "perfedavg", "alpha": 0.3}, x, y, 2)  # batch = all 8
    w = algo.server_init(senv)["weights"]
    adapted = algo.personal_weights(env, {"weights": w}, {}, RoundContext(1))
    W, b = w["head.weight"].double().numpy(), w["head.bias"].double().numpy()
    gW, gb = np_ce_grad(W, b, x.double().numpy(), y.numpy())
    assert np.allclose(adapted["head.weight"].numpy(), W - 0.3 * gW, atol=1e-6)
    assert np.allclose(adapted["head.bias"].numpy(), b - 0.3 * gb, atol=1e-6)


@pytest.mark.parametrize("variant", ["fo", "hf"])
def test_perfedavg_meta_step_direction_by_hand(variant):
    torch.manual_seed(1)
    x, y = data(9, 3, 3)
    x = x.double()
    model = torch.nn.Linear(3, 3).double()
    alpha, delta = 0.4, 1e-3
    meta_loss(alpha, variant, delta)(model, x, y).backward()
    W, b = model.weight.detach().numpy(), model.bias.detach().numpy()
    xs, ys = x.numpy(), y.numpy()
    if variant == "fo":  # the batch split in two: D = 5 samples, D' = 4
        (x1, y1), (x2, y2) = (xs[:5], ys[:5]), (xs[5:], ys[5:])
    else:  # in three: D, D', D'' of 3 samples each
        (x1, y1), (x2, y2), (x3, y3) = [(xs[i : i + 3], ys[i : i + 3]) for i in (0, 3, 6)]
    g1W, g1b = np_ce_grad(W, b, x1, y1)
    vW, vb = np_ce_grad(W - alpha * g1W, b - alpha * g1b, x2, y2)
    if variant == "hf":
        pW, pb = np_ce_grad(W + delta * vW, b + delta * vb, x3, y3)
        mW, mb = np_ce_grad(W - delta * vW, b - delta * vb, x3, y3)
        vW, vb = vW - alpha * (pW - mW) / (2 * delta), vb - alpha * (pb - mb) / (2 * delta)
    assert np.allclose(model.weight.grad.numpy(), vW, atol=1e-9)
    assert np.allclose(model.bias.grad.numpy(), vb, atol=1e-9)


# -- pFedMe ---------------------------------------------------------------------------------------


def test_pfedme_inner_problem_on_a_quadratic():
    a = np.array([[2.0, 0.0], [1.0, 1.0], [0.0, 3.0]])
    bb = np.array([1.0, -2.0, 0.5])
    w = np.array([0.3, -0.7])
    lam = 2.0
    # minimiser of 1/2 ||A theta - b||^2 + lam/2 ||theta - w||^2: (A^T A + lam I)^-1 (A^T b + lam w)
    star = np.linalg.solve(a.T @ a + lam * np.eye(2), a.T @ bb + lam * w)
    at, bt = torch.tensor(a), torch.tensor(bb)

    def f(th):
        return 0.5 * (at @ th["t"] - bt).pow(2).sum()

    theta0 = {"t": torch.zeros(2, dtype=torch.float64)}
    anchor = {"t": torch.tensor(w)}
    one = moreau_steps(f, theta0, anchor, lam, 0.05, 1)["t"].numpy()
    assert np.allclose(one, -0.05 * (a.T @ (-bb) + lam * (0 - w)))  # one GD step by hand
    many = moreau_steps(f, theta0, anchor, lam, 0.05, 2000)["t"].numpy()
    assert np.allclose(many, star, atol=1e-10)


def test_pfedme_local_step_pulls_w_toward_theta():
    torch.manual_seed(2)
    x, y = data(6, 3, 3)
    model = torch.nn.Linear(3, 3)
    theta = {k: v.detach().clone() for k, v in model.named_parameters()}
    lam, lr, k = 15.0, 0.01, 3
    pfedme_loss(theta, lam, lr, k)(model, x, y).backward()
    W, b = model.weight.detach().double().numpy(), model.bias.detach().double().numpy()
    tW, tb = W.copy(), b.copy()
    for _ in range(k):  # inner GD by hand, then the w-gradient lam (w - theta)
        gW, gb = np_ce_grad(tW, tb, x.double().numpy(), y.numpy())
        tW, tb = tW - lr * (gW + lam * (tW - W)), tb - lr * (gb + lam * (tb - b))
    assert np.allclose(theta["weight"].numpy(), tW, atol=1e-6)
    assert np.allclose(model.weight.grad.numpy(), lam * (W - tW), atol=1e-5)
    assert np.allclose(model.bias.grad.numpy(), lam * (b - tb), atol=1e-5)


def test_pfedme_server_mixes_with_beta():
    x, y = data(4, 3, 2)
    algo, senv, _ = one_client({"name": "pfedme", "beta": 2.0}, x, y, 2)
    old = {"head.weight": torch.tensor([[1.0]]), "head.bias": torch.tensor([0.0])}
    ups = {
        0: {"weights": {"head.weight": torch.tensor([[3.0]]), "head.bias": torch.tensor([1.0])}},
        1: {"weights": {"head.weight": torch.tensor([[5.0]]), "head.bias": torch.tensor([3.0])}},
    }
    for u in ups.values():
        u["num_samples"] = 1
    new = algo.aggregate(senv, {"weights": old}, ups, 1, "train")["weights"]
    # (1 - 2) * 1 + 2 * mean(3, 5) = 7;  (1 - 2) * 0 + 2 * mean(1, 3) = 4
    assert new["head.weight"].item() == 7.0 and new["head.bias"].item() == 4.0


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
