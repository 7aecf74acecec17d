"""pFedMe: T. Dinh, Tran & Nguyen, "Personalized Federated Learning with Moreau Envelopes",
NeurIPS 2020 (Algorithm 1).

Shared: the local copy w of the global model. Private: the personalized model theta_i (client
state ``personal``), the approximate solution of the client's Moreau-envelope problem (Eq. 3)

    theta_i(w) = argmin_theta  f_i(theta; D) + (lam / 2) ||theta - w||^2 ,

which never leaves the client.

Client i, from the downloaded w^t, for R local steps (Algorithm 1), each on a fresh batch D:

1. Inner problem: K steps of gradient descent with ``personal_lr`` on
   f_i(theta; D) + (lam / 2) ||theta - w||^2, warm-started from the previous step's theta
   (theta starts at w^t in each round), giving theta_i;
2. Local update: w <- w - eta lam (w - theta_i)  (eta = ``train.lr``).

The last theta_i is the personalized model; w is uploaded. Server (Algorithm 1):
w^{t+1} = (1 - beta) w^t + beta * mean_S(w_i) (the plain mean; ``weighting: samples`` weights
by n_i as the authors' code). ``global_acc`` scores w.

Defaults: lam = 15, K = 5, personal_lr = 0.1, beta = 1 (the authors' code README, MNIST);
R = ``train.local_epochs`` epochs of batches (how PFLlib runs it for GPFL; ``local_steps`` sets
R directly as the paper does, R = 20). The local update uses the config's optimiser settings (a
gradient step of size eta on (lam / 2) ||w - theta_i||^2).

Deviations: a client never selected yet is scored with the global model (it has no theta).

Options for PFLlib's code (system/flcore, commit d832e76):

- ``theta_decay`` (mu): adds (mu / 2) ||theta||^2 to the inner problem, so each inner step is
  theta <- theta - personal_lr (grad f + lam (theta - w) + mu theta), PFLlib's
  ``pFedMeOptimizer.step`` (``optimizers/fedoptimizer.py`` lines 34 and 45, mu = 0.001 fixed).
  The paper's inner problem has no such term: default 0. The reported training loss then
  includes (mu / 2) ||theta||^2 (the inner objective at the new theta).
- ``scored``: what pflkit scores as pFedMe's personalized model. ``personal`` (default, the
  paper): theta. ``global``: the global model w, scored as FedAvg's (the default ``personal_model``;
  under MAP's protocol, ``eval.selected_clients``, the uploaded w). This is what PFLlib's
  "personalized" accuracy measures: ``optimizer.step`` returns the model's own parameter
  objects (fedoptimizer.py line 47), so ``personalized_params`` is the model
  (``clients/clientpFedMe.py`` line 56); the model is then set to the local w (line 68) and, at
  the next ``send_models``, to the global model (lines 74-77; ``servers/serverpFedMe.py`` line
  31), before ``evaluate_personalized`` scores it (serverpFedMe.py line 41, clientpFedMe.py
  line 81). A client PFLlib never trained keeps a copy of the initial model there (line 19)
  and is scored with it; pflkit scores it with the global model (no difference under full
  participation).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Literal, NotRequired, TypedDict, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call

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
)
from pflkit.algorithms.env import ClientEnv, ServerEnv
from pflkit.algorithms.fedavg import FedAvg
from pflkit.algorithms.records import WeightsPayload, WeightsUpload
from pflkit.primitives.training import (
    LossFn,
    Weights,
    get_weights,
    set_weights,
    steps_per_epoch,
)
from pflkit.primitives.tree import convex_combination


class PFedMeState(TypedDict):
    """The client's personalized model theta_i (from its first round on)."""

    personal: NotRequired[Weights]


Params = dict[str, Tensor]


def moreau_steps(
    loss_of: Callable[[Params], Tensor],
    theta: Params,
    anchor: Params,
    lam: float,
    lr: float,
    steps: int,
) -> Params:
    """K steps of gradient descent on loss_of(theta) + (lam / 2) ||theta - anchor||^2 from
    ``theta``; returns the new theta (detached)."""
    theta = {k: v.detach().clone().requires_grad_(True) for k, v in theta.items()}
    ts, anchors = list(theta.values()), [anchor[k] for k in theta]
    for _ in range(steps):
        grads = torch.autograd.grad(loss_of(theta), ts)
        with torch.no_grad():  # theta -= lr * (g + lam * (theta - anchor)), in place
            step = torch._foreach_sub(ts, anchors)
            torch._foreach_mul_(step, lam)
            torch._foreach_add_(step, grads)
            torch._foreach_mul_(step, lr)
            torch._foreach_sub_(ts, step)
    return {k: v.detach() for k, v in theta.items()}


def pfedme_loss(
    theta: Params, lam: float, lr: float, k_steps: int, theta_decay: float = 0.0
) -> LossFn:
    """Per batch: solve the inner problem (updating ``theta`` in place, warm start), then
    return a loss whose gradient with respect to w is lam (w - theta) and whose value is the
    inner objective at the new theta. ``theta_decay`` mu adds (mu / 2) ||theta||^2 to f (PFLlib's
    inner step; module docstring)."""

    def loss_fn(model: nn.Module, x: Tensor, y: Tensor) -> Tensor:
        w = dict(model.named_parameters())
        anchor = {k: v.detach() for k, v in w.items()}

        def f(params: Params) -> Tensor:
            loss = F.cross_entropy(functional_call(model, params, (x,)), y)
            if theta_decay:  # its gradient: theta_decay * theta
                loss = loss + 0.5 * theta_decay * sum(v.pow(2).sum() for v in params.values())
            return loss

        theta.update(moreau_steps(f, theta, anchor, lam, lr, k_steps))
        pull = 0.5 * lam * cast(Tensor, sum((w[k] - theta[k]).pow(2).sum() for k in w))
        with torch.no_grad():
            value = f(theta) + pull
        return pull - pull.detach() + value

    return loss_fn


@register
class PFedMe(FedAvg):
    name = "pfedme"
    secagg = ("samples", "uniform")  # its aggregate is the mean of the uploads
    private = ("personal",)
    description = "pFedMe (T. Dinh et al. 2020): Moreau-envelope personalized models"
    state = PFedMeState

    class Params(FedAvg.Params):
        lam: float = param(15.0, "authors' code README (MNIST)", gt=0)
        inner_steps: int = param(5, "authors' code (K = 5)", ge=1)
        personal_lr: float = param(0.1, "authors' code README (MNIST)", gt=0)
        beta: float = param(1.0, "authors' code README (beta = 1: plain averaging)", gt=0)
        local_steps: int | None = param(None, "PFLlib (None: train.local_epochs epochs)", ge=1)
        weighting: Weighting = param("uniform", "paper (Alg. 1: mean over S)")
        theta_decay: float = param(
            0.0, "paper (none); PFLlib pFedMeOptimizer (fedoptimizer.py lines 34, 45): 0.001", ge=0
        )
        scored: Literal["personal", "global"] = param(
            "personal", "paper (theta); global: PFLlib's 'personalized' accuracy (clientpFedMe.py)"
        )

    params: Params

    def client_update(
        self, env: ClientEnv, payload: WeightsPayload, state: PFedMeState, ctx: RoundContext
    ) -> Update:
        p, t = self.params, env.run.train
        model = env.model()
        set_weights(model, payload["weights"])
        theta = {k: v.detach().clone() for k, v in model.named_parameters()}
        steps = p.local_steps or t.local_epochs * steps_per_epoch(
            env.num_train, t.batch_size, ctx.drop_last
        )
        loss = env.train(
            model,
            ctx,
            steps=steps,
            loss_fn=pfedme_loss(theta, p.lam, p.personal_lr, p.inner_steps, p.theta_decay),
        )
        w = get_weights(model)
        personal = {k: theta.get(k, v).detach().clone() for k, v in w.items()}
        upload = {"weights": w, "num_samples": env.num_train}
        return Update(upload, {**state, "personal": personal}, {"train_loss": loss})

    def aggregate(
        self,
        env: ServerEnv,
        server: State,
        uploads: Mapping[int, WeightsUpload],
        ctx: ServerContext,
    ) -> State:
        mean = super().aggregate(env, server, uploads, ctx)["weights"]
        b, old = self.params.beta, server["weights"]
        return {**server, "weights": convex_combination(old, mean, b)}

    def personal_model(
        self,
        env: ClientEnv,
        view: Payload,
        state: State,
        ctx: RoundContext,
        upload: Upload | None = None,
    ) -> nn.Module:
        if self.params.scored == "global":
            # the global model w (under MAP's protocol after local training, as FedAvg's)
            return super().personal_model(env, view, state, ctx, upload)
        if upload is None and state.get("personal") is None:
            return super().personal_model(env, view, state, ctx)
        return load_model(env, state["personal"])
