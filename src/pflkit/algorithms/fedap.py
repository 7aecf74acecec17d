"""f-FedAP: Lu, Wang, Chen, Qin, Xu, Dimitriadis & Qin, "Personalized Federated Learning with
Adaptive Batchnorm for Healthcare", IEEE Trans. Big Data 2022 (FedAP, §3); the "f" version
as the pFedSim paper runs it (App. A.5): FedBN warm-up instead of a pre-trained model, then
similarity-weighted aggregation with model momentum. Authors' code: microsoft/PersonalizedFL
(``fedap``).

Shared: every parameter except BatchNorm layers (as FedBN), and once per client its BN input
statistics. Private: each client's BatchNorm layers (client state ``bn``), never sent.

1. **Warm-up** (rounds 1 .. T_g, T_g = floor(rho * T)): FedBN.
2. **Statistics** (FedAP §3.2): with the warm-up model and its own BN layers, client i passes
   its training data through the network and records, at the input of every BN layer l, the
   per-channel mean mu_il and variance sigma_il^2.
3. **Similarity** (FedAP Eq. for the Wasserstein distance of diagonal Gaussians, summed over
   layers as the authors' code does)::

       d_ij = sum_l sqrt( ||mu_il - mu_jl||^2 + ||sigma_il - sigma_jl||^2 )
       W_ij = (1 - mu) * (1 / d_ij) / sum_{k != i} (1 / d_ik),    W_ii = mu   (model momentum)

4. **Personalized aggregation**: client i receives sum_j W_ij theta_j over its non-BN
   parameters, theta_j being client j's last uploaded model; it trains E epochs and uploads.

Defaults: rho = 0.5 and model momentum mu = 0.5 (pFedSim App. A.5). Warm-up rounds train
``train.local_epochs`` epochs, as every other round; ``warmup_epochs: 1`` is FL-bench's code
(``src/server/fedap.py``, ``package``: ``local_epoch = 1`` while it pre-trains).

Deviations (partial participation; FedAP has every client take part):
- Statistics are computed when a client is first selected after the warm-up, with the model
  it then receives (the warm-up extractor and its own BN layers: the model it had at the
  switch), and uploaded once (counted in its bytes). Until the server has a client's
  statistics, that client receives its own last model; the sums over k run over the clients
  whose statistics are known.
- Means and variances are over the whole training split in one pass (eval mode); the code
  averages per-batch values. d_ij = 0 is clamped to 1e-12 (the code uses a weight of 1e14).
- Personalized model for evaluation: the client's last trained model (non-BN part stored on
  the server) with its own BN layers; no global model is scored.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NotRequired, TypedDict

import torch
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
from pflkit.algorithms.env import ClientEnv, ServerEnv
from pflkit.algorithms.fedbn import FedBN, FedBNState
from pflkit.algorithms.pfedsim import warmup_rounds
from pflkit.algorithms.records import WeightsUpload
from pflkit.primitives.bn import bn_keys, bn_modules, merged, only, without
from pflkit.primitives.training import Weights
from pflkit.primitives.tree import weighted_sum

Stats = dict[str, list[Tensor]]  # {"mean": [per layer], "var": [per layer]}


class FedAPPayload(TypedDict):
    """The model to train, and whether the server still needs the client's BN statistics."""

    weights: Weights
    need_stats: NotRequired[bool]


class FedAPUpload(WeightsUpload):
    """FedBN's upload, plus the BN input statistics when the server asked for them."""

    stats: NotRequired[Stats]


class FedAPServer(TypedDict):
    """The global model, each client's BN statistics and its last uploaded model."""

    weights: Weights
    stats: dict[int, Stats]
    personal: dict[int, Weights]


@torch.no_grad()
def feature_stats(model: nn.Module, x: Tensor, batch_size: int = 1000) -> Stats:
    """Per-channel mean and (population) variance of the input of every BatchNorm layer of
    ``model`` over the samples ``x`` (eval mode), float64."""
    mods = [m for _, m in bn_modules(model)]
    acc: list[list[Any]] = [[0.0, 0.0, 0] for _ in mods]  # sum, sum of squares, count

    def hook(i: int) -> Callable[[nn.Module, tuple[Tensor, ...]], None]:
        def fn(module: nn.Module, inputs: tuple[Tensor, ...]) -> None:
            z = inputs[0].double()
            dims = [0] + list(range(2, z.dim()))
            acc[i][0] = acc[i][0] + z.sum(dims)
            acc[i][1] = acc[i][1] + (z * z).sum(dims)
            acc[i][2] += z.numel() // z.shape[1]

        return fn

    handles = [m.register_forward_pre_hook(hook(i)) for i, m in enumerate(mods)]
    try:
        model.eval()
        for s in range(0, len(x), batch_size):
            model(x[s : s + batch_size])
    finally:
        for h in handles:
            h.remove()
    means, variances = [], []
    for s1, s2, n in acc:
        mean = s1 / max(n, 1)
        means.append(torch.as_tensor(mean, dtype=torch.float64, device=x.device))
        var = torch.as_tensor(s2 / max(n, 1) - mean * mean, dtype=torch.float64, device=x.device)
        variances.append(var.clamp(min=0.0))
    return {"mean": means, "var": variances}


def bn_wasserstein(a: Stats, b: Stats) -> float:
    """sum over layers of the 2-Wasserstein distance of N(mu_a, diag var_a) and
    N(mu_b, diag var_b): sqrt(||mu_a - mu_b||^2 + ||sigma_a - sigma_b||^2)."""
    total = 0.0
    for ma, va, mb, vb in zip(a["mean"], a["var"], b["mean"], b["var"], strict=True):
        sq = ((ma - mb) ** 2).sum() + ((va.sqrt() - vb.sqrt()) ** 2).sum()
        total += math.sqrt(float(sq))
    return total


def fedap_weights(
    cid: int, others: Sequence[int], dists: Sequence[float], momentum: float
) -> dict[int, float]:
    """W_i.: momentum for ``cid``, (1 - momentum) shared by ``others`` in proportion to 1/d."""
    if not others:
        return {cid: 1.0}
    inv = [1.0 / max(d, 1e-12) for d in dists]
    s = sum(inv)
    out = {j: (1.0 - momentum) * v / s for j, v in zip(others, inv, strict=True)}
    out[cid] = momentum
    return out


@register
class FedAP(FedBN):
    name = "fedap"
    release = None
    release_refusal = "its first upload carries the batch-norm statistics of the client's data, with no clipping defined"
    uses_each_upload = "mixes each client's model by the similarity of its batch-norm statistics"
    description = (
        "f-FedAP (Lu et al. 2022): FedBN warm-up, then aggregation weighted by the Wasserstein "
        "distance of BN statistics, with model momentum"
    )
    payload = FedAPPayload
    upload = FedAPUpload
    server = FedAPServer

    class Params(FedBN.Params):
        warmup_ratio: float = param(0.5, "pFedSim App. A.5 (generalization ratio)", ge=0, le=1)
        momentum: float = param(0.5, "pFedSim App. A.5 (model momentum mu)", ge=0, le=1)
        warmup_epochs: int | None = param(
            None, "local epochs of a warm-up round (None: train.local_epochs; FL-bench: 1)", ge=1
        )

    params: Params

    def t_g(self, env: ServerEnv | ClientEnv) -> int:
        return warmup_rounds(env.run.rounds, self.params.warmup_ratio)

    def server_init(self, env: ServerEnv) -> FedAPServer:
        return {**super().server_init(env), "stats": {}, "personal": {}}

    def stored(self, server: State, cid: int) -> Weights:
        weights: Weights = server["personal"].get(cid, server["weights"])
        return weights

    def row(self, server: State, cid: int) -> dict[int, float]:
        stats = server["stats"]
        others = sorted(j for j in stats if j != cid)
        dists = [bn_wasserstein(stats[cid], stats[j]) for j in others]
        return fedap_weights(cid, others, dists, self.params.momentum)

    def configure(self, env: ServerEnv, server: State, cid: int, ctx: ServerContext) -> Payload:
        if ctx.round <= self.t_g(env):
            return {"weights": server["weights"]}
        if cid not in server["stats"]:
            return {"weights": self.stored(server, cid), "need_stats": True}
        own = self.stored(server, cid)
        row = self.row(server, cid)
        trees = [self.stored(server, j) for j in row]
        return {"weights": weighted_sum(trees, list(row.values()), own)}

    def client_update(  # type: ignore[override]  # its payload has keys FedAvg's lacks
        self, env: ClientEnv, payload: FedAPPayload, state: FedBNState, ctx: RoundContext
    ) -> Update:
        model = env.model()
        start = merged(model, payload["weights"], state["bn"])
        extra: dict[str, Stats] = {}
        if payload.get("need_stats"):
            stats_model = env.model("fedap_stats")
            stats_model.load_state_dict(start)
            extra["stats"] = feature_stats(stats_model, env.data.train_x)
        warm = ctx.round <= self.t_g(env) and self.params.warmup_epochs is not None
        epochs: dict[str, Any] = {"epochs": self.params.warmup_epochs} if warm else {}
        weights, loss = train_from(env, start, ctx, **epochs)
        keys = bn_keys(model)
        upload = {"weights": without(weights, keys), "num_samples": env.num_train, **extra}
        return Update(upload, {**state, "bn": only(weights, keys)}, {"train_loss": loss})

    def aggregate(  # type: ignore[override]  # FedAP's upload record, not FedAvg's
        self,
        env: ServerEnv,
        server: State,
        uploads: Mapping[int, FedAPUpload],
        ctx: ServerContext,
    ) -> State:
        if ctx.round <= self.t_g(env):
            return super().aggregate(env, server, uploads, ctx)
        personal, stats = dict(server["personal"]), dict(server["stats"])
        for cid, up in uploads.items():
            personal[cid] = up["weights"]
            if "stats" in up:
                stats[cid] = up["stats"]
        return {**server, "personal": personal, "stats": stats}

    def eval_view(
        self, env: ServerEnv, server: State, cid: int | None, ctx: ServerContext
    ) -> Payload:
        """The client's stored personalized model (no global model: ``cid`` None gives
        nothing)."""
        return {} if cid is None else {"weights": self.stored(server, cid)}
