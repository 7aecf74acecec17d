"""Local training only: each client trains its own model on its own data, with no
communication. The lower bound that every pFL paper reports ("Local" / "Standalone").

Private: the whole model (client state ``weights``). Shared: nothing (0 bytes each way).
Each client's model starts from its own random initialisation; in each round the selected
clients train for the configured local epochs.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TypedDict

from torch import nn

from pflkit.algorithms.base import (
    Algorithm,
    Payload,
    RoundContext,
    ServerContext,
    State,
    Update,
    Upload,
    load_model,
    register,
    train_from,
)
from pflkit.algorithms.env import ClientEnv, ServerEnv
from pflkit.algorithms.records import Empty
from pflkit.primitives.training import Weights


class LocalState(TypedDict):
    """The client's own model."""

    weights: Weights


@register
class Local(Algorithm):
    name = "local"
    sample_dp_covered = True  # DP-SGD covers it (pflkit.privacy.dpsgd)
    secagg_refusal = "it has no server aggregate to secure"
    release = {}  # nothing leaves the client
    vectorize = True  # engine.vectorize covers its local work
    description = "Local training only: every client trains its own model, no communication"
    payload = Empty
    upload = Empty
    state = LocalState
    server = Empty

    def server_init(self, env: ServerEnv) -> Empty:
        return {}

    def client_init(self, env: ClientEnv) -> LocalState:
        return {"weights": env.init_weights()}

    def configure(self, env: ServerEnv, server: State, cid: int, ctx: ServerContext) -> Payload:
        return {}

    def client_update(
        self, env: ClientEnv, payload: Empty, state: LocalState, ctx: RoundContext
    ) -> Update:
        weights, loss = train_from(env, state["weights"], ctx)
        return Update({}, {"weights": weights}, {"train_loss": loss})

    def aggregate(
        self, env: ServerEnv, server: State, uploads: Mapping[int, Empty], ctx: ServerContext
    ) -> State:
        return server

    def personal_model(
        self,
        env: ClientEnv,
        view: Payload,
        state: State,
        ctx: RoundContext,
        upload: Upload | None = None,
    ) -> nn.Module:
        return load_model(env, state["weights"])
