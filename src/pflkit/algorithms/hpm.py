"""Inherited private model (HPM): the personalization half of MAP, from FedPHP (Li et al.,
ECML-PKDD 2021) and MAP (Li et al., TKDE 2024), specs/map.md §2.3.

Each client keeps a private model psi_p that never leaves it, a moving average of its past
personalized models (MAP Eq. 10)::

    psi_p <- (1 - mu_k) * psi_hat + mu_k * psi_p,   mu_k = clip(mu * z_k / (Q * T), 0, 1)

where z_k counts the client's selections including the current one, Q is the client fraction
and T the number of rounds (``mu_schedule="paper"``). The authors' code counts z_k *before*
the current selection, divides by max(int(Q*T), 1) and clips to [0, 0.9]
(``mu_schedule="code"``, specs/map.md §8.5).

While fine-tuning, knowledge is transferred from the (frozen, eval-mode) HPM with the loss of
Eq. 13, (1 - lambda) CE + lambda L_kt, where L_kt is

- ``kd`` (Eq. 11): tau^2 * KL(softmax(g_p / tau) || softmax(g / tau)), batch mean, tau = 4;
  ``kd_form="code"`` is the authors' -sum softmax(g_p / tau) log_softmax(g) (no tau on the
  student, no tau^2; specs/map.md §8.6);
- ``mmd`` (Eq. 12): multi-kernel Gaussian MMD between the student's and the HPM's features,
  biased V-statistic, 5 kernels with bandwidths base * 2^i (i = 0..4), base = mean pairwise
  squared distance of the joint batch / 4 (the authors' DAN-style estimator, §8.17).

A client without an HPM yet (its first selection) trains on plain CE and its HPM starts as
that fine-tuned model (specs/map.md §8.4: the paper skips KT in round 1; a client first chosen
later has no HPM either). ``hpm_bn_recompute`` (authors' code) re-estimates the HPM's BatchNorm
statistics on the local training data after every update (§8.7).
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from pydantic import BaseModel, Field
from torch import Tensor, nn

from pflkit.algorithms.base import Context, State
from pflkit.algorithms.training import LossFn, Weights, get_weights, set_weights


class HPMParams(BaseModel):
    lam: float = Field(0.01, ge=0, le=1)  # lambda of Eq. 13; MAP default (specs §3)
    kt: Literal["kd", "mmd"] = "kd"
    tau: float = Field(4.0, gt=0)  # KD temperature, fixed to 4 in the paper
    mu: float = Field(0.9, ge=0, le=1)  # macro momentum
    mu_schedule: Literal["paper", "code"] = "paper"
    kd_form: Literal["paper", "code"] = "paper"
    hpm_bn_recompute: bool = False


def hpm_momentum(z: int, q: float, t: int, mu: float = 0.9, schedule: str = "paper") -> float:
    """mu_k for a client selected for the z-th time (z counts the current selection)."""
    if schedule == "paper":
        return min(max(mu * z / (q * t), 0.0), 1.0)
    return min(max(mu * (z - 1) / max(int(q * t), 1), 0.0), 0.9)


def hpm_update(hpm: Weights, new: Weights, m: float) -> Weights:
    """(1 - m) * new + m * hpm for floating entries; integer buffers come from ``new``."""
    return {
        k: torch.lerp(v, hpm[k], m) if v.is_floating_point() else v.clone() for k, v in new.items()
    }


def kd_loss(student: Tensor, teacher: Tensor, tau: float = 4.0, form: str = "paper") -> Tensor:
    target = F.softmax(teacher / tau, dim=1)
    if form == "paper":
        log_p = F.log_softmax(student / tau, dim=1)
        return tau**2 * F.kl_div(log_p, target, reduction="batchmean")
    return -(target * F.log_softmax(student, dim=1)).sum(1).mean()


def mmd_loss(h: Tensor, hp: Tensor, kernels: int = 5, mul: float = 2.0) -> Tensor:
    """Multi-kernel Gaussian MMD^2 (biased) between feature batches ``h`` and ``hp``."""
    z = torch.cat([h, hp])
    d2 = torch.cdist(z, z).pow(2)
    n = len(z)
    base = d2.detach().sum() / (n * n - n) / mul ** (kernels // 2)
    k = sum(torch.exp(-d2 / (base * mul**i)) for i in range(kernels))
    b = len(h)
    return k[:b, :b].mean() + k[b:, b:].mean() - 2 * k[:b, b:].mean()


def kt_loss(teacher: nn.Module, p: HPMParams) -> LossFn:
    """(1 - lambda) CE + lambda L_kt against a frozen teacher (MAP Eq. 13)."""
    teacher.eval()

    def loss_fn(model, x, y):
        h = model.features(x)
        logits = model.head(h)
        with torch.no_grad():
            hp = teacher.features(x)
            gp = teacher.head(hp)
        kt = kd_loss(logits, gp, p.tau, p.kd_form) if p.kt == "kd" else mmd_loss(h, hp)
        return (1 - p.lam) * F.cross_entropy(logits, y) + p.lam * kt

    return loss_fn


@torch.no_grad()
def recompute_bn(model: nn.Module, x: Tensor, batch_size: int) -> None:
    """Re-estimate BatchNorm running statistics with a cumulative average over ``x``."""
    bns = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    if not bns:
        return
    saved = [m.momentum for m in bns]
    for m in bns:
        m.reset_running_stats()
        m.momentum = None
    model.train()
    for i in range(0, len(x), batch_size):
        model(x[i : i + batch_size])
    for m, mom in zip(bns, saved, strict=True):
        m.momentum = mom


def personalize(
    ctx: Context, model: nn.Module, cid: int, state: State, p: HPMParams, **train: object
) -> tuple[State, float]:
    """Fine-tune ``model`` (already holding the start weights) with KT from the client's HPM,
    then fold the result into the HPM. Returns the new client state and the mean loss."""
    arch = ctx.arch(cid)
    hpm = state.get("hpm")
    if hpm is None:
        loss = ctx.train(model, cid, **train)
        new_hpm = get_weights(model)
    else:
        teacher = ctx.model(arch, slot="hpm_teacher")
        set_weights(teacher, hpm)
        loss = ctx.train(model, cid, loss_fn=kt_loss(teacher, p), **train)
        z = state["selected"] + 1
        cfg = ctx.cfg.train
        m = hpm_momentum(z, cfg.client_fraction, cfg.rounds, p.mu, p.mu_schedule)
        new_hpm = hpm_update(hpm, get_weights(model), m)
    if p.hpm_bn_recompute:
        scratch = ctx.model(arch, slot="hpm_teacher")
        set_weights(scratch, new_hpm)
        recompute_bn(scratch, ctx.client(cid).train_x, ctx.cfg.train.batch_size)
        new_hpm = get_weights(scratch)
    return {"hpm": new_hpm, "selected": state.get("selected", 0) + 1}, loss
