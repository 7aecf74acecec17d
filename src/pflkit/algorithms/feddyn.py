"""FedDyn: Acar, Zhao, Matas, Mattina, Whatmough & Saligrama, "Federated Learning Based on
Dynamic Regularization", ICLR 2021 (Algorithm 1).

Shared: the server model theta (downloaded), each selected client's trained model (uploaded).
Private: each client's gradient state g_k = grad L_k(theta_k^{t-1}) (client state ``grad``,
zero at first), one tensor per parameter. Server state: theta and h (one tensor per parameter,
zero at first).

Client k in round t, from the downloaded theta^{t-1} (Algorithm 1, Eq. 1 and the update below
it)::

    theta_k^t = argmin_theta  L_k(theta) - <g_k, theta> + (alpha/2) ||theta - theta^{t-1}||^2
    g_k      <- g_k - alpha (theta_k^t - theta^{t-1})

The argmin is approximated by E epochs of local SGD: the linear term adds -g_k to each
gradient and the quadratic term alpha (theta - theta^{t-1}) (gradient hooks; the reported loss
is the task loss alone). ``train.grad_clip`` clips the task loss's gradient before these terms
are added (``clip_on: task``, the engine's order).

Server, with m = the number of clients and P_t the round's clients::

    h^t     = h^{t-1} - alpha (1/m) sum_{k in P_t} (theta_k^t - theta^{t-1})
    theta^t = (1/|P_t|) sum_{k in P_t} theta_k^t - (1/alpha) h^t

Defaults: alpha = 0.01 (pFedSim App. A.5; the FedDyn paper searches {0.1, 0.01, 0.001}).
Deviations: BatchNorm running statistics are buffers, not parameters: they are averaged like
FedAvg (no h correction); integer buffers are taken from the first client. The server model
theta^t is the model evaluated and sent (the paper's code also reports an "all clients"
average). ``weighting: samples`` would weight the mean by n_k; the paper's mean is uniform.

Options for FL-bench's FedDyn (06e658b; ``src/client/feddyn.py``, ``src/server/feddyn.py``):

- ``prox_term: linear``: the client's regulariser without the (alpha/2) ||theta||^2 part of
  the quadratic term, i.e. -<g_k, theta> - alpha <theta^{t-1}, theta>: each gradient gets
  -g_k - alpha theta^{t-1} (no alpha theta). FL-bench's client loss is CE + alpha <theta,
  delta_k> (client lines 30-32) with delta_k = nabla_k - theta^{t-1} (server lines 34-36),
  where nabla_k, the sum of the client's drifts theta_k - theta^{t-1} (server line 50, the
  upload being theta^{t-1} - theta_k), is -g_k / alpha here; its SGD has no weight decay
  (``config/defaults.yaml``, ``optimizer.weight_decay: 0``) to add alpha theta back. Its server
  step, mean_k theta_k + the mean over all m clients of nabla_k (server lines 50-54), is the one
  above with ``weighting: samples`` (FL-bench weights each upload by its training-set size,
  ``src/client/fedavg.py`` line 178). Default ``quadratic``: the paper's (alpha/2)
  ||theta - theta^{t-1}||^2.
- ``clip_on: total``: ``train.grad_clip`` clips the whole gradient, FedDyn's terms included,
  as FL-bench clips after ``loss.backward()`` of its full loss (client lines 33-37,
  ``max_grad_norm`` 10, server line 24).

FL-bench's client also skips batches of one sample (client lines 24-25); pflkit trains on them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Literal, NotRequired, TypedDict

import torch

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
from pflkit.algorithms.records import WeightsPayload, WeightsUpload
from pflkit.primitives.training import Weights, clip_grad, proximal_pull, shift_grad


class FedDynState(TypedDict):
    """The client's linear term: its last local gradient (from its first round on)."""

    grad: NotRequired[Weights]


class FedDynServer(TypedDict):
    """The server model theta and the running mean h of the clients' updates."""

    weights: Weights
    h: Weights


def param_zeros(model: torch.nn.Module) -> Weights:
    return {k: torch.zeros_like(p) for k, p in model.named_parameters()}


def feddyn_server_update(
    theta: Mapping[str, torch.Tensor],
    h: Mapping[str, torch.Tensor],
    uploads: Mapping[int, WeightsUpload],
    alpha: float,
    num_clients: int,
    uniform: bool = True,
) -> tuple[Weights, Weights]:
    """(theta^t, h^t) from theta^{t-1}, h^{t-1} and the uploads' ``weights`` (see above)."""
    mean = weighted_average(uploads, uniform=uniform)
    new_h: Weights = {}
    for k, hk in h.items():
        drift = sum(u["weights"][k] - theta[k] for u in uploads.values())
        new_h[k] = hk - alpha * drift / num_clients
    new_theta = {k: (v - new_h[k] / alpha if k in new_h else v) for k, v in mean.items()}
    return new_theta, new_h


@register
class FedDyn(Algorithm):
    name = "feddyn"
    sample_dp_covered = True  # DP-SGD covers it (pflkit.privacy.dpsgd)
    release = {"weights": "weights"}
    secagg = ("uniform",)  # its aggregate needs the plain sum, the mean only when uniform
    private = ("grad",)
    description = "FedDyn (Acar et al. 2021): dynamic linear + quadratic regularizer, server h"
    payload = WeightsPayload
    upload = WeightsUpload
    state = FedDynState
    server = FedDynServer

    class Params(Algorithm.Params):
        alpha: float = param(0.01, "pFedSim App. A.5 (paper grid {0.1, 0.01, 0.001})", gt=0)
        weighting: Weighting = param("uniform", "paper (Alg. 1: mean over P_t)")
        prox_term: Literal["quadratic", "linear"] = param(
            "quadratic", "paper (Eq. 1); linear: FL-bench src/client/feddyn.py lines 30-32"
        )
        clip_on: Literal["task", "total"] = param(
            "task", "pflkit engine (paper: no clipping); total: FL-bench client lines 33-37"
        )

    params: Params

    def server_init(self, env: ServerEnv) -> FedDynServer:
        return {"weights": env.init_weights(), "h": param_zeros(env.model())}

    def client_update(
        self, env: ClientEnv, payload: WeightsPayload, state: FedDynState, ctx: RoundContext
    ) -> Update:
        a = self.params.alpha
        theta = payload["weights"]
        model = env.model()
        grad = state.get("grad") or param_zeros(model)
        params = dict(model.named_parameters())
        hooks = [shift_grad([(p, -grad[k]) for k, p in params.items()])]
        if self.params.prox_term == "quadratic":
            hooks.append(proximal_pull([(p, theta[k]) for k, p in params.items()], a))
        else:  # linear: the quadratic term's -alpha <theta^{t-1}, theta> part only
            hooks.append(shift_grad([(p, -a * theta[k]) for k, p in params.items()]))
        clip = env.run.train.grad_clip
        if self.params.clip_on == "total" and clip is not None:  # clip after FedDyn's terms
            train = env.run.train.model_copy(update={"grad_clip": None})
            env = dataclasses.replace(env, run=dataclasses.replace(env.run, train=train))
            hooks.append(clip_grad(clip))
        weights, loss = train_from(env, theta, ctx, grad_hooks=hooks)
        new_grad = {k: g - a * (weights[k] - theta[k]) for k, g in grad.items()}
        upload = {"weights": weights, "num_samples": env.num_train}
        return Update(upload, {**state, "grad": new_grad}, {"train_loss": loss})

    def aggregate(
        self,
        env: ServerEnv,
        server: State,
        uploads: Mapping[int, WeightsUpload],
        ctx: ServerContext,
    ) -> State:
        p = self.params
        theta, h = feddyn_server_update(
            server["weights"],
            server["h"],
            uploads,
            p.alpha,
            env.num_clients,
            uniform=p.weighting == "uniform",
        )
        return {**server, "weights": theta, "h": h}
