"""GPFL: Zhang, Hua, Wang, Song, Xue, Ma, Cao & Guan, "GPFL: Simultaneously Learning Global and
Personalized Feature Information for Personalized Federated Learning", ICCV 2023
(specs/gpfl.md; docs/gpfl.md has the options table and the equation-to-code map).

Shared (downloaded, trained, uploaded, averaged by n_i): the feature extractor phi (the model's
``body``), the Conditional Valve CoV (``cov.*``) and the Global Category Embedding table GCE
C in R^{U x K} (``gce.table``), all in one flat dict ``shared``. Private: the head psi_i (the
model's ``head``) and the label proportions alpha_i (Eq. 6), which never leave the client.

Client i, given (phi, V, C) (Algorithm 1):

- C_hat = frozen copy of the received C; conditional inputs (Sec. 3.2), constants in the round:
  g = (1/U) sum_u c_hat_u (Eq. 5), p_i = sum_u alpha_i^u c_hat_u (Eq. 7, see deviations).
- CoV (Eq. 4): gamma = LN_g(ReLU(A_g z + a_g)), beta = LN_b(ReLU(A_b z + a_b)) from the
  conditional input z only, CoV(f, z) = ReLU((gamma + 1) * f + beta); f = phi(x),
  f^G = CoV(f, g) (global guidance route), f^P = CoV(f, p_i) (personalized task route).
- Loss (Eq. 11), one backward pass per mini-batch, one SGD step on phi, V, C and psi_i:
  L = CE(psi_i(f^P), y)                                        (L^P, Eq. 10)
    + CE(cos(f^G, c_u)_u, y)                                   (L^alg, Eq. 8: cosine logits
                                                                against the trainable C)
    + lam * mean_b ||f^G_b - c_hat_{y_b}||_2                   (L^mlg, Eq. 9)
    + mu ||V||_2 + mu ||C||_2                                  (regularisers, Eq. 11)
- Inference (Sec. 3.2): psi_i(CoV(phi(x), p_i)), with the latest aggregated phi and V and the
  client's p_i from the latest global table; GPFL has no global model (no ``global_acc``).

Named options for the authors' code (TsingZ0/GPFL, PFLlib; specs/gpfl.md §9):

- ``mlg: batch_frobenius``: L^mlg = Frobenius norm of the whole batch difference matrix (not a
  mean); the published lam values (0.01 for the CNN) belong to this form.
- ``regulariser: weight_decay``: mu as SGD weight decay on CoV and GCE only (the code's three
  optimizers: model without decay, CoV and GCE with decay mu; same lr, no momentum; here one
  SGD whose gradient hook adds mu * v to the CoV and GCE gradients, which is the same update).
- ``cond_source: local_previous``: g and p_i from the client's own table before it is
  overwritten (its table trained in its last round; zero vectors before its first round).
- ``pci_form: printed``: Eq. 7 as printed, p_i = (1/U) sum_u alpha_i^u c_hat_u.

Ablations (Table 6): ``use_pci: false`` replaces p_i and g by two constant vectors a and b, the
same on every client (N(0, 1) draws from the run seed: the paper does not give them);
``use_cov: false`` feeds f to both routes (no CoV is shared); ``use_mlg: false`` drops L^mlg;
``use_gce: false`` drops GCE, L^alg and L^mlg (CoV then gets the constants a and b; the paper
does not say what it gets).

Deviations and choices: p_i without the 1/U of the printed Eq. 7 (specs/gpfl.md §8.2: with it a
uniform client gets g/U, not g); L^mlg as the per-sample L2 distance averaged over the batch;
the regulariser as printed (unsquared norms, ||V|| over all CoV tensors, ||C|| over the whole
table); K = the model's ``feature_dim``. BatchNorm buffers of phi are averaged like parameters.
In the code the aggregated modules are pushed to every client each round; here only the
participants receive them, so under partial participation ``cond_source: local_previous`` uses
the table of the client's last own round. Defaults lam = 0.01, mu = 0.1 (the authors'
``run_me.sh`` for the 4-layer CNN; they belong to the code's forms of L^mlg and the
regulariser).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, Literal, NotRequired, TypedDict, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from pflkit.algorithms.base import (
    Algorithm,
    Payload,
    RoundContext,
    ServerContext,
    State,
    Update,
    Upload,
    Weighting,
    param,
    register,
    weighted_average,
)
from pflkit.algorithms.blocks.rs import class_counts
from pflkit.algorithms.blocks.split import common_init, common_seed, require_homogeneous
from pflkit.algorithms.env import ClientEnv, ServerEnv
from pflkit.models import PFLModel
from pflkit.primitives.training import GradHook, Weights, get_weights, group, set_weights


class GPFLPayload(TypedDict):
    """The shared parts: the body, the CoV's and the GCE's table."""

    shared: Weights


class GPFLUpload(Upload):
    """The trained shared parts and the sample count."""

    shared: Weights


class GPFLState(TypedDict):
    """The client's head, its class distribution alpha, and its last table
    (``cond_source: local_previous``)."""

    head: Weights
    alpha: Tensor
    table: NotRequired[Tensor]


class GPFLServer(TypedDict):
    """The global shared parts."""

    shared: Weights


TABLE = "gce.table"
ROUTES = ("gamma", "beta")
COV_PARTS = ("linear.weight", "linear.bias", "ln.weight", "ln.bias")


# -- the math (module functions: tested by value against hand computations) ----------------------


def init_cov(k: int, gen: torch.Generator, device: torch.device | None = None) -> Weights:
    """Two Linear(K, K) -> ReLU -> LayerNorm(K) stacks with PyTorch's default init (Linear:
    U(-1/sqrt(K), 1/sqrt(K)) for weight and bias; LayerNorm: weight 1, bias 0), drawn from the
    CPU generator ``gen`` and put on ``device``."""
    bound = 1 / math.sqrt(k)

    def uniform(*shape: int) -> Tensor:
        return ((torch.rand(*shape, generator=gen, device="cpu") * 2 - 1) * bound).to(device)

    out: Weights = {}
    for r in ROUTES:
        out[f"cov.{r}.linear.weight"] = uniform(k, k)
        out[f"cov.{r}.linear.bias"] = uniform(k)
        out[f"cov.{r}.ln.weight"] = torch.ones(k, device=device)
        out[f"cov.{r}.ln.bias"] = torch.zeros(k, device=device)
    return out


def cov_params(cov: Weights, z: Tensor) -> tuple[Tensor, Tensor]:
    """(gamma, beta) = (h_gamma(z), h_beta(z)), h(z) = LN(ReLU(A z + a)) (Eq. 4)."""

    def h(r: str) -> Tensor:
        u = F.relu(F.linear(z, cov[f"cov.{r}.linear.weight"], cov[f"cov.{r}.linear.bias"]))
        return F.layer_norm(u, u.shape[-1:], cov[f"cov.{r}.ln.weight"], cov[f"cov.{r}.ln.bias"])

    return h("gamma"), h("beta")


def cov_apply(f: Tensor, gamma: Tensor, beta: Tensor) -> Tensor:
    """CoV(f, z) = ReLU((gamma + 1) * f + beta), gamma and beta broadcast over the batch."""
    return F.relu(f * (gamma + 1) + beta)


def cond_inputs(
    table: Tensor, alpha: Tensor, pci_form: str = "weighted_mean"
) -> tuple[Tensor, Tensor]:
    """(g, p): g = mean_u c_u (Eq. 5); p = sum_u alpha_u c_u, or (1/U) of it (``printed``)."""
    g = table.mean(0)
    p = alpha.to(table.dtype) @ table
    return g, (p / table.shape[0] if pci_form == "printed" else p)


def alg_loss(f_g: Tensor, table: Tensor, y: Tensor) -> Tensor:
    """L^alg (Eq. 8): cross-entropy over cos(f^G, c_u), no temperature; batch mean."""
    cos = F.normalize(f_g, dim=1) @ F.normalize(table, dim=1).T
    return F.cross_entropy(cos, y)


def mlg_loss(f_g: Tensor, targets: Tensor, form: str = "mean_l2") -> Tensor:
    """L^mlg (Eq. 9) to the frozen embeddings of the true classes: mean of per-sample L2
    distances (paper), or the Frobenius norm of the batch difference (authors' code)."""
    d = f_g - targets
    loss: Tensor = d.norm(dim=1).mean() if form == "mean_l2" else d.norm()
    return loss


def reg_norms(tensors: list[Tensor]) -> Tensor:
    """||.||_2 of the tensors taken together as one vector."""
    norm: Tensor = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(tensors)))
    return norm


class NormPenalty:
    """``mu * sum_V ||V||_2`` over groups V of tensors (Eq. 11's regularisers) with its gradient
    ``mu * V / ||V||_2`` added in closed form by a grad hook instead of through autograd (the
    same gradient; it saves the graph of the norms over CoV's ~0.5M entries at every step).
    :meth:`value` (in the loss, no gradient) computes the norms; the hook, which runs after that
    step's backward pass and before its optimiser step, reuses them."""

    def __init__(self, groups: list[list[Tensor]], mu: float):
        self.groups, self.mu = groups, mu
        self.norms: list[Tensor] = []

    @torch.no_grad()
    def value(self) -> Tensor:
        self.norms = [reg_norms(ts) for ts in self.groups]
        return self.mu * cast(Tensor, sum(self.norms))

    @torch.no_grad()
    def __call__(self, params: list[Tensor]) -> None:
        for ts, norm in zip(self.groups, self.norms, strict=True):
            if norm > 0:
                grads = cast(list[Tensor], [t.grad for t in ts])  # after backward: all set
                torch._foreach_add_(grads, ts, alpha=self.mu / float(norm))


def decay(tensors: list[Tensor], mu: float) -> GradHook:
    """Weight decay mu on ``tensors`` only (the code's CoV and GCE optimizers)."""

    def hook(params: list[Tensor]) -> None:
        for t in tensors:
            assert t.grad is not None, "a grad hook runs after backward, which set it"
            t.grad.add_(t.detach(), alpha=mu)

    return hook


class GPFLNet(nn.Module):
    """The personalized model with CoV: ``model.head(CoV(model.features(x)))`` with the fixed
    ``gamma``, ``beta`` (computed once from p_i by :meth:`GPFL.personal_model`, which scores
    the plain model instead for the no-CoV ablation)."""

    def __init__(self, model: PFLModel, gamma: Tensor, beta: Tensor, cond: Tensor | None = None):
        super().__init__()
        self.model, self.gamma, self.beta = model, gamma, beta
        self.cond = cond
        """The conditional input p_i that gamma and beta were computed from (a field, for
        inspection; None where it was not given)."""

    def route(self, x: Tensor) -> Tensor:
        """The personalized route f^P = CoV(phi(x), p_i) (Sec. 3.2), what the head classifies."""
        return cov_apply(self.model.features(x), self.gamma, self.beta)

    def forward(self, x: Tensor) -> Tensor:
        logits: Tensor = self.model.head(self.route(x))
        return logits


# -- the algorithm ---------------------------------------------------------------------------------


@register
class GPFL(Algorithm):
    name = "gpfl"
    release = {"shared": "shared"}  # feature extractor, CoV and GCE
    secagg = ("samples", "uniform")  # its aggregate is the mean of the uploads
    private = ("head",)
    description = "GPFL (Zhang et al. 2023): CoV + global category embeddings, private head"
    payload = GPFLPayload
    upload = GPFLUpload
    state = GPFLState
    server = GPFLServer

    class Params(Algorithm.Params):
        lam: float = param(0.01, "authors' run_me.sh (CNN), set for mlg: batch_frobenius", ge=0)
        mu: float = param(0.1, "authors' run_me.sh (CNN), set for weight_decay", ge=0)
        mlg: Literal["mean_l2", "batch_frobenius"] = param(
            "mean_l2", "paper (Eq. 9); batch_frobenius: authors' code"
        )
        regulariser: Literal["norm", "weight_decay"] = param(
            "norm", "paper (Eq. 11); weight_decay: authors' code"
        )
        cond_source: Literal["received_global", "local_previous"] = param(
            "received_global", "paper (Alg. 1); local_previous: authors' code"
        )
        pci_form: Literal["weighted_mean", "printed"] = param(
            "weighted_mean", "authors' code and specs §8.2 (Eq. 7 without 1/U); printed: Eq. 7"
        )
        use_pci: bool = param(True, "paper (false: Table 6 'w/o PCI')")
        use_cov: bool = param(True, "paper (false: Table 6 'w/o CoV')")
        use_mlg: bool = param(True, "paper (false: Table 6 'w/o L_mlg')")
        use_gce: bool = param(True, "paper (false: Table 6 'w/o GCE')")
        weighting: Weighting = param("samples", "paper (Alg. 1: n_i weights)")

    params: Params

    # -- state -----------------------------------------------------------------------------
    def check(self, env: ServerEnv) -> None:
        require_homogeneous(env, self.name)

    def server_init(self, env: ServerEnv) -> GPFLServer:
        model = env.model()
        shared = group(model, common_init(env), "body")
        gen = torch.Generator().manual_seed(common_seed(env.run.seed, 1))
        k, u = model.feature_dim, env.num_classes
        if self.params.use_cov:
            shared.update(init_cov(k, gen, env.device))
        if self.params.use_gce:  # nn.Embedding's N(0, 1)
            shared[TABLE] = torch.randn(u, k, generator=gen, device="cpu").to(env.device)
        return {"shared": shared}

    def client_init(self, env: ClientEnv) -> GPFLState:
        counts = class_counts(env.data.train_y, env.num_classes)
        return {
            "head": group(env.model(), common_init(env), "head"),
            "alpha": counts / counts.sum(),
        }

    def configure(self, env: ServerEnv, server: State, cid: int, ctx: ServerContext) -> Payload:
        return {"shared": server["shared"]}

    def aggregate(
        self, env: ServerEnv, server: State, uploads: Mapping[int, GPFLUpload], ctx: ServerContext
    ) -> State:
        uniform = self.params.weighting == "uniform"
        return {**server, "shared": weighted_average(uploads, "shared", uniform=uniform)}

    # -- conditional inputs ------------------------------------------------------------------
    def _constants(self, env: ClientEnv, k: int) -> tuple[Tensor, Tensor]:
        """(b, a): the constant inputs replacing (g, p) without PCI or without GCE."""
        gen = torch.Generator().manual_seed(common_seed(env.run.seed, 2))
        b, a = torch.randn(2, k, generator=gen, device="cpu").to(env.device)
        return b, a

    def _inputs(
        self, env: ClientEnv, shared: Weights, state: Mapping[str, Any], k: int
    ) -> tuple[Tensor, Tensor]:
        """(g, p) for this round (training) or for scoring with ``shared``."""
        p = self.params
        if not (p.use_pci and p.use_gce):
            return self._constants(env, k)
        if p.cond_source == "received_global":
            table = shared[TABLE]
        elif "table" in state:
            table = state["table"]
        else:  # the code's zero vectors before a client's first own table
            return torch.zeros(k, device=env.device), torch.zeros(k, device=env.device)
        return cond_inputs(table, state["alpha"], p.pci_form)

    # -- local training ----------------------------------------------------------------------
    def client_update(
        self, env: ClientEnv, payload: GPFLPayload, state: GPFLState, ctx: RoundContext
    ) -> Update:
        p = self.params
        shared = payload["shared"]
        model = env.model()
        set_weights(model, {**group(model, shared, "body"), **state["head"]})
        k = model.feature_dim
        g, pc = self._inputs(env, shared, state, k)
        cov = {n: v.clone().requires_grad_() for n, v in shared.items() if n.startswith("cov.")}
        table = shared[TABLE].clone().requires_grad_() if p.use_gce else None
        table_hat = shared[TABLE] if p.use_gce else None
        extra = [*cov.values()] + ([table] if table is not None else [])

        def loss_fn(module: nn.Module, x: Tensor, y: Tensor) -> Tensor:
            model = cast(PFLModel, module)  # the client's PFLModel (env.model)
            f = model.features(x)
            if p.use_cov and p.use_gce:  # both routes' gamma, beta in one batched pass
                gamma, beta = cov_params(cov, torch.stack([pc, g]))
                f_p, f_g = cov_apply(f, gamma[0], beta[0]), cov_apply(f, gamma[1], beta[1])
            elif p.use_cov:
                f_p, f_g = cov_apply(f, *cov_params(cov, pc)), None
            else:
                f_p = f_g = f
            loss = F.cross_entropy(model.head(f_p), y)
            if p.use_gce:
                assert f_g is not None and table is not None and table_hat is not None  # use_gce
                loss = loss + alg_loss(f_g, table, y)
                if p.use_mlg and p.lam:
                    loss = loss + p.lam * mlg_loss(f_g, table_hat[y], p.mlg)
            if penalty:  # its value; its gradient comes from the same object's grad hook
                loss = loss + penalty.value()
            return loss

        hooks: list[GradHook] = []
        penalty = None
        if p.regulariser == "norm" and p.mu and extra:
            groups = [ts for ts in ([*cov.values()], [table] if table is not None else []) if ts]
            penalty = NormPenalty(groups, p.mu)
            hooks.append(penalty)
        if p.regulariser == "weight_decay" and p.mu and extra:
            hooks.append(decay(extra, p.mu))
        loss = env.train(
            model, ctx, loss_fn=loss_fn, params=[*model.parameters(), *extra], grad_hooks=hooks
        )
        w = get_weights(model)
        up = group(model, w, "body")
        up.update({n: v.detach().clone() for n, v in cov.items()})
        if table is not None:
            up[TABLE] = table.detach().clone()
        new_state = {**state, "head": group(model, w, "head")}
        if p.cond_source == "local_previous" and table is not None:
            new_state["table"] = up[TABLE]
        upload = {"shared": up, "num_samples": env.num_train}
        return Update(upload, new_state, {"train_loss": loss})

    # -- evaluation ----------------------------------------------------------------------------
    def eval_view(
        self, env: ServerEnv, server: State, cid: int | None, ctx: ServerContext
    ) -> Payload:
        return {} if cid is None else {"shared": server["shared"]}  # no global model

    @torch.no_grad()
    def personal_model(
        self,
        env: ClientEnv,
        view: Payload,
        state: GPFLState,
        ctx: RoundContext,
        upload: GPFLUpload | None = None,
    ) -> nn.Module:
        """The personalized model: the shared body (the view's; under MAP's protocol the one this
        client trained, its upload) with the private head psi_i, through CoV conditioned on p_i
        (:class:`GPFLNet`); the plain model for the no-CoV ablation."""
        shared = view["shared"] if upload is None else upload["shared"]
        model = env.model()
        set_weights(model, {**group(model, shared, "body"), **state["head"]})
        if not self.params.use_cov:
            return model
        p_i = self._inputs(env, shared, state, model.feature_dim)[1]
        gamma, beta = cov_params(shared, p_i)
        return GPFLNet(model, gamma, beta, p_i)

    def features(self, model: nn.Module, x: Tensor) -> Tensor:
        """The personalized route f^P = CoV(phi(x), p_i) that psi_i classifies (GPFL Fig. 2's
        features); the body output for the no-CoV ablation, which scores the plain model."""
        return model.route(x) if isinstance(model, GPFLNet) else super().features(model, x)
