"""pFedSim: Tan, Zhou, Liu, Wang, Yu, "pFedSim: Similarity-Aware Model Aggregation Towards
Personalized Federated Learning", arXiv 2305.15706 (2023); the authors' code is
KarhouTam/FL-bench, ``src/server/pfedsim.py`` (specs/pfedsim.md §9).

Shared: the feature extractor omega (``body``), mixed per client by classifier similarity.
Private: the classifier phi (``head``), never averaged after the warm-up; the server stores
every client's last model and sends its own classifier back (paper Alg. 2, Eq. 4).

1. **Generalization phase** (rounds 1 .. T_g, T_g = floor(rho * T)): FedAvg on the whole model
   (paper Alg. 1), weighted by training-set size.
2. **Switch** (Alg. 2): every client's stored model is the last global model; Phi = I_n.
3. **Personalization** (rounds T_g + 1 .. T): for each selected client i, from the state at the
   start of the round (spec pitfall 7)::

       omega_i = sum_j Phi_ij omega_j / sum_j Phi_ij          (Eq. 4, over all n clients)
       phi_i   = phi_i (its own stored classifier)

   The client trains the whole model for E epochs (cross-entropy) and uploads it; the server
   stores it, then for every pair i != j of the round's clients recomputes (Eq. 3)::

       cos_c(i, j) = <phi_ic, phi_jc> / (|phi_ic| |phi_jc| + 1e-8)      (rows of the head weight)
       Phi_ij = Phi_ji = -(1/|Y|) sum_c log(1 - max(0, cos_c))          (sim_reduce=per_class_log)

   Pairs never co-sampled keep Phi_ij = 0 (they drop out of Eq. 4); the diagonal is never
   recomputed.

Defaults follow the paper; the FL-bench code's behaviours are named options (specs §8, §9.5):

- ``sim_reduce``: ``per_class_log`` (Eq. 3: log per class, then mean) or ``mean_then_log``
  (code: mean cosine over classes, clip at 0, then -log(1 - .)).
- ``self_weight``: ``paper`` (Phi_ii = 1, the identity never updated) or ``code`` (the self
  entry set to 0.9999 before the transform, i.e. -log(1e-4) = 9.21).
- ``sim_use_bias``: also append the head bias b_c to the class row (paper silent; code: no).
- ``bn_stats``: ``aggregate`` (BatchNorm running statistics are part of the model: averaged by
  FedAvg in warm-up and similarity-mixed like the other extractor tensors; FL-bench HEAD's
  default) or ``local`` (2023 code: running statistics never leave the client, in both phases).
- ``cos_max``: every cosine is clamped to <= 1 - 1e-6 and computed in float64, so identical
  classifiers (right after warm-up) give -log(1e-6) = 13.8, never inf (spec pitfall 3).
- The code's gate ("aggregate only when the row has a positive off-diagonal entry") is not an
  option: when the row has none, Eq. 4 gives the client's own extractor exactly (1 * omega / 1).

Evaluation: a client's personalized model is its stored model (its last trained model, or the
warm-up model if it has not been selected since), as the code's test step (spec §2.7, §8.9).
The global model is scored only while there is one (through round T_g).

Deviations: the extractor/classifier split is by module (``body``/``head``), not by name
(spec pitfall 12); the head must be one Linear layer. Integer buffers (BN's batch counter) are
the client's own, never averaged.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
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
    Weighting,
    load_model,
    param,
    register,
    train_from,
    weighted_average,
)
from pflkit.algorithms.blocks.split import require_homogeneous
from pflkit.algorithms.env import ClientEnv, ServerEnv
from pflkit.algorithms.records import WeightsPayload, WeightsUpload
from pflkit.errors import PflkitError
from pflkit.primitives.bn import buffer_keys, merged, only, without
from pflkit.primitives.training import Weights
from pflkit.primitives.tree import weighted_sum


class PFedSimState(TypedDict):
    """The client's BatchNorm buffers (``bn_stats: local``)."""

    buffers: NotRequired[Weights]


class PFedSimServer(TypedDict):
    """The global shared model, the similarities Phi and each client's last model."""

    weights: Weights
    phi: Tensor
    personal: dict[int, Weights]


SimReduce = Literal["per_class_log", "mean_then_log"]
SelfWeight = Literal["paper", "code"]
BNStats = Literal["aggregate", "local"]

COS_EPS = 1e-8  # Eq. 3's epsilon in the denominator
CODE_SELF_WEIGHT = -math.log(1.0 - 0.9999)  # FL-bench: self entry 0.9999 -> -log(1e-4)


def warmup_rounds(rounds: int, ratio: float) -> int:
    """T_g = floor(rho * T) (spec pitfall 8: T_g warm-up rounds, then T - T_g)."""
    return int(math.floor(ratio * rounds + 1e-9))


def class_rows(head: Mapping[str, Tensor], use_bias: bool = False) -> Tensor:
    """The classifier's per-class vectors phi_c (rows of the Linear head's weight), with the
    bias appended as one more column when ``use_bias``; float64."""
    weight = next(v for v in head.values() if v.dim() == 2).double()
    if not use_bias:
        return weight
    bias = [v for v in head.values() if v.dim() == 1]
    return torch.cat([weight, bias[0].double()[:, None]], 1) if bias else weight


def class_cosines(a: Tensor, b: Tensor, cos_max: float = 1 - 1e-6) -> Tensor:
    """cos_c = <a_c, b_c> / (|a_c| |b_c| + 1e-8) per row c, clamped to ``cos_max`` (float64)."""
    a, b = a.double(), b.double()
    cos = (a * b).sum(1) / (a.norm(dim=1) * b.norm(dim=1) + COS_EPS)
    clamped: Tensor = cos.clamp(max=cos_max)
    return clamped


def classifier_similarity(
    a: Tensor, b: Tensor, reduce: SimReduce = "per_class_log", cos_max: float = 1 - 1e-6
) -> float:
    """Phi_ij from two clients' class rows (Eq. 3, or the code's mean-then-log form)."""
    cos = class_cosines(a, b, cos_max)
    if reduce == "per_class_log":
        return float((-torch.log1p(-cos.clamp(min=0.0))).mean())
    return float(-torch.log1p(-cos.mean().clamp(min=0.0)))


def aggregation_weights(row: Tensor, cid: int, self_weight: SelfWeight = "paper") -> Tensor:
    """Eq. 4's normalised weights of client ``cid`` from its row of Phi (off-diagonal
    similarities; the diagonal is 1 for ``paper``, -log(1e-4) for ``code``)."""
    w = row.double().clone()
    w[cid] = 1.0 if self_weight == "paper" else CODE_SELF_WEIGHT
    return w / w.sum()


def mix(stored: list[Weights], w: Tensor, keys: list[str], own: Weights) -> Weights:
    """sum_j w_j stored_j[k] for every float key in ``keys``, over the j with w_j > 0 in
    order; integer entries are the client's own."""
    nz = [j for j in range(len(stored)) if w[j] > 0]
    return weighted_sum([stored[j] for j in nz], [float(w[j]) for j in nz], own, keys)


@register
class PFedSim(Algorithm):
    name = "pfedsim"
    sample_dp_covered = True  # DP-SGD covers it (pflkit.privacy.dpsgd)
    vectorize = True  # engine.vectorize covers its local work
    release = {"weights": "weights"}
    uses_each_upload = "measures the similarity of each client's classifier and mixes each client's extractor by it"
    private = ("buffers",)  # with bn_stats: local
    description = (
        "pFedSim (Tan et al. 2023): FedAvg warm-up, then per-client extractors averaged by "
        "classifier similarity, private classifiers"
    )
    payload = WeightsPayload
    upload = WeightsUpload
    state = PFedSimState
    server = PFedSimServer

    class Params(Algorithm.Params):
        warmup_ratio: float = param(0.5, "paper (rho, App. A.5)", ge=0, le=1)
        sim_reduce: SimReduce = param("per_class_log", "paper (Eq. 3); mean_then_log: code")
        self_weight: SelfWeight = param("paper", "paper (Phi = I_n); code: -log(1 - 0.9999)")
        sim_use_bias: bool = param(False, "authors' code (paper: 'decision boundaries')")
        cos_max: float = param(1 - 1e-6, "pflkit (keeps -log(1 - cos) finite)", gt=0, lt=1)
        bn_stats: BNStats = param("aggregate", "paper reading, FL-bench HEAD; local: 2023 code")
        weighting: Weighting = param("samples", "paper (Alg. 1: |D_i| weights)")

    params: Params

    # -- helpers --------------------------------------------------------------------------------
    def t_g(self, env: ServerEnv | ClientEnv) -> int:
        return warmup_rounds(env.run.rounds, self.params.warmup_ratio)

    def shared(self, model: nn.Module, weights: Mapping[str, Tensor]) -> Weights:
        """What crosses the network: everything, or everything but the buffers (bn local)."""
        if self.params.bn_stats == "local":
            return without(weights, buffer_keys(model))
        return dict(weights)

    def check(self, env: ServerEnv) -> None:
        require_homogeneous(env, self.name)
        if not isinstance(env.model().head, nn.Linear):
            raise PflkitError(
                f"algorithm '{self.name}' measures similarity on a linear classifier, but "
                f"model '{env.model().name}' has another head: pick a model with a Linear head"
            )

    # -- state ----------------------------------------------------------------------------------
    def server_init(self, env: ServerEnv) -> PFedSimServer:
        n = env.num_clients
        return {
            "weights": self.shared(env.model(), env.init_weights()),
            # off-diagonal Phi; I_n implied
            "phi": torch.zeros(n, n, dtype=torch.float64, device=env.device),
            "personal": {},  # cid -> the client's last uploaded model (personalization phase)
        }

    def client_init(self, env: ClientEnv) -> PFedSimState:
        if self.params.bn_stats == "local":
            model = env.model()
            return {"buffers": only(env.init_weights(), buffer_keys(model))}
        return {}

    def stored(self, server: PFedSimServer, cid: int) -> Weights:
        return server["personal"].get(cid, server["weights"])

    # -- one exchange ---------------------------------------------------------------------------
    def configure(
        self, env: ServerEnv, server: PFedSimServer, cid: int, ctx: ServerContext
    ) -> Payload:
        if ctx.round <= self.t_g(env):
            return {"weights": server["weights"]}
        model = env.model()
        own = self.stored(server, cid)
        w = aggregation_weights(server["phi"][cid], cid, self.params.self_weight)
        stored = [self.stored(server, j) for j in range(env.num_clients)]
        body = [k for k in model.group_keys("body") if k in own]
        head = [k for k in model.group_keys("head") if k in own]
        weights = {**mix(stored, w, body, own), **only(own, head)}
        return {"weights": {k: weights[k] for k in own}}

    def client_update(
        self, env: ClientEnv, payload: WeightsPayload, state: PFedSimState, ctx: RoundContext
    ) -> Update:
        model = env.model()
        start = merged(model, payload["weights"], state.get("buffers", {}))
        weights, loss = train_from(env, start, ctx)
        new_state = dict(state)
        if self.params.bn_stats == "local":
            new_state["buffers"] = only(weights, buffer_keys(model))
        upload = {"weights": self.shared(model, weights), "num_samples": env.num_train}
        return Update(upload, new_state, {"train_loss": loss})

    def aggregate(
        self,
        env: ServerEnv,
        server: PFedSimServer,
        uploads: Mapping[int, WeightsUpload],
        ctx: ServerContext,
    ) -> State:
        p = self.params
        if ctx.round <= self.t_g(env):
            avg = weighted_average(uploads, uniform=p.weighting == "uniform")
            return {**server, "weights": avg}
        head_keys = env.model().group_keys("head")
        personal = dict(server["personal"])
        rows = {}
        for cid, up in uploads.items():
            personal[cid] = up["weights"]
            rows[cid] = class_rows(only(up["weights"], head_keys), p.sim_use_bias)
        phi = server["phi"].clone()
        ids = sorted(uploads)
        for a, i in enumerate(ids):
            for j in ids[a + 1 :]:
                phi[i, j] = phi[j, i] = classifier_similarity(
                    rows[i], rows[j], p.sim_reduce, p.cos_max
                )
        return {**server, "personal": personal, "phi": phi}

    # -- evaluation -----------------------------------------------------------------------------
    def eval_view(
        self, env: ServerEnv, server: PFedSimServer, cid: int | None, ctx: ServerContext
    ) -> Payload:
        """The client's stored model; with ``cid`` None the global model during the warm-up
        (with shared BN statistics), else none."""
        if cid is not None:
            return {"weights": self.stored(server, cid)}
        if self.params.bn_stats == "local" or ctx.round > self.t_g(env) or self.t_g(env) == 0:
            return {}  # no global model after the warm-up (or without shared BN statistics)
        return {"weights": server["weights"]}

    def personal_model(
        self,
        env: ClientEnv,
        view: Payload,
        state: State,
        ctx: RoundContext,
        upload: Upload | None = None,
    ) -> nn.Module:
        return load_model(env, merged(env.model(), view["weights"], state.get("buffers", {})))
