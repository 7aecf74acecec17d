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
  squared distance of the joint batch / 4 (the authors' DAN-style estimator, §8.17);
  ``mmd_form="pfllib"`` is PFLlib's estimator instead (``clientphp.py`` lines 93-130): with
  d2 the pairwise squared distances (|a|^2 + |b|^2 - 2 a.b), the kernel
  sum_{s in (10, 15, 20, 50)} exp(-0.5 * d2 / s) and the loss mean(K_hh + K_pp - 2 K_hp) over
  the B x B matrices (for equal batches: the biased V-statistic of that kernel).

A client without an HPM yet (its first selection) trains on plain CE and its HPM starts as
that fine-tuned model (specs/map.md §8.4: the paper skips KT in round 1; a client first chosen
later has no HPM either). ``hpm_init="start"`` (PFLlib, whose private model is a copy of the
initial model, ``clientphp.py`` line 15) instead takes the model the fine-tuning starts from
(FedPHP: the download; MAP: stage A's result) as the HPM of a client without one, so KT from it
applies at the first selection and the momentum update of Eq. 10 (z = 1) folds it in as usual.
``hpm_bn_recompute`` (authors' code) re-estimates the HPM's BatchNorm statistics on the local
training data after every update (§8.7).
"""

from __future__ import annotations

from typing import Literal, NotRequired, TypedDict, cast

import torch
import torch.nn.functional as F
from pydantic import BaseModel
from torch import Tensor, nn

from pflkit.algorithms.base import RoundContext, param
from pflkit.algorithms.env import ClientEnv
from pflkit.models import PFLModel
from pflkit.primitives.training import LossFn, Weights, get_weights, set_weights


class HPMState(TypedDict):
    """The client's historical personalized model and its selection count (from its first
    round on)."""

    hpm: NotRequired[Weights]
    selected: NotRequired[int]


class HPMParams(BaseModel):
    lam: float = param(0.01, "MAP §4.2.2 (lambda of Eq. 13; values studied in §5.2.5)", ge=0, le=1)
    kt: Literal["kd", "mmd"] = param("kd", "MAP §4.2.2 (KD Eq. 11 or MMD Eq. 12)")
    tau: float = param(4.0, "paper (KD temperature, fixed to 4)", gt=0)
    mu: float = param(0.9, "MAP §4.2.2 (macro momentum of Eq. 10)", ge=0, le=1)
    mu_schedule: Literal["paper", "code"] = param("paper", "paper (Eq. 10); code: authors' code")
    kd_form: Literal["paper", "code"] = param("paper", "paper (Eq. 11); code: authors' code")
    mmd_form: Literal["multi_kernel", "pfllib"] = param(
        "multi_kernel", "MAP authors' code (Eq. 12); pfllib: PFLlib clientphp.py lines 93-130"
    )
    hpm_init: Literal["trained", "start"] = param(
        "trained", "paper (no KT at the first selection); start: PFLlib clientphp.py line 15"
    )
    hpm_bn_recompute: bool = param(False, "paper; true: authors' code")


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
    """Multi-kernel Gaussian MMD^2 (biased) between feature batches ``h`` and ``hp``. As the
    authors' code, each bandwidth gets 1e-8 so identical batches give 0, not 0/0."""
    z = torch.cat([h, hp])
    d2 = torch.cdist(z, z).pow(2)
    n = len(z)
    base = d2.detach().sum() / (n * n - n) / mul ** (kernels // 2)
    k = cast(Tensor, sum(torch.exp(-d2 / (base * mul**i + 1e-8)) for i in range(kernels)))
    b = len(h)
    return k[:b, :b].mean() + k[b:, b:].mean() - 2 * k[:b, b:].mean()


def mmd_pfllib(h: Tensor, hp: Tensor, bandwidths: tuple[float, ...] = (10, 15, 20, 50)) -> Tensor:
    """PFLlib's FedPHP MMD (module docstring): fixed RBF bandwidths, one mean over the summed
    B x B kernel matrices. Squared distances as |a|^2 + |b|^2 - 2 a.b, as PFLlib computes them."""

    def kernel(a: Tensor, b: Tensor) -> Tensor:
        d2 = (a * a).sum(1, keepdim=True) + (b * b).sum(1) - 2 * a @ b.T
        return cast(Tensor, sum(torch.exp(-0.5 * d2 / s) for s in bandwidths))

    return (kernel(h, h) + kernel(hp, hp) - 2 * kernel(h, hp)).mean()


def kt_loss(teacher: PFLModel, p: HPMParams) -> LossFn:
    """(1 - lambda) CE + lambda L_kt against a frozen teacher (MAP Eq. 13)."""
    teacher.eval()

    def loss_fn(module: nn.Module, x: Tensor, y: Tensor) -> Tensor:
        model = cast(PFLModel, module)  # the client's PFLModel (env.model)
        h = model.features(x)
        logits = model.head(h)
        with torch.no_grad():
            hp = teacher.features(x)
            gp = teacher.head(hp)
        if p.kt == "kd":
            kt = kd_loss(logits, gp, p.tau, p.kd_form)
        else:
            kt = mmd_pfllib(h, hp) if p.mmd_form == "pfllib" else mmd_loss(h, hp)
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
    env: ClientEnv,
    model: nn.Module,
    state: HPMState,
    p: HPMParams,
    ctx: RoundContext,
    **train: object,
) -> tuple[HPMState, float]:
    """Fine-tune ``model`` (already holding the start weights) with KT from the client's HPM
    in round context ``ctx``, then fold the result into the HPM. Returns the new client state
    and the mean loss."""
    if "hpm" not in state and p.hpm_init == "start":  # PFLlib: KT from the first selection
        state = {**state, "hpm": get_weights(model), "selected": 0}
    hpm = state.get("hpm")
    if hpm is None:
        loss = env.train(model, ctx, **train)
        new_hpm = get_weights(model)
    else:
        teacher = env.model(slot="hpm_teacher")
        set_weights(teacher, hpm)
        loss = env.train(model, ctx, loss_fn=kt_loss(teacher, p), **train)
        z = state["selected"] + 1
        m = hpm_momentum(z, env.run.client_fraction, env.run.rounds, p.mu, p.mu_schedule)
        new_hpm = hpm_update(hpm, get_weights(model), m)
    if p.hpm_bn_recompute:
        scratch = env.model(slot="hpm_teacher")
        set_weights(scratch, new_hpm)
        recompute_bn(scratch, env.data.train_x, env.run.train.batch_size)
        new_hpm = get_weights(scratch)
    return {"hpm": new_hpm, "selected": state.get("selected", 0) + 1}, loss
