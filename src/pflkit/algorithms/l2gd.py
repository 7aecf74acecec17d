"""L2GD: Hanzely & Richtárik, "Federated Learning of a Mixture of Global and Local Models",
arXiv 2002.05516 (2020), Algorithm 1 (Loopless Local Gradient Descent). A baseline of pFedPM's
Table I (specs/pfedpm.md §5).

Shared: each round, the client's model x_i (uploaded) and the average x_bar (downloaded).
Private: the client's own model x_i (client state ``weights``), its personalized model.

Objective (the paper's formulation), over one model x_i per client, i = 1..n:

    F(x) = (1/n) sum_i f_i(x_i) + lam * (1/(2n)) sum_i ||x_i - x_bar||^2,
    x_bar = (1/n) sum_i x_i

(n times it is sum_i f_i(x_i) + (lam/2) sum_i ||x_i - x_bar||^2: the same minimiser).

Algorithm 1, step size alpha (``eta``): each iteration flips a coin xi ~ Bernoulli(p);

- xi = 0 (local step, every client):  x_i <- x_i - alpha / (n (1 - p)) * grad f_i(x_i)
- xi = 1 (aggregation step):           x_i <- x_i - alpha * lam / (n p) * (x_i - x_bar)

An aggregation step leaves x_bar unchanged, so a run of consecutive aggregation steps needs one
communication only; the paper counts a communication each time the coin turns from 0 to 1.

**How a pflkit round maps onto the coin flips** (exact, for the whole coin sequence): one round
is one run of local steps followed by one run of aggregation steps, in two exchanges:

1. ``"local"`` phase (no model downloaded): every participating client runs L_r local steps,
   L_r ~ Geometric(p) on {1, 2, ...} (the length of a run of zeros, mean 1/p; a straggler,
   ``system.stragglers``, runs its share of them), and uploads x_i (and n_i). The server computes x_bar = (1/|S|) sum_{i in S} x_i over the uploads
   (``weighting="samples"``: weighted by n_i instead).
2. ``"pull"`` phase (x_bar downloaded, nothing uploaded): every client applies the M_r
   aggregation steps of the run, M_r ~ Geometric(1 - p) on {1, 2, ...} (mean 1/(1-p)):

       x_i <- x_bar + (1 - c)^{M_r} (x_i - x_bar),   c = alpha * lam / (n p)

   (M_r applications of the aggregation step; ``pulls="one"``: M_r = 1 always).

L_r and M_r come from a numpy generator seeded by the run seed and the round only
(:func:`~pflkit.algorithms.blocks.split.common_seed`), so every client and every engine draws
the same values; all models start from the same w^0 (so the coin sequence may start with
either kind of step: aggregation steps on equal models change nothing).

Step sizes. ``eta`` (alpha) unset (default): alpha = ``train.lr`` * n (1 - p), i.e. the local
step is x_i <- x_i - ``train.lr`` * g_i (the run's lr, as for every method of a comparison),
and the pull is c = ``train.lr`` * lam (1 - p) / p. ``eta`` set: the local step's lr is
eta / (n (1 - p)) and c = eta * lam / (n p); both phases' payloads then carry n
(``num_clients``, 8 bytes each), which a device of the paper knows. n is the number of clients of
the run. With ``train.lr_schedule`` both step sizes are multiplied by the round's factor.
A pull c above 1 (x_i would overshoot x_bar; the paper's step-size bound gives c <= 1/2) is
refused.

Defaults: p = 0.1 (the communication probability of the FedEM code's L2SGD baseline,
omarfoq/FedEM ``utils/args.py``); lam = 1 (pflkit). The experiments of the L2GD paper could
not be consulted when this was written and pFedPM states neither value, so both are
starting points to tune, not the paper's settings.

Deviations from Algorithm 1: (i) a local step uses a mini-batch stochastic gradient (one batch
of ``train.batch_size``, batches drawn as in every pflkit local loop) instead of grad f_i;
(ii) by default plain SGD (``momentum=False``: ``train.momentum`` ignored, as the paper's step
has none; ``momentum=True`` uses it within a round); ``train.weight_decay`` is part of f_i;
(iii) ``local_steps="epochs"`` replaces L_r by ``train.local_epochs`` epochs of local steps
(a fixed, per-client count, as FedAvg's), keeping the step sizes above; (iv) with partial
participation x_bar averages the round's participants and the others do nothing that round
(the paper's partial-participation variants are not implemented); (v) the whole float state
(parameters and BatchNorm statistics) is x_i; integer buffers stay the client's own.
The global model scored on the global test set is x_bar; a client's personalized model is its
x_i after the round's pull (also under MAP's selected-clients protocol).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal, NotRequired, TypedDict, cast

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
    train_from,
    weighted_average,
)
from pflkit.algorithms.blocks.split import common_init, common_seed, require_homogeneous
from pflkit.algorithms.env import ClientEnv, ServerEnv
from pflkit.algorithms.fedavg import FedAvg
from pflkit.algorithms.records import Empty, WeightsServer, WeightsUpload
from pflkit.errors import PflkitError
from pflkit.primitives.training import Weights
from pflkit.primitives.tree import interpolate


class L2GDLocalPayload(TypedDict):
    """Phase ``local``: the number of clients n (when ``eta`` sets the local step)."""

    num_clients: NotRequired[int]


class L2GDPullPayload(L2GDLocalPayload):
    """Phase ``pull``: the global mean x-bar too."""

    weights: Weights


class L2GDState(TypedDict):
    """The client's local model x_i."""

    weights: Weights


_COIN = 0x12C0  # key of the round's coin-run generator


def coin_runs(seed: int, rnd: int, p: float) -> tuple[int, int]:
    """(L_r, M_r) of round ``rnd``: the lengths of its run of local steps (Geometric(p) on
    1, 2, ...) and of its run of aggregation steps (Geometric(1 - p)); the same in every
    client and engine (seeded by the run seed and the round only)."""
    rng = np.random.default_rng(common_seed(seed, _COIN, rnd))
    return int(rng.geometric(p)), int(rng.geometric(1.0 - p))


def step_sizes(alpha: float, lam: float, p: float, n: int) -> tuple[float, float]:
    """(local lr, pull coefficient) of Algorithm 1: alpha / (n (1 - p)) and alpha lam / (n p)."""
    return alpha / (n * (1.0 - p)), alpha * lam / (n * p)


def pull(
    x: Mapping[str, torch.Tensor], x_bar: Mapping[str, torch.Tensor], c: float, times: int
) -> Weights:
    """``times`` aggregation steps x <- x - c (x - x_bar), as x_bar + (1 - c)^times (x - x_bar),
    on the floating-point entries (integer entries stay x's)."""
    keep = (1.0 - c) ** times
    return interpolate(x_bar, x, keep)


@register
class L2GD(FedAvg):
    name = "l2gd"
    sample_dp_covered = True  # DP-SGD covers it (pflkit.privacy.dpsgd)
    release = None
    release_refusal = "it uploads only in the rounds its coin flip communicates, and pflkit's client-level DP releases once every round"
    description = (
        "L2GD (Hanzely & Richtárik 2020): private models, geometric runs of local steps, "
        "pulled toward their average with probability p"
    )
    payload = L2GDLocalPayload | L2GDPullPayload
    upload = WeightsUpload | Empty
    state = L2GDState

    class Params(FedAvg.Params):
        lam: float = param(1.0, "pflkit (paper's experiments not consulted)", ge=0)
        p: float = param(0.1, "FedEM code's L2SGD (communication probability)", gt=0, lt=1)
        eta: float | None = param(None, "pflkit (None: local step = train.lr)", gt=0)
        local_steps: Literal["geometric", "epochs"] = param("geometric", "paper (Alg. 1)")
        pulls: Literal["geometric", "one"] = param("geometric", "paper (Alg. 1)")
        momentum: bool = param(False, "paper (plain gradient steps)")
        weighting: Weighting = param("uniform", "paper (x_bar = (1/n) sum_i x_i)")

    params: Params

    def phases(self, rnd: int) -> tuple[str, str]:
        return ("local", "pull")

    # -- step sizes -----------------------------------------------------------------------------
    def local_lr(self, base_lr: float, n: int | None) -> float:
        """The local step's lr before the round's schedule factor."""
        p = self.params
        if p.eta is None:
            return base_lr
        assert n is not None, "configure sends num_clients whenever eta is set"
        return step_sizes(p.eta, p.lam, p.p, n)[0]

    def pull_coefficient(self, base_lr: float, n: int | None) -> float:
        """c = alpha lam / (n p), before the round's schedule factor."""
        p = self.params
        if p.eta is None:  # alpha = lr n (1 - p)
            return base_lr * p.lam * (1.0 - p.p) / p.p
        assert n is not None, "configure sends num_clients whenever eta is set"
        return step_sizes(p.eta, p.lam, p.p, n)[1]

    def check(self, env: ServerEnv) -> None:
        require_homogeneous(env, self.name, "averages whole client models")
        c = self.pull_coefficient(env.run.train.lr, env.num_clients)
        if c > 1:
            raise PflkitError(
                f"algorithm 'l2gd' pulls each model by c = alpha * lam / (n p) = {c:.4g} > 1 "
                f"(lam {self.params.lam}, p {self.params.p}): lower lam, eta or train.lr, "
                "or raise p, so that c <= 1"
            )

    # -- state ----------------------------------------------------------------------------------
    def server_init(self, env: ServerEnv) -> WeightsServer:
        return {"weights": common_init(env)}

    def client_init(self, env: ClientEnv) -> L2GDState:
        return {"weights": common_init(env)}

    # -- one exchange ---------------------------------------------------------------------------
    def configure(self, env: ServerEnv, server: State, cid: int, ctx: ServerContext) -> Payload:
        n = {} if self.params.eta is None else {"num_clients": env.num_clients}
        return {"weights": server["weights"], **n} if ctx.phase == "pull" else n

    def client_update(  # type: ignore[override]  # its payload has keys FedAvg's lacks
        self,
        env: ClientEnv,
        payload: L2GDLocalPayload | L2GDPullPayload,
        state: L2GDState,
        ctx: RoundContext,
    ) -> Update:
        p, t = self.params, env.run.train
        n = payload.get("num_clients")
        if ctx.phase == "pull":
            steps = 1 if p.pulls == "one" else coin_runs(env.run.seed, ctx.round, p.p)[1]
            c = self.pull_coefficient(t.lr, n) * ctx.lr_factor
            x = pull(state["weights"], cast(L2GDPullPayload, payload)["weights"], c, steps)
            return Update({}, {**state, "weights": x})
        overrides: dict[str, Any] = {"lr": self.local_lr(t.lr, n)}
        if p.local_steps == "geometric":
            overrides["steps"] = coin_runs(env.run.seed, ctx.round, p.p)[0]
        if not p.momentum:
            overrides["momentum"] = 0.0
        x, loss = train_from(env, state["weights"], ctx, **overrides)
        upload = {"weights": x, "num_samples": env.num_train}
        return Update(upload, {**state, "weights": x}, {"train_loss": loss})

    def aggregate(
        self,
        env: ServerEnv,
        server: State,
        uploads: Mapping[int, WeightsUpload | Empty],
        ctx: ServerContext,
    ) -> State:
        if ctx.phase == "pull":
            return server
        uniform = self.params.weighting == "uniform"
        local = cast(Mapping[int, WeightsUpload], uploads)  # the local phase's uploads
        return {**server, "weights": weighted_average(local, uniform=uniform)}

    # -- evaluation -----------------------------------------------------------------------------
    def personal_model(
        self,
        env: ClientEnv,
        view: Payload,
        state: State,
        ctx: RoundContext,
        upload: Upload | None = None,
    ) -> nn.Module:
        return load_model(env, state["weights"])
