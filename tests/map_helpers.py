"""Helpers of the MAP-family tests (tests/algorithms/test_map.py, test_fedphp.py,
blocks/test_rs.py, blocks/test_hpm.py): a bias-free linear model whose features are its input,
a fixed student/teacher pair of them, a numpy softmax, and MAP Eq. 13 with KD written out."""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from split_helpers import mlp_logits


class Head(torch.nn.Module):
    """features = x, logits = W x (bias-free, as MAP's models)."""

    def __init__(self, d=3, c=4):
        super().__init__()
        self.head = torch.nn.Linear(d, c, bias=False)

    def features(self, x):
        return x

    def forward(self, x):
        return self.head(x)


def np_softmax(z):
    e = np.exp(z - z.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def two_heads():
    """A student and a teacher Head with fixed weights, a batch of 3 and its labels."""
    student, teacher = Head(), Head()
    with torch.no_grad():
        student.head.weight.copy_(torch.tensor([[1.0, 0, 0], [0, 1, 0], [0, 0, 1], [1, 1, 0]]))
        teacher.head.weight.copy_(torch.tensor([[0.5, 0, 1], [2, 0, 0], [0, -1, 0], [0, 0, 0]]))
    x = torch.tensor([[1.0, 2.0, 0.0], [0.0, -1.0, 3.0], [2.0, 0.5, 1.0]])
    return student, teacher, x, torch.tensor([0, 2, 2])


def kt_ce(hpm, lam, tau=4.0):
    """MAP Eq. 13 with KD (Eq. 11) written out: (1 - lam) CE + lam tau^2 KL(p_hpm || p) at
    temperature tau, the KL summed over classes and averaged over the batch."""

    def loss(w, x, y):
        z = mlp_logits(w, x)
        pt = torch.softmax(mlp_logits(hpm, x) / tau, 1)
        kl = (pt * (pt.log() - torch.log_softmax(z / tau, 1))).sum(1).mean()
        return (1 - lam) * F.cross_entropy(z, y) + lam * tau**2 * kl

    return loss
