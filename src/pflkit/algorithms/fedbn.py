"""FedBN: Li, Jiang, Zhang, Kamp & Dou, "FedBN: Federated Learning on Non-IID Features via
Local Batch Normalization", ICLR 2021 (Algorithm 1).

Shared: every parameter except the BatchNorm layers. Private: each client's BatchNorm layers
(affine weight and bias, running mean and variance, batch counter), kept in client state and
never sent in either direction.

- Client k loads the downloaded non-BN weights next to its own BN layers, runs E epochs of
  local SGD on the whole model, uploads the non-BN weights (Algorithm 1: "local update" on
  all parameters, "aggregation" on non-BN ones).
- Server: w_{t+1} = sum_k (n_k / n) w_k over the non-BN entries (the paper writes the uniform
  mean for its equal-sized clients; ``weighting: uniform`` gives it).
- A client's BN layers start from the model's initial values (weight 1, bias 0, statistics
  0 / 1), the same on every client, as Algorithm 1's shared initialisation.

Personalized model: the global non-BN weights with the client's own BN layers. There is no
global model to score on the global test set (it has no BN layers), so ``global_acc`` is not
reported. On a model without BatchNorm, FedBN is FedAvg.

Deviations: none.
"""

from __future__ import annotations

from typing import ClassVar, TypedDict

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
    train_from,
)
from pflkit.algorithms.env import ClientEnv, ServerEnv
from pflkit.algorithms.fedavg import FedAvg
from pflkit.algorithms.records import WeightsPayload, WeightsServer
from pflkit.primitives.bn import bn_keys, merged, only, without
from pflkit.primitives.training import Weights


class FedBNState(TypedDict):
    """The client's BatchNorm entries (parameters and buffers), never uploaded."""

    bn: Weights


@register
class FedBN(FedAvg):
    name = "fedbn"
    sample_dp_covered = True  # DP-SGD covers it (pflkit.privacy.dpsgd)
    vectorize = True  # engine.vectorize covers its local work
    private = ("bn",)  # the BatchNorm layers: the upload carries the rest
    description = "FedBN (Li et al. 2021): FedAvg on everything but BatchNorm layers, kept local"
    state: ClassVar[object] = FedBNState

    class Params(FedAvg.Params):
        weighting: Weighting = param("samples", "paper (Alg. 1 with n_k weights; uniform: Eq.)")

    params: Params

    def server_init(self, env: ServerEnv) -> WeightsServer:
        return {"weights": without(env.init_weights(), bn_keys(env.model()))}

    def client_init(self, env: ClientEnv) -> FedBNState:
        return {"bn": only(env.init_weights(), bn_keys(env.model()))}

    def client_update(
        self, env: ClientEnv, payload: WeightsPayload, state: FedBNState, ctx: RoundContext
    ) -> Update:
        model = env.model()
        start = merged(model, payload["weights"], state["bn"])
        weights, loss = train_from(env, start, ctx, loss_fn=self.local_objective(env, payload))
        keys = bn_keys(model)
        upload = {"weights": without(weights, keys), "num_samples": env.num_train}
        return Update(upload, {**state, "bn": only(weights, keys)}, {"train_loss": loss})

    def eval_view(
        self, env: ServerEnv, server: State, cid: int | None, ctx: ServerContext
    ) -> Payload:
        """The global model; with BatchNorm layers there is none to score on the global test
        set (``cid`` None gives nothing): each client keeps its own statistics."""
        if cid is None and bn_keys(env.model()):
            return {}
        return {"weights": server["weights"]}

    def personal_model(
        self,
        env: ClientEnv,
        view: Payload,
        state: State,
        ctx: RoundContext,
        upload: Upload | None = None,
    ) -> nn.Module:
        return load_model(env, merged(env.model(), view["weights"], state["bn"]))
