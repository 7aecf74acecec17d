"""FedMD: Li & Wang, "FedMD: Heterogenous Federated Learning via Model Distillation", NeurIPS
2019 workshop. Clients upload soft scores on the public set, the server averages them into one
consensus (``c = 1/N`` everywhere), each client "digests" it (distils ``R`` epochs) and then
"revisits" its private data (``E`` epochs): ``order="distill_then_train"`` (FedMD's order, the
default). Shared: ``B x C`` floats each way. Each client is scored with its own model at the
end of the round, i.e. after private training in FedMD's order and after distillation with
``order: train_then_distill`` (KT-pFL's); a comparison with KT-pFL should give both the same
``order`` (docs/ktpfl.md).

The public samples are **fixed**: by default every round uses the whole configured public set,
drawn once for the run (``data.public.size`` samples, seeded by ``data.seed``). The FedMD code
base that KT-pFL's code is built on redraws the alignment subset every round instead
(``N_alignment`` = 5000 public samples, with replacement; specs/ktpfl.md §9).
``public_per_round: k`` draws a fresh ``k`` of the public set, without replacement, every
round and sends their indices.

Deviations (as the KT-pFL code's FedMD engine, §9): no transfer-learning pre-training on a
labelled public set, and soft predictions at temperature ``T`` (default 1, the code's) fitted
with ``kd_loss`` (default: KL) instead of raw logits fitted with an L1 loss.

The round structure (share soft predictions, mix, distil) is
:class:`~pflkit.algorithms.blocks.distill.SoftTeacherKD`; FedMD only fixes the mixture.
"""

from __future__ import annotations

import torch

from pflkit.algorithms.base import State, register
from pflkit.algorithms.blocks.distill import SoftTeacherKD


@register
class FedMD(SoftTeacherKD):
    name = "fedmd"
    sample_dp_covered = True  # DP-SGD covers it (pflkit.privacy.dpsgd)
    secagg_refusal = "its server averages soft predictions per client and sends them back"
    release = None
    release_refusal = "its uploads are soft predictions on the public set, for which pflkit defines no clipping yet"
    description = (
        "FedMD (Li & Wang 2019): average of soft predictions on a public set as one consensus; "
        "digest (distil) then revisit (private training); heterogeneous models"
    )
    default_order = "distill_then_train"

    def mixing_weights(self, server: State) -> torch.Tensor:
        a = len(server["active"])
        return torch.full((a, a), 1.0 / a, dtype=torch.float64, device=server["soft"].device)
