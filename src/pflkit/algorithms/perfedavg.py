"""Per-FedAvg: Fallah, Mokhtari & Ozdaglar, "Personalized Federated Learning with Theoretical
Guarantees: A Model-Agnostic Meta-Learning Approach", NeurIPS 2020 (Algorithm 1, Sec. 5).

Shared: the whole model w (the meta-model, scored as ``global_acc``). Private: nothing.

The client objective is the MAML one, F_i(w) = f_i(w - alpha grad f_i(w)) (Eq. 3). Client i
runs local steps from the downloaded w; each step draws independent batches D, D' (and D''
for HF) of ``train.batch_size`` samples each and does (Algorithm 1, step 8)

    w_tmp = w - alpha grad f(w, D)
    FO:  w <- w - beta grad f(w_tmp, D')
    HF:  w <- w - beta (I - alpha d_i) grad f(w_tmp, D'),
         d_i = [grad f(w + delta v, D'') - grad f(w - delta v, D'')] / (2 delta),
         v = grad f(w_tmp, D')

(FO: the first-order approximation that drops the Hessian; HF: the Hessian-free version of
Sec. 5, where the Hessian-vector product is a difference of gradients.) One step consumes 2
(FO) or 3 (HF) batches, so an epoch is ceil(n / (2B)) or ceil(n / (3B)) steps, each sample
visited once (as PFLlib's loader of 2B samples split in two).

Server: w <- mean of the participants' w (Algorithm 1, step 10: 1/(rn) sum);
``weighting: samples`` weights by n_i. Personalized model: one step of SGD with step size
alpha on one batch of the client's training data from the latest w (the evaluation protocol
of Sec. 6: "one step of stochastic gradient descent").

Defaults: alpha and beta = ``train.lr``, PFLlib's choice, not the paper's (PFLlib, the code
that ran this baseline for GPFL, steps with the learning rate for alpha and sets beta to the
learning rate too, ``clientperavg.py``; its ``-bt`` is not read). pFedSim App. A.5 (and
FL-bench, which ran pFedSim's baselines) use alpha = 0.01 (the lr) and beta = 0.001.
``delta`` = 0.001 (our choice: the paper leaves it to the analysis; FL-bench's default too).
Deviations: none known beyond the defaults. PFLlib trains each selected client twice a round
(``serverperavg.py``: ``train.local_epochs`` 2 here); FL-bench averages uniformly and scores
after one epoch of local fine-tuning.
"""

from __future__ import annotations

from typing import Literal, cast

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

from pflkit.algorithms.base import (
    Payload,
    RoundContext,
    Update,
    Weighting,
    load_model,
    param,
    register,
    train_from,
)
from pflkit.algorithms.env import ClientEnv
from pflkit.algorithms.fedavg import FedAvg
from pflkit.algorithms.records import Empty, WeightsPayload, WeightsUpload
from pflkit.primitives.training import LossFn, Weights, cross_entropy


def _split(x: torch.Tensor, y: torch.Tensor, k: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """k consecutive parts of a batch (a batch too small to split serves every part)."""
    if len(y) < k:
        return [(x, y)] * k
    return list(zip(torch.tensor_split(x, k), torch.tensor_split(y, k), strict=True))


def _grads(
    model: nn.Module, params: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor
) -> list[torch.Tensor]:
    loss = F.cross_entropy(functional_call(model, params, (x,)), y)
    return list(torch.autograd.grad(loss, list(params.values())))


def meta_loss(alpha: float, variant: str = "fo", delta: float = 1e-3) -> LossFn:
    """A loss whose gradient with respect to w is the Per-FedAvg step direction (FO or HF) and
    whose value is f(w_tmp, D') (the MAML objective on this batch)."""

    def loss_fn(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        parts = _split(x, y, 2 if variant == "fo" else 3)
        params: dict[str, torch.Tensor] = dict(model.named_parameters())
        (x1, y1), (x2, y2) = parts[0], parts[1]
        g = _grads(model, params, x1, y1)  # constants: no graph through the inner step
        tmp = {k: p - alpha * gk for (k, p), gk in zip(params.items(), g, strict=True)}
        outer = F.cross_entropy(functional_call(model, tmp, (x2,)), y2)
        if variant == "fo":
            return outer  # d outer / d w = grad f(w_tmp, D') since d w_tmp / d w = I
        v = torch.autograd.grad(outer, list(params.values()), retain_graph=True)
        x3, y3 = parts[2]
        pairs = list(zip(params.items(), v, strict=True))
        plus = {k: (p + delta * vk).detach().requires_grad_() for (k, p), vk in pairs}
        minus = {k: (p - delta * vk).detach().requires_grad_() for (k, p), vk in pairs}
        gp, gm = _grads(model, plus, x3, y3), _grads(model, minus, x3, y3)
        corr = cast(
            torch.Tensor,
            sum(
                (p * (alpha * (a - b) / (2 * delta))).sum()
                for p, a, b in zip(params.values(), gp, gm, strict=True)
            ),
        )
        return outer - corr + corr.detach()  # gradient: v - alpha d_i; value: outer

    return loss_fn


@register
class PerFedAvg(FedAvg):
    name = "perfedavg"
    description = "Per-FedAvg (Fallah et al. 2020): MAML local steps, one-step adaptation"

    class Params(FedAvg.Params):
        variant: Literal["fo", "hf"] = param("fo", "paper (Sec. 5: FO; hf: Hessian-free)")
        alpha: float | None = param(None, "PFLlib clientperavg.py: the lr (None: train.lr)", gt=0)
        beta: float | None = param(
            None, "PFLlib clientperavg.py: the lr (None: train.lr); pFedSim A.5: 0.001", gt=0
        )
        delta: float = param(1e-3, "our choice (HF finite-difference step)", gt=0)
        weighting: Weighting = param("uniform", "paper (Alg. 1: 1/(rn) sum)")

    params: Params

    def _alpha(self, env: ClientEnv) -> float:
        return self.params.alpha or env.run.train.lr

    def client_update(
        self, env: ClientEnv, payload: WeightsPayload, state: Empty, ctx: RoundContext
    ) -> Update:
        p, t = self.params, env.run.train
        k = 2 if p.variant == "fo" else 3
        weights, loss = train_from(
            env,
            payload["weights"],
            ctx,
            batch_size=k * t.batch_size,
            lr=p.beta or t.lr,
            loss_fn=meta_loss(self._alpha(env), p.variant, p.delta),
        )
        upload = {"weights": weights, "num_samples": env.num_train}
        return Update(upload, state, {"train_loss": loss})

    def adapt(self, env: ClientEnv, weights: Weights, ctx: RoundContext) -> Weights:
        """One SGD step of size alpha on one training batch (the personalized model)."""
        adapted, _ = train_from(
            env, weights, ctx, steps=1, lr=self._alpha(env), loss_fn=cross_entropy
        )
        return adapted

    def personal_model(
        self,
        env: ClientEnv,
        view: Payload,
        state: Empty,
        ctx: RoundContext,
        upload: WeightsUpload | None = None,
    ) -> nn.Module:
        """The global model (under MAP's protocol the uploaded one) adapted by one step."""
        start = view["weights"] if upload is None else upload["weights"]
        return load_model(env, self.adapt(env, start, ctx))
