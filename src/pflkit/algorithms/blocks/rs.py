"""Restricted softmax (RS): the aggregation half of MAP, from FedRS (Li & Zhan, KDD 2021) and
MAP (Li et al., TKDE 2024), specs/map.md §2.2.

RS is cross-entropy on per-class scaled logits (MAP Eq. 8)::

    p_c = exp(a_c w_c^T h) / sum_j exp(a_j w_j^T h),   a_c = 1 if c in O^k, alpha if c in M^k

where O^k are the classes client k observes and M^k the ones it misses. A missing class's proxy
w_c then receives alpha times its plain-softmax gradient (alpha = 0: no cross-entropy gradient
at all; alpha = 1: plain softmax).

Scale rules (``mode``):

- ``hard`` (paper, default): 1 for classes with at least ``min_samples`` local training
  samples, ``alpha`` otherwise. (Observed is decided from counts, not from the released code's
  proportion test, which is a bug: specs/map.md §8.9.)
- ``soft`` (FedRS code, DittoRS): ``alpha + (1 - alpha) * n_c / max_j n_j``.
- ``complete`` (MAP §5.4, Table III, taken literally): ``n_c / sum_j n_j``; see specs/map.md
  §8.11 for why ``soft`` is the usual reading for complete classes.

The scale multiplies the whole logit (w_c^T h + b_c). MAP's models have bias-free heads, where
this is exactly Eq. 8; for a head with a bias it scales the bias too (as fluke does).

:class:`RestrictedSoftmax` is the one piece that turns an algorithm's local objective into RS:
FedRS = RS + FedAvg, ScaRS = RS + SCAFFOLD, DittoRS = RS + Ditto's global branch.
"""

from __future__ import annotations

from typing import Any, Literal

import torch
import torch.nn.functional as F
from pydantic import BaseModel
from torch import Tensor, nn

from pflkit.algorithms.base import param
from pflkit.algorithms.env import ClientEnv
from pflkit.primitives.training import LossFn

RSMode = Literal["hard", "soft", "complete"]


class RSParams(BaseModel):
    alpha: float = param(
        0.9, "MAP §4.1.3 (alpha of Eq. 8, the scale of missing classes; §5.2.5)", ge=0, le=1
    )
    rs_mode: RSMode = param("hard", "paper (MAP Eq. 8)")
    min_samples: int = param(1, "paper (observed = at least one sample)", ge=1)


def class_counts(y: Tensor, num_classes: int) -> Tensor:
    return torch.bincount(y, minlength=num_classes).float()


def rs_scale(counts: Tensor, alpha: float, mode: RSMode = "hard", min_samples: int = 1) -> Tensor:
    """Per-class logit scale a_c of a client with class counts ``counts``."""
    if mode == "hard":
        return torch.where(counts >= min_samples, 1.0, alpha)
    if mode == "soft":
        return alpha + (1 - alpha) * counts / counts.max()
    if mode == "complete":
        return counts / counts.sum()
    raise ValueError(f"unknown RS mode {mode!r}")


def rs_loss(scale: Tensor) -> LossFn:
    """Cross-entropy on RS logits ``scale * logits`` (MAP Eq. 8)."""

    def loss_fn(model: nn.Module, x: Tensor, y: Tensor) -> Tensor:
        return F.cross_entropy(model(x) * scale, y)

    return loss_fn


def client_rs_loss(y: Tensor, num_classes: int, p: RSParams) -> LossFn:
    """The RS loss of a client whose training labels are ``y``."""
    return rs_loss(rs_scale(class_counts(y, num_classes), p.alpha, p.rs_mode, p.min_samples))


class RestrictedSoftmax:
    """Mixin placed before an algorithm class: its local objective (``local_objective``)
    becomes the client's RS loss. The algorithm's Params must include :class:`RSParams`."""

    params: RSParams

    def local_objective(self, env: ClientEnv, payload: Any) -> LossFn:
        return client_rs_loss(env.data.train_y, env.num_classes, self.params)
