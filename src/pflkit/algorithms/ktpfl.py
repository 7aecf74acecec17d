"""KT-pFL: Zhang, Guo, Ma, Wang, Xu, Wu, "Parameterized Knowledge Transfer for Personalized
Federated Learning", NeurIPS 2021 (specs/ktpfl.md).

**Shared**: soft predictions ``S_n = softmax(f_n(x_pub) / T)`` on the public set (``B x C``
floats up) and one personalised teacher per client (``B x C`` floats down). **Private**: each
client's model, of any architecture (client state ``weights``). **Server**: the knowledge-
coefficient matrix ``c`` (``N x N``, server state ``c``; ``c[m, n]`` is client ``m``'s weight in
client ``n``'s teacher: column ``n`` belongs to student ``n``, as in the paper's eqs. 2 and 7),
the latest uploads ``S_m`` and ``D_m``. The server holds no model.

One round, paper order (Alg. 1, Fig. 1; ``order="train_then_distill"``; phases of
:class:`~pflkit.algorithms.blocks.distill.SoftTeacherKD`):

1. phase ``share``: client ``n`` trains ``E`` epochs on its private data (eq. 5, cross-entropy,
   ``train.lr`` = eta_1) and uploads ``S_n`` (and ``D_n``);
2. the server forms ``S_hat_n = sum_m c[m, n] S_m`` (eq. 2's teacher);
3. phase ``distill``: client ``n`` downloads ``S_hat_n`` and distils ``R`` epochs on the public
   set, minimising ``KL(S_hat_n || s(w_n))`` with the teacher held constant (eq. 6);
4. the server updates ``c`` with the models frozen (eq. 7) and applies it next round.

Coefficient update (``coef_update``):

- ``"paper"`` (default): ``coef_steps`` gradient steps on
  ``J(c) = lam * sum_n (D_n / D) * KL_n(c) + rho * ||c - 1/N||_F^2`` with
  ``KL_n(c) = KL(sum_m c[m, n] S_m(x) || S_n(x))`` over the round's public samples (eqs. 4, 7),
  step ``coef_lr`` = eta_3, each step followed by projecting every column onto the probability
  simplex (the paper states no constraint; KL needs valid mixtures; §8.2, §10).
  ``coef_kl: mean`` (default) averages ``KL_n`` over the public samples (eq. 7 writes it on a
  mini-batch ``xi_r`` with no reduction; specs/ktpfl.md §10's reading); ``coef_kl: sum`` sums
  it as eq. 2 writes it, which multiplies the KL part by ``B = |xi_r|``.
- ``"official"``: the authors' code: per student, loss ``MSE(S_n, sum_m c[m, n] S_m) +
  rho * MSE(c[:, n], 1/N)``, one step with the code's normalised step size (start at 1, divide or
  multiply by 5, five times, so that mean|grad| * step lands near [0.01, 0.05]), then
  ``c[:, n] = softmax(5 * c[:, n])``, stored post-softmax (§9).
- ``"fixed"``: ``c`` never changes (not in the paper: an ablation). With ``c_init: uniform``
  every teacher is the plain mean of all clients' predictions (learned ``c`` against none);
  with ``c_init: identity`` every teacher is the student's own predictions (self-only).

How ``c`` behaves: the self term ``m = n`` is part of every teacher, so the KL part alone is
minimised by ``c = I`` (self-teaching, §8.4) and only ``rho`` holds ``c`` back; where ``c``
settles depends on ``lam * KL / rho``, i.e. on the reduction (``sum`` scales the KL part by
``B``), on T and on N. docs/ktpfl.md ("The knowledge coefficients") has the measurements behind
the defaults ``coef_kl: mean`` and ``coef_steps: 20`` per round (the paper does not say how many
steps eq. 7 stands for) and the advice on ``lam`` at T > 1. The server records the mean
diagonal (self) mass of ``c`` after every update in its state, ``c_self_mass`` (one number per
round): a value near 1 means self-teaching (collapse), near ``1 / N`` uniform mixing (FedMD).

When ``c`` is updated (``coef_timing``): ``"after_distill_reuse_uploads"`` (default: eq. 7 after
distillation, evaluated with the uploads of step 1, so no second upload),
``"after_distill_reupload"`` (clients upload fresh predictions after distilling: eq. 7's
``w*`` literally, twice the upload traffic), ``"before_mix"`` (the code: update ``c`` from this
round's uploads, then mix). The authors' code order is ``order: distill_then_train,
coef_timing: before_mix, coef_update: official, local_epoch_schedule: ramp`` (distil, then train
privately; local epochs 1, 2, ..., E) with ``kd_loss: kl_mean`` and ``temperature: 10``.

Defaults (specs/ktpfl.md §3, §10): T = 1 (not in the paper; the code's Table-1 config
``*_20models_T1`` and its baseline engines; 10 in ``*_T10`` and the sweeps), ``kd_loss: kl``
(eq. 6, no ``T^2``), rho = 0.7 (code; inferred for the paper), lam = 1 (not stated), eta_3 =
0.01 (hyper-parameter study), ``coef_steps`` = 20 and ``coef_kl: mean`` (above), R = 1, public
batch 256, eta_2 = eta_1 = ``train.lr``, ``c_0`` uniform. Set E (``train.local_epochs``, paper
20), the private batch (``train.batch_size``, paper 128), eta_1 (``train.lr``, paper 0.01 /
0.02 for CIFAR-10) and ``|D_r|`` (``data.public.size``, paper 3000) in the config.

Partial participation (unspecified in the paper, §8.14): the teachers mix only the round's
clients, each column renormalised over them, and only the sub-block ``c[S_t, S_t]`` is updated
(each column keeping its mass on ``S_t``).

Deviations: ``c`` is kept on the simplex (projection); ``coef_steps = 20`` steps on ``c`` per
round (Alg. 1: "update c via (7)"); the distillation loss is eq. 6's KL per sample, averaged
over the mini-batch (``kd_loss``, see :mod:`pflkit.algorithms.blocks.distill`; the code also
divides by the number of classes: ``kd_loss: kl_mean``); no public-data pre-training and no
1-epoch "initialisation" pass (the code's ``pretrain``).

**ktpfl_homo** (Table 2's homogeneous variant; App. C is missing, so this is an inferred
design, §2.5): all clients share one architecture and exchange parameters. The server keeps one
personalised model per client ``w_bar_n = sum_m c[m, n] w_m`` (floating-point entries; integer
buffers from client ``n``), client ``n`` downloads ``w_bar_n``, trains ``E`` epochs and uploads
its weights and its soft predictions on the public set; ``c`` is learned from those predictions
exactly as above (the KT-pFL objective), after the mix, and ``c_self_mass`` is recorded the
same way. Clients are scored with their model after local training.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal, NotRequired, TypedDict

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
    load_model,
    param,
    register,
)
from pflkit.algorithms.blocks.distill import (
    KDServer,
    ShareUpload,
    SoftTeacherKD,
    project_simplex,
    public_indices,
    public_subset,
    require_public,
    restrict,
    soft_predictions,
)
from pflkit.algorithms.blocks.split import require_homogeneous
from pflkit.algorithms.env import ClientEnv, ServerEnv
from pflkit.algorithms.records import Empty, WeightsUpload
from pflkit.primitives.training import Weights, get_weights, set_weights
from pflkit.primitives.tree import weighted_sum


class KTpFLReupload(TypedDict):
    """Phase ``distill`` with ``coef_timing: after_distill_reupload``: soft predictions again."""

    soft: Tensor


class KTpFLServer(KDServer):
    """SoftTeacherKD's server state and the self mass of c after each of its updates."""

    c_self_mass: list[float]


class KTpFLHomoPayload(TypedDict):
    """The client's personalised mix (or w^0), and the round's public subset."""

    weights: Weights
    public_idx: NotRequired[Tensor]


class KTpFLHomoUpload(WeightsUpload):
    """The trained model and its soft predictions on the public subset."""

    soft: Tensor


class KTpFLHomoState(TypedDict):
    """The client's model after its last local training."""

    weights: NotRequired[Weights]


class KTpFLHomoServer(TypedDict):
    """c, w^0, each client's personalised mix and the self mass of c after each update."""

    c: Tensor
    weights: Weights
    personal: dict[int, Weights]
    c_self_mass: list[float]


EPS = 1e-12


# -- the coefficient update (eq. 7) ---------------------------------------------------------------


def coef_objective(
    c: Tensor, soft: Tensor, weights: Tensor, lam: float, rho: float, reduction: str = "sum"
) -> Tensor:
    """``lam * sum_n weights[n] * sum_x KL(sum_m c[m, n] soft[m, x] || soft[n, x])
    + rho * ||c - 1/N||_F^2`` for ``c [N, N]``, ``soft [N, B, C]``, ``weights [N]`` (eqs. 2, 4;
    ``reduction="mean"`` averages over the ``B`` public samples instead of summing)."""
    n = c.shape[0]
    s = soft.to(c.dtype)
    p = torch.einsum("mn,mbk->nbk", c, s)
    kl = (p * (p.clamp_min(EPS).log() - s.clamp_min(EPS).log())).sum(-1)  # [N, B]
    kl = kl.mean(-1) if reduction == "mean" else kl.sum(-1)
    return lam * (weights.to(c.dtype) * kl).sum() + rho * (c - 1.0 / n).pow(2).sum()


def coef_step_paper(
    c: Tensor,
    soft: Tensor,
    weights: Tensor,
    *,
    lam: float,
    rho: float,
    lr: float,
    steps: int = 1,
    reduction: str = "sum",
) -> Tensor:
    """Eq. 7: ``steps`` gradient steps on :func:`coef_objective` with step ``lr``, each followed
    by projecting every column onto the probability simplex. Returns the new ``c``."""
    x = c.detach().double()
    for _ in range(steps):
        xg = x.clone().requires_grad_(True)
        loss = coef_objective(xg, soft, weights, lam, rho, reduction)
        (grad,) = torch.autograd.grad(loss, xg)
        x = project_simplex(x - lr * grad)
    return x


def coef_step_official(c: Tensor, soft: Tensor, *, rho: float) -> Tensor:
    """The KT-pFL code's update (``engine_kt_pfl.get_models_logits``), column = student:
    MSE surrogate + rho * MSE to uniform, normalised step, per-column softmax(5 c)."""
    x = c.detach().double().clone()
    n = x.shape[0]
    s = soft.double()
    uniform = torch.full((n,), 1.0 / n, dtype=torch.float64, device=c.device)
    for j in range(n):
        col = x[:, j].clone().requires_grad_(True)
        teacher = torch.einsum("m,mbk->bk", col, s)
        loss = F.mse_loss(s[j], teacher) + rho * F.mse_loss(col, uniform)
        (g,) = torch.autograd.grad(loss, col)
        avg, step = float(g.abs().sum()) / n, 1.0
        for _ in range(5):  # the code's loop, both tests in every pass
            if avg > 0.01:
                avg, step = avg / 5, step / 5
            if avg < 0.01:
                avg, step = avg * 5, step * 5
        x[:, j] = x[:, j] - step * g
    return torch.softmax(5.0 * x, dim=0)


class CoefParams(BaseModel):
    """The knowledge-coefficient hyper-parameters (KT-pFL and its homogeneous variant)."""

    rho: float = param(0.7, "authors' code (penalty_ratio, conf/*_10models_T10_*.json)", ge=0)
    lam: float = param(1.0, "pflkit (weight of the KD term, eqs. 4, 7; paper: not stated)", ge=0)
    coef_lr: float = param(0.01, "paper §5.2.2 (Table 3: eta_1 = eta_2 = eta_3 = 0.01)", gt=0)
    coef_steps: int = param(
        20, "pflkit: 20 so that c moves (module docstring); paper: not stated", gt=0
    )
    coef_update: Literal["paper", "official", "fixed"] = param(
        "paper", "paper (eq. 7); official: code; fixed: c stays c_0 (an ablation, no paper)"
    )
    c_init: Literal["uniform", "identity"] = param(
        "uniform", "authors' code (c_0 = 1/N; paper: not stated); identity: self-only (ablation)"
    )
    coef_kl: Literal["mean", "sum"] = param(
        "mean", "pflkit's reading of eq. 7 (specs/ktpfl.md §10); sum: eq. 2 (KL summed over D_r)"
    )


def update_coefficients(
    c: Tensor, active: Tensor, soft: Tensor, num_samples: Tensor, p: CoefParams
) -> Tensor:
    """New ``c`` after one eq.-7 update on the sub-block of the round's clients ``active``
    (``soft [A, B, C]``, ``num_samples [A]``); each column keeps its mass on ``active``."""
    if p.coef_update == "fixed":
        return c
    c = c.clone()
    sub = c[active][:, active]
    mass = sub.sum(0, keepdim=True).clamp_min(1e-300)
    x = sub / mass
    if p.coef_update == "paper":
        w = num_samples.double() / num_samples.double().sum()
        x = coef_step_paper(
            x, soft, w, lam=p.lam, rho=p.rho, lr=p.coef_lr, steps=p.coef_steps, reduction=p.coef_kl
        )
    else:
        x = coef_step_official(x, soft, rho=p.rho)
    c[active.view(-1, 1), active.view(1, -1)] = x * mass
    return c


def initial_c(n: int, p: CoefParams, device: torch.device) -> Tensor:
    """``c_0``: uniform ``1 / N`` (the paper) or the identity (every teacher is the student's own
    predictions), float64 ``[N, N]``."""
    if p.c_init == "identity":
        return torch.eye(n, dtype=torch.float64, device=device)
    return torch.full((n, n), 1.0 / n, dtype=torch.float64, device=device)


def self_mass(c: Tensor) -> float:
    """Mean diagonal of ``c``: the average weight of each client's own predictions in its
    teacher (1: self-teaching, ``1 / N``: uniform mixing)."""
    return float(c.diagonal().mean())


def with_c(server: State, c: Tensor) -> State:
    """``server`` with the new ``c`` and its self mass appended to ``c_self_mass``."""
    return {**server, "c": c, "c_self_mass": [*server.get("c_self_mass", []), self_mass(c)]}


# -- KT-pFL (heterogeneous models, knowledge distillation) -----------------------------------------


@register
class KTpFL(SoftTeacherKD):
    name = "ktpfl"
    sample_dp_covered = True  # DP-SGD covers it (pflkit.privacy.dpsgd)
    secagg_refusal = "its server mixes the clients' individual models and soft predictions"
    release = None
    release_refusal = "its uploads are soft predictions on the public set, for which pflkit defines no clipping yet"
    description = (
        "KT-pFL (Zhang et al. 2021): soft predictions on a public set, learned knowledge-"
        "coefficient matrix c mixes them into per-client teachers; heterogeneous models"
    )
    default_order = "train_then_distill"
    upload = ShareUpload | KTpFLReupload | Empty
    server = KTpFLServer

    class Params(SoftTeacherKD.Params, CoefParams):
        temperature: float = param(
            1.0, "authors' code, Table-1 config *_20models_T1 (paper: not stated; *_T10: 10)", gt=0
        )
        coef_timing: Literal[
            "after_distill_reuse_uploads", "after_distill_reupload", "before_mix"
        ] = param("after_distill_reuse_uploads", "paper (Alg. 1); before_mix: authors' code")

    params: Params

    def server_init(self, env: ServerEnv) -> KTpFLServer:
        c = initial_c(env.num_clients, self.params, env.device)
        return {**super().server_init(env), "c": c, "c_self_mass": []}

    def _update_c(self, server: State, soft: Tensor) -> State:
        c = update_coefficients(
            server["c"], server["active"], soft, server["num_samples"], self.params
        )
        return with_c(server, c)

    def before_mix(self, server: State, rnd: int) -> State:
        if self.params.coef_timing == "before_mix":
            return self._update_c(server, server["soft"])
        return server

    def distill_upload(self, model: nn.Module, x: Tensor) -> KTpFLReupload | Empty:
        if self.params.coef_timing == "after_distill_reupload":
            return {"soft": soft_predictions(model, x, self.params.temperature)}
        return {}

    def after_distill(
        self, server: State, uploads: Mapping[int, Mapping[str, Any]], rnd: int
    ) -> State:
        timing = self.params.coef_timing
        if timing == "before_mix":
            return server
        soft = server["soft"]
        if timing == "after_distill_reupload":
            active = server["active"].tolist()
            soft = torch.stack([uploads[c]["soft"] for c in active])
            server = {**server, "soft": soft}
        return self._update_c(server, soft)


# -- homogeneous KT-pFL (Table 2; inferred design) ---------------------------------------------------


def mix_weights(c_col: Tensor, models: list[Weights], own: Weights) -> Weights:
    """``sum_m c_col[m] * models[m]`` for floating-point entries; integer buffers from ``own``."""
    return weighted_sum(models, c_col.tolist(), own)


@register
class KTpFLHomo(Algorithm):
    name = "ktpfl_homo"
    sample_dp_covered = True  # DP-SGD covers it (pflkit.privacy.dpsgd)
    secagg_refusal = "its server mixes the clients' individual models"
    release = None
    release_refusal = "its uploads are soft predictions on the public set, for which pflkit defines no clipping yet"
    description = (
        "KT-pFL, homogeneous variant (Table 2): the learned matrix c mixes client parameters "
        "into one personalised model per client (inferred design: App. C is missing)"
    )
    payload = KTpFLHomoPayload
    upload = KTpFLHomoUpload
    state = KTpFLHomoState
    server = KTpFLHomoServer

    class Params(Algorithm.Params, CoefParams):
        temperature: float = param(
            1.0, "as ktpfl (T of the soft predictions that drive c; paper: not stated)", gt=0
        )
        public_per_round: int | None = param(None, "paper (None: the whole public set)", gt=0)

    params: Params

    def check(self, env: ServerEnv) -> None:
        require_public(env, self.name, self.params.public_per_round)
        require_homogeneous(env, self.name, "averages parameters", instead="ktpfl")

    def server_init(self, env: ServerEnv) -> KTpFLHomoServer:
        n = env.num_clients
        return {
            "c": initial_c(n, self.params, env.device),
            "weights": env.init_weights(env.arch(0)),
            "personal": {},
            "c_self_mass": [],
        }

    def configure(self, env: ServerEnv, server: State, cid: int, ctx: ServerContext) -> Payload:
        payload: Payload = {"weights": server["personal"].get(cid, server["weights"])}
        idx = public_indices(env, ctx.round, self.params.public_per_round)
        if idx is not None:
            payload["public_idx"] = idx
        return payload

    def client_update(
        self, env: ClientEnv, payload: KTpFLHomoPayload, state: KTpFLHomoState, ctx: RoundContext
    ) -> Update:
        model = env.model()
        set_weights(model, payload["weights"])
        loss = env.train(model, ctx)
        x = public_subset(env, payload.get("public_idx"))
        weights = get_weights(model)
        upload = {
            "weights": weights,
            "soft": soft_predictions(model, x, self.params.temperature),
            "num_samples": env.num_train,
        }
        return Update(upload, {"weights": weights}, {"train_loss": loss})

    def aggregate(
        self,
        env: ServerEnv,
        server: State,
        uploads: Mapping[int, KTpFLHomoUpload],
        ctx: ServerContext,
    ) -> State:
        active_list = sorted(uploads)
        active = torch.tensor(active_list, device=env.device)
        models = [uploads[c]["weights"] for c in active_list]
        mixing = restrict(server["c"], active)
        personal = dict(server["personal"])
        for j, cid in enumerate(active_list):
            personal[cid] = mix_weights(mixing[:, j], models, uploads[cid]["weights"])
        soft = torch.stack([uploads[c]["soft"] for c in active_list])
        num = torch.tensor(
            [float(uploads[c]["num_samples"]) for c in active_list], device=env.device
        )
        c = update_coefficients(server["c"], active, soft, num, self.params)
        return with_c({**server, "personal": personal}, c)

    def eval_view(
        self, env: ServerEnv, server: State, cid: int | None, ctx: ServerContext
    ) -> Payload:
        """The model client ``cid`` would download: its personalised mix, or the initial one
        (no global model: ``cid`` None gives nothing)."""
        if cid is None:
            return {}
        return {"weights": server["personal"].get(cid, server["weights"])}

    def personal_model(
        self,
        env: ClientEnv,
        view: Payload,
        state: KTpFLHomoState,
        ctx: RoundContext,
        upload: KTpFLHomoUpload | None = None,
    ) -> nn.Module:
        # its model after its last local training, or the model it would download
        return load_model(env, state.get("weights", view["weights"]))
