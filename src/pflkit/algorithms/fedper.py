"""FedPer: Arivazhagan, Aggarwal, Singh & Choudhary, "Federated Learning with Personalization
Layers", arXiv:1912.00818, 2019 (Sec. 3, Algorithm 1).

Shared: the base layers W_B (the model's ``body``). Private: the personalization layers W_P
(the model's ``head``), which never leave the client.

- Client j receives W_B, loads it under its own W_P_j and runs E epochs of mini-batch SGD on
  both together (the paper's "W_B, W_P_j <- SGD(...)", one joint objective: cross-entropy).
- Server: W_B <- sum_j (n_j / n) W_B_j over the participants (Alg. 1: weighted by local data).
- Personalized model: the latest aggregated W_B with the client's own W_P_j; under MAP's
  protocol (``eval.selected_clients``), the client's model right after local training: its
  trained W_B_j with its W_P_j.

:class:`SplitBody` is the shared-body / private-head plumbing that FedRep reuses.
``private_layers`` moves named layers of the body to the private side: ``[fc1]`` with
``fedproto_cnn`` shares only the two conv layers, as FedProto's code sets up FedPer (every key
not starting with ``fc`` averaged), whose FedPer and FedRep numbers pFedPM's Table I copies.

Deviations: the paper does not say how W_P starts; here every head starts from the same
initial model as the body (:func:`~pflkit.algorithms.blocks.split.common_init`, as the
PFLlib/GPFL code that runs this baseline). BatchNorm statistics in the body are averaged like
parameters. There is no global model: ``global_acc`` is not reported.
"""

from __future__ import annotations

from pflkit.algorithms.base import (
    Algorithm,
    Payload,
    State,
    Update,
    Weighting,
    param,
    register,
    weighted_average,
)
from pflkit.algorithms.blocks.split import common_init, require_homogeneous
from pflkit.algorithms.blocks.training import get_weights, set_weights
from pflkit.algorithms.env import ClientEnv, ServerEnv
from pflkit.errors import PflkitError
from pflkit.models import PFLModel


class SplitBody(Algorithm):
    """Shared ``body`` (downloaded, trained, uploaded, averaged), private ``head`` (client
    state ``head``), less the body layers named in ``private_layers``, which are private too.
    Subclasses define :meth:`local_train`."""

    class Params(Algorithm.Params):
        weighting: Weighting = param(
            "samples", "FedPer paper Alg. 1 (n_j / n); FedRep paper: plain mean; PFLlib: samples"
        )
        private_layers: list[str] = param(
            [], "paper (the head only); fc1 with fedproto_cnn: FedProto's code (convs shared)"
        )

    def check(self, env: ServerEnv) -> None:
        require_homogeneous(env, self.name)
        model = env.model()
        layers = sorted({k.split(".")[1] for k in model.group_keys("body")})
        for name in self.params.private_layers:
            if name not in layers:
                raise PflkitError(
                    f"algorithm '{self.name}' private_layers: {name!r} is not a layer of the "
                    f"model's body (its layers: {', '.join(layers)})"
                )
        if not self.shared_keys(model):
            raise PflkitError(
                f"algorithm '{self.name}' private_layers {self.params.private_layers} leaves "
                "nothing shared: keep at least one body layer out of it"
            )

    def shared_keys(self, model: PFLModel) -> list[str]:
        """State-dict keys of the shared part: the body less ``private_layers``."""
        private = tuple(f"body.{name}." for name in self.params.private_layers)
        return [k for k in model.group_keys("body") if not k.startswith(private)]

    def private_keys(self, model: PFLModel) -> list[str]:
        """State-dict keys of the private part: ``private_layers`` of the body, then the head."""
        shared = set(self.shared_keys(model))
        return [k for k in model.group_keys("body") if k not in shared] + model.group_keys("head")

    def server_init(self, env: ServerEnv) -> State:
        w = common_init(env)
        return {"body": {k: w[k] for k in self.shared_keys(env.model())}}

    def client_init(self, env: ClientEnv) -> State:
        w = common_init(env)
        return {"head": {k: w[k] for k in self.private_keys(env.model())}}

    def configure(self, env: ServerEnv, server: State, cid: int, rnd: int, phase: str) -> Payload:
        return {"body": server["body"]}

    def local_train(self, env: ClientEnv, model: PFLModel) -> float:
        raise NotImplementedError

    def client_update(self, env: ClientEnv, payload: Payload, state: State, rnd: int, phase: str):
        model = env.model()
        set_weights(model, {**payload["body"], **state["head"]})
        loss = self.local_train(env, model)
        w = get_weights(model)
        upload = {"body": {k: w[k] for k in self.shared_keys(model)}, "num_samples": env.num_train}
        private = {k: w[k] for k in self.private_keys(model)}
        return Update(upload, {**state, "head": private}, {"train_loss": loss})

    def aggregate(self, env, server, uploads, rnd, phase) -> State:
        uniform = self.params.weighting == "uniform"
        return {**server, "body": weighted_average(uploads, "body", uniform=uniform)}

    def global_weights(self, env: ServerEnv, server: State):
        return None

    def eval_view(self, env: ServerEnv, server: State, cid: int) -> Payload:
        return {"body": server["body"]}

    def personal_weights(self, env: ClientEnv, view: Payload, state: State):
        return {**view["body"], **state["head"]}

    def trained_weights(self, env, view, upload, state):
        """MAP's protocol: the model right after local training, the body this client trained
        (its upload) with its trained private part, not this round's aggregated body."""
        return {**upload["body"], **state["head"]}


@register
class FedPer(SplitBody):
    name = "fedper"
    description = "FedPer (Arivazhagan et al. 2019): shared body, private head, trained jointly"

    def local_train(self, env: ClientEnv, model: PFLModel) -> float:
        return env.train(model)
