"""pflkit.algorithms.blocks.rs: the restricted softmax (FedRS, MAP stage A, ScaMAP)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from map_helpers import Head, np_softmax, two_heads
from pflkit.algorithms.blocks.rs import class_counts, rs_loss, rs_scale


def test_rs_scales_exactly_the_missing_classes_logits():
    counts = torch.tensor([5.0, 0.0, 2.0, 0.0])
    scale = rs_scale(counts, alpha=0.3)
    assert scale.tolist() == pytest.approx([1.0, 0.3, 1.0, 0.3])
    torch.manual_seed(0)
    logits = torch.randn(6, 4)
    scaled = logits * scale
    assert torch.equal(scaled[:, [0, 2]], logits[:, [0, 2]])  # observed: unchanged
    assert torch.allclose(scaled[:, [1, 3]], 0.3 * logits[:, [1, 3]])  # missing: alpha times
    assert rs_scale(counts, 0.3, min_samples=3).tolist() == pytest.approx([1.0, 0.3, 0.3, 0.3])


def test_rs_with_alpha_one_is_plain_softmax():
    torch.manual_seed(0)
    model, x, y = Head(), torch.randn(8, 3), torch.tensor([0, 2] * 4)
    scale = rs_scale(class_counts(y, 4), alpha=1.0)
    assert torch.equal(rs_loss(scale)(model, x, y), F.cross_entropy(model(x), y))


def test_rs_with_alpha_zero_gives_missing_proxies_no_gradient():
    torch.manual_seed(0)
    model, x, y = Head(), torch.randn(8, 3), torch.tensor([0, 2] * 4)
    rs_loss(rs_scale(class_counts(y, 4), alpha=0.0))(model, x, y).backward()
    g = model.head.weight.grad
    assert torch.count_nonzero(g[[1, 3]]) == 0  # missing classes 1 and 3
    assert torch.count_nonzero(g[[0, 2]]) > 0
    # with alpha = 0.5 the missing proxies' gradient is damped, not zero
    model.zero_grad()
    rs_loss(rs_scale(class_counts(y, 4), alpha=0.5))(model, x, y).backward()
    assert torch.count_nonzero(model.head.weight.grad[[1, 3]]) > 0


def test_rs_soft_and_complete_modes():
    counts = torch.tensor([10.0, 0.0, 5.0])
    assert rs_scale(counts, 0.2, "soft").tolist() == pytest.approx([1.0, 0.2, 0.2 + 0.8 * 0.5])
    assert rs_scale(counts, 0.2, "complete").tolist() == pytest.approx([10 / 15, 0.0, 5 / 15])


def test_rs_loss_by_value_for_a_fractional_alpha():
    # MAP Eq. 8 with alpha = 0.5 on a client that observes classes 0 and 2: logits z = W x,
    # missing classes 1 and 3 scaled by 0.5, then cross-entropy averaged over the batch
    model, _, x, y = two_heads()
    z = np.array([[1, 2, 0, 3], [0, -1, 3, -1], [2, 0.5, 1, 2.5]])  # W x by hand
    a = np.array([1, 0.5, 1, 0.5])
    p = np_softmax(z * a)
    expect = -np.mean(np.log(p[[0, 1, 2], [0, 2, 2]]))
    scale = rs_scale(class_counts(y, 4), alpha=0.5)
    assert rs_loss(scale)(model, x, y).item() == pytest.approx(expect, rel=1e-6)
