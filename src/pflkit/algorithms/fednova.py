"""FedNova: Wang, Liu, Liang, Joshi, Poor, "Tackling the Objective Inconsistency Problem in
Heterogeneous Federated Optimization", NeurIPS 2020 (its general model of local solvers,
§4, and FedNova's normalized averaging, §5); a baseline of MAP (Li et al., TKDE 2024,
Tables I-II; specs/map.md §5).

Shared: the global model x_t (downloaded); each selected client's normalised update d_i, its
normaliser a_i = ||a_i||_1 (one number) and n_i (uploaded), plus its buffers (BatchNorm
statistics, which are averaged, not normalised). Private: nothing. With ``gmf > 0`` the
server keeps a momentum buffer (server dict).

Client i, from x_t: tau_i local SGD steps of the run's local training (lr eta, momentum rho =
``train.momentum``, ``train.weight_decay``), on cross-entropy plus, with ``prox_mu > 0``, the
proximal term (mu / 2) ||x - x_t||^2 whose gradient mu (x - x_t) is added to each step's
gradient (so it enters the momentum buffer, as in the FedNova and MAP code). tau_i =
E * ceil(n_i / B), the steps :func:`~pflkit.primitives.training.local_sgd` runs (every
batch, the last one of an epoch possibly smaller); a straggler runs ``ctx.work_steps`` of them.
The local update is x_t - x_i = eta G_i a_i (G_i: the stochastic gradients; the paper's model of
a local solver), and the client uploads::

    d_i = (x_t - x_i) / ||a_i||_1          (parameters; the paper's eta G_i a_i / ||a_i||_1)
    ||a_i||_1 = tau_i                                          plain SGD
              = [tau_i - rho (1 - rho^tau_i) / (1 - rho)] / (1 - rho)   momentum rho
              = [1 - (1 - alpha)^tau_i] / alpha,  alpha = eta mu        proximal SGD

(the paper's examples of a_i).

For momentum and prox together (not in the paper) ||a_i||_1 is the same definition, the sum of
the coefficients of the local gradients in x_t - x_i, computed by the recursion
b <- rho b + 1 - alpha A, A <- A + b (tau_i times from A = b = 0), which gives each closed form
above when rho = 0 or alpha = 0. eta is the round's learning rate (``train.lr`` times the
``train.lr_schedule`` factor).

Server, with p_i = n_i / n over the selected clients (``weighting: samples``, the paper) or
1 / |S| (``uniform``, the MAP code)::

    tau_eff = sum_i p_i ||a_i||_1                                     (§5)
    Delta   = tau_eff * sum_i p_i d_i
    gmf = 0:  x_{t+1} = x_t - Delta
    gmf > 0:  M <- gmf M + Delta (M = 0 at the start);  x_{t+1} = x_t - M

With equal tau_i and no momentum or prox this is FedAvg. Buffers: the weighted mean of the
clients' (floating-point; integer ones from the first client), as FedAvg.

Defaults: ``gmf = 0`` and ``prox_mu = 0`` (the paper's FedNova, vanilla local SGD and no server
momentum); the MAP code's grid is (gmf, prox_mu) in {(0.9, 1e-4), (0.5, 1e-3), (0.3, 1e-2)}
with local momentum 0.9 and uniform weighting.

Options and deviations:

- ``variant="code"`` reproduces the FedNova authors' code (JYWa/FedNova), which the MAP code
  copies, where it differs: with ``prox_mu > 0`` it sets tau_eff = sum_i p_i tau_i (steps, not
  ||a_i||_1), and with momentum and prox together its normaliser follows
  A <- (A + c)(1 - alpha) + 1 with c <- rho c + 1 (not the coefficient sum of the solver it
  runs). Clients then also upload tau_i. Without prox both variants are identical.
- Server momentum: the code keeps buf <- gmf buf + Delta / eta and steps x <- x - eta buf; here
  M = eta buf, which is the same under a constant learning rate (with ``train.lr_schedule``
  the code's M would be rescaled by the ratio of consecutive rounds' learning rates).
- Not reproduced from the MAP code: normalising and momentum-stepping BatchNorm buffers like
  parameters (here they are averaged), its 5-round lr warm-up, and at least 5 local steps.
  ``train.grad_clip: 100`` gives its gradient clipping (clipping makes ||a_i||_1 inexact, as in
  the code). Local training must be SGD (``train.optimizer: sgd``; refused otherwise).
- Evaluation: the global model (the default ``personal_model``); MAP's selected-clients protocol
  scores the client's model after its local training (kept in client state for it).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal, NotRequired, TypedDict

import torch
from torch import nn

from pflkit.algorithms.base import (
    Payload,
    RoundContext,
    ServerContext,
    State,
    Update,
    Upload,
    load_model,
    param,
    register,
    weighted_average,
)
from pflkit.algorithms.blocks.split import require_homogeneous
from pflkit.algorithms.env import ClientEnv, ServerEnv
from pflkit.algorithms.fedavg import FedAvg
from pflkit.algorithms.records import WeightsPayload, WeightsServer
from pflkit.errors import PflkitError
from pflkit.primitives.training import (
    Weights,
    get_weights,
    proximal_pull,
    set_weights,
    steps_per_epoch,
)


class FedNovaUpload(Upload):
    """The normalised update d_i, its norm a_i, the buffers, and the steps (code variant)."""

    d: Weights
    a: float
    buffers: Weights
    steps: NotRequired[int]


class FedNovaState(TypedDict):
    """The trained model, kept for MAP's protocol (``eval.selected_clients``) only."""

    weights: NotRequired[Weights]


class FedNovaServer(WeightsServer):
    """The global model, and the server momentum when ``gmf`` > 0."""

    momentum: NotRequired[Weights]


Variant = Literal["paper", "code"]


def nova_norm(
    steps: int, momentum: float = 0.0, eta_mu: float = 0.0, variant: Variant = "paper"
) -> float:
    """||a_i||_1 of ``steps`` local SGD steps with momentum ``momentum`` and proximal factor
    ``eta_mu`` (= lr * mu): ``"paper"`` the sum of the gradients' coefficients in the local
    update (closed forms in the module docstring), ``"code"`` the FedNova code's recursion."""
    a = b = c = 0.0
    for _ in range(steps):
        if variant == "paper":
            b = momentum * b + 1.0 - eta_mu * a
            a += b
            continue
        if momentum:
            c = momentum * c + 1.0
            a += c
        if eta_mu:
            a = a * (1.0 - eta_mu) + 1.0
        if not momentum and not eta_mu:
            a += 1.0
    return a


def nova_server_step(
    x: Weights,
    uploads: Mapping[int, FedNovaUpload],
    *,
    uniform: bool,
    gmf: float = 0.0,
    momentum: Weights | None = None,
    tau_eff_from: Literal["norm", "steps"] = "norm",
) -> tuple[Weights, Weights | None]:
    """FedNova's server step on ``x`` from uploads ``{"d", "a", "buffers", "num_samples"
    [, "steps"]}``: tau_eff = sum_i p_i a_i (or sum_i p_i tau_i for ``tau_eff_from="steps"``),
    Delta = tau_eff sum_i p_i d_i, then x - Delta, or x - M with M = gmf M + Delta. Returns
    (new x, new M or None)."""
    ups: list[Mapping[str, Any]] = list(uploads.values())  # read by the key ``key``
    w = [1.0 if uniform else float(u["num_samples"]) for u in ups]
    total = sum(w)
    p = [wi / total for wi in w]
    key = "a" if tau_eff_from == "norm" else "steps"
    tau_eff = sum(pi * float(u[key]) for pi, u in zip(p, ups, strict=True))
    new_x = weighted_average(uploads, "buffers", uniform=uniform)  # buffers: FedAvg's mean
    mean_d = weighted_average(uploads, "d", uniform=uniform)  # sum_i p_i d_i
    new_m: Weights | None = None if momentum is None else {}
    for k, agg in mean_d.items():
        delta = tau_eff * agg
        if gmf > 0:
            assert momentum is not None and new_m is not None
            new_m[k] = gmf * momentum[k] + delta
            delta = new_m[k]
        new_x[k] = x[k] - delta
    return {k: new_x[k] for k in x}, new_m  # in the model's key order


@register
class FedNova(FedAvg):
    name = "fednova"
    sample_dp_covered = True  # DP-SGD covers it (pflkit.privacy.dpsgd)
    secagg_refusal = "its server normalizes each client's update by that client's own step count"
    release = None
    release_refusal = "its upload carries the normaliser a_i and the step count tau_i, functions of the client's data size with no clipping defined"
    description = (
        "FedNova (Wang et al. 2020): local updates normalised by their step counts, "
        "rescaled by the effective number of steps"
    )
    upload = FedNovaUpload
    state = FedNovaState
    server = FedNovaServer

    class Params(FedAvg.Params):  # weighting: samples (paper p_i); uniform (MAP code)
        gmf: float = param(
            0.0, "paper (no server momentum); MAP code grid {0.9, 0.5, 0.3}", ge=0, lt=1
        )
        prox_mu: float = param(0.0, "paper (plain SGD); MAP code grid {1e-4, 1e-3, 1e-2}", ge=0)
        variant: Variant = param("paper", "paper; code: the FedNova/MAP code's prox handling")

    params: Params

    def check(self, env: ServerEnv) -> None:
        require_homogeneous(env, self.name, "averages whole client models")
        opt = env.run.train.optimizer
        if opt != "sgd":
            raise PflkitError(
                f"fednova normalises each update by its SGD step count, but train.optimizer is "
                f"{opt!r}: set train.optimizer: sgd"
            )

    def server_init(self, env: ServerEnv) -> FedNovaServer:
        weights = env.init_weights()
        server: FedNovaServer = {"weights": weights}
        if self.params.gmf > 0:
            server["momentum"] = {
                k: torch.zeros_like(weights[k]) for k, _ in env.model().named_parameters()
            }
        return server

    def local_steps(self, env: ClientEnv, ctx: RoundContext) -> int:
        """tau_i: the steps ``env.train`` runs with the run's epochs and batch size."""
        t = env.run.train
        per_epoch = steps_per_epoch(env.num_train, t.batch_size, ctx.drop_last)
        return ctx.work_steps(t.local_epochs * per_epoch)

    def client_update(
        self, env: ClientEnv, payload: WeightsPayload, state: FedNovaState, ctx: RoundContext
    ) -> Update:
        p, t = self.params, env.run.train
        x = payload["weights"]
        model = env.model()
        set_weights(model, x)
        hooks = []
        if p.prox_mu > 0:
            anchors = [(w, x[k]) for k, w in model.named_parameters()]
            hooks.append(proximal_pull(anchors, p.prox_mu))
        loss = env.train(model, ctx, loss_fn=self.local_objective(env, payload), grad_hooks=hooks)
        trained = get_weights(model)
        steps = self.local_steps(env, ctx)
        eta = ctx.lr_factor * t.lr  # the lr the steps ran at
        a = nova_norm(steps, t.momentum, eta * p.prox_mu, p.variant)
        params = dict(model.named_parameters())
        d = {k: (x[k] - trained[k]) / a if a else torch.zeros_like(x[k]) for k in params}
        upload: FedNovaUpload = {
            "d": d,
            "a": a,
            "buffers": {k: v for k, v in trained.items() if k not in params},
            "num_samples": env.num_train,
        }
        if p.variant == "code" and p.prox_mu > 0:
            upload["steps"] = steps
        new_state = {**state, "weights": trained} if env.run.selected_eval else state
        return Update(upload, new_state, {"train_loss": loss})

    def aggregate(  # type: ignore[override]  # FedNova's upload record, not FedAvg's
        self,
        env: ServerEnv,
        server: State,
        uploads: Mapping[int, FedNovaUpload],
        ctx: ServerContext,
    ) -> State:
        p = self.params
        x, m = nova_server_step(
            server["weights"],
            uploads,
            uniform=p.weighting == "uniform",
            gmf=p.gmf,
            momentum=server.get("momentum"),
            tau_eff_from="steps" if p.variant == "code" and p.prox_mu > 0 else "norm",
        )
        new = {**server, "weights": x}
        if m is not None:
            new["momentum"] = m
        return new

    def personal_model(
        self,
        env: ClientEnv,
        view: Payload,
        state: State,
        ctx: RoundContext,
        upload: Upload | None = None,
    ) -> nn.Module:
        """The global model; under MAP's protocol the model after this round's local training
        (its state: the upload is d_i, not a model)."""
        if upload is None:
            return super().personal_model(env, view, state, ctx)
        return load_model(env, state["weights"])
