"""FedAvg: McMahan et al., "Communication-Efficient Learning of Deep Networks from
Decentralized Data", AISTATS 2017 (Algorithm 1).

Shared: the whole model. Private: nothing.

- Client k starts from the global weights w_t and runs E epochs of mini-batch SGD on its
  training split, giving w_{t+1}^k.
- Server: w_{t+1} = sum_k (n_k / n) w_{t+1}^k over the selected clients (n = their total);
  ``weighting: uniform`` gives the plain mean instead (how the MAP authors' code runs FedAvg).

Deviations: none. BatchNorm running statistics are averaged like parameters; integer buffers
(BN's step counter) are taken from the first client.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

from pflkit.algorithms.base import (
    Algorithm,
    RoundContext,
    ServerContext,
    State,
    Update,
    Weighting,
    param,
    register,
    train_from,
    weighted_average,
)
from pflkit.algorithms.env import ClientEnv, ServerEnv
from pflkit.algorithms.records import Empty, WeightsPayload, WeightsServer, WeightsUpload
from pflkit.primitives.training import LossFn, cross_entropy


@register
class FedAvg(Algorithm):
    name = "fedavg"
    sample_dp_covered = True  # DP-SGD covers it (pflkit.privacy.dpsgd)
    release: ClassVar[Mapping[str, str | None] | None] = {
        "weights": "weights"
    }  # the trained model, an update of the download
    secagg: ClassVar[tuple[str, ...]] = (
        "samples",
        "uniform",
    )  # its aggregate is the mean of the uploads
    vectorize = True  # engine.vectorize covers its local work
    description = "FedAvg (McMahan et al. 2017): local SGD, sample-weighted model averaging"
    payload: ClassVar[object] = WeightsPayload
    upload: ClassVar[object] = WeightsUpload
    state: ClassVar[object] = Empty
    server: ClassVar[object] = WeightsServer

    class Params(Algorithm.Params):
        weighting: Weighting = param("samples", "paper (Alg. 1: n_k / n)")

    params: Params

    def local_objective(self, env: ClientEnv, payload: WeightsPayload) -> LossFn:
        """The loss of the local steps (FedProx: + proximal term; FedRS: restricted softmax)."""
        return cross_entropy

    def client_update(  # the state passes through: a subclass gives its own record
        self, env: ClientEnv, payload: WeightsPayload, state: Any, ctx: RoundContext
    ) -> Update:
        loss_fn = self.local_objective(env, payload)
        weights, loss = train_from(env, payload["weights"], ctx, loss_fn=loss_fn)
        upload = {"weights": weights, "num_samples": env.num_train}
        return Update(upload, state, {"train_loss": loss})

    def aggregate(
        self,
        env: ServerEnv,
        server: State,
        uploads: Mapping[int, WeightsUpload],
        ctx: ServerContext,
    ) -> State:
        uniform = self.params.weighting == "uniform"
        return {**server, "weights": weighted_average(uploads, uniform=uniform)}
