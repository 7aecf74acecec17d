"""FLDA: Peterson, Kanani, Marathe, "Private Federated Learning with Domain Adaptation", NeurIPS
2019 Workshop on Federated Learning for Data Privacy and Confidentiality (arXiv 1912.06733); a
baseline of MAP (Li et al., TKDE 2024, Tables I-II, specs/map.md §5).

A mixture of experts per client: the general model G (shared, trained by FedAvg), a private model
P_k and a private gate. Shared: G only (downloaded, trained, uploaded, averaged by n_k). Private:
P_k and the gate (client state ``private`` and ``gate``), which never leave the client.

The gate is a per-sample logistic regression, alpha_k(x) = sigmoid(v_k . u(x) + c_k), and alpha_k
weights the **general** expert: the client's prediction for input x is

    p_k(y | x) = alpha_k(x) softmax(G(x))_y + (1 - alpha_k(x)) softmax(P_k(x))_y.

``variant: paper`` (default):

- gate input u(x) = x flattened (the raw input);
- client step, per mini-batch, one backward pass and one SGD step on G, P_k, v_k, c_k:
  L = CE(G(x), y) - log p_k(y | x) with G(x) detached inside p_k: G is trained on its own
  cross-entropy only (exactly FedAvg's client step: the same batches, the same updates, unless
  ``train.grad_clip`` clips all parameters together), P_k and the gate on the mixture's negative
  log-likelihood, with G held fixed;
- upload G; server: FedAvg (``weighting``);
- personalized model: p_k with the latest global G (scored by its log-probabilities).

``variant: map_code``, what the MAP authors ran (lxcnju/MAP ``algorithms/flda.py`` and
``FLDANet`` in ``networks/basic_classify_nets.py``):

- gate input u(x) = h_G(x), the general model's features (its body output);
- the experts' **logits** are mixed, z = alpha_k(x) G(x) + (1 - alpha_k(x)) P_k(x), and the loss
  is 2 * CE(z, y) (the code adds the cross-entropy of the same mixed logits twice) on G, P_k and
  the gate together: G also learns through the mixture and the gate;
- personalized model: z (its softmax), global model: G alone.

Both variants: P_k starts as an initial model drawn independently of G's (the code re-initialises
a copy for the private model; here from a generator seeded by the run seed only, the same start
on every client, as the code's deep copies); v_k, c_k start as PyTorch's default
``nn.Linear(d, 1)`` init, U(-1/sqrt(d), 1/sqrt(d)) (the code's gate layer; same on every
client). A client that has not trained yet is scored with the global model (it has no private
model yet). Selected clients under MAP's protocol are scored on the mixture with the G they just
trained (``personal_model`` with the upload).

Sources and deviations: the paper's text was not available to us. From its abstract and
summaries: each user keeps a private model next to the general shared model, a learned
per-example gating function alpha_i(x) mixes the two (a mixture of experts), the general model is
trained by federated learning with differential privacy and the private parts on the user's data
only. Our reading, not checked against the text: alpha weights the general model (as in the MAP
code), the gate is a logistic regression on the raw input, the experts' class probabilities are
mixed (the mixture-of-experts likelihood), and the general model learns from its own
cross-entropy only. The general model is trained without differential-privacy noise, as the MAP
authors' code runs FLDA. The MAP code's other settings are run-wide options: plain-mean aggregation is
``train.weighting: uniform``, gradient clipping is ``train.grad_clip`` (it clips G, P_k and the
gate together, as the code does); its 5-round learning-rate warm-up is not reproduced.
"""

from __future__ import annotations

import math
from typing import Literal, NotRequired, TypedDict, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from pflkit.algorithms.base import (
    Payload,
    RoundContext,
    State,
    Update,
    Upload,
    load_model,
    param,
    register,
)
from pflkit.algorithms.blocks.split import common_seed, require_homogeneous
from pflkit.algorithms.env import ClientEnv, ServerEnv
from pflkit.algorithms.fedavg import FedAvg
from pflkit.algorithms.records import WeightsPayload
from pflkit.models import PFLModel
from pflkit.primitives.training import (
    LossFn,
    Weights,
    get_weights,
    set_weights,
)


class FLDAState(TypedDict):
    """The client's private model and its gate (from its first round on)."""

    private: NotRequired[Weights]
    gate: NotRequired[dict[str, Tensor]]  # {"weight", "bias"}


Variant = Literal["paper", "map_code"]
P_SLOT = "flda_private"
PRIVATE_KEY, GATE_KEY = 0xF1DA, 0x6A7E  # common_seed keys of the private model and the gate


# -- the math (module functions: tested by value against hand computations) ----------------------


def gate_logit(u: Tensor, weight: Tensor, bias: Tensor) -> Tensor:
    """The gate's pre-activation s = v . u + c per sample (alpha = sigmoid(s)), u flattened."""
    return u.flatten(1) @ weight + bias


def mixture(zg: Tensor, zp: Tensor, s: Tensor, variant: Variant) -> Tensor:
    """The mixture's scores, alpha = sigmoid(s) weighting the general expert's: paper
    log(alpha softmax(zg) + (1 - alpha) softmax(zp)) (log-probabilities, computed stably);
    map_code alpha zg + (1 - alpha) zp (mixed logits)."""
    s = s[:, None]
    if variant == "paper":
        log_g = F.logsigmoid(s) + F.log_softmax(zg, dim=1)
        log_p = F.logsigmoid(-s) + F.log_softmax(zp, dim=1)
        return torch.logaddexp(log_g, log_p)
    alpha = torch.sigmoid(s)
    return alpha * zg + (1 - alpha) * zp


def flda_loss(pmodel: nn.Module, gate: tuple[Tensor, Tensor], variant: Variant) -> LossFn:
    """The client's loss (module docstring): paper CE(G(x), y) - log p_k(y | x) with G(x)
    detached in the mixture; map_code 2 * CE(mixed logits, y)."""
    weight, bias = gate

    def loss_fn(module: nn.Module, x: Tensor, y: Tensor) -> Tensor:
        model = cast(PFLModel, module)  # the client's PFLModel (env.model)
        h = model.features(x)
        zg = model.head(h)
        zp = pmodel(x)
        if variant == "paper":
            mix = mixture(zg.detach(), zp, gate_logit(x, weight, bias), variant)
            return F.cross_entropy(zg, y) + F.nll_loss(mix, y)
        return 2 * F.cross_entropy(mixture(zg, zp, gate_logit(h, weight, bias), variant), y)

    return loss_fn


class GatedMixture(nn.Module):
    """The personalized classifier: ``mixture`` of the general model and the private model."""

    def __init__(
        self, model: PFLModel, pmodel: PFLModel, gate: tuple[Tensor, Tensor], variant: Variant
    ):
        super().__init__()
        self.model, self.pmodel, self.variant = model, pmodel, variant
        self.weight, self.bias = gate

    def forward(self, x: Tensor) -> Tensor:
        h = self.model.features(x)
        u = x if self.variant == "paper" else h
        s = gate_logit(u, self.weight, self.bias)
        return mixture(self.model.head(h), self.pmodel(x), s, self.variant)


# -- the algorithm ---------------------------------------------------------------------------------


@register
class FLDA(FedAvg):
    name = "flda"
    private = ("private",)
    description = "FLDA (Peterson et al. 2019): FedAvg model + private model, mixed by a gate"
    state = FLDAState

    class Params(FedAvg.Params):
        variant: Variant = param(
            "paper", "our reading of the paper (gate on x, mixed probabilities); map_code: MAP code"
        )

    params: Params

    def check(self, env: ServerEnv) -> None:
        require_homogeneous(env, self.name, "averages its shared global model")

    # -- the private parts' starting values ----------------------------------------------------
    def _init_private(self, env: ClientEnv) -> Weights:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(common_seed(env.run.seed, PRIVATE_KEY))
            return env.init_weights()

    def _init_gate(self, env: ClientEnv) -> dict[str, Tensor]:
        if self.params.variant == "paper":
            d = env.data.train_x[0].numel()
        else:
            d = env.model().feature_dim
        bound = 1 / math.sqrt(d)
        gen = torch.Generator().manual_seed(common_seed(env.run.seed, GATE_KEY))
        w = (torch.rand(d + 1, generator=gen, device="cpu") * 2 - 1) * bound
        return {"weight": w[:d].to(env.device), "bias": w[d:].to(env.device)}

    # -- one round -------------------------------------------------------------------------------
    def client_update(
        self, env: ClientEnv, payload: WeightsPayload, state: FLDAState, ctx: RoundContext
    ) -> Update:
        model = env.model()
        set_weights(model, payload["weights"])
        pmodel = env.model(P_SLOT)
        set_weights(pmodel, state["private"] if "private" in state else self._init_private(env))
        pmodel.train()
        g = state["gate"] if "gate" in state else self._init_gate(env)
        weight = g["weight"].detach().clone().requires_grad_()
        bias = g["bias"].detach().clone().requires_grad_()
        loss = env.train(
            model,
            ctx,
            loss_fn=flda_loss(pmodel, (weight, bias), self.params.variant),
            params=[*model.parameters(), *pmodel.parameters(), weight, bias],
        )
        upload = {"weights": get_weights(model), "num_samples": env.num_train}
        gate = {"weight": weight.detach().clone(), "bias": bias.detach().clone()}
        new_state = {**state, "private": get_weights(pmodel), "gate": gate}
        return Update(upload, new_state, {"train_loss": loss})

    # -- evaluation ----------------------------------------------------------------------------
    def personal_model(
        self,
        env: ClientEnv,
        view: Payload,
        state: State,
        ctx: RoundContext,
        upload: Upload | None = None,
    ) -> nn.Module:
        """The gated mixture of the general model (the view's; under MAP's protocol the
        uploaded one) and the private model; before the client first trains, the general
        model alone."""
        model = super().personal_model(env, view, state, ctx, upload)
        if "private" not in state:  # never trained: the global model
            return model
        pmodel = load_model(env, state["private"], P_SLOT)
        gate = (state["gate"]["weight"], state["gate"]["bias"])
        general = cast(PFLModel, model)  # the default personal_model's: load_model's PFLModel
        return GatedMixture(general, pmodel, gate, self.params.variant)
