"""SCAFFOLD: Karimireddy et al., "SCAFFOLD: Stochastic Controlled Averaging for Federated
Learning", ICML 2020 (Algorithm 1, control-variate option II); and ScaRS, SCAFFOLD whose local
loss is the restricted softmax (MAP, Li et al., TKDE 2024, its ablation "RS applied to
Scaffold"; specs/map.md §2.5, §9.1).

Shared: the global model x and the server control variate c (both downloaded, so SCAFFOLD
downloads twice the parameters: c covers parameters only), and per round each selected client's
model delta Delta y_i and control delta Delta c_i (uploaded). Private: the client control variate
c_i (client state ``control``), and for ``personal="local"`` the client's last local model.

Client i, from the downloaded x and c, with K = epochs * ceil(n_i / B) local steps at lr eta_l
(``train.lr`` times the round's ``train.lr_schedule`` factor; paper Algorithm 1, lines 7-13)::

    y <- x
    y <- y - eta_l (g_i(y) + c - c_i)                   K times   (Eq. 3 / line 10)
    c_i+ <- c_i - c + (x - y) / (K eta_l)               option II (Eq. 4 / line 12)
    upload Delta y = y - x,  Delta c = c_i+ - c_i;  keep c_i <- c_i+

Server (lines 16-17), over the selected clients S of N::

    x <- x + eta_g * mean_S(Delta y)
    c <- c + (|S| / N) * mean_S(Delta c)                 (control_scale="paper")

How the correction is applied: the shared :func:`~pflkit.primitives.training.local_sgd` loop runs with momentum 0 and adds
c - c_i to each parameter's gradient (``grad_shift``, after ``train.grad_clip`` if set, as the
MAP code clips g alone). So a step is y <- y - eta_l (g(y) + c - c_i [+ wd * y]) with the same
batch order as FedAvg's client step (with c = c_i = 0 it *is* FedAvg's step without momentum).

ScaRS: the same, with g_i the gradient of the restricted-softmax loss (MAP Eq. 8, :mod:`pflkit.algorithms.blocks.rs`):
per-class logit scale 1 for observed classes, alpha for missing ones (``rs_mode="hard"``, the
paper's rule and what the MAP code's ScaffoldRS intends; observed = at least ``min_samples``
training samples, specs/map.md §8.9). ``alpha`` defaults to 0.9 (MAP §5.2.5's preferred value).

Defaults: ``eta_g`` = 1.0 (the paper's experiments; the MAP code grid is {0.5, 0.75, 0.9});
uniform means over S (the paper and the MAP code). The module-level functions
:func:`scaffold_server_init`, :func:`scaffold_payload`, :func:`scaffold_client_step` (built on
:func:`scaffold_local_steps`) and :func:`scaffold_server_update` are the whole algorithm; the
class only wires them, and ScaMAP (MAP whose stage A is SCAFFOLD with the RS loss) calls the
same functions.

Deviations and options:

- The server's control update scales by |S|/N as in the paper; ``control_scale="code"`` omits
  the factor as the MAP code does (c <- c + mean_S(Delta c)).
- ``weighting="samples"`` weights the model deltas by n_i (like FedAvg); the control deltas are
  always averaged uniformly, which keeps c = mean_i(c_i) with the paper's scale.
- Buffers (BatchNorm running statistics) are not covered by the controls: they are uploaded
  in Delta y and averaged like FedAvg (x_buf <- mean_S(y_buf), no eta_g); integer buffers are
  taken from the first client, as in :func:`weighted_average`.
- ``train.momentum`` is ignored (the paper's step and the MAP code's ScaffoldOptimizer have no
  momentum). ``train.weight_decay`` is applied as part of the local objective (its gradient
  is in g and so in the control estimate); ``local_weight_decay=false`` ignores it, as the MAP
  code's optimizer does.
- Personalized model: ``personal="global"`` (default) scores the global model, as FedAvg and
  FedRS here; ``personal="local"`` scores each client's model after its last local training.
  MAP's protocol (``eval.selected_clients``, §4.4), which the MAP code uses for Scaffold and
  ScaRS (§2.5), always scores that local model. A client not yet selected uses the global
  model. The
  last local model is kept in client state (``weights``) only when something reads it: for
  ``personal="local"`` and for MAP's selected-clients evaluation (``eval.selected_clients``).
- Only option II of the control update is implemented (option I needs an extra pass over the
  local data at x).
- ``train.grad_clip: 100`` reproduces the MAP code's gradient clipping (not in the paper).
  Not reproduced from the MAP code (none is in the paper): its 5-round lr warm-up, eta_g
  applied to BatchNorm buffers too, and its count-of-proportion RS mask (a bug, specs/map.md
  §8.9).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Literal, NamedTuple, NotRequired, TypedDict

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
    register,
    weighted_average,
)
from pflkit.algorithms.blocks.rs import RestrictedSoftmax, RSParams
from pflkit.algorithms.env import ClientEnv, ServerEnv
from pflkit.primitives.training import (
    LossFn,
    Weights,
    cross_entropy,
    get_weights,
    set_weights,
    shift_grad,
    steps_per_epoch,
)


class ScaffoldPayload(TypedDict):
    """The global model x and the server control variate c."""

    weights: Weights
    control: Weights


class ScaffoldUpload(Upload):
    """Delta y (parameters and buffers) and Delta c (parameters)."""

    delta_y: Weights
    delta_c: Weights


class ControlState(TypedDict):
    """The client control variate c_i (from its first round on)."""

    control: NotRequired[Weights]


class ScaffoldState(ControlState):
    """c_i, and the client's last local model y (``personal: local`` or MAP's protocol)."""

    weights: NotRequired[Weights]


class ScaffoldServer(TypedDict):
    """x and c."""

    weights: Weights
    control: Weights


ControlScale = Literal["paper", "code"]


class ScaffoldStep(NamedTuple):
    """Result of :func:`scaffold_local_steps`."""

    weights: Weights  # y: the client's model after K corrected steps (parameters and buffers)
    control: Weights  # c_i+: the client's new control variate (parameters only)
    delta_y: Weights  # y - x (parameters and buffers): uploaded
    delta_c: Weights  # c_i+ - c_i (parameters only): uploaded
    loss: float  # mean task loss over the K steps (without the correction term)


def zero_control(model: torch.nn.Module) -> Weights:
    """A control variate of zeros: one tensor per *parameter* of ``model``."""
    return {k: torch.zeros_like(p) for k, p in model.named_parameters()}


def scaffold_server_init(env: ServerEnv) -> ScaffoldServer:
    """x_0 (a fresh global model) and c = 0."""
    return {"weights": env.init_weights(), "control": zero_control(env.model())}


def scaffold_payload(server: State) -> Payload:
    """The download: x and c."""
    return {"weights": server["weights"], "control": server["control"]}


def scaffold_local_steps(
    env: ClientEnv,
    global_weights: Mapping[str, torch.Tensor],
    c_global: Mapping[str, torch.Tensor],
    c_local: Mapping[str, torch.Tensor] | None,
    ctx: RoundContext,
    *,
    loss_fn: LossFn = cross_entropy,
    lr: float | None = None,
    epochs: int | None = None,
    batch_size: int | None = None,
    weight_decay: float | None = None,
    steps: int | None = None,
    slot: int | str = 0,
) -> ScaffoldStep:
    """SCAFFOLD's client step (Algorithm 1 lines 7-13, option II) on the client of ``env``.

    Starts from ``global_weights`` (x), runs K local steps of
    y <- y - lr * (grad loss_fn(y) + c_global - c_local [+ weight_decay * y]), no momentum,
    then sets c_local+ = c_local - c_global + (x - y) / (K * lr). K = ``steps`` if given, else
    epochs * ceil(n / batch_size) (whole epochs, the last batch of each possibly partial).
    ``c_local=None`` means zeros (a client's first participation). ``lr``, ``epochs``,
    ``batch_size`` and ``weight_decay`` default to the run's training settings; ``ctx`` is the
    round's context (its lr factor scales ``lr``, a straggler runs ``ctx.work_steps(K)``).

    Trains the reusable model ``env.model(slot)``, which holds y afterwards (a later stage can
    continue from it, as ScaMAP's stage B does), and draws the batch order from torch's global
    RNG: the same draws as FedAvg's client step.
    """
    t = env.run.train
    lr = t.lr if lr is None else lr
    epochs = t.local_epochs if epochs is None else epochs
    batch_size = t.batch_size if batch_size is None else batch_size
    weight_decay = t.weight_decay if weight_decay is None else weight_decay
    n = env.num_train
    if steps is None:
        steps = epochs * steps_per_epoch(n, batch_size, ctx.drop_last)
    if n == 0:
        steps = 0  # no data: no step, no control change

    model = env.model(slot)
    set_weights(model, global_weights)
    params = dict(model.named_parameters())
    if c_local is None:
        c_local = {k: torch.zeros_like(p) for k, p in params.items()}
    correction = [(p, (c_global[k] - c_local[k]).detach()) for k, p in params.items()]
    loss = env.train(
        model,
        ctx,
        steps=steps,
        batch_size=batch_size,
        lr=lr,
        momentum=0.0,
        weight_decay=weight_decay,
        loss_fn=loss_fn,
        grad_hooks=[shift_grad(correction)],  # after train.grad_clip's clipping, if set
    )
    y = get_weights(model)
    delta_y = {k: y[k] - global_weights[k] for k in y}
    if steps == 0:
        delta_c = {k: torch.zeros_like(v) for k, v in c_local.items()}
    else:
        # c_i+ - c_i = -c + (x - y) / (K lr), K the steps run (a straggler runs fewer), lr the
        # one the steps ran at (times the round's train.lr_schedule factor)
        k_steps, step_lr = ctx.work_steps(steps), ctx.lr_factor * lr
        delta_c = {k: -delta_y[k] / (k_steps * step_lr) - c_global[k] for k in c_local}
    new_c = {k: c_local[k] + delta_c[k] for k in c_local}
    return ScaffoldStep(y, new_c, delta_y, delta_c, loss)


def scaffold_client_step(
    env: ClientEnv,
    payload: ScaffoldPayload,
    state: ControlState,
    ctx: RoundContext,
    loss_fn: LossFn,
    *,
    local_weight_decay: bool = True,
    steps: int | None = None,
) -> tuple[ScaffoldStep, ScaffoldUpload]:
    """The client's corrected steps from the download ``{weights, control}`` and its stored
    ``control``, and the upload they produce ``{delta_y, delta_c, num_samples}``."""
    step = scaffold_local_steps(
        env,
        payload["weights"],
        payload["control"],
        state.get("control"),
        ctx,
        loss_fn=loss_fn,
        steps=steps,
        weight_decay=None if local_weight_decay else 0.0,
    )
    upload: ScaffoldUpload = {
        "delta_y": step.delta_y,
        "delta_c": step.delta_c,
        "num_samples": env.num_train,
    }
    return step, upload


def scaffold_server_update(
    server: State,
    uploads: Mapping[int, ScaffoldUpload],
    eta_g: float,
    num_clients: int,
    *,
    control_scale: ControlScale = "paper",
    weighting: Weighting = "uniform",
) -> State:
    """SCAFFOLD's server step (Algorithm 1 lines 16-17) on ``server = {"weights": x,
    "control": c, ...}`` and uploads ``{"delta_y", "delta_c", "num_samples"}``.

    x <- x + eta_g * mean(Delta y) on parameters (buffers: x + mean(Delta y), i.e. FedAvg's
    average); c <- c + s * mean(Delta c) with s = |S| / num_clients (``"paper"``) or 1
    (``"code"``). ``weighting`` applies to the model deltas only. Other server keys are kept.
    """
    x, c = server["weights"], server["control"]
    dy = weighted_average(uploads, "delta_y", uniform=weighting == "uniform")
    dc = weighted_average(uploads, "delta_c", uniform=True)
    scale = len(uploads) / num_clients if control_scale == "paper" else 1.0
    new_x = {}
    for k, v in x.items():
        if not v.is_floating_point():
            new_x[k] = v + dy[k]
        else:
            new_x[k] = v + (eta_g if k in c else 1.0) * dy[k]
    new_c = {k: v + scale * dc[k] for k, v in c.items()}
    return {**server, "weights": new_x, "control": new_c}


class ScaffoldServerParams(Algorithm.Params):
    """SCAFFOLD's server-side parameters (SCAFFOLD, ScaRS, ScaMAP)."""

    eta_g: float = param(1.0, "paper (server learning rate)", gt=0)
    control_scale: ControlScale = param("paper", "paper (|S|/N); code: the MAP code")
    local_weight_decay: bool = param(True, "pflkit (false: the MAP code's optimizer)")


def scaffold_aggregate(
    env: ServerEnv,
    server: State,
    uploads: Mapping[int, ScaffoldUpload],
    p: ScaffoldServerParams,
    weighting: Weighting,
) -> State:
    """:func:`scaffold_server_update` with an algorithm's parameters ``p``."""
    return scaffold_server_update(
        server,
        uploads,
        p.eta_g,
        env.num_clients,
        control_scale=p.control_scale,
        weighting=weighting,
    )


@register
class Scaffold(Algorithm):
    name = "scaffold"
    sample_dp_covered = True  # DP-SGD covers it (pflkit.privacy.dpsgd)
    release = {"delta_y": None, "delta_c": None}  # both are updates, clipped together
    secagg = ("uniform",)  # its aggregate needs the plain sum, the mean only when uniform
    description = "SCAFFOLD (Karimireddy et al. 2020): control variates correct client drift"
    payload = ScaffoldPayload
    upload = ScaffoldUpload
    state = ScaffoldState
    server = ScaffoldServer

    class Params(ScaffoldServerParams):
        weighting: Weighting = param("uniform", "paper (of the model deltas)")
        personal: Literal["global", "local"] = param("global", "pflkit (the global model)")

    params: Params

    def server_init(self, env: ServerEnv) -> ScaffoldServer:
        return scaffold_server_init(env)

    def configure(self, env: ServerEnv, server: State, cid: int, ctx: ServerContext) -> Payload:
        return scaffold_payload(server)

    def local_objective(self, env: ClientEnv, payload: ScaffoldPayload) -> LossFn:
        """The task loss of the local steps (ScaRS: restricted softmax)."""
        return cross_entropy

    def client_update(
        self, env: ClientEnv, payload: ScaffoldPayload, state: ScaffoldState, ctx: RoundContext
    ) -> Update:
        step, upload = scaffold_client_step(
            env,
            payload,
            state,
            ctx,
            self.local_objective(env, payload),
            local_weight_decay=self.params.local_weight_decay,
        )
        new_state = {**state, "control": step.control}
        # the last local model y is read only for personal="local" and MAP's protocol
        if self.params.personal == "local" or env.run.selected_eval:
            new_state["weights"] = step.weights
        return Update(upload, new_state, {"train_loss": step.loss})

    def aggregate(
        self,
        env: ServerEnv,
        server: State,
        uploads: Mapping[int, ScaffoldUpload],
        ctx: ServerContext,
    ) -> State:
        return scaffold_aggregate(env, server, uploads, self.params, self.params.weighting)

    def personal_model(
        self,
        env: ClientEnv,
        view: Payload,
        state: State,
        ctx: RoundContext,
        upload: Upload | None = None,
    ) -> nn.Module:
        """The global model, or with ``personal: local`` the client's own y; under MAP's protocol
        y after this round's local steps (the upload is a delta)."""
        if upload is not None:
            return load_model(env, state["weights"])
        if self.params.personal == "local" and state.get("weights") is not None:
            return load_model(env, state["weights"])
        return super().personal_model(env, view, state, ctx)


@register
class ScaRS(RestrictedSoftmax, Scaffold):
    name = "scars"
    description = "ScaRS (MAP ablation): SCAFFOLD whose local loss is the restricted softmax"

    class Params(Scaffold.Params, RSParams):  # alpha (0.9), rs_mode ("hard"), min_samples (1)
        pass

    params: Params
