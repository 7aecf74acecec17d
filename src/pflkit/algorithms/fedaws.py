"""FedAwS: Yu, Rawat, Menon & Kumar, "Federated Learning with Only Positive Labels", ICML 2020
(Algorithm 1, the spreadout regularizer reg_sp); a baseline of MAP (Li et al., TKDE 2024,
Tables I-II, specs/map.md §5), which applies the spreadout term to clients with incomplete
classes.

Shared: the whole model (as FedAvg). Private: nothing.

Client k: FedAvg's client step from the downloaded w_t, E epochs of mini-batch SGD on its
training split, with the loss ``client_loss``:

- ``ce`` (default): plain cross-entropy, as FedAvg. This is how the MAP paper and code run
  FedAwS ("the spreadout term could be also applied to the considered FL scene"; the code's
  clients train on CE).
- ``positive``: the FedAwS paper's positive-only loss, the batch mean of
  (max(0, positive_margin - cos(h, w_y)))^2, where h is the input of the classifier's final
  Linear and w_y its weight row of the sample's class (bias ignored). Only the body and the
  rows of classes the client has get a gradient (weight decay, if set, still shrinks all).

Server (Algorithm 1): first FedAvg's averaging, w = sum_k (n_k / n) w_k (``weighting: uniform``:
the plain mean), then ``server_steps`` gradient steps on the spreadout regularizer over the
class-embedding matrix W (the weight of the last ``nn.Linear`` in ``model.head``, one row per
class), starting from the averaged W:

    form "paper":  reg(W) = sum_{c} sum_{c' != c} (max(0, margin - d(w_c, w_c')))^2,
                   d(u, v) = 1 - cos(u, v)        (the paper's cosine distance of the
                                                   l2-normalised embeddings, = ||u^ - v^||^2 / 2)
                   W <- W - server_lr * grad reg(W)                  (plain gradient steps)

    form "code":   reg(W) = (1 / C^2) sum_{c, c'} (max(0, margin - d'(w_c, w_c')))^2,
                   d'(u, v) = (1 - cos(u, v)) / 2 off the diagonal, 0 on it
                   SGD with momentum 0.9 (fresh each round) at server_lr     (the MAP code)

In the code form the C diagonal entries add the constant margin^2 / C^2 each to the value (no
gradient). Everything else in the model (body, classifier bias, buffers) is the FedAvg average.

Defaults and their sources:

- ``form`` = "paper": the paper's regularizer with one plain gradient step per round (Algorithm 1:
  W <- W - lambda * eta * grad reg_sp(W)); ``server_steps`` = 1.
- ``server_lr`` = None: lambda * eta of Algorithm 1 with lambda = 10 (the multiplier the paper's
  experiments use; its sensitivity study tries 1, 10, 100) and eta = ``train.lr``.
- ``margin`` = 0.9: the first value of the MAP code's grid {0.9, 0.8, 0.5} (the paper's CIFAR
  margin was not available to us). In "paper" units (d = 1 - cos) it asks for cos <= 0.1 between
  class embeddings; in "code" units (d' = (1 - cos) / 2) for cos <= -0.8.
- The MAP code's grid is (margin, server_steps, server_lr) in {(0.9, 20, 1.0), (0.8, 30, 0.1),
  (0.5, 50, 0.01)} with ``form: code``; its plain-mean averaging is ``train.weighting: uniform``.
- ``positive_margin`` = 0.9: the paper's positive threshold (used only by ``client_loss:
  positive``).

Deviations and choices:

- The paper's setting has one class per client: client k downloads only its own class embedding
  w_k, and the server stacks the returned rows instead of averaging W. With clients of several
  classes (MAP's setting, and pflkit's) every client downloads and uploads the whole model and
  the server averages W like every other parameter before the spreadout steps.
- ``client_loss: positive`` is not the default: with clients that hold several classes it
  discards the negatives the client does have, and the model is still scored with its ordinary
  logits W h + b (the paper's cosine scoring is not built); it is offered for the one-class
  setting the paper targets.
- The paper's stochastic negative mining variant (spreadout over each class's k nearest
  classes) is not implemented: reg_sp covers every pair of classes.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from pflkit.algorithms.base import ServerContext, State, param, register, weighted_average
from pflkit.algorithms.blocks.split import require_homogeneous
from pflkit.algorithms.env import ClientEnv, ServerEnv
from pflkit.algorithms.fedavg import FedAvg
from pflkit.algorithms.records import WeightsPayload, WeightsUpload
from pflkit.errors import PflkitError
from pflkit.primitives.training import LossFn, Weights, cross_entropy

SpreadoutForm = Literal["paper", "code"]
PAPER_LR_MULTIPLIER = 10.0  # lambda of Algorithm 1's server step lambda * eta
CODE_MOMENTUM = 0.9  # the MAP code's server SGD momentum


def final_linear(model: nn.Module) -> tuple[str, nn.Linear]:
    """The state-dict name of the weight of the last ``nn.Linear`` in ``model.head`` (the
    class-embedding matrix W, one row per class) and that layer; a :class:`PflkitError` when
    the head has none."""
    head = getattr(model, "head", None)
    linears = (
        []
        if head is None
        else [(n, m) for n, m in head.named_modules() if isinstance(m, nn.Linear)]
    )
    if not linears:
        raise PflkitError(
            f"fedaws spreads out the class embeddings, the weight of the last nn.Linear in the "
            f"model's head, but model '{getattr(model, 'name', type(model).__name__)}' has no "
            "Linear layer in its head: pick a model whose classifier is a Linear layer"
        )
    name, layer = linears[-1]
    return ("head." + name + "." if name else "head.") + "weight", layer


def spreadout(w: Tensor, margin: float, form: SpreadoutForm = "paper") -> Tensor:
    """The spreadout regularizer of the class-embedding rows of ``w`` (see the module
    docstring for both forms)."""
    wn = F.normalize(w, dim=1)
    cos = wn @ wn.T
    off = ~torch.eye(len(w), dtype=torch.bool, device=w.device)
    if form == "paper":
        return F.relu(margin - (1 - cos[off])).pow(2).sum()
    d = torch.where(off, 0.5 * (1 - cos), torch.zeros_like(cos))
    return F.relu(margin - d).pow(2).mean()


def spreadout_steps(
    w: Tensor, margin: float, steps: int, lr: float, form: SpreadoutForm = "paper"
) -> Tensor:
    """``steps`` gradient steps on :func:`spreadout` from ``w``: plain steps ("paper") or SGD
    with momentum 0.9 ("code"). Returns the new matrix (``w`` is not modified)."""
    momentum = 0.0 if form == "paper" else CODE_MOMENTUM
    with torch.enable_grad():
        ws = w.detach().clone().requires_grad_(True)
        opt = torch.optim.SGD([ws], lr=lr, momentum=momentum)
        for _ in range(steps):
            opt.zero_grad(set_to_none=True)
            spreadout(ws, margin, form).backward()
            opt.step()
    return ws.detach()


def positive_loss(layer: nn.Linear, positive_margin: float) -> LossFn:
    """The paper's positive-only loss, mean (max(0, positive_margin - cos(h, w_y)))^2 with h the
    input of ``layer`` (the classifier's final Linear) and w_y its weight row of class y."""

    def loss_fn(model: nn.Module, x: Tensor, y: Tensor) -> Tensor:
        seen: list[Tensor] = []
        handle = layer.register_forward_pre_hook(lambda _m, args: seen.append(args[0]))
        try:
            model(x)
        finally:
            handle.remove()
        cos = F.cosine_similarity(seen[-1], layer.weight[y], dim=1)
        return F.relu(positive_margin - cos).pow(2).mean()

    return loss_fn


@register
class FedAwS(FedAvg):
    name = "fedaws"
    sample_dp_covered = True  # DP-SGD covers it (pflkit.privacy.dpsgd)
    secagg = ("samples", "uniform")  # its aggregate is the mean of the uploads
    description = "FedAwS (Yu et al. 2020): FedAvg + server-side spreadout of class embeddings"

    class Params(FedAvg.Params):
        margin: float = param(0.9, "MAP code grid {0.9, 0.8, 0.5} (first)", gt=0)
        server_steps: int = param(1, "paper (Alg. 1: one step); MAP code grid {20, 30, 50}", ge=1)
        server_lr: float | None = param(
            None, "paper (Alg. 1: lambda * eta, lambda = 10; None: 10 * train.lr)", gt=0
        )
        form: SpreadoutForm = param("paper", "paper (reg_sp, cosine distance); code: MAP code")
        client_loss: Literal["ce", "positive"] = param(
            "ce", "MAP paper and code (CE); positive: FedAwS paper's positive-only loss"
        )
        positive_margin: float = param(0.9, "paper (positive threshold)", gt=0, le=1)

    params: Params

    def check(self, env: ServerEnv) -> None:
        require_homogeneous(env, self.name, "averages whole client models")
        final_linear(env.model())

    def local_objective(self, env: ClientEnv, payload: WeightsPayload) -> LossFn:
        if self.params.client_loss == "ce":
            return cross_entropy
        _, layer = final_linear(env.model())  # the model train_from trains (slot 0)
        return positive_loss(layer, self.params.positive_margin)

    def server_lr(self, env: ServerEnv) -> float:
        lr = self.params.server_lr
        return PAPER_LR_MULTIPLIER * env.run.train.lr if lr is None else lr

    def aggregate(
        self,
        env: ServerEnv,
        server: State,
        uploads: Mapping[int, WeightsUpload],
        ctx: ServerContext,
    ) -> State:
        p = self.params
        weights: Weights = weighted_average(uploads, uniform=p.weighting == "uniform")
        key, _ = final_linear(env.model())
        weights[key] = spreadout_steps(
            weights[key], p.margin, p.server_steps, self.server_lr(env), p.form
        )
        return {**server, "weights": weights}
