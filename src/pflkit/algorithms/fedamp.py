"""FedAMP: Huang, Chu, Zhou, Wang, Liu, Pei & Zhang, "Personalized Cross-Silo Federated Learning
on Non-IID Data", AAAI 2021 (Algorithm 1, Eqs. 4-6, and its heuristic variant HeurFedAMP).

Shared: each client's personal model w_i (uploaded after local training) and its cloud model
u_i (downloaded). Private: nothing beyond the client's data; the client keeps w_i in its state
(``weights``) to continue training it, and the server keeps every client's last upload (server
state ``models``; a client not selected in a round keeps its last one there, a client never
selected yet counts as the common initial model w^0).

Server step (Eqs. 4-6, attentive message passing): for the selected client i, from the stored
models w_1..w_N (all N clients)::

    u_i = sum_j xi_ij w_j,
    xi_ij = alpha_k A'(||w_i - w_j||^2)      (j != i),    xi_ii = 1 - sum_{j != i} xi_ij,
    A(x) = 1 - exp(-x / sigma),   A'(x) = exp(-x / sigma) / sigma

(``attention="paper"``). There is no normaliser: the off-diagonal weights are the step size
alpha_k times the attention derivative, so u_i = w_i - alpha_k grad_{w_i} A(W) up to the
paper's factor convention. ||.|| runs over all model *parameters* (float64).

``attention="heuristic"`` is the paper's HeurFedAMP (the cosine heuristic for deep networks;
also PFLlib's old ``serverhamp.py``)::

    xi_ij = (1 - xi_ii) exp(s cos(w_i, w_j)) / sum_{h != i} exp(s cos(w_i, w_h))   (j != i)

with xi_ii = ``heur_self_weight`` and s = ``heur_sigma`` (the self term is *not* in the
normaliser).

Client step: i downloads u_i and trains its own model w_i (starting from its last w_i, as
PFLlib's client does; w^0 in its first round) for the run's local epochs on

    F_i(w) + (lam / (2 alpha_k)) ||w - u_i||^2          (Alg. 1, the proximal step)

(the pull is a gradient hook: (lam / alpha_k)(w - u_i) added to each parameter's gradient after
``train.grad_clip``; buffers are not pulled), then uploads w_i. The server stores it and
recomputes the squared distances and cosines of i to every stored model (server state
``sqdist`` and ``cos``, N x N float64; the next round's weights come from them).

Personalized model: w_i from the client's state (identical to its last upload); w^0 for a
client never selected. There is no global model. Integer buffers of u_i are the client's own
stored ones; float buffers (BatchNorm statistics) are mixed with the same xi as parameters.

Defaults: ``alpha_k`` = 1 and ``lam`` = 1 (PFLlib's ``main.py`` defaults ``-alk``/``-lam``;
the paper's own values are in its experiments/appendix, not available here). ``sigma`` = 20
(pflkit: PFLlib's default 1 with alpha_k = 1 gives xi_ij up to 1 each, so with 20 clients
sum_{j != i} xi_ij reaches 19 and xi_ii = -18; sigma = 20 keeps alpha_k (N - 1) / sigma <= 1
for N <= 21). ``heur_sigma`` = 0.1 and ``heur_self_weight`` = 0.1 (PFLlib's HeurFedAMP run
script ``-sg 0.1 -xi 0.1``).

Deviations and guards:

- Refused up front: ``attention="paper"`` with alpha_k (N - 1) / sigma > 1. A'(x) <= 1/sigma,
  so this bound keeps every xi_ii >= 0 (u_i a convex combination); beyond it xi_ii can turn
  negative and u_i extrapolates (PFLlib's FedAMP lets that happen).
- The step size alpha_k is a constant (the paper allows a schedule alpha_k).
- PFLlib's FedAMP (TsingZ0/PFLlib, ``system/flcore/clients/clientamp.py`` and
  ``system/flcore/servers/serveramp.py``) trains differently. Its client adds
  ``0.5 * lamda / alphaK * torch.norm(gm - pm, p=2)`` (the norm, not its square) to the
  cross-entropy, but builds ``gm`` and ``pm`` from the ``p.data`` of its model and of its cloud
  model ``client_u`` (clientamp.py ``train``, lines 40-42): tensors autograd does not track, so
  the term is a constant with zero gradient. PFLlib's clients therefore train their own model
  on cross-entropy alone (the term only raises the reported loss), and u_i reaches neither the
  training nor the scored model: ``lam: 0`` here is PFLlib's client step. Its server builds
  u_i = sum_j xi_ij w_j + xi_ii w_i (serveramp.py ``send_models``, lines 75-103; clientamp.py
  ``set_parameters``, lines 57-59) from the models uploaded in the previous round only (none
  before the first upload) and the client's own current model; here every client's stored
  model is mixed, and the pull (lam / alpha_k)(w - u_i), the gradient of the paper's squared
  penalty, is applied.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Literal, NotRequired, TypedDict

import torch
from torch import Tensor, nn

from pflkit.algorithms.base import (
    Algorithm,
    Payload,
    RoundContext,
    ServerContext,
    State,
    Update,
    Upload,
    load_model,
    param,
    register,
)
from pflkit.algorithms.blocks.split import common_init, require_homogeneous
from pflkit.algorithms.env import ClientEnv, ServerEnv
from pflkit.algorithms.records import WeightsPayload
from pflkit.errors import PflkitError
from pflkit.primitives.training import (
    Weights,
    get_weights,
    proximal_pull,
    set_weights,
)
from pflkit.primitives.tree import weighted_sum


class FedAMPUpload(TypedDict):
    """The client's trained personalized model w_i (the server stores it; no sample count)."""

    weights: Weights


class FedAMPState(TypedDict):
    """The client's personalized model w_i (from its first round on)."""

    weights: NotRequired[Weights]


class FedAMPServer(TypedDict):
    """w^0, every client's last uploaded model, and the pairwise distances and cosines."""

    init: Weights
    models: dict[int, Weights]
    sqdist: Tensor
    cos: Tensor


Attention = Literal["paper", "heuristic"]


def paper_attention(sqdist: Tensor, cid: int, alpha_k: float, sigma: float) -> Tensor:
    """Eqs. 5-6: xi_ij = alpha_k exp(-d_ij / sigma) / sigma for j != i, xi_ii = 1 - their sum,
    from row ``cid`` of the squared distances ``sqdist`` (float64)."""
    d = sqdist.double()
    xi = alpha_k * torch.exp(-d / sigma) / sigma
    xi[cid] = 0.0
    xi[cid] = 1.0 - xi.sum()
    return xi


def heuristic_attention(cos: Tensor, cid: int, scale: float, self_weight: float) -> Tensor:
    """HeurFedAMP: xi_ij = (1 - xi_ii) softmax_{j != i}(scale * cos_ij), xi_ii = ``self_weight``
    (float64; with no other client, xi = e_i)."""
    c = cos.double()
    if len(c) == 1:
        return torch.ones(1, dtype=torch.float64, device=c.device)
    e = torch.exp(scale * (c - c.max()))  # the shift cancels in the ratio
    e[cid] = 0.0
    xi = (1.0 - self_weight) * e / e.sum()
    xi[cid] = self_weight
    return xi


def cloud_model(
    stored: Sequence[Mapping[str, Tensor]], xi: Tensor, own: Mapping[str, Tensor]
) -> Weights:
    """u = sum_j xi_j stored_j on floating entries (accumulated in float64, cast back; zero
    weights skipped); integer entries are ``own``'s."""
    nz = [j for j in range(len(stored)) if float(xi[j]) != 0.0]
    return weighted_sum(
        [stored[j] for j in nz], [float(xi[j]) for j in nz], own, dtype=torch.float64
    )


def pair_stats(
    a: Mapping[str, Tensor], b: Mapping[str, Tensor], keys: Sequence[str]
) -> tuple[float, float]:
    """(||a - b||^2, cos(a, b)) over the entries ``keys`` flattened together, in float64."""
    sq = dot = na = nb = 0.0
    for k in keys:
        x, y = a[k].double(), b[k].double()
        sq += float((x - y).pow(2).sum())
        dot += float((x * y).sum())
        na += float(x.pow(2).sum())
        nb += float(y.pow(2).sum())
    cos = dot / max(math.sqrt(na) * math.sqrt(nb), 1e-12)
    return sq, cos


@register
class FedAMP(Algorithm):
    name = "fedamp"
    sample_dp_covered = True  # DP-SGD covers it (pflkit.privacy.dpsgd)
    release = {"weights": "weights"}
    uses_each_upload = "gives each client its own attention-weighted mix of the clients' models"
    description = (
        "FedAMP (Huang et al. 2021): per-client cloud models by attentive message passing, "
        "personal models trained with a proximal pull to them"
    )
    payload = WeightsPayload
    upload = FedAMPUpload
    state = FedAMPState
    server = FedAMPServer

    class Params(Algorithm.Params):
        attention: Attention = param("paper", "paper (Eqs. 5-6); heuristic: HeurFedAMP")
        alpha_k: float = param(1.0, "PFLlib main.py default (-alk)", gt=0)
        lam: float = param(1.0, "PFLlib main.py default (-lam)", ge=0)
        sigma: float = param(20.0, "pflkit (keeps xi_ii >= 0 for 21 clients; PFLlib: 1)", gt=0)
        heur_sigma: float = param(0.1, "PFLlib HeurFedAMP run script (-sg)", ge=0)
        heur_self_weight: float = param(0.1, "PFLlib HeurFedAMP run script (-xi)", ge=0, le=1)

    params: Params

    # -- checks and state -----------------------------------------------------------------------
    def check(self, env: ServerEnv) -> None:
        require_homogeneous(env, self.name, "mixes whole client models")
        p = self.params
        bound = p.alpha_k * (env.num_clients - 1) / p.sigma
        if p.attention == "paper" and bound > 1:
            raise PflkitError(
                f"fedamp: alpha_k * (num_clients - 1) / sigma = {bound:.4g} exceeds 1, so the "
                "self weight xi_ii = 1 - sum_j xi_ij could turn negative: set sigma to at "
                f"least {p.alpha_k * (env.num_clients - 1):.4g} or alpha_k to at most "
                f"{p.sigma / (env.num_clients - 1):.4g}"
            )

    def server_init(self, env: ServerEnv) -> FedAMPServer:
        n = env.num_clients
        return {
            "init": common_init(env),  # w^0 of every client not yet stored (the client's too)
            "models": {},  # cid -> the client's last uploaded w_i
            "sqdist": torch.zeros(n, n, dtype=torch.float64, device=env.device),
            "cos": torch.ones(n, n, dtype=torch.float64, device=env.device),
        }

    def stored(self, server: FedAMPServer, cid: int) -> Weights:
        return server["models"].get(cid, server["init"])

    def attention_row(self, server: FedAMPServer, cid: int) -> Tensor:
        """xi_i. (float64) for the selected client ``cid`` from the server's pair matrices."""
        p = self.params
        if p.attention == "paper":
            return paper_attention(server["sqdist"][cid], cid, p.alpha_k, p.sigma)
        return heuristic_attention(server["cos"][cid], cid, p.heur_sigma, p.heur_self_weight)

    # -- one exchange ---------------------------------------------------------------------------
    def configure(
        self, env: ServerEnv, server: FedAMPServer, cid: int, ctx: ServerContext
    ) -> Payload:
        xi = self.attention_row(server, cid)
        stored = [self.stored(server, j) for j in range(env.num_clients)]
        return {"weights": cloud_model(stored, xi, stored[cid])}

    def client_update(
        self, env: ClientEnv, payload: WeightsPayload, state: FedAMPState, ctx: RoundContext
    ) -> Update:
        p = self.params
        model = env.model()
        set_weights(model, state.get("weights") or common_init(env))
        cloud = payload["weights"]
        anchors = [(w, cloud[k]) for k, w in model.named_parameters()]
        loss = env.train(model, ctx, grad_hooks=[proximal_pull(anchors, p.lam / p.alpha_k)])
        weights = get_weights(model)
        return Update({"weights": weights}, {**state, "weights": weights}, {"train_loss": loss})

    def aggregate(
        self,
        env: ServerEnv,
        server: FedAMPServer,
        uploads: Mapping[int, FedAMPUpload],
        ctx: ServerContext,
    ) -> State:
        models = dict(server["models"])
        for cid, up in uploads.items():
            models[cid] = up["weights"]
        sqdist, cos = server["sqdist"].clone(), server["cos"].clone()
        keys = [k for k, _ in env.model().named_parameters()]
        done: set[tuple[int, int]] = set()
        for i in sorted(uploads):
            for j in range(env.num_clients):
                pair = (min(i, j), max(i, j))
                if j == i or pair in done:
                    continue
                done.add(pair)
                sq, c = pair_stats(models[i], models.get(j, server["init"]), keys)
                sqdist[i, j] = sqdist[j, i] = sq
                cos[i, j] = cos[j, i] = c
        return {**server, "models": models, "sqdist": sqdist, "cos": cos}

    # -- evaluation -----------------------------------------------------------------------------
    def eval_view(
        self, env: ServerEnv, server: State, cid: int | None, ctx: ServerContext
    ) -> Payload:
        return {}  # one cloud model per client, no global model; w_i is on the client

    def personal_model(
        self,
        env: ClientEnv,
        view: Payload,
        state: State,
        ctx: RoundContext,
        upload: Upload | None = None,
    ) -> nn.Module:
        return load_model(env, state.get("weights") or common_init(env))
