"""Local training only: each client trains its own model on its own data, with no
communication. The lower bound that every pFL paper reports ("Local" / "Standalone").

Private: the whole model (client state ``weights``). Shared: nothing (0 bytes each way).
Each client's model starts from its own random initialisation; in each round the selected
clients train for the configured local epochs.
"""

from __future__ import annotations

from pflkit.algorithms.base import Algorithm, Payload, State, Update, register, train_from


@register
class Local(Algorithm):
    name = "local"
    description = "Local training only: every client trains its own model, no communication"

    def server_init(self) -> State:
        return {}

    def client_init(self, cid: int) -> State:
        return {"weights": self.ctx.init_weights(self.ctx.arch(cid))}

    def configure(self, server: State, cid: int, rnd: int, phase: str) -> Payload:
        return {}

    def client_update(self, cid: int, payload: Payload, state: State, rnd: int, phase: str):
        weights, loss = train_from(self.ctx, cid, state["weights"])
        return Update({}, {"weights": weights}, {"train_loss": loss})

    def aggregate(self, server, uploads, rnd, phase) -> State:
        return server

    def personal_weights(self, server: State, cid: int, state: State):
        return state["weights"]
