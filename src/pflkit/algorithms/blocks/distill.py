"""Shared machinery of the knowledge-distillation algorithms (KT-pFL, FedMD, Sim-pFD, TopK-pFD,
FedDF, pFedDF): soft predictions at temperature T on the public set, the distillation loss and
loop, the simplex projection, and :class:`SoftTeacherKD`, the round structure that KT-pFL,
FedMD, Sim-pFD and TopK-pFD share.

The public set is ``env.public_x`` (``data.public`` in the config). Its labels are never
used. Soft predictions are always taken in eval mode (BN and dropout frozen) and the student is
trained in train mode (specs/ktpfl.md §8.16).

**SoftTeacherKD** (specs/ktpfl.md §2.2-2.3). Each client keeps its own model (any architecture,
client state ``weights``); only ``B x C`` soft predictions cross the network. A round has two
exchanges (``phases()``):

1. ``"share"``: with ``order="train_then_distill"`` (the paper's order) the client first trains
   ``E`` epochs on its private data; it then uploads ``S_n = softmax(f_n(x_pub) / T)``
   (``B x C`` floats) and its sample count ``D_n``. The server forms the mixing matrix ``c``
   (``c[m, n]`` = weight of client ``m`` in client ``n``'s teacher: column ``n`` belongs to
   student ``n``) and the per-client teachers ``S_hat_n = sum_m c[m, n] S_m``.
2. ``"distill"``: client ``n`` downloads ``S_hat_n`` (``B x C`` floats) and distils for ``R``
   epochs over the public set, minimising ``KL(S_hat_n || softmax(f_n(x) / T))``; with
   ``order="distill_then_train"`` (FedMD's digest-revisit, the KT-pFL code's order) it then
   trains ``E`` epochs on its private data.

A held-out client (``data.holdout_clients``), never in ``c``, is personalized by the same two
phases (``Algorithm.adapt_holdout``'s default) with the uniform mean of the round's shared
predictions as its teacher (FedMD's consensus; KT-pFL's ``c`` starts uniform).

Subclasses only say how ``c`` is formed: uniform (FedMD), learned (KT-pFL), cosine similarity
(Sim-pFD), top-K cosine (TopK-pFD). With partial participation the mixture runs over the
clients of the round only, each student's column renormalised over them (§8.14).

Defaults from specs/ktpfl.md §3-4: ``R = 1`` distillation epoch, public batch 256, distillation
learning rate = the private one (``train.lr``), the whole configured public set every round
(``data.public.size`` = the paper's ``|D_r| = 3000``; the set is drawn once, with
``data.seed``, and stays fixed: ``public_per_round: k`` draws a fresh ``k`` of it each round),
temperature ``T = 1`` for every method (KT-pFL's paper states no T; the authors' code uses
T = 1 in its FedMD / Sim / TopK engines and in its Table-1 config ``*_20models_T1``, T = 10 in
``*_T10`` and the sweeps), so a comparison with the defaults distils at one temperature.

The distillation loss (``kd_loss``; the paper states neither the reduction nor a ``T^2`` factor,
specs/ktpfl.md §8.3):

- ``kl`` (default, KT-pFL eq. 6 read literally): the per-sample KL divergence (summed over
  classes, averaged over the mini-batch), no ``T^2`` factor;
- ``kl_t2``: that times ``T^2``, Hinton et al. (2015)'s correction that keeps the gradient's
  size independent of T;
- ``kl_mean``: the KT-pFL code's ``kl_div(..., reduction="mean")`` (averaged over samples *and*
  classes: ``kl / C``), no ``T^2``.

The choice sets how hard distillation pulls. On the logits the gradient is ``(q - p) / T`` for
``kl``, ``T (q - p)`` for ``kl_t2`` and ``(q - p) / (T C)`` for ``kl_mean`` (``p``, ``q``: teacher
and student at temperature T); at T = 1 ``kl`` and ``kl_t2`` are the same loss. How much more
weakly ``kl`` pulls at T > 1 (measured) and which ``kd_loss`` to use: docs/ktpfl.md, "The
distillation loss and the temperature".
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar, Literal, NotRequired, TypedDict, cast

import numpy as np
import torch
import torch.nn.functional as F
from pydantic import BaseModel
from torch import Tensor, nn

from pflkit.algorithms.base import (
    Algorithm,
    Payload,
    RoundContext,
    ServerContext,
    State,
    Update,
    Upload,
    load_model,
    param,
)
from pflkit.algorithms.env import ClientEnv, ServerEnv, given
from pflkit.algorithms.records import Empty
from pflkit.config import TrainConfig
from pflkit.errors import PflkitError
from pflkit.primitives.training import (
    PLAIN_SGD,
    LocalOptim,
    LossFn,
    Weights,
    get_weights,
    local_sgd,
    predict,
    set_weights,
)


class SharePayload(TypedDict):
    """Phase ``share``: the round's public subset (none: the whole public set)."""

    public_idx: NotRequired[Tensor]


class DistillPayload(TypedDict):
    """Phase ``distill``: the client's teacher, soft predictions on the public subset."""

    teacher: Tensor


class ShareUpload(Upload):
    """Phase ``share``: the client's soft predictions on the public subset."""

    soft: Tensor


class KDState(TypedDict):
    """The client's model, and the round's public subset between its two phases."""

    weights: Weights
    public_idx: NotRequired[Tensor]


class KDServer(TypedDict):
    """The mixing matrix c, and after a ``share`` phase the round's soft predictions, its
    clients (``active``), their sample counts and each one's teacher."""

    c: Tensor
    soft: NotRequired[Tensor]
    active: NotRequired[Tensor]
    num_samples: NotRequired[Tensor]
    teachers: NotRequired[dict[int, Tensor]]


PUBLIC_FIX = "set data.public: {dataset: mnist5k, size: 3000}"


def require_public(env: ServerEnv, algorithm: str, per_round: int | None = None) -> None:
    """Refuse a run without a public set, or with ``per_round`` above its size, in one
    sentence that says how to fix it."""
    if env.public_x is None:
        raise PflkitError(
            f"algorithm '{algorithm}' distils on a public set but none is configured: "
            f"{PUBLIC_FIX} (a public set with the task's classes and input shape)"
        )
    if per_round is not None and per_round > len(env.public_x):
        raise PflkitError(
            f"algorithm '{algorithm}': public_per_round {per_round} exceeds the "
            f"public set's {len(env.public_x)} samples: lower it or raise data.public.size"
        )


def soft_predictions(model: nn.Module, x: Tensor, temperature: float) -> Tensor:
    """``softmax(f(x) / T)`` in eval mode, float32 ``[len(x), C]``."""
    return torch.softmax(predict(model, x, 1000).float() / temperature, dim=1)


def kd_loss(temperature: float, kind: str = "kl") -> LossFn:
    """Loss ``(model, x, teacher_probs) -> KL(teacher || softmax(model(x) / T))``.

    ``kl``: per-sample KL (summed over classes, averaged over the batch); ``kl_t2``: that times
    ``T^2``; ``kl_mean``: the KT-pFL code's ``kl_div(log_softmax(z / T), p, reduction="mean")``.
    """
    t = float(temperature)

    def loss_fn(model: nn.Module, x: Tensor, target: Tensor) -> Tensor:
        logp = F.log_softmax(model(x) / t, dim=1)
        if kind == "kl_mean":  # torch's reduction="mean": over samples and classes
            return F.kl_div(logp, target, reduction="sum") / target.numel()
        kl = F.kl_div(logp, target, reduction="batchmean")
        return kl * (t * t) if kind == "kl_t2" else kl

    return loss_fn


def distill(
    model: nn.Module,
    x: Tensor,
    teacher: Tensor,
    *,
    epochs: int,
    batch_size: int,
    lr: float,
    temperature: float,
    kind: str = "kl",
    momentum: float = 0.0,
    weight_decay: float = 0.0,
    optim: LocalOptim = PLAIN_SGD,
) -> float:
    """Train ``model`` in place to match ``teacher`` probabilities on ``x`` (the one SGD loop;
    ``optim``: a client's round optimiser, ``RoundContext.optim``)."""
    return local_sgd(
        model,
        x,
        teacher,
        epochs=epochs,
        batch_size=batch_size,
        lr=lr,
        momentum=momentum,
        weight_decay=weight_decay,
        loss_fn=kd_loss(temperature, kind),
        optim=optim,
    )


def mix(c: Tensor, soft: Tensor) -> Tensor:
    """Teachers ``T[n] = sum_m c[m, n] soft[m]`` for ``c [M, N]``, ``soft [M, B, C]``."""
    return torch.einsum("mn,mbk->nbk", c.to(soft.dtype), soft)


def project_simplex(v: Tensor) -> Tensor:
    """Euclidean projection of every column of ``v`` onto the probability simplex
    ``{x >= 0, sum(x) = 1}``: the sort-based algorithm of Held et al. (1974) / Duchi et al.
    (2008)."""
    n = v.shape[0]
    u, _ = torch.sort(v, dim=0, descending=True)
    css = u.cumsum(0) - 1.0
    k = torch.arange(1, n + 1, dtype=v.dtype, device=v.device).view(-1, *([1] * (v.dim() - 1)))
    cond = (u - css / k) > 0
    rho = cond.to(v.dtype).cumsum(0).argmax(0, keepdim=True)  # last index where cond holds
    theta = css.gather(0, rho) / (rho + 1).to(v.dtype)
    return (v - theta).clamp_min(0)


def cosine_matrix(soft: Tensor) -> Tensor:
    """Cosine similarity between the flattened soft-prediction matrices ``soft [M, B, C]``."""
    flat = soft.reshape(soft.shape[0], -1).double()
    flat = flat / flat.norm(dim=1, keepdim=True).clamp_min(1e-12)
    cos: Tensor = flat @ flat.T
    return cos


def round_indices(
    seed: int, rnd: int, pool: int, size: int, device: torch.device | None = None
) -> Tensor:
    """The public subset of round ``rnd``: ``size`` of ``pool`` indices without replacement,
    a pure function of (seed, round), so every algorithm sees the same subsets."""
    rng = np.random.default_rng([seed, rnd, 0x9B])
    return torch.from_numpy(np.sort(rng.choice(pool, size, replace=False))).to(device)


class DistillParams(BaseModel):
    """Distillation settings shared by every KD algorithm (specs/ktpfl.md §3-4: "these apply
    to all methods"); :func:`distill_configured` applies them."""

    temperature: float = param(
        1.0, "KT-pFL code: baseline engines and the Table-1 config *_20models_T1 (T)", gt=0
    )
    distill_epochs: int = param(1, "KT-pFL §4 (R = 1)", gt=0)
    distill_lr: float | None = param(None, "KT-pFL §4 (eta_2 = eta_1; None: train.lr)", gt=0)
    distill_batch_size: int = param(256, "KT-pFL code", gt=0)
    kd_loss: Literal["kl", "kl_t2", "kl_mean"] = param(
        "kl", "KT-pFL eq. 6 (no T^2); kl_t2: Hinton et al. 2015; kl_mean: authors' code"
    )


class SoftTeacherKD(Algorithm):
    """Clients share soft predictions on the public set; the server mixes them into one
    teacher per client with a matrix ``c``; clients distil (module docstring)."""

    default_order: str = "train_then_distill"
    payload = SharePayload | DistillPayload
    upload: ClassVar[object] = ShareUpload | Empty
    state = KDState
    server: ClassVar[object] = KDServer

    class Params(Algorithm.Params, DistillParams):
        order: Literal["train_then_distill", "distill_then_train"] | None = param(
            None, "the algorithm's paper (None: its default order)"
        )
        local_epoch_schedule: Literal["fixed", "ramp"] = param("fixed", "paper; ramp: KT-pFL code")
        public_per_round: int | None = param(None, "paper (None: the whole public set)", gt=0)

    params: Params

    @property
    def order(self) -> str:
        return self.params.order or self.default_order

    def check(self, env: ServerEnv) -> None:
        require_public(env, self.name, self.params.public_per_round)

    # -- round structure -------------------------------------------------------------------------
    def phases(self, rnd: int) -> tuple[str, str]:
        return ("share", "distill")

    def local_epochs(self, env: ClientEnv, rnd: int) -> int:
        e = env.run.train.local_epochs
        return min(rnd, e) if self.params.local_epoch_schedule == "ramp" else e

    # -- state -------------------------------------------------------------------------------------
    def server_init(self, env: ServerEnv) -> KDServer:
        n = env.num_clients
        return {"c": torch.full((n, n), 1.0 / n, dtype=torch.float64, device=env.device)}

    def client_init(self, env: ClientEnv) -> KDState:
        return {"weights": env.init_weights()}

    # -- one exchange ------------------------------------------------------------------------------
    def configure(self, env: ServerEnv, server: State, cid: int, ctx: ServerContext) -> Payload:
        if ctx.phase == "share":
            idx = public_indices(env, ctx.round, self.params.public_per_round)
            return {} if idx is None else {"public_idx": idx}
        teachers = server["teachers"]
        if cid not in teachers:  # a held-out client (data.holdout_clients): no column of c
            return {"teacher": server["soft"].mean(0)}  # the round's uniform consensus
        return {"teacher": teachers[cid].clone()}

    def _train_private(self, env: ClientEnv, model: nn.Module, ctx: RoundContext) -> float:
        return env.train(model, ctx, epochs=self.local_epochs(env, ctx.round))

    def client_update(
        self,
        env: ClientEnv,
        payload: SharePayload | DistillPayload,
        state: KDState,
        ctx: RoundContext,
    ) -> Update:
        model = env.model()
        set_weights(model, state["weights"])
        metrics: dict[str, float] = {}
        new_state: dict[str, Any] = dict(state)
        if ctx.phase == "share":
            new_state["public_idx"] = payload.get("public_idx")
            if self.order == "train_then_distill":
                metrics["train_loss"] = self._train_private(env, model, ctx)
            x = public_subset(env, new_state.get("public_idx"))
            upload: Mapping[str, object] = {
                "soft": soft_predictions(model, x, self.params.temperature),
                "num_samples": env.num_train,
            }
        else:
            x = public_subset(env, state.get("public_idx"))
            teacher = cast(DistillPayload, payload)["teacher"]  # phase distill
            metrics["distill_loss"] = distill_configured(
                env.run.train, self.params, model, x, teacher, ctx.optim
            )
            if self.order == "distill_then_train":
                metrics["train_loss"] = self._train_private(env, model, ctx)
            upload = self.distill_upload(model, x)
        if new_state.get("public_idx") is None:
            new_state.pop("public_idx", None)
        new_state["weights"] = get_weights(model)
        return Update(upload, new_state, metrics)

    def distill_upload(self, model: nn.Module, x: Tensor) -> Mapping[str, object]:
        """What a client sends after distilling (nothing, unless KT-pFL re-uploads)."""
        return {}

    def aggregate(
        self,
        env: ServerEnv,
        server: State,
        uploads: Mapping[int, Mapping[str, Any]],
        ctx: ServerContext,
    ) -> State:
        """Phase share: the teachers from the uploads' soft predictions (ShareUpload);
        phase distill: :meth:`after_distill` with what the clients upload after distilling
        (:meth:`distill_upload`'s record)."""
        server = dict(server)
        active = sorted(uploads)
        if ctx.phase == "share":
            shared = cast(Mapping[int, ShareUpload], uploads)  # phase share
            server["soft"] = torch.stack([shared[c]["soft"] for c in active])
            server["active"] = torch.tensor(active, device=env.device)
            server["num_samples"] = torch.tensor(
                [float(shared[c]["num_samples"]) for c in active],
                dtype=torch.float64,
                device=env.device,
            )
            server = self.before_mix(server, ctx.round)
            weights = self.mixing_weights(server)  # [A, A], columns on the simplex
            teachers = mix(weights, server["soft"])
            server["teachers"] = {c: teachers[i] for i, c in enumerate(active)}
        else:
            server = self.after_distill(server, uploads, ctx.round)
        return server

    # -- hooks for the subclasses -------------------------------------------------------------------
    def mixing_weights(self, server: State) -> Tensor:
        """``[A, A]`` teacher weights among this round's clients (``server["active"]``);
        column ``j`` is student ``active[j]``. Default: the stored ``c``, restricted to the
        round's clients and renormalised per column."""
        return restrict(server["c"], server["active"])

    def before_mix(self, server: State, rnd: int) -> State:
        return server

    def after_distill(
        self, server: State, uploads: Mapping[int, Mapping[str, Any]], rnd: int
    ) -> State:
        return server

    # -- evaluation ---------------------------------------------------------------------------------
    def personal_model(
        self,
        env: ClientEnv,
        view: Payload,
        state: State,
        ctx: RoundContext,
        upload: Upload | None = None,
    ) -> nn.Module:
        """The client's own model (every client keeps its own, possibly unique, architecture;
        the server holds no model, so ``eval_view`` is empty)."""
        return load_model(env, state["weights"])


def restrict(c: Tensor, active: Tensor) -> Tensor:
    """``c[active][:, active]`` with every column renormalised to sum to 1."""
    sub = c[active][:, active]
    mass = sub.sum(0, keepdim=True)
    return torch.where(mass > 0, sub / mass.clamp_min(1e-300), 1.0 / len(active))


def public_indices(env: ServerEnv, rnd: int, per_round: int | None) -> Tensor | None:
    """The public subset of round ``rnd`` (None: the whole public set)."""
    if per_round is None:
        return None
    pool = len(given(env.public_x, "public_x"))  # check: require_public
    return round_indices(env.run.seed, rnd, pool, per_round, env.device)


def public_subset(env: ClientEnv, idx: Tensor | None) -> Tensor:
    """The public samples ``idx`` (None: all of them)."""
    x = given(env.public_x, "public_x")  # check: require_public
    return x if idx is None else x[idx]


def distill_configured(
    t: TrainConfig,
    p: DistillParams,
    model: nn.Module,
    x: Tensor,
    teacher: Tensor,
    optim: LocalOptim = PLAIN_SGD,
) -> float:
    """:func:`distill` with an algorithm's distillation parameters (``distill_epochs``,
    ``distill_batch_size``, ``distill_lr``, ``temperature``, ``kd_loss``) and the run's
    optimiser settings ``t`` (learning rate by default, momentum, weight decay); ``optim``: a
    client's round optimiser (``RoundContext.optim``), plain SGD on the server."""
    return distill(
        model,
        x,
        teacher,
        epochs=p.distill_epochs,
        batch_size=p.distill_batch_size,
        lr=p.distill_lr or t.lr,
        temperature=p.temperature,
        kind=p.kd_loss,
        momentum=t.momentum,
        weight_decay=t.weight_decay,
        optim=optim,
    )
