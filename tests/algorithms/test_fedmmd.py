"""FedMMD: the client loss CE + lam * MMD^2(local features, frozen global features) by value
(a hand-computed single-kernel case and an independent numpy multi-kernel estimator), no
gradient into the global stream, lam = 0 is FedAvg exactly, the MMD term keeps the local
features near the global ones, bad parameters."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch import nn

from conftest import tiny_config
from pflkit.algorithms.base import parse_params
from pflkit.algorithms.context import RoundContext, ServerContext
from pflkit.algorithms.fedmmd import fedmmd_loss
from pflkit.engine import Simulation
from pflkit.errors import PflkitError
from pflkit.experiment import validate
from pflkit.models import PFLModel


def tiny_model(body: nn.Module, head: nn.Module, dim: int) -> PFLModel:
    return PFLModel(body, head, dim)


def np_mmd(h: np.ndarray, hg: np.ndarray, kernels: int = 5, mul: float = 2.0) -> float:
    """The biased multi-kernel Gaussian MMD^2 written out in numpy (DAN / MAP code form)."""
    z = np.concatenate([h, hg]).astype(np.float64)
    n, b = len(z), len(h)
    d2 = ((z[:, None, :] - z[None, :, :]) ** 2).sum(-1)
    base = d2.sum() / (n * n - n) / mul ** (kernels // 2)
    k = sum(np.exp(-d2 / (base * mul**i + 1e-8)) for i in range(kernels))
    return float(k[:b, :b].mean() + k[b:, b:].mean() - 2 * k[:b, b:].mean())


def np_ce(logits: np.ndarray, y: np.ndarray) -> float:
    z = logits - logits.max(1, keepdims=True)
    logp = z - np.log(np.exp(z).sum(1, keepdims=True))
    return float(-logp[np.arange(len(y)), y].mean())


def test_loss_by_hand_single_kernel():
    # local body w = [1, 0], global body w = [0, 1]; x = [0, 1] twice -> h = [0, 0], h_g = [1, 1]
    local = tiny_model(nn.Linear(2, 1, bias=False), nn.Linear(1, 2, bias=False), 1)
    glob = tiny_model(nn.Linear(2, 1, bias=False), nn.Linear(1, 2, bias=False), 1)
    with torch.no_grad():
        local.body.weight.copy_(torch.tensor([[1.0, 0.0]]))
        local.head.weight.copy_(torch.tensor([[1.0], [-1.0]]))  # logits [0, 0]: CE = ln 2
        glob.body.weight.copy_(torch.tensor([[0.0, 1.0]]))
        glob.head.weight.copy_(torch.tensor([[5.0], [5.0]]))
    x = torch.tensor([[0.0, 1.0], [0.0, 1.0]])
    y = torch.tensor([0, 1])
    # one kernel: squared distances 0 within a stream, 1 across (8 of the 12 off-diagonal
    # entries), bandwidth 8 / 12 = 2/3; MMD^2 = 1 + 1 - 2 exp(-1.5) = 1.5537397
    loss = fedmmd_loss(glob, lam=0.1, kernels=1)(local, x, y)
    assert math.exp(-1.5) == pytest.approx(0.22313016, abs=1e-8)
    assert loss.item() == pytest.approx(0.69314718 + 0.1 * 1.55373968, abs=1e-6)
    # lam scales the MMD term only (sign and size)
    loss3 = fedmmd_loss(glob, lam=3.0, kernels=1)(local, x, y)
    assert loss3.item() == pytest.approx(0.69314718 + 3.0 * 1.55373968, abs=1e-5)


def test_loss_matches_numpy_multi_kernel_and_global_stream_gets_no_gradient():
    torch.manual_seed(0)

    def net():
        return tiny_model(nn.Sequential(nn.Linear(3, 4), nn.Tanh()), nn.Linear(4, 3), 4)

    local, glob = net(), net()
    x = torch.randn(6, 3)
    y = torch.tensor([0, 1, 2, 0, 1, 2])
    loss = fedmmd_loss(glob, lam=0.5)(local, x, y)  # kernels 5, mul 2

    def np_forward(m):
        w1, b1 = m.body[0].weight.detach().numpy(), m.body[0].bias.detach().numpy()
        h = np.tanh(x.numpy() @ w1.T + b1)
        return h, h @ m.head.weight.detach().numpy().T + m.head.bias.detach().numpy()

    h, logits = np_forward(local)
    hg, _ = np_forward(glob)
    assert np_mmd(h, hg) > 0.01  # a non-trivial case
    want = np_ce(logits, y.numpy()) + 0.5 * np_mmd(h, hg)
    assert loss.item() == pytest.approx(want, abs=1e-5)

    loss.backward()
    assert all(p.grad is None for p in glob.parameters())  # the global stream is frozen
    assert all(p.grad is not None for p in local.parameters())
    assert not glob.training  # eval mode (BatchNorm would use running statistics)


def test_global_stream_is_the_downloaded_model():
    cfg = validate(tiny_config(algorithm={"name": "fedmmd", "lam": 0.5}))
    sim = Simulation(cfg)
    env = sim.envs[0]
    torch.manual_seed(3)
    down = {k: v + 0.3 * torch.randn_like(v) for k, v in sim.server["weights"].items()}
    loss_fn = sim.algo.local_objective(env, {"weights": down})
    local = env.model()
    local.load_state_dict(sim.server["weights"])
    ref = env.model("reference")
    ref.load_state_dict(down)
    x, y = env.data.train_x[:16], env.data.train_y[:16]
    with torch.no_grad():
        h, hg, logits = local.features(x), ref.features(x), local(x)
    want = np_ce(logits.numpy(), y.numpy()) + 0.5 * np_mmd(h.numpy(), hg.numpy())
    assert loss_fn(local, x, y).item() == pytest.approx(want, abs=1e-5)
    sim.close()


def run(algorithm: dict, rounds: int = 2, **train):
    cfg = validate(tiny_config(algorithm=algorithm, train={"rounds": rounds, **train}))
    sim = Simulation(cfg)
    rows = [sim.run_round(r) for r in range(1, rounds + 1)]
    sim.close()
    return sim, rows


def test_lam_zero_is_fedavg_exactly_and_lam_changes_the_run():
    avg, _ = run({"name": "fedavg"})
    zero, _ = run({"name": "fedmmd", "lam": 0.0})
    some, rows = run({"name": "fedmmd", "lam": 1.0})
    w_avg, w_zero, w_some = avg.server["weights"], zero.server["weights"], some.server["weights"]
    assert all(torch.equal(w_avg[k], w_zero[k]) for k in w_avg)
    assert any(not torch.allclose(w_avg[k], w_some[k]) for k in w_avg)
    # the whole model goes up and down, as in FedAvg (+ 8 bytes for num_samples)
    full = sum(v.numel() * v.element_size() for v in w_avg.values())
    assert rows[0]["bytes_down"] == [full] * len(rows[0]["clients"])
    assert rows[0]["bytes_up"] == [full + 8] * len(rows[0]["clients"])


def feature_mmd_after_training(lam: float) -> float:
    """One client step of client 0 from the initial model; MMD^2 between the trained model's
    and the downloaded model's features on the client's training data."""
    cfg = validate(
        tiny_config(
            algorithm={"name": "fedmmd", "lam": lam},
            train={"rounds": 1, "local_epochs": 3, "lr": 0.1},
        )
    )
    sim = Simulation(cfg)
    env = sim.envs[0]
    payload = sim.algo.configure(sim.senv, sim.server, 0, ServerContext(1, "train"))
    torch.manual_seed(1)
    upload = sim.algo.client_update(env, payload, {}, RoundContext(1)).upload
    model = env.model("measure")
    feats = []
    for w in (upload["weights"], payload["weights"]):
        model.load_state_dict(w)
        with torch.no_grad():
            feats.append(model.features(env.data.train_x).numpy())
    sim.close()
    return np_mmd(*feats)


def test_mmd_term_keeps_local_features_near_the_global_ones():
    free, tied = feature_mmd_after_training(0.0), feature_mmd_after_training(1.0)
    assert tied < 0.5 * free, (free, tied)


@pytest.mark.parametrize(
    "bad, match",
    [
        ({"lam": -0.1}, "fedmmd.lam"),
        ({"kernels": 0}, "fedmmd.kernels"),
        ({"kernel_mul": 0}, "fedmmd.kernel_mul"),
        ({"sigma": 1.0}, "has no parameter 'sigma'"),
    ],
)
def test_bad_parameters_are_one_sentence(bad, match):
    with pytest.raises(PflkitError, match=match) as err:
        parse_params({"name": "fedmmd", **bad})
    assert "\n" not in str(err.value)
