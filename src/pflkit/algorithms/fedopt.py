"""FedOpt: Reddi, Charles, Zaheer, Garrett, Rush, Konečný, Kumar, McMahan, "Adaptive Federated
Optimization", ICLR 2021 (Algorithm 1, the FedOpt framework, and Algorithm 2, FedAdagrad /
FedAdam / FedYogi); with ``server_opt: sgdm``, FedAvgM (Hsu et al. 2019), the optimiser the
MAP authors' code runs as its "FedOpt" baseline (MAP, Li et al., TKDE 2024, Tables I-II;
specs/map.md §5).

Shared: the whole model (downloaded) and each selected client's trained model (uploaded, as
FedAvg; the server forms the deltas, so the bytes are those of FedAvg). Private: nothing. The
server's optimiser state (m, v) stays on the server (server dict, one tensor per parameter).

Client i: E epochs of local SGD from x_t, exactly FedAvg's client step, giving x_i.

Server, with p_i = n_i / n over the selected clients (``weighting: samples``, the default: the
example-weighted average the paper's experiments use; Algorithms 1-2 write the plain mean) or
1 / |S| (``uniform``, as the MAP code averages)::

    Delta_t = sum_i p_i (x_i - x_t)                              pseudo-gradient (Alg. 1/2)
    sgdm:    m_t = beta1 m_{t-1} + Delta_t;            x_{t+1} = x_t + eta m_t
    adagrad: m_t = beta1 m_{t-1} + (1 - beta1) Delta_t;  v_t = v_{t-1} + Delta_t^2
    adam:    m_t = (as adagrad);  v_t = beta2 v_{t-1} + (1 - beta2) Delta_t^2
    yogi:    m_t = (as adagrad);  v_t = v_{t-1} - (1 - beta2) Delta_t^2 sign(v_{t-1} - Delta_t^2)
    adagrad / adam / yogi:  x_{t+1} = x_t + eta m_t / (sqrt(v_t) + tau)          (Alg. 2)

with m_{-1} = 0 and v_{-1} = ``v_init`` (default tau^2, Alg. 2's v_{-1} >= tau^2). As in
Algorithm 2 there is no bias correction of m or v. ``sgdm`` is torch's SGD with momentum
beta1, dampening 0, no Nesterov, no weight decay, stepping on the gradient x_t - mean(x_i):
exactly the MAP code's server optimiser (``glo_optimizer="SGD"``, momentum 0.9); with beta1 = 0
and eta = 1 it is FedAvg.

Defaults and sources:

- ``server_opt = "sgdm"``: the FedOpt of the MAP comparison (the MAP code's grid runs only
  server SGD with momentum 0.9, i.e. FedAvgM) and the ServerOpt of Reddi et al.'s FedAvgM
  baseline. Algorithm 2's adaptive optimisers are ``adagrad``, ``adam``, ``yogi``.
- ``server_lr`` (None: per optimiser): sgdm 1.0 (the MAP code grid {1.0, 0.1, 0.05}; 1.0 is
  FedAvg's step), adam and yogi 1e-2, adagrad 1e-1: Reddi et al.'s best CIFAR-10 values
  (App. D; FedAdam eta = 10^-2 with tau = 10^-3, FedAdagrad eta = 10^-1 with tau = 10^-2, as
  Flower's reproduction of the paper lists them); Yogi takes Adam's. The paper tunes eta per
  task on a grid of powers of 10 (about 10^-3 to 10^1).
- ``beta1 = 0.9`` (the paper's experiments; the MAP code's server momentum 0.9),
  ``beta2 = 0.99`` (the paper's experiments), ``tau = 1e-3`` (the paper's default
  adaptivity; tuned per task in App. D).

Deviations and choices: only parameters are optimised. Floating-point buffers (BatchNorm
running statistics) are set to the weighted mean of the clients' buffers, as FedAvg sets them
and as the MAP code does (it loads the mean state dict, then steps the parameters only);
integer buffers (BN's step counter) are taken from the first client, as
:func:`~pflkit.algorithms.base.weighted_average` does (the MAP code averages and truncates
them). The MAP code's ``glo_optimizer="Adam"`` (torch Adam with bias correction, eps 1e-8,
beta2 0.999; not in its grid) is not reproduced.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Literal, NotRequired, TypedDict

import torch

from pflkit.algorithms.base import ServerContext, State, param, register, weighted_average
from pflkit.algorithms.blocks.split import require_homogeneous
from pflkit.algorithms.env import ServerEnv
from pflkit.algorithms.fedavg import FedAvg
from pflkit.algorithms.records import WeightsServer, WeightsUpload
from pflkit.primitives.training import Weights


class FedOptMoments(TypedDict):
    """The server optimiser's state: m, and v for the adaptive ones."""

    m: Weights
    v: NotRequired[Weights]


class FedOptServer(WeightsServer, FedOptMoments):
    """The global model and the server optimiser's state."""


ServerOpt = Literal["sgdm", "adagrad", "adam", "yogi"]

# server learning rates when ``server_lr`` is None (see the module docstring for the sources)
DEFAULT_SERVER_LR: dict[str, float] = {"sgdm": 1.0, "adagrad": 1e-1, "adam": 1e-2, "yogi": 1e-2}


def fedopt_state(
    weights: Weights, param_keys: Iterable[str], server_opt: str, v_init: float
) -> FedOptMoments:
    """The server optimiser's initial state for the parameters ``param_keys`` of ``weights``:
    ``m`` = 0 and, for the adaptive optimisers, ``v`` = ``v_init`` (plain tensors)."""
    state: FedOptMoments = {"m": {k: torch.zeros_like(weights[k]) for k in param_keys}}
    if server_opt != "sgdm":
        state["v"] = {k: torch.full_like(weights[k], v_init) for k in param_keys}
    return state


def fedopt_server_step(
    x: Weights,
    mean: Weights,
    m: Weights,
    v: Weights | None,
    server_opt: str,
    lr: float,
    beta1: float,
    beta2: float,
    tau: float,
) -> tuple[Weights, Weights, Weights | None]:
    """One server step: for each key of ``m`` (the parameters), Delta = mean - x, then the
    update of ``server_opt`` (module docstring); every other key of ``x`` becomes ``mean``'s.
    Returns the new (x, m, v); the inputs are not modified."""
    new_x = dict(mean)  # buffers: the clients' (weighted) mean, as FedAvg
    new_m: Weights = {}
    new_v: Weights | None = None if v is None else {}
    for k, mk in m.items():
        delta = mean[k] - x[k]
        if server_opt == "sgdm":
            new_m[k] = beta1 * mk + delta
            new_x[k] = x[k] + lr * new_m[k]
            continue
        assert v is not None and new_v is not None
        new_m[k] = beta1 * mk + (1 - beta1) * delta
        sq = delta * delta
        if server_opt == "adagrad":
            new_v[k] = v[k] + sq
        elif server_opt == "adam":
            new_v[k] = beta2 * v[k] + (1 - beta2) * sq
        elif server_opt == "yogi":
            new_v[k] = v[k] - (1 - beta2) * sq * torch.sign(v[k] - sq)
        else:  # the Params literal makes this unreachable
            raise ValueError(f"unknown server optimiser {server_opt!r}")
        new_x[k] = x[k] + lr * new_m[k] / (new_v[k].sqrt() + tau)
    return new_x, new_m, new_v


@register
class FedOpt(FedAvg):
    name = "fedopt"
    sample_dp_covered = True  # DP-SGD covers it (pflkit.privacy.dpsgd)
    secagg = ("samples", "uniform")  # its aggregate is the mean of the uploads
    description = (
        "FedOpt (Reddi et al. 2021): FedAvg clients, a server optimiser (SGD with momentum = "
        "FedAvgM, Adagrad, Adam, Yogi) on the averaged update"
    )
    server = FedOptServer

    class Params(FedAvg.Params):
        server_opt: ServerOpt = param(
            "sgdm", "MAP code (server SGD, momentum 0.9: FedAvgM); paper Alg. 2: adagrad|adam|yogi"
        )
        server_lr: float | None = param(
            None,
            "None: sgdm 1.0 (MAP code grid {1.0, 0.1, 0.05}), adam/yogi 1e-2, adagrad 1e-1 "
            "(paper App. D, CIFAR-10)",
            gt=0,
        )
        beta1: float = param(0.9, "paper experiments (MAP code: momentum 0.9)", ge=0, lt=1)
        beta2: float = param(0.99, "paper experiments", ge=0, lt=1)
        tau: float = param(1e-3, "paper (adaptivity)", gt=0)
        v_init: float | None = param(None, "paper Alg. 2 (None: tau^2)", ge=0)

    params: Params

    @property
    def server_lr(self) -> float:
        p = self.params
        return DEFAULT_SERVER_LR[p.server_opt] if p.server_lr is None else p.server_lr

    def check(self, env: ServerEnv) -> None:
        require_homogeneous(env, self.name, "averages whole client models")

    def server_init(self, env: ServerEnv) -> FedOptServer:
        p = self.params
        weights = env.init_weights()
        keys = [k for k, _ in env.model().named_parameters()]
        v_init = p.tau**2 if p.v_init is None else p.v_init
        return {"weights": weights, **fedopt_state(weights, keys, p.server_opt, v_init)}

    def aggregate(
        self,
        env: ServerEnv,
        server: State,
        uploads: Mapping[int, WeightsUpload],
        ctx: ServerContext,
    ) -> State:
        p = self.params
        mean = weighted_average(uploads, uniform=p.weighting == "uniform")
        x, m, v = fedopt_server_step(
            server["weights"],
            mean,
            server["m"],
            server.get("v"),
            p.server_opt,
            self.server_lr,
            p.beta1,
            p.beta2,
            p.tau,
        )
        new = {**server, "weights": x, "m": m}
        if v is not None:
            new["v"] = v
        return new
