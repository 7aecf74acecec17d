"""FedAwS: the spreadout regularizer (paper and MAP-code forms) and its gradient by hand on three
2-d class embeddings, the server steps, that the server step changes only the class embeddings,
the positive-only client loss, the classifier lookup, and a short end-to-end run. Expected
numbers are written by hand or computed with plain numpy formulas."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torch import nn

from conftest import tiny_config
from pflkit.algorithms import build_algorithm
from pflkit.algorithms.context import ServerContext
from pflkit.algorithms.fedaws import final_linear, positive_loss, spreadout, spreadout_steps
from pflkit.engine import Simulation
from pflkit.errors import PflkitError
from pflkit.experiment import validate
from pflkit.models.base import PFLModel

# rows: cos(w1, w2) = 0.8, cos(w1, w3) = 0, cos(w2, w3) = -0.6 (w3 has norm 2)
W = torch.tensor([[1.0, 0.0], [0.8, 0.6], [0.0, -2.0]])


def test_spreadout_value_by_hand():
    # paper: d = 1 - cos = 0.2, 1.0, 1.6; margin 1.2 -> hinges 1.0, 0.2, 0 (the last pair is
    # outside the margin); every unordered pair counted twice: 2 * (1.0^2 + 0.2^2)
    assert spreadout(W, 1.2, "paper").item() == pytest.approx(2.08, abs=1e-6)
    # margin 0.9: only the first pair is inside: 2 * 0.7^2
    assert spreadout(W, 0.9, "paper").item() == pytest.approx(0.98, abs=1e-6)
    assert spreadout(W, 0.1, "paper").item() == 0.0
    # MAP code: d' = (1 - cos) / 2 = 0.1, 0.5, 0.8; margin 0.9 -> hinges 0.8, 0.4, 0.1, and each of
    # the 3 diagonal entries (d' = 0) adds 0.9^2; mean over the 9 entries
    want = (2 * (0.64 + 0.16 + 0.01) + 3 * 0.81) / 9
    assert spreadout(W, 0.9, "code").item() == pytest.approx(want, abs=1e-6)
    assert want == pytest.approx(0.45)


def test_spreadout_gradient_by_hand():
    w = W.clone().requires_grad_(True)
    spreadout(w, 1.2, "paper").backward()
    # d reg / d w_c = sum_{c'} 4 h_cc' (w^_c' - cos w^_c) / |w_c|, h = margin - 1 + cos:
    # w1: 4 * (1.0 * (0, 0.6) + 0.2 * (0, -1)) = (0, 1.6)
    # w2: 4 * 1.0 * ((1, 0) - 0.8 * (0.8, 0.6)) = (1.44, -1.92)   (pair 2-3 outside the margin)
    # w3: 4 * 0.2 * ((1, 0) - 0) / 2 = (0.4, 0)
    want = torch.tensor([[0.0, 1.6], [1.44, -1.92], [0.4, 0.0]])
    assert torch.allclose(w.grad, want, atol=1e-5)


def numpy_grad(w: np.ndarray, margin: float, form: str) -> np.ndarray:
    """Closed-form gradient of the spreadout regularizer (an independent implementation)."""
    c = len(w)
    norms = np.linalg.norm(w, axis=1, keepdims=True)
    u = w / norms
    cos = u @ u.T
    g = np.zeros_like(w)
    for i in range(c):
        for j in range(c):
            if i == j:
                continue
            dcos = (u[j] - cos[i, j] * u[i]) / norms[i, 0]
            if form == "paper":
                h = max(0.0, margin - (1 - cos[i, j]))
                g[i] += 4 * h * dcos
            else:
                h = max(0.0, margin - (1 - cos[i, j]) / 2)
                g[i] += 2 / c**2 * h * dcos
    return g


def cosines(w) -> np.ndarray:
    u = np.asarray(w, dtype=np.float64)
    u = u / np.linalg.norm(u, axis=1, keepdims=True)
    return u @ u.T


def test_one_server_step_moves_the_embeddings_apart_by_the_expected_amount():
    new = spreadout_steps(W, 1.2, steps=1, lr=0.1, form="paper")
    want = np.array([[1.0, -0.16], [0.656, 0.792], [-0.04, -2.0]])  # W - 0.1 * gradient above
    np.testing.assert_allclose(new.numpy(), want, atol=1e-6)
    before, after = cosines(W), cosines(new)
    assert after[0, 1] < before[0, 1] - 0.25  # the pair deepest inside the margin moves apart
    assert spreadout(new, 1.2).item() < spreadout(W, 1.2).item() - 0.5
    assert torch.equal(W, torch.tensor([[1.0, 0.0], [0.8, 0.6], [0.0, -2.0]]))  # input untouched
    # code form: SGD with momentum 0.9, two steps: v1 = g(W), W1 = W - lr v1;
    # v2 = 0.9 v1 + g(W1), W2 = W1 - lr v2
    w0 = W.double().numpy()
    v1 = numpy_grad(w0, 0.9, "code")
    w1 = w0 - 1.0 * v1
    w2 = w1 - 1.0 * (0.9 * v1 + numpy_grad(w1, 0.9, "code"))
    got = spreadout_steps(W.double(), 0.9, steps=2, lr=1.0, form="code")
    np.testing.assert_allclose(got.numpy(), w2, atol=1e-10)
    assert np.abs(w2 - w0).max() > 0.05


def _sim(**algo):
    return Simulation(validate(tiny_config(algorithm=algo, train={"rounds": 2})))


def test_server_step_changes_only_the_class_embeddings():
    sim = _sim(name="fedaws", margin=1.5, server_lr=0.3)  # random rows (cos ~ 0) are inside
    base = sim.server["weights"]
    gen = torch.Generator().manual_seed(3)
    uploads = {
        c: {
            "weights": {k: v + 0.1 * torch.randn(v.shape, generator=gen) for k, v in base.items()},
            "num_samples": n,
        }
        for c, n in ((0, 10), (2, 30))
    }
    server = sim.algo.aggregate(sim.senv, sim.server, uploads, ServerContext(1, "train"))
    avg = {k: 0.25 * uploads[0]["weights"][k] + 0.75 * uploads[2]["weights"][k] for k in base}
    assert set(server["weights"]) == set(base)
    for k, v in server["weights"].items():
        if k != "head.weight":  # body, classifier bias: FedAvg's n_k-weighted average
            assert torch.allclose(v, avg[k], atol=1e-6), k
    w0 = avg["head.weight"].double().numpy()
    want = w0 - 0.3 * numpy_grad(w0, 1.5, "paper")
    np.testing.assert_allclose(server["weights"]["head.weight"].numpy(), want, atol=1e-5)
    assert np.abs(want - w0).max() > 1e-2


def test_final_linear_is_the_last_linear_of_the_head_and_a_head_without_one_is_refused():
    def toy(head):
        return PFLModel(nn.Flatten(), head, 4, name="toy")

    assert final_linear(toy(nn.Linear(4, 3)))[0] == "head.weight"
    assert final_linear(toy(nn.Sequential(nn.Dropout(0.5), nn.Linear(4, 3))))[0] == "head.1.weight"
    deep = toy(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3)))
    key, layer = final_linear(deep)
    assert key == "head.2.weight" and layer is deep.head[2] and key in deep.state_dict()
    with pytest.raises(PflkitError, match="no Linear layer in its head"):
        final_linear(toy(nn.Identity()))
    algo = build_algorithm({"name": "fedaws"})
    env = SimpleNamespace(archs=["toy"], model=lambda: toy(nn.Sequential(nn.ReLU())))
    with pytest.raises(PflkitError, match="toy"):
        algo.check(env)


def test_positive_only_loss_by_hand():
    head = nn.Linear(2, 3)
    with torch.no_grad():
        head.weight.copy_(torch.tensor([[1.0, 0.0], [0.0, 2.0], [1.0, 1.0]]))
        head.bias.copy_(torch.tensor([5.0, -5.0, 0.0]))  # ignored: cosine of h and w_y
    model = PFLModel(nn.Identity(), head, 2)
    x = torch.tensor([[3.0, 0.0], [1.0, 1.0]])
    y = torch.tensor([0, 1])
    # cos(x1, w0) = 1 -> 0; cos(x2, w1) = 1/sqrt(2) -> (0.9 - 0.70710678)^2; batch mean
    want = (0.9 - 2**-0.5) ** 2 / 2
    loss = positive_loss(head, 0.9)(model, x, y)
    assert loss.item() == pytest.approx(want, abs=1e-7)
    loss.backward()
    assert head.weight.grad[2].abs().sum() == 0 and head.weight.grad[1].abs().sum() > 0
    assert head.bias.grad is None or head.bias.grad.abs().sum() == 0


def test_end_to_end_round_spreads_the_classifier_and_keeps_fedavg_elsewhere():
    aws, avg = _sim(name="fedaws"), _sim(name="fedavg")  # server_lr = 10 * train.lr = 0.5
    ra, rf = aws.run_round(1), avg.run_round(1)
    assert ra["train_loss"] == pytest.approx(rf["train_loss"], abs=1e-7)  # same client step
    assert ra["bytes_up"] == rf["bytes_up"] and ra["bytes_down"] == rf["bytes_down"]
    wa, wf = aws.server["weights"], avg.server["weights"]
    for k in wa:
        if k != "head.weight":
            assert torch.equal(wa[k], wf[k]), k
    # defaults: one plain step at lambda * eta = 10 * 0.05 on the paper's form, margin 0.9,
    # from the averaged classifier (FedAvg's, since the client steps are the same)
    w0 = wf["head.weight"].double().numpy()
    want = w0 - 0.5 * numpy_grad(w0, 0.9, "paper")
    np.testing.assert_allclose(wa["head.weight"].numpy(), want, atol=1e-5)
    ca, cf = cosines(wa["head.weight"]), cosines(wf["head.weight"])
    off = ~np.eye(len(ca), dtype=bool)
    assert ca[off].max() < cf[off].max() - 0.01
    assert "global_acc" in ra
    # the positive-only client loss leaves the classifier bias alone (no weight decay here)
    pos = _sim(name="fedaws", client_loss="positive")
    bias0 = pos.server["weights"]["head.bias"].clone()
    row = pos.run_round(1)
    assert torch.allclose(pos.server["weights"]["head.bias"], bias0, atol=1e-7)
    assert 0 < row["train_loss"] < (0.9 + 1) ** 2


@pytest.mark.parametrize(
    "bad, word",
    [
        ({"margin": 0}, "margin"),
        ({"server_steps": 0}, "server_steps"),
        ({"server_lr": -0.1}, "server_lr"),
        ({"form": "mean"}, "form"),
        ({"client_loss": "hinge"}, "client_loss"),
        ({"positive_margin": 1.5}, "positive_margin"),
    ],
)
def test_bad_parameters_are_one_sentence(bad, word):
    with pytest.raises(PflkitError) as err:
        build_algorithm({"name": "fedaws", **bad})
    msg = str(err.value)
    assert word in msg and "\n" not in msg
