"""The knowledge-distillation baselines of KT-pFL's Table 1 (specs/ktpfl.md §5, §9):
FedMD, Sim-pFD, TopK-pFD (soft-prediction sharing, :class:`SoftTeacherKD`) and FedDF, pFedDF
(parameter sharing within each architecture group plus server-side ensemble distillation).

**FedMD** (Li & Wang, "FedMD: Heterogenous Federated Learning via Model Distillation", NeurIPS
2019 workshop). Clients upload soft scores on the public set, the server averages them into one
consensus (``c = 1/N`` everywhere), each client "digests" it (distils ``R`` epochs) and then
"revisits" its private data (``E`` epochs): ``order="distill_then_train"``. Shared: ``B x C``
floats each way. Deviation (as the KT-pFL code's FedMD engine, §9): no transfer-learning
pre-training on a labelled public set, and soft predictions at temperature ``T`` (default 1,
the code's) instead of raw logits fitted with an L1 loss.

**Sim-pFD** (KT-pFL §5, "Sim-pFL"): as KT-pFL, but ``c`` is not learned: client ``n``'s teacher
weights come from the cosine similarity between the flattened ``B x C`` soft-prediction matrices
of the round. ``sim_weights="cosine"`` (default, the paper's wording): ``c[m, n] = cos(S_m, S_n)
/ sum_m' cos(S_m', S_n)`` (soft predictions are non-negative, so every cosine is in [0, 1]);
``"code"``: the authors' ``cos(S_m, S_n) - min_m' cos(S_m', S_n)``, normalised, so the least
similar client gets weight 0. Self included in both (as the code).

**TopK-pFD** (KT-pFL §5, "TopK-pFL"): client ``n``'s teacher is the plain average of the ``k``
clients most cosine-similar to it (``k = 5``, the paper's; the client itself is always among
them, cos = 1; the code keeps about N/2 instead).

Sim-pFD and TopK-pFD use KT-pFL's order by default (train, share, distil) and ``T = 1`` (the
code's engines); any of :class:`SoftTeacherKD`'s parameters can be changed.

**FedDF** (Lin, Kong, Stich, Jaggi, "Ensemble Distillation for Robust Model Fusion in Federated
Learning", NeurIPS 2020). The server keeps one prototype model per architecture. Client ``n``
downloads its architecture's prototype, trains ``E`` epochs on its private data and uploads the
weights. The server averages the uploads of each architecture group (sample-weighted, FedAvg),
then distils the ensemble of *all* received client models into each averaged prototype on the
public set: teacher ``softmax(mean_m f_m(x) / T)`` (FedDF's averaged logits), student
initialised at the group average, ``distill_epochs`` epochs of SGD (``distill_lr``, default
``train.lr``). Each client is scored with its architecture's prototype (a global model, not
personalised). Deviations: FedDF distils with Adam (lr 1e-3) for up to 10^4 steps with early
stopping on a validation split and random crops; here the same SGD settings as the other
methods of Table 1 (R = 1 epoch over the public set, specs/ktpfl.md §4: "these apply to all
methods").

**pFedDF** (KT-pFL's personalised FedDF): FedDF's training; to evaluate, each client starts from
the last fused prototype of its architecture and fine-tunes it on its private data for
``ft_epochs`` (default: ``train.local_epochs``) at ``train.lr``. As FedAvg-FT, fine-tuning never
feeds back into training.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Literal

import torch
from pydantic import Field

from pflkit.algorithms.base import (
    Algorithm,
    Context,
    Payload,
    State,
    Update,
    Upload,
    register,
    train_from,
    weighted_average,
)
from pflkit.algorithms.distill import (
    SoftTeacherKD,
    cosine_matrix,
    distill_configured,
    require_public,
)
from pflkit.algorithms.training import get_weights, predict, set_weights

# -- soft-prediction sharing ------------------------------------------------------------------------


@register
class FedMD(SoftTeacherKD):
    name = "fedmd"
    description = (
        "FedMD (Li & Wang 2019): average of soft predictions on a public set as one consensus; "
        "digest (distil) then revisit (private training); heterogeneous models"
    )
    default_order = "distill_then_train"

    def mixing_weights(self, server: State) -> torch.Tensor:
        a = len(server["active"])
        return torch.full((a, a), 1.0 / a, dtype=torch.float64)


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
    cos = cos + torch.eye(a, dtype=cos.dtype)  # the student itself first, even on ties
    top = cos.topk(k, dim=0).indices
    w = torch.zeros(a, a, dtype=torch.float64)
    w.scatter_(0, top, 1.0 / k)
    return w


@register
class SimPFD(SoftTeacherKD):
    name = "simpfd"
    description = (
        "Sim-pFD (KT-pFL baseline): per-client teachers weighted by cosine similarity of soft "
        "predictions on a public set; heterogeneous models"
    )

    class Params(SoftTeacherKD.Params):
        sim_weights: Literal["cosine", "code"] = "cosine"

    def mixing_weights(self, server: State) -> torch.Tensor:
        return similarity_weights(server["soft"], self.params.sim_weights)


@register
class TopKPFD(SoftTeacherKD):
    name = "topkpfd"
    description = (
        "TopK-pFD (KT-pFL baseline): each client's teacher averages its k most cosine-similar "
        "clients' soft predictions (k = 5); heterogeneous models"
    )

    class Params(SoftTeacherKD.Params):
        k: int = Field(5, gt=0)

    def mixing_weights(self, server: State) -> torch.Tensor:
        return topk_weights(server["soft"], self.params.k)


# -- FedDF / pFedDF ------------------------------------------------------------------------------------


@register
class FedDF(Algorithm):
    name = "feddf"
    description = (
        "FedDF (Lin et al. 2020): FedAvg within each architecture group, then server-side "
        "ensemble distillation of all client models into each prototype on a public set"
    )

    class Params(Algorithm.Params):
        temperature: float = Field(1.0, gt=0)
        distill_epochs: int = Field(1, gt=0)
        distill_lr: float | None = Field(None, gt=0)
        distill_batch_size: int = Field(256, gt=0)
        kd_loss: Literal["kl", "kl_t2", "kl_mean"] = "kl"

    def __init__(self, ctx: Context, params: Params):
        super().__init__(ctx, params)
        self.public = require_public(ctx, self.name)
        self.archs = sorted({ctx.arch(c) for c in range(ctx.data.num_clients)})

    def server_init(self) -> State:
        return {"protos": {a: self.ctx.init_weights(a) for a in self.archs}}

    def configure(self, server: State, cid: int, rnd: int, phase: str) -> Payload:
        return {"weights": server["protos"][self.ctx.arch(cid)]}

    def client_update(self, cid: int, payload: Payload, state: State, rnd: int, phase: str):
        weights, loss = train_from(self.ctx, cid, payload["weights"])
        n = len(self.ctx.client(cid).train_y)
        return Update({"weights": weights, "num_samples": n}, state, {"train_loss": loss})

    def ensemble_teacher(self, uploads: Mapping[int, Upload]) -> torch.Tensor:
        """``softmax(mean_m f_m(x_pub) / T)`` over every uploaded client model."""
        logits = None
        for cid, up in uploads.items():
            model = self.ctx.model(self.ctx.arch(cid), slot="feddf_teacher")
            set_weights(model, up["weights"])
            z = predict(model, self.public, 1000).double()
            logits = z if logits is None else logits + z
        assert logits is not None
        return torch.softmax(logits / len(uploads) / self.params.temperature, dim=1).float()

    def aggregate(self, server: State, uploads: Mapping[int, Upload], rnd: int, phase: str):
        p = self.params
        teacher = self.ensemble_teacher(uploads)
        protos = dict(server["protos"])
        for arch in self.archs:
            group = {c: u for c, u in uploads.items() if self.ctx.arch(c) == arch}
            if not group:
                continue
            model = self.ctx.model(arch, slot="feddf_student")
            set_weights(model, weighted_average(group))
            distill_configured(self.ctx, p, model, self.public, teacher)
            protos[arch] = get_weights(model)
        return {**server, "protos": protos}

    def global_weights(self, server: State):
        # a single global model exists only when every client shares the global architecture
        if self.archs == [self.ctx.arch(None)]:
            return server["protos"][self.archs[0]]
        return None

    def personal_weights(self, server: State, cid: int, state: State):
        return server["protos"][self.ctx.arch(cid)]


@register
class PFedDF(FedDF):
    name = "pfeddf"
    description = (
        "pFedDF (KT-pFL's personalised FedDF): FedDF, then each client fine-tunes its "
        "architecture's fused prototype on its private data before evaluation"
    )

    class Params(FedDF.Params):
        ft_epochs: int | None = Field(None, gt=0)  # None: train.local_epochs

    def personal_weights(self, server: State, cid: int, state: State):
        t = self.ctx.cfg.train
        weights, _ = train_from(
            self.ctx,
            cid,
            server["protos"][self.ctx.arch(cid)],
            epochs=self.params.ft_epochs or t.local_epochs,
        )
        return weights
