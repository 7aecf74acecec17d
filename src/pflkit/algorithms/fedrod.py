"""FedRoD: Chen & Chao, "On Bridging Generic and Personalized Federated Learning for Image
Classification", ICLR 2022 (Sec. 4, Algorithm 1, linear personalized head).

Shared: the feature extractor theta (the model's ``body``) and the generic head G-head (the
model's ``head``); together they are the generic model, scored as ``global_acc``. Private: the
personalized head P-head phi_i (client state ``phead``) and the class counts.

Client i, per mini-batch (one backward pass; Algorithm 1 trains both objectives together):

- Generic objective, the balanced risk of Eq. 7 with the balanced softmax (BSM; Ren et al.
  2020): L_BSM = -log( n_y exp(z_y) / sum_c n_c exp(z_c) ) = CE(z + log n, y), where
  z = G-head(f), f = theta(x) and n_c counts the client's training samples of class c (a class
  the client lacks gets log 0 = -inf: it takes no probability mass).
- Personalized objective: CE(z.detach() + P-head(f.detach()), y). The personalized logits are
  the sum of the two heads (Sec. 4.2) and the personalized loss sends **no gradient** to theta
  or to the G-head (the paper's stop-gradient: the generic model is learned by L_BSM only).
- Upload theta and the G-head; the server averages them by n_i (FedAvg).

Personalized prediction: G-head(f) + P-head(f).

Options: ``variant: map_code`` is the MAP authors' FedROD (specs/map.md §9): the generic
logits are multiplied by (4 p_c)^gamma, p_c = n_c / n, instead of adding log n_c, and the
personalized logits are the **mean** of the two heads. ``gamma`` from the MAP grid
{1, 0.5, 0.25}; 1 by default (our choice).

Deviations: the P-head starts as the initial G-head (PFLlib's FedRoD copies it; the paper does
not say). The hypernetwork P-head of FedRoD's Sec. 4.3 is not implemented.
"""

from __future__ import annotations

from typing import Literal, TypedDict, cast

import torch.nn.functional as F
from torch import Tensor, nn

from pflkit.algorithms.base import (
    Payload,
    RoundContext,
    Update,
    load_model,
    param,
    register,
)
from pflkit.algorithms.blocks.rs import class_counts
from pflkit.algorithms.blocks.split import common_init, require_homogeneous
from pflkit.algorithms.env import ClientEnv, ServerEnv
from pflkit.algorithms.fedavg import FedAvg
from pflkit.algorithms.records import WeightsPayload, WeightsServer, WeightsUpload
from pflkit.models import PFLModel
from pflkit.primitives.training import (
    LossFn,
    Weights,
    get_weights,
    group,
    prefixed,
    set_weights,
    unprefixed,
)


class FedRoDState(TypedDict):
    """The client's personalized head."""

    phead: Weights


Variant = Literal["paper", "map_code"]
P_SLOT = "fedrod_phead"


def generic_logits(z: Tensor, counts: Tensor, variant: Variant, gamma: float) -> Tensor:
    """The logits whose cross-entropy is the generic loss: z + log n_c (BSM, paper) or
    z * (4 p_c)^gamma (MAP code)."""
    if variant == "paper":
        return z + counts.log()  # log 0 = -inf for absent classes
    return z * (4 * counts / counts.sum()).pow(gamma)


def combine(zg: Tensor, zp: Tensor, variant: Variant) -> Tensor:
    """Personalized logits: sum of the two heads (paper) or their mean (MAP code)."""
    return zg + zp if variant == "paper" else (zg + zp) / 2


def fedrod_loss(phead: nn.Module, counts: Tensor, variant: Variant, gamma: float) -> LossFn:
    """L_generic(G-head(f)) + CE(combine(G-head(f).detach(), P-head(f.detach())), y)."""

    def loss_fn(module: nn.Module, x: Tensor, y: Tensor) -> Tensor:
        model = cast(PFLModel, module)  # the client's PFLModel (env.model)
        f = model.features(x)
        zg = model.head(f)
        generic = F.cross_entropy(generic_logits(zg, counts, variant, gamma), y)
        personal = F.cross_entropy(combine(zg.detach(), phead(f.detach()), variant), y)
        return generic + personal

    return loss_fn


class TwoHeads(nn.Module):
    """The personalized classifier: combine(G-head(f), P-head(f)), f = body(x)."""

    def __init__(self, model: PFLModel, phead: nn.Module, variant: Variant):
        super().__init__()
        self.model, self.phead, self.variant = model, phead, variant

    def forward(self, x: Tensor) -> Tensor:
        f = self.model.features(x)
        return combine(self.model.head(f), self.phead(f), self.variant)


@register
class FedRoD(FedAvg):
    name = "fedrod"
    private = ("phead",)
    description = "FedRoD (Chen & Chao 2022): generic head (balanced softmax) + private head"
    state = FedRoDState

    class Params(FedAvg.Params):
        variant: Variant = param("paper", "paper (BSM, sum of heads); map_code: MAP authors'")
        gamma: float = param(
            1.0, "our pick from the MAP code grid {1, 0.5, 0.25} (map_code only)", gt=0
        )

    params: Params

    def check(self, env: ServerEnv) -> None:
        require_homogeneous(env, self.name)

    def server_init(self, env: ServerEnv) -> WeightsServer:
        return {"weights": common_init(env)}

    def client_init(self, env: ClientEnv) -> FedRoDState:
        return {"phead": group(env.model(), common_init(env), "head")}

    def _phead(self, env: ClientEnv, head: Weights) -> nn.Module:
        pmodel = env.model(P_SLOT)
        pmodel.head.load_state_dict(unprefixed(head, "head."))
        return pmodel.head

    def client_update(
        self, env: ClientEnv, payload: WeightsPayload, state: FedRoDState, ctx: RoundContext
    ) -> Update:
        p = self.params
        model = env.model()
        set_weights(model, payload["weights"])
        phead = self._phead(env, state["phead"])
        phead.train()
        counts = class_counts(env.data.train_y, env.num_classes)
        loss = env.train(
            model,
            ctx,
            loss_fn=fedrod_loss(phead, counts, p.variant, p.gamma),
            params=[*model.parameters(), *phead.parameters()],
        )
        new_head = prefixed({k: v.detach().clone() for k, v in phead.state_dict().items()}, "head.")
        upload = {"weights": get_weights(model), "num_samples": env.num_train}
        return Update(upload, {**state, "phead": new_head}, {"train_loss": loss})

    def personal_model(
        self,
        env: ClientEnv,
        view: Payload,
        state: FedRoDState,
        ctx: RoundContext,
        upload: WeightsUpload | None = None,
    ) -> nn.Module:
        """The two heads on the received body (under MAP's protocol the uploaded model) with the
        client's private head."""
        model = load_model(env, view["weights"] if upload is None else upload["weights"])
        return TwoHeads(model, self._phead(env, state["phead"]), self.params.variant)
