"""Shared body, private head: the pieces FedPer, FedRep, FedRoD and GPFL have in common.

- :func:`common_init`: the initial model, drawn from a generator seeded by the run seed only, so
  the server and every client build the same values without sending them (the authors' codes
  deep-copy one initial model into every client: all private heads start equal).
- :func:`require_homogeneous`: algorithms that average (or mix, or generate) parameters need
  every client on the same architecture.
- :class:`SplitBody`: the shared-body / private-head algorithm that FedPer and FedRep subclass.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TypedDict

import numpy as np
import torch
from torch import nn

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
    weighted_average,
)
from pflkit.algorithms.env import ClientEnv, ServerEnv
from pflkit.errors import PflkitError
from pflkit.models import PFLModel
from pflkit.primitives.training import Weights, get_weights, set_weights


class BodyPayload(TypedDict):
    """The shared body (less ``private_layers``)."""

    body: Weights


class BodyUpload(Upload):
    """The trained shared body and the sample count."""

    body: Weights


class HeadState(TypedDict):
    """The client's private part: the head and ``private_layers``."""

    head: Weights


class BodyServer(TypedDict):
    """The global shared body."""

    body: Weights


def common_seed(seed: int, *keys: int) -> int:
    """A torch seed derived from the run seed and ``keys`` only (no client, no round)."""
    return int(np.random.SeedSequence([seed, 0x5A7E, *keys]).generate_state(1)[0])


def common_init(env: ClientEnv | ServerEnv) -> Weights:
    """The run's initial model: the same values on the server and on every client."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(common_seed(env.run.seed))
        return env.init_weights()


def require_homogeneous(
    env: ServerEnv,
    name: str,
    why: str = "averages the feature extractor",
    instead: str | None = None,
) -> None:
    """Refuse a federation of mixed architectures; ``why`` says what the algorithm does that
    needs one architecture (it completes "algorithm 'name' ..."), ``instead`` names an
    algorithm the message offers for mixed architectures."""
    if len(set(env.archs)) > 1:
        other = f", or use '{instead}'" if instead else ""
        raise PflkitError(
            f"algorithm '{name}' {why}, so every client needs the same "
            f"architecture (got {len(set(env.archs))}): remove model.per_client{other}"
        )


class SplitBody(Algorithm):
    """Shared ``body`` (downloaded, trained, uploaded, averaged), private ``head`` (client
    state ``head``), less the body layers named in ``private_layers``, which are private too.
    Subclasses define :meth:`local_train`."""

    release = {"body": "body"}
    secagg = ("samples", "uniform")  # its aggregate is the mean of the uploads
    private = ("head",)
    payload = BodyPayload
    upload = BodyUpload
    state = HeadState
    server = BodyServer

    class Params(Algorithm.Params):
        weighting: Weighting = param(
            "samples", "FedPer paper Alg. 1 (n_j / n); FedRep paper: plain mean; PFLlib: samples"
        )
        private_layers: list[str] = param(
            [], "paper (the head only); fc1 with fedproto_cnn: FedProto's code (convs shared)"
        )

    params: Params

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

    def server_init(self, env: ServerEnv) -> BodyServer:
        w = common_init(env)
        return {"body": {k: w[k] for k in self.shared_keys(env.model())}}

    def client_init(self, env: ClientEnv) -> HeadState:
        w = common_init(env)
        return {"head": {k: w[k] for k in self.private_keys(env.model())}}

    def configure(self, env: ServerEnv, server: State, cid: int, ctx: ServerContext) -> Payload:
        return {"body": server["body"]}

    def local_train(self, env: ClientEnv, model: PFLModel, ctx: RoundContext) -> float:
        raise NotImplementedError

    def client_update(
        self, env: ClientEnv, payload: BodyPayload, state: HeadState, ctx: RoundContext
    ) -> Update:
        model = env.model()
        set_weights(model, {**payload["body"], **state["head"]})
        loss = self.local_train(env, model, ctx)
        w = get_weights(model)
        upload = {"body": {k: w[k] for k in self.shared_keys(model)}, "num_samples": env.num_train}
        private = {k: w[k] for k in self.private_keys(model)}
        return Update(upload, {**state, "head": private}, {"train_loss": loss})

    def aggregate(
        self, env: ServerEnv, server: State, uploads: Mapping[int, BodyUpload], ctx: ServerContext
    ) -> State:
        uniform = self.params.weighting == "uniform"
        return {**server, "body": weighted_average(uploads, "body", uniform=uniform)}

    def eval_view(
        self, env: ServerEnv, server: State, cid: int | None, ctx: ServerContext
    ) -> Payload:
        """The shared body (there is no global model: ``cid`` None gives nothing)."""
        return {} if cid is None else {"body": server["body"]}

    def personal_model(
        self,
        env: ClientEnv,
        view: Payload,
        state: HeadState,
        ctx: RoundContext,
        upload: BodyUpload | None = None,
    ) -> nn.Module:
        """The received body with the client's private part; under MAP's protocol the body this
        client trained (its upload), not this round's aggregated body."""
        body = view["body"] if upload is None else upload["body"]
        return load_model(env, {**body, **state["head"]})
