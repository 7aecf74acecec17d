"""FeSEM: Federated Stochastic Expectation Maximization, from "Multi-Center Federated Learning"
(M. Xie, G. Long, T. Shen, T. Zhou, X. Wang, J. Jiang, C. Zhang, arXiv 2005.01026, 2020),
published as "Multi-center federated learning: clients clustering for better personalization"
(G. Long, M. Xie et al., World Wide Web 26, 2023; arXiv v3). A baseline
of pFedPM's Table I (specs/pfedpm.md §5).

Shared: the whole model. The server keeps K centre models W~^(1..K) and each client's cluster
id (per-client server state ``assign``); a client downloads the centre of its cluster and
uploads its trained model. Private: nothing (``personal="local"`` keeps the client's last
trained model in its state, for scoring only).

Objective (multi-center loss): min over assignments r and centres W~ of
sum_i sum_k r_i^(k) ||W_i - W~^(k)||, with W_i each client's local model. One round:

- Client i downloads W~^(k) of its cluster k = assign[i] and runs FedAvg's client step
  (E epochs of SGD from it on its own data), giving its local model W_i, which it uploads.
- Server, over the uploads of the round, in this order:

  * E-step: assign[i] = argmin_k ||W_i - W~^(k)||_2 for every uploading client, with W_i its
    model *after* local training and W~ the centres as they were at the start of the round
    (the Euclidean distance runs over the model's parameters, flattened, in float64; buffers
    are left out; ties go to the lowest k).
  * M-step: W~^(k) = mean of W_i over the clients the E-step put in cluster k this round:
    the plain mean (``weighting="uniform"``, the paper's M-step, a k-means update) or
    weighted by n_i (``weighting="samples"``, FedAvg's rule; ``train.weighting``
    sets it for every method of a comparison). Buffers (BatchNorm statistics) are averaged the
    same way; integer buffers come from the first member.
  * A centre no client chose this round (an empty cluster) keeps its previous value.

Initialisation (``init``):

- ``"clients"`` (default): a client without a cluster (every client in round 1) downloads the
  run's initial model w^0 (the same on every client). The first time uploads arrive, each
  uninitialised centre becomes the model of one of those clients, drawn without replacement
  by a generator seeded from the run seed and the round; then the E- and M-steps run as above
  (so a drawn client is at distance 0 from its own centre). Centres left uninitialised (fewer
  uploads than K, under partial participation) are drawn from later rounds' uploads. This is
  k-means' usual (Forgy) start; the paper, as far as we could check, does not fix the start.
- ``"random"``: K independently initialised models (seeded from the run seed and k), as the
  FeSEM of the FlexCFL code (morningD/FlexCFL) does; clients without a cluster still download
  w^0. Random centres can all lie far from the trained models, so that every client picks
  the same one and the others stay empty.

Personalized model (``personal``): ``"center"`` (default, the paper's per-cluster global
model) scores the centre of the client's cluster (w^0 until its first upload);
``"local"`` scores the client's model after its last local training. There is no single
global model (nothing is scored on the global test set).

Defaults: ``num_clusters`` K = 2, the number of clusters of the SEM baseline in the FedProto
code, whose FeSEM numbers pFedPM's Table I copies (specs/pfedpm.md §6.3); pFedPM does not state
K (the FeSEM paper's own settings could not be consulted here). K must be at most the number
of clients.

Deviations: the paper's E-step and M-step run over all clients; with partial participation
they run over the round's participants only (a non-participating client keeps its cluster).
The local update is plain local SGD from the centre (no distance term in the local loss).
Momentum and weight decay are the config's (``train.*``), as for FedAvg.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Literal, NotRequired, TypedDict

import numpy as np
import torch
from torch import nn

from pflkit.algorithms.base import (
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
    weighted_average,
)
from pflkit.algorithms.blocks.split import common_init, common_seed, require_homogeneous
from pflkit.algorithms.env import ClientEnv, ServerEnv
from pflkit.algorithms.fedavg import FedAvg
from pflkit.algorithms.records import WeightsPayload, WeightsUpload
from pflkit.errors import PflkitError
from pflkit.primitives.training import Weights


class FeSEMState(TypedDict):
    """The client's last local model (``personal: local`` or MAP's protocol)."""

    weights: NotRequired[Weights]


class FeSEMServer(TypedDict):
    """w^0, the cluster centers, and each client's cluster."""

    weights: Weights
    centers: dict[int, Weights]
    assign: dict[int, int]


CenterInit = Literal["clients", "random"]
_INIT_DRAW = 0xFE5E  # key of the generator that draws the initial centres' clients
_RANDOM_CENTER = 0xCE  # key of the seed of random centre k


def model_distance(
    a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor], keys: Sequence[str]
) -> float:
    """||a - b||_2 over the entries ``keys`` (flattened and concatenated), in float64."""
    total = 0.0
    for k in keys:
        total += float((a[k].double() - b[k].double()).pow(2).sum())
    dist: float = total**0.5
    return dist


def nearest_center(
    weights: Mapping[str, torch.Tensor], centers: Mapping[int, Weights], keys: Sequence[str]
) -> int:
    """The E-step for one client: the id of the centre nearest to ``weights`` (lowest id on
    ties)."""
    best, best_d = -1, float("inf")
    for k in sorted(centers):
        d = model_distance(weights, centers[k], keys)
        if d < best_d:
            best, best_d = k, d
    return best


def fesem_step(
    centers: Mapping[int, Weights],
    uploads: Mapping[int, WeightsUpload],
    keys: Sequence[str],
    uniform: bool,
) -> tuple[dict[int, Weights], dict[int, int]]:
    """One E-step and M-step over ``uploads``: (new centres, each uploader's cluster id).
    A centre without members keeps its value."""
    assign = {cid: nearest_center(up["weights"], centers, keys) for cid, up in uploads.items()}
    new = dict(centers)
    for k in sorted(centers):
        members = {cid: uploads[cid] for cid in sorted(uploads) if assign[cid] == k}
        if members:
            new[k] = weighted_average(members, uniform=uniform)
    return new, assign


@register
class FeSEM(FedAvg):
    name = "fesem"
    sample_dp_covered = True  # DP-SGD covers it (pflkit.privacy.dpsgd)
    uses_each_upload = "clusters the clients by the distance of each upload to the cluster centres"
    description = (
        "FeSEM (Xie, Long et al. 2020): K centre models; clients join the nearest centre "
        "(E-step), centres average their members (M-step)"
    )
    state = FeSEMState
    server = FeSEMServer

    class Params(FedAvg.Params):
        num_clusters: int = param(2, "FedProto code's SEM helper (lib/utils.py:147, k = 2)", ge=1)
        init: CenterInit = param("clients", "pflkit (k-means' start; random: FlexCFL code)")
        personal: Literal["center", "local"] = param("center", "paper (the cluster model)")
        weighting: Weighting = param("uniform", "paper (M-step: mean of the members)")

    params: Params

    def check(self, env: ServerEnv) -> None:
        require_homogeneous(env, self.name, "averages whole client models")
        k = self.params.num_clusters
        if k > env.num_clients:
            raise PflkitError(
                f"algorithm 'fesem' has num_clusters {k} but the run has only "
                f"{env.num_clients} clients: set num_clusters to at most {env.num_clients}"
            )

    # -- state ----------------------------------------------------------------------------------
    def server_init(self, env: ServerEnv) -> FeSEMServer:
        centers: dict[int, Weights] = {}
        if self.params.init == "random":
            for k in range(self.params.num_clusters):
                with torch.random.fork_rng(devices=[]):
                    torch.manual_seed(common_seed(env.run.seed, _RANDOM_CENTER, k))
                    centers[k] = env.init_weights()
        # weights: w^0, what a client without a cluster downloads
        return {"weights": common_init(env), "centers": centers, "assign": {}}

    def center_of(self, server: State, cid: int) -> Weights:
        k = server["assign"].get(cid)
        center: Weights = server["weights"] if k is None else server["centers"][k]
        return center

    # -- one exchange ---------------------------------------------------------------------------
    def configure(self, env: ServerEnv, server: State, cid: int, ctx: ServerContext) -> Payload:
        return {"weights": self.center_of(server, cid)}

    def client_update(
        self, env: ClientEnv, payload: WeightsPayload, state: FeSEMState, ctx: RoundContext
    ) -> Update:
        update = super().client_update(env, payload, state, ctx)
        if self.params.personal == "local" or env.run.selected_eval:
            return Update(
                update.upload, {**state, "weights": update.upload["weights"]}, update.metrics
            )
        return update

    def aggregate(
        self,
        env: ServerEnv,
        server: State,
        uploads: Mapping[int, WeightsUpload],
        ctx: ServerContext,
    ) -> State:
        centers = dict(server["centers"])
        missing = [k for k in range(self.params.num_clusters) if k not in centers]
        if missing:  # init="clients": centres from distinct clients of this round
            rng = np.random.default_rng(common_seed(env.run.seed, _INIT_DRAW, ctx.round))
            pool = sorted(uploads)
            drawn = rng.choice(len(pool), size=min(len(missing), len(pool)), replace=False)
            for k, j in zip(missing, drawn, strict=False):
                centers[k] = {n: v.clone() for n, v in uploads[pool[int(j)]]["weights"].items()}
        keys = [n for n, _ in env.model().named_parameters()]
        uniform = self.params.weighting == "uniform"
        centers, assign = fesem_step(centers, uploads, keys, uniform)
        return {**server, "centers": centers, "assign": {**server["assign"], **assign}}

    # -- evaluation -----------------------------------------------------------------------------
    def eval_view(
        self, env: ServerEnv, server: State, cid: int | None, ctx: ServerContext
    ) -> Payload:
        # its cluster's centre model; K centre models, no single global one (cid None: nothing)
        return {} if cid is None else {"weights": self.center_of(server, cid)}

    def personal_model(
        self,
        env: ClientEnv,
        view: Payload,
        state: State,
        ctx: RoundContext,
        upload: Upload | None = None,
    ) -> nn.Module:
        if self.params.personal == "local" and state.get("weights") is not None:
            return load_model(env, state["weights"])
        return super().personal_model(env, view, state, ctx, upload)
