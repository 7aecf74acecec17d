"""Ditto: Li, Hu, Beirami & Smith, "Ditto: Fair and Robust Federated Learning Through
Personalization", ICML 2021 (Algorithm 1); and DittoRS, Ditto whose global branch uses the
restricted softmax (MAP, Li et al., TKDE 2024, its ablation "RS applied to Ditto";
specs/map.md §2.5, §9.1).

Shared: the global model w (downloaded; the global branch's result uploaded). Private: the
personal model v_k (client state ``personal``), which never leaves the client and is the
client's personalized model.

Client k, given the downloaded w_t (Algorithm 1):

1. Global branch: FedAvg's client step, E local epochs of SGD on F_k from w_t (the paper's
   "solve G_k inexactly"), giving w_k; uploaded. (DittoRS: on the RS loss, MAP Eq. 8.)
2. Personal branch: ``personal_epochs`` epochs of SGD from the stored v_k on the personal
   objective (paper Eq. 2)

       h_k(v; w_t) = F_k(v) + (lam / 2) ||v - w_t||^2,
       v <- v - eta (grad F_k(v) + lam (v - w_t))          (Algorithm 1, personal update)

   with plain cross-entropy for F_k (in DittoRS too) and w_t the downloaded model.

Server: w_{t+1} = w_t + mean_S(w_k - w_t) = mean_S(w_k), the uniform mean (Algorithm 1; the MAP
code averages Ditto uniformly too); ``weighting="samples"`` weights by n_k like FedAvg.

Defaults: ``lam`` = 0.1, the value in both the Ditto paper's grid for clean data
{0.1, 1, 2} and the MAP code's grid {0.1, 0.01, 0.001}; ``personal_epochs`` =
``train.local_epochs`` and ``personal_lr`` = ``train.lr`` (the paper uses one eta; the MAP code
trains the personal model for as many steps as the global branch). Both branches use the
config's optimiser settings (momentum, weight decay). DittoRS: ``alpha`` = 0.9 (MAP §4.1.3, §5.2.5) and
``rs_mode="hard"``, the paper's RS indicator (Eq. 8: alpha for classes the client lacks, 1
otherwise; MAP defines DittoRS only as "RS applied to Ditto"); ``rs_mode="soft"``
(alpha + (1 - alpha) n_c / max_j n_j) is what the MAP code's DittoRS uses.

Deviations and options:

- The personal model starts as the first global model the client downloads (Algorithm 1 takes
  v_k^0 as an input; implementations, the MAP code included, set it to the initial global model
  w^0). The two agree for clients selected in round 1 (all of them under full participation);
  a client first selected later starts from the then-current w_t instead of w^0, and until its
  first selection its personalized model is the global model.
- ``prox="smooth_l1"`` replaces (lam/2)||v - w_t||^2 by lam * mean over parameter tensors of the
  mean smooth-L1(v, w_t), as the MAP code does (for Ditto and DittoRS).
- The proximal term covers parameters, not buffers (BatchNorm statistics of v are its own).
- The global branch runs first, so its batch order (and the upload) is exactly FedAvg's client
  step for the same seed; the personal branch then draws its own batch order.
- The MAP code's gradient clipping at norm 100 (not in the paper) is ``train.grad_clip: 100``;
  its 5-round lr warm-up is not reproduced.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal, NotRequired, TypedDict

import torch
import torch.nn.functional as F
from torch import nn

from pflkit.algorithms.base import (
    Payload,
    RoundContext,
    State,
    Update,
    Upload,
    Weighting,
    load_model,
    param,
    register,
    train_from,
)
from pflkit.algorithms.blocks.rs import RestrictedSoftmax, RSMode, RSParams
from pflkit.algorithms.env import ClientEnv
from pflkit.algorithms.fedavg import FedAvg
from pflkit.algorithms.records import WeightsPayload
from pflkit.primitives.training import (
    LossFn,
    StackableLoss,
    Weights,
    cross_entropy,
    proximal_loss,
)


class DittoState(TypedDict):
    """The client's personal model v_k (from its first round on)."""

    personal: NotRequired[Weights]


def _smooth_l1_proximal(
    model: nn.Module, x: torch.Tensor, y: torch.Tensor, t: Mapping[str, Any], lam: float
) -> torch.Tensor:
    terms = [F.smooth_l1_loss(p, t["anchor"][k]) for k, p in model.named_parameters()]
    return cross_entropy(model, x, y) + lam * sum(terms) / len(terms)


def smooth_l1_proximal_loss(global_weights: Mapping[str, torch.Tensor], lam: float) -> LossFn:
    """Cross-entropy + lam * mean over parameter tensors of smooth-L1(p, w_global) (MAP code)."""
    return StackableLoss(_smooth_l1_proximal, {"anchor": global_weights}, (lam,))


@register
class Ditto(FedAvg):
    name = "ditto"
    sample_dp_covered = True  # DP-SGD covers it (pflkit.privacy.dpsgd)
    private = ("personal",)
    vectorize = True  # engine.vectorize covers its local work
    description = "Ditto (Li et al. 2021): FedAvg + a private model pulled toward the global one"
    state = DittoState

    class Params(FedAvg.Params):
        lam: float = param(0.1, "paper grid {0.1, 1, 2} and MAP code grid", ge=0)
        prox: Literal["l2", "smooth_l1"] = param("l2", "paper (Eq. 2); smooth_l1: MAP code")
        personal_epochs: int | None = param(None, "MAP code (None: train.local_epochs)", gt=0)
        personal_lr: float | None = param(None, "paper (one eta; None: train.lr)", gt=0)
        weighting: Weighting = param("uniform", "paper (Alg. 1: server average)")

    params: Params

    def personal_loss(self, w_global: Weights) -> LossFn:
        p = self.params
        if p.prox == "l2":
            return proximal_loss(w_global, p.lam)
        return smooth_l1_proximal_loss(w_global, p.lam)

    def client_update(
        self, env: ClientEnv, payload: WeightsPayload, state: DittoState, ctx: RoundContext
    ) -> Update:
        p, t = self.params, env.run.train
        w_t = payload["weights"]
        glob = super().client_update(env, payload, state, ctx)  # FedAvg's client step
        personal, ploss = train_from(
            env,
            state.get("personal", w_t),
            ctx,
            epochs=p.personal_epochs or t.local_epochs,
            lr=p.personal_lr or t.lr,
            loss_fn=self.personal_loss(w_t),
        )
        metrics = {**glob.metrics, "personal_loss": ploss}
        return Update(glob.upload, {**state, "personal": personal}, metrics)

    def personal_model(
        self,
        env: ClientEnv,
        view: Payload,
        state: State,
        ctx: RoundContext,
        upload: Upload | None = None,
    ) -> nn.Module:
        """The personal model v_k; before it first trains, the global (or uploaded) model."""
        if state.get("personal") is None:
            return super().personal_model(env, view, state, ctx, upload)
        return load_model(env, state["personal"])


@register
class DittoRS(RestrictedSoftmax, Ditto):
    name = "dittors"
    description = "DittoRS (MAP ablation): Ditto whose global branch uses the restricted softmax"

    class Params(Ditto.Params, RSParams):  # alpha (0.9), rs_mode, min_samples (1)
        rs_mode: RSMode = param("hard", "paper (MAP Eq. 8); soft: MAP code's DittoRS")

    params: Params
