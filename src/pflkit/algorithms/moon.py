"""MOON: Li, He & Song, "Model-Contrastive Federated Learning", CVPR 2021 (Algorithm 1,
Eq. 1-3); a baseline of MAP (Li et al., TKDE 2024, Tables I-II, specs/map.md §5).

Shared: the whole model (as FedAvg). Private: the client's previous local model w_k^{t-1}
(client state ``prev``, plain weights), which never leaves the client.

Client k, given the downloaded global model w_t, starts from w_t and runs E epochs of mini-batch
SGD on (Eq. 3)

    l = CE(head(z), y) + mu * l_con,
    l_con = -log( exp(sim(z, z_glob) / tau) / (exp(sim(z, z_glob) / tau) + exp(sim(z, z_prev) / tau)) )

averaged over the batch (Eq. 2), where sim is the cosine similarity, z = R_w(x) is the
representation of the model being trained, z_glob = R_{w_t}(x) that of the downloaded global
model and z_prev = R_{w_k^{t-1}}(x) that of the client's previous local model. Both reference
models are frozen (no gradient, eval mode: BatchNorm uses its running statistics) and see the
same (augmented) batch. After training, the local model is uploaded and also kept as the new
``prev``.

Server: FedAvg, w_{t+1} = sum_k (n_k / n) w_k over the selected clients (Algorithm 1;
``weighting: uniform`` gives the plain mean, as the MAP code runs MOON).

Defaults and their sources:

- ``mu`` = 1: the paper's tuned value for CIFAR-100 and Tiny-ImageNet (tuned over
  {0.1, 1, 5, 10}; CIFAR-10's best was 5, set ``mu: 5`` there) and the official code's
  default. The MAP code's grid for MOON is {1e-3, 1e-2, 1e-1} (``train.py``, ``reg_lamb``).
- ``tau`` = 0.5: the paper's temperature (as SimCLR's) and the official code's default; the
  MAP code hard-codes the factor 2.0 = 1 / 0.5.

Deviations and choices:

- Representation: the paper puts a projection head (a 2-layer MLP) after the base encoder and
  contrasts its output. pflkit models have a body and a head only, so z is the body output
  ``model.features(x)``, the layer in front of the classifier, which is what the MAP authors'
  code contrasts (its networks' ``hs``). No projection head is offered: it would add parameters
  outside the model's state dict.
- First participation: Algorithm 1 does not define w_k^{t-1} before the client has trained once.
  Here a client that has no previous local model trains on plain CE (l_con is left out). The
  official code does the same in the first round (its pool of previous models is empty, so the
  contrastive logits have one column and l_con = 0); the MAP code uses a copy of the initial
  global model, which in round 1 equals the downloaded model, giving l_con a zero gradient. A
  client first selected in a later round is, in the MAP code, pushed away from the initial
  global model (in the official code, from its own never-trained initial network); here it
  trains on CE in that round (``first_prev: none``, the default).
- ``first_prev: initial`` (PFLlib's code): a client's previous model starts as the initial
  global model, ``old_model = copy.deepcopy(self.model)`` at construction
  (``system/flcore/clients/clientmoon.py`` line 17, PFLlib d832e76), so l_con applies from a
  client's first selection with the initial model as the negative. In round 1 the initial model
  is the downloaded one, z_glob = z_prev, and l_con = log 2 has zero gradient (only the reported
  loss changes); a client first selected later is pushed away from the initial model. The
  server keeps a copy of the initial model and sends it with a client's download until an
  upload of that client has arrived (counted as communication; PFLlib's clients hold it).
- ``prev`` is the client's last trained model, whenever it last took part (as in both codes).
- With ``mu`` = 0 the loss, gradients and upload equal FedAvg's (the reference models are still
  evaluated, in eval mode, so they change nothing).
- PFLlib runs its reference models in train mode (the server's global model and a deep copy of
  the trained model, clientmoon.py lines 43-44, 53, 66); here they run in eval mode. The two
  differ only for models with BatchNorm or dropout.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Literal, NotRequired, TypedDict, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from pflkit.algorithms.base import (
    Payload,
    RoundContext,
    ServerContext,
    State,
    Update,
    param,
    register,
    train_from,
)
from pflkit.algorithms.blocks.split import require_homogeneous
from pflkit.algorithms.env import ClientEnv, ServerEnv
from pflkit.algorithms.fedavg import FedAvg
from pflkit.algorithms.records import WeightsServer, WeightsUpload
from pflkit.models import PFLModel
from pflkit.primitives.training import LossFn, Weights, set_weights


class MOONPayload(TypedDict):
    """The global model, and w^0 as the previous model of a client's first round
    (``first_prev: initial``)."""

    weights: Weights
    init: NotRequired[Weights]


class MOONState(TypedDict):
    """The client's previous local model (from its first round on)."""

    prev: NotRequired[Weights]


class MOONServer(WeightsServer):
    """The global model, and w^0 and the clients that have uploaded (``first_prev:
    initial``)."""

    init: NotRequired[Weights]
    uploaded: NotRequired[list[int]]


GLOBAL_SLOT = "moon_global"
PREV_SLOT = "moon_prev"


def model_contrastive_loss(z: Tensor, z_glob: Tensor, z_prev: Tensor, tau: float) -> Tensor:
    """MOON's l_con (Eq. 2), the batch mean of
    -log(e^{cos(z, z_glob)/tau} / (e^{cos(z, z_glob)/tau} + e^{cos(z, z_prev)/tau}))."""
    sims = torch.stack(
        [F.cosine_similarity(z, z_glob, dim=1), F.cosine_similarity(z, z_prev, dim=1)], dim=1
    )
    target = torch.zeros(len(z), dtype=torch.long, device=z.device)  # the positive: z_glob
    return F.cross_entropy(sims / tau, target)


def moon_loss(global_model: PFLModel, prev_model: PFLModel | None, mu: float, tau: float) -> LossFn:
    """CE(head(z), y) + mu * l_con(z, z_glob, z_prev) with the frozen reference models in eval
    mode; plain CE when there is no previous model."""
    global_model.eval()
    if prev_model is not None:
        prev_model.eval()

    def loss_fn(module: nn.Module, x: Tensor, y: Tensor) -> Tensor:
        model = cast(PFLModel, module)  # the client's PFLModel (env.model)
        z = model.features(x)
        ce = F.cross_entropy(model.head(z), y)
        if prev_model is None:
            return ce
        with torch.no_grad():
            z_glob = global_model.features(x)
            z_prev = prev_model.features(x)
        return ce + mu * model_contrastive_loss(z, z_glob, z_prev, tau)

    return loss_fn


@register
class MOON(FedAvg):
    name = "moon"
    sample_dp_covered = True  # DP-SGD covers it (pflkit.privacy.dpsgd)
    secagg = ("samples", "uniform")  # its aggregate is the mean of the uploads
    description = "MOON (Li et al. 2021): FedAvg + model-contrastive loss (global vs previous)"
    payload = MOONPayload
    state = MOONState
    server = MOONServer

    class Params(FedAvg.Params):
        mu: float = param(1.0, "paper (1 for CIFAR-100/Tiny-ImageNet, 5 for CIFAR-10)", ge=0)
        tau: float = param(0.5, "paper and MAP code (factor 2.0 = 1 / tau)", gt=0)
        first_prev: Literal["none", "initial"] = param(
            "none", "official code (round 1: l_con = 0); initial: PFLlib clientmoon.py line 17"
        )

    params: Params

    def check(self, env: ServerEnv) -> None:
        require_homogeneous(env, self.name, "averages whole client models")

    def moon_objective(self, env: ClientEnv, payload: MOONPayload, prev: Weights | None) -> LossFn:
        p = self.params
        global_model = env.model(GLOBAL_SLOT)
        set_weights(global_model, payload["weights"])
        prev_model = None
        if prev is not None:
            prev_model = env.model(PREV_SLOT)
            set_weights(prev_model, prev)
        return moon_loss(global_model, prev_model, p.mu, p.tau)

    def server_init(self, env: ServerEnv) -> MOONServer:
        server: MOONServer = super().server_init(env)
        if self.params.first_prev == "initial":  # the initial model, and who has uploaded since
            server["init"] = {k: v.clone() for k, v in server["weights"].items()}
            server["uploaded"] = []
        return server

    def configure(self, env: ServerEnv, server: State, cid: int, ctx: ServerContext) -> Payload:
        payload = super().configure(env, server, cid, ctx)
        if "init" in server and cid not in server["uploaded"]:
            payload["init"] = server["init"]  # the client's previous model before its first
        return payload

    def aggregate(
        self,
        env: ServerEnv,
        server: State,
        uploads: Mapping[int, WeightsUpload],
        ctx: ServerContext,
    ) -> State:
        new = super().aggregate(env, server, uploads, ctx)
        if "uploaded" in server:
            new["uploaded"] = sorted(set(server["uploaded"]) | set(uploads))
        return new

    def client_update(  # type: ignore[override]  # its payload has keys FedAvg's lacks
        self, env: ClientEnv, payload: MOONPayload, state: MOONState, ctx: RoundContext
    ) -> Update:
        prev = state.get("prev")
        if prev is None:
            prev = payload.get("init")  # first_prev: initial
        loss_fn = self.moon_objective(env, payload, prev)
        weights, loss = train_from(env, payload["weights"], ctx, loss_fn=loss_fn)
        upload = {"weights": weights, "num_samples": env.num_train}
        prev = {k: v.clone() for k, v in weights.items()}
        return Update(upload, {**state, "prev": prev}, {"train_loss": loss})
