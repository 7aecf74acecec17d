"""FedMMD: Yao, Huang, Sun, "Two-Stream Federated Learning: Reduce the Communication Costs",
IEEE VCIP 2018 (MAP's reference [42]; extended by the same group, with FedFusion, as "Federated
Learning with Additional Mechanisms on Clients to Reduce Communication Costs", arXiv 2019); a
baseline of MAP (Li et al., TKDE 2024, Tables I-II, specs/map.md §5).

Shared: the whole model (as FedAvg). Private: nothing.

Client k, given the downloaded global model w_t ("two streams": a frozen copy of w_t and the
local model w, started at w_t), runs E epochs of mini-batch SGD on

    L(w) = CE(head(h), y) + lam * MMD^2(h, h_g),   h = body_w(x),  h_g = body_{w_t}(x),

on each local batch (x, y): both streams see the same batch, h_g is computed without gradient
(the global stream is frozen, in eval mode: BatchNorm uses its running statistics) and h, h_g are
the models' feature vectors (``model.features(x)``, the body output in front of the
classifier). MMD^2 is :func:`~pflkit.algorithms.blocks.hpm.mmd_loss`: the biased multi-kernel
Gaussian estimator over the joint batch, ``kernels`` bandwidths base * kernel_mul^i
(i = 0..kernels-1), base = (mean off-diagonal squared distance of the joint batch, detached) /
kernel_mul^(kernels // 2), each bandwidth + 1e-8 (the DAN-style estimator of the MAP code).

Server: FedAvg, w_{t+1} = sum_k (n_k / n) w_k over the selected clients (``weighting:
uniform``: the plain mean).

Defaults and their sources:

- ``lam`` = 0.01: the middle of the MAP code's grid {1e-3, 1e-2, 1e-1} (``train.py``,
  ``get_hypers("fedmmd")``); our choice of the three. The FedMMD paper's own value was not
  checked (its text was not available to us).
- ``kernels`` = 5, ``kernel_mul`` = 2.0: the MAP code's ``mmd_rbf_noaccelerate`` defaults.

The MAP authors' code implements FedProx and FedMMD in one file (``algorithms/fedreg.py``,
``reg_way="fedmmd"``): loss CE + reg_lamb * MMD(h, h_g.detach()) with h, h_g the networks'
feature outputs and the global copy in eval mode. This module does exactly that; the code's
other settings are run-wide options here: its plain-mean aggregation is ``train.weighting:
uniform``, its gradient clipping at norm ``max_grad_norm`` is ``train.grad_clip``; its 5-round
learning-rate warm-up is not reproduced. (Its FedProx, ``reg_way="fedprox"``, is a mean over
parameter tensors of smooth-L1 to the global model, which is Ditto's ``prox: smooth_l1`` form,
not pflkit's ``fedprox``.)

Deviations: which layer's representations the paper's MMD constraint compares, and its kernel,
could not be checked against the paper text; both follow the MAP code (body output, multi-kernel
Gaussian). With ``lam`` = 0 no MMD is computed and the client step is FedAvg's exactly.
"""

from __future__ import annotations

from typing import cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from pflkit.algorithms.base import param, register
from pflkit.algorithms.blocks.hpm import mmd_loss
from pflkit.algorithms.blocks.split import require_homogeneous
from pflkit.algorithms.env import ClientEnv, ServerEnv
from pflkit.algorithms.fedavg import FedAvg
from pflkit.algorithms.records import WeightsPayload
from pflkit.models import PFLModel
from pflkit.primitives.training import LossFn, cross_entropy, set_weights

GLOBAL_SLOT = "fedmmd_global"


def fedmmd_loss(global_model: PFLModel, lam: float, kernels: int = 5, mul: float = 2.0) -> LossFn:
    """CE(head(h), y) + lam * MMD^2(h, h_g), h the trained model's features and h_g those of
    the frozen ``global_model`` (eval mode, no gradient) on the same batch."""
    global_model.eval()

    def loss_fn(module: nn.Module, x: Tensor, y: Tensor) -> Tensor:
        model = cast(PFLModel, module)  # the client's PFLModel (env.model)
        h = model.features(x)
        with torch.no_grad():
            h_g = global_model.features(x)
        return F.cross_entropy(model.head(h), y) + lam * mmd_loss(h, h_g, kernels, mul)

    return loss_fn


@register
class FedMMD(FedAvg):
    name = "fedmmd"
    sample_dp_covered = True  # DP-SGD covers it (pflkit.privacy.dpsgd)
    description = "FedMMD (Yao et al. 2018): FedAvg + MMD between local and global features"

    class Params(FedAvg.Params):
        lam: float = param(0.01, "MAP code grid {1e-3, 1e-2, 1e-1} (middle)", ge=0)
        kernels: int = param(5, "MAP code (mmd_rbf_noaccelerate)", ge=1)
        kernel_mul: float = param(2.0, "MAP code (mmd_rbf_noaccelerate)", gt=0)

    params: Params

    def check(self, env: ServerEnv) -> None:
        require_homogeneous(env, self.name, "averages whole client models")

    def local_objective(self, env: ClientEnv, payload: WeightsPayload) -> LossFn:
        p = self.params
        if p.lam == 0:
            return cross_entropy
        global_model = env.model(GLOBAL_SLOT)
        set_weights(global_model, payload["weights"])
        return fedmmd_loss(global_model, p.lam, p.kernels, p.kernel_mul)
