"""Sim-pFD and TopK-pFD: the similarity-based personalised distillation baselines defined in
KT-pFL (Zhang et al., "Parameterized Knowledge Transfer for Personalized Federated Learning",
NeurIPS 2021, §5; specs/ktpfl.md §5, §9).

**Sim-pFD** (KT-pFL §5, "Sim-pFL"): as KT-pFL, but ``c`` is not learned: client ``n``'s teacher
weights come from the cosine similarity between the flattened ``B x C`` soft-prediction matrices
of the round. ``sim_weights="cosine"`` (default, the paper's wording): ``c[m, n] = cos(S_m, S_n)
/ sum_m' cos(S_m', S_n)`` (soft predictions are non-negative, so every cosine is in [0, 1]);
``"code"``: the authors' ``cos(S_m, S_n) - min_m' cos(S_m', S_n)``, normalised, so the least
similar client gets weight 0. Self included in both (as the code).

**TopK-pFD** (KT-pFL §5, "TopK-pFL"): client ``n``'s teacher is the plain average of the ``k``
clients most cosine-similar to it (``k = 5``, the paper's; the client itself is always among
them, cos = 1; the code keeps about N/2 instead).

Sim-pFD and TopK-pFD use KT-pFL's order by default (train, share, distil; the authors' code
distils first: ``order: distill_then_train``), ``T = 1`` (the code's engines; the same default
as KT-pFL and FedMD) and ``kd_loss: kl``; any of :class:`SoftTeacherKD`'s parameters can be
changed. Each client is scored with its own model after the round's last step.
"""

from __future__ import annotations

from typing import Literal

import torch

from pflkit.algorithms.base import State, param, register
from pflkit.algorithms.blocks.distill import SoftTeacherKD, cosine_matrix


def similarity_weights(soft: torch.Tensor, kind: str = "cosine") -> torch.Tensor:
    """Sim-pFD's teacher weights ``[A, A]`` (column = student) from soft predictions."""
    cos = cosine_matrix(soft)
    if kind == "code":
        cos = cos - cos.min(dim=0, keepdim=True).values
    total = cos.sum(0, keepdim=True)
    a = cos.shape[0]
    return torch.where(total > 0, cos / total.clamp_min(1e-300), 1.0 / a)


def topk_weights(soft: torch.Tensor, k: int) -> torch.Tensor:
    """TopK-pFD's teacher weights ``[A, A]``: ``1/k`` on the ``k`` most cosine-similar clients
    of each student (itself included), 0 elsewhere."""
    cos = cosine_matrix(soft)
    a = cos.shape[0]
    k = min(k, a)
    cos = cos + torch.eye(a, dtype=cos.dtype, device=cos.device)  # the student first, even on ties
    top = cos.topk(k, dim=0).indices
    w = torch.zeros(a, a, dtype=torch.float64, device=cos.device)
    w.scatter_(0, top, 1.0 / k)
    return w


@register
class SimPFD(SoftTeacherKD):
    name = "simpfd"
    sample_dp_covered = True  # DP-SGD covers it (pflkit.privacy.dpsgd)
    secagg_refusal = "its server distils from each client's soft predictions"
    release = None
    release_refusal = "its uploads are soft predictions on the public set, for which pflkit defines no clipping yet"
    description = (
        "Sim-pFD (KT-pFL baseline): per-client teachers weighted by cosine similarity of soft "
        "predictions on a public set; heterogeneous models"
    )

    class Params(SoftTeacherKD.Params):
        sim_weights: Literal["cosine", "code"] = param("cosine", "paper; code: authors' code")

    params: Params

    def mixing_weights(self, server: State) -> torch.Tensor:
        return similarity_weights(server["soft"], self.params.sim_weights)


@register
class TopKPFD(SoftTeacherKD):
    name = "topkpfd"
    sample_dp_covered = True  # DP-SGD covers it (pflkit.privacy.dpsgd)
    secagg_refusal = "its server picks teachers among the clients' individual soft predictions"
    description = (
        "TopK-pFD (KT-pFL baseline): each client's teacher averages its k most cosine-similar "
        "clients' soft predictions (k = 5); heterogeneous models"
    )

    class Params(SoftTeacherKD.Params):
        k: int = param(5, "paper (k = 5)", gt=0)

    params: Params

    def mixing_weights(self, server: State) -> torch.Tensor:
        return topk_weights(server["soft"], self.params.k)
