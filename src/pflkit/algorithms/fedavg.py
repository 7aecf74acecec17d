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

from typing import Literal

from pflkit.algorithms.base import (
    Algorithm,
    Payload,
    State,
    Update,
    register,
    train_from,
    weighted_average,
)


@register
class FedAvg(Algorithm):
    name = "fedavg"
    description = "FedAvg (McMahan et al. 2017): local SGD, sample-weighted model averaging"

    class Params(Algorithm.Params):
        weighting: Literal["samples", "uniform"] = "samples"

    def client_update(self, cid: int, payload: Payload, state: State, rnd: int, phase: str):
        overrides = self.train_overrides(cid, payload)
        weights, loss = train_from(self.ctx, cid, payload["weights"], **overrides)
        n = len(self.ctx.client(cid).train_y)
        return Update({"weights": weights, "num_samples": n}, state, {"train_loss": loss})

    def train_overrides(self, cid: int, payload: Payload) -> dict:
        """Extra local_sgd arguments (e.g. a loss); FedProx and FedRS override this."""
        return {}

    def aggregate(self, server, uploads, rnd, phase) -> State:
        uniform = self.params.weighting == "uniform"
        return {**server, "weights": weighted_average(uploads, uniform=uniform)}
