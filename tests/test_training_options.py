"""Local optimisers, learning-rate schedules over rounds and data augmentation (issue 16,
item 4): the schedule's factors and Adam's first step by value, the schedule reaching every
local learning rate of a round, augmentation against a per-sample loop, bad values refused."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from pflkit.engine import Simulation
from pflkit.engine.schedule import lr_factor
from pflkit.errors import PflkitError
from pflkit.primitives.training import LocalOptim, crop_flip, local_sgd, steps_per_epoch


def test_lr_factor_by_value(tiny):
    step = tiny(
        train={"rounds": 6, "lr": 0.1, "lr_schedule": "step", "lr_gamma": 0.5, "lr_step_rounds": 2}
    ).train
    assert [lr_factor(step, r) for r in range(1, 7)] == [1, 1, 0.5, 0.5, 0.25, 0.25]
    cos = tiny(train={"rounds": 4, "lr": 0.1, "lr_schedule": "cosine", "lr_min": 0.02}).train
    # lr_r = 0.02 + 0.08 (1 + cos(pi (r - 1) / 4)) / 2: 0.1, 0.0883, 0.06, 0.0317
    expected = [0.1, 0.02 + 0.04 * (1 + math.sqrt(0.5)), 0.06, 0.02 + 0.04 * (1 - math.sqrt(0.5))]
    assert [lr_factor(cos, r) * 0.1 for r in range(1, 5)] == pytest.approx(expected)
    assert lr_factor(tiny().train, 7) == 1.0


class Recorder:
    """Records (optimiser class, lr) of every optimiser local_sgd builds."""

    def __init__(self, monkeypatch):
        self.made = []
        for cls in (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW):
            real = cls.__init__

            def init(opt, params, *a, _real=real, **kw):
                _real(opt, params, *a, **kw)
                self.made.append((type(opt).__name__, opt.param_groups[0]["lr"]))

            monkeypatch.setattr(cls, "__init__", init)


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_the_schedule_scales_every_local_lr_of_a_round(tiny, monkeypatch, optimizer):
    """Ditto trains two models per client per round: the global one at train.lr and the
    personal one at personal_lr; the step schedule halves both from round 2 on."""
    rec = Recorder(monkeypatch)
    cfg = tiny(
        algorithm={"name": "ditto", "personal_lr": 0.2},
        train={
            "rounds": 2,
            "lr": 0.05,
            "optimizer": optimizer,
            "lr_schedule": "step",
            "lr_gamma": 0.5,
        },
        eval={"global_model": False},
    )
    with Simulation(cfg) as sim:
        sim.run_round(1)
        first, rec.made[:] = list(rec.made), []
        sim.run_round(2)
    name = {"sgd": "SGD", "adamw": "AdamW"}[optimizer]
    assert {n for n, _ in first + rec.made} == {name}
    assert sorted({lr for _, lr in first}) == pytest.approx([0.05, 0.2])
    assert sorted({lr for _, lr in rec.made}) == pytest.approx([0.025, 0.1])


def test_adam_first_step_moves_each_weight_by_lr_against_its_gradient_sign():
    """Adam's first step is -lr * m / (sqrt(v) + eps) with m = (1-b1) g, v = (1-b2) g^2 after
    bias correction: -lr * g / (|g| + eps) = -lr * sign(g)."""
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    x, y = torch.randn(4, 3), torch.tensor([0, 1, 1, 0])
    before = model.weight.detach().clone()
    grad = torch.autograd.grad(nn.functional.cross_entropy(model(x), y), model.weight)[0]
    optim = LocalOptim("adam", lr_factor=0.5)
    local_sgd(model, x, y, epochs=1, batch_size=4, lr=0.02, optim=optim)
    assert model.weight.detach() - before == pytest.approx(-0.01 * grad.sign(), abs=1e-6)


def test_parameters_outside_params_get_no_gradient_and_are_restored():
    """Training only the second layer (FedRep's head epochs) computes no gradient for the
    first; its step on the second layer is one SGD step with the hand-computed gradient; the
    first layer requires a gradient again afterwards, also when the loss raises."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    x, y = torch.randn(5, 3), torch.tensor([0, 1, 1, 0, 1])
    head = model[1]
    h = model[0](x).detach()
    p = torch.softmax(h @ head.weight.detach().T + head.bias.detach(), dim=1)
    grad_w = (p - nn.functional.one_hot(y, 2)).T @ h / 5  # dCE/dW of a linear layer, batch mean
    before = head.weight.detach().clone()
    seen = []

    def loss_fn(m, xb, yb):
        seen.append([t.requires_grad for t in m.parameters()])
        return nn.functional.cross_entropy(m(xb), yb)

    local_sgd(
        model, x, y, epochs=1, batch_size=5, lr=0.1, loss_fn=loss_fn, params=head.parameters()
    )
    assert seen == [[False, False, True, True]]
    assert model[0].weight.grad is None and model[0].bias.grad is None
    assert head.weight.detach() == pytest.approx(before - 0.1 * grad_w, abs=1e-6)
    assert all(t.requires_grad for t in model.parameters())

    def failing(m, xb, yb):
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        local_sgd(
            model, x, y, epochs=1, batch_size=5, lr=0.1, loss_fn=failing, params=head.parameters()
        )
    assert all(t.requires_grad for t in model.parameters())


def test_crop_flip_equals_a_per_sample_loop():
    x = torch.arange(2 * 2 * 3 * 4, dtype=torch.float32).reshape(2, 2, 3, 4)
    torch.manual_seed(3)
    out = crop_flip(2)(x)
    torch.manual_seed(3)  # the same draws, in the same order, applied one sample at a time
    dy, dx = torch.randint(0, 5, (2, 2))
    flip = torch.rand(2) < 0.5
    for i in range(2):
        padded = torch.zeros(2, 7, 8)
        padded[:, 2:5, 2:6] = x[i]
        crop = padded[:, dy[i] : dy[i] + 3, dx[i] : dx[i] + 4]
        assert torch.equal(out[i], crop.flip(2) if flip[i] else crop)
    torch.manual_seed(3)
    assert torch.equal(crop_flip(2)(x), out)  # deterministic under a seed
    assert torch.equal(crop_flip(0)(x)[~flip], x[~flip])  # no padding, no flip: the input


def test_augmentation_is_deterministic_and_changes_training(tiny):
    def final(augment):
        cfg = tiny(train={"rounds": 2, "augment": augment, "crop_padding": 1})
        with Simulation(cfg) as sim:
            return [sim.run_round(r)["pers_acc_mean"] for r in (1, 2)]

    assert final("crop_flip") == final("crop_flip")
    assert final("crop_flip") != final("none")


@pytest.mark.parametrize(
    "key, value, message",
    [
        ("optimizer", "rmsprop", "train.optimizer"),
        ("lr_schedule", "linear", "train.lr_schedule"),
        ("lr_gamma", 0, "train.lr_gamma"),
        ("lr_step_rounds", 0, "train.lr_step_rounds"),
        ("lr_min", 1.0, "must not exceed train.lr"),
        ("augment", "mixup", "train.augment"),
    ],
)
def test_bad_values_are_one_sentence(tiny, key, value, message):
    with pytest.raises(PflkitError, match=message):
        tiny(train={key: value})


def test_augmenting_non_images_is_refused(tiny):
    cfg = tiny(data={"dataset": "synthetic"}, train={"augment": "crop_flip"})
    with pytest.raises(PflkitError, match="needs images"):
        Simulation(cfg)


def _batch_sizes(n: int, batch_size: int, epochs: int, drop_last: bool = False) -> list[int]:
    seen: list[int] = []

    def loss_fn(m, xb, yb):
        seen.append(len(yb))
        return nn.functional.cross_entropy(m(xb), yb)

    torch.manual_seed(0)
    x, y = torch.randn(n, 3), torch.arange(n) % 2
    optim = LocalOptim(drop_last=drop_last)
    model = nn.Linear(3, 2)
    local_sgd(
        model, x, y, epochs=epochs, batch_size=batch_size, lr=0.1, loss_fn=loss_fn, optim=optim
    )
    assert steps_per_epoch(n, batch_size, drop_last) * epochs == len(seen)
    return seen


def test_drop_last_skips_each_epochs_short_batch():
    """25 samples in batches of 10: 10, 10, 5 each epoch by default; 10, 10 with drop_last
    (PFLlib's DataLoader); a client smaller than a batch still takes one step on all of it."""
    assert _batch_sizes(25, 10, 2) == [10, 10, 5, 10, 10, 5]
    assert _batch_sizes(25, 10, 2, drop_last=True) == [10, 10, 10, 10]
    assert _batch_sizes(20, 10, 1, drop_last=True) == [10, 10]
    assert _batch_sizes(5, 10, 2, drop_last=True) == [5, 5]


def test_the_engine_applies_train_drop_last(tiny, monkeypatch):
    """train.drop_last reaches the local_sgd calls of a round (the engine's round context)."""
    from pflkit.algorithms import env as env_module

    seen = []

    def recording(*a, **kw):
        seen.append(kw["optim"].drop_last)
        return local_sgd(*a, **kw)

    monkeypatch.setattr(env_module, "local_sgd", recording)
    for drop in (False, True):
        with Simulation(tiny(train={"rounds": 1, "drop_last": drop})) as sim:
            sim.run_round(1)
        assert seen and set(seen) == {drop}
        seen.clear()
