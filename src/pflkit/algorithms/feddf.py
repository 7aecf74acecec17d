"""FedDF: Lin, Kong, Stich, Jaggi, "Ensemble Distillation for Robust Model Fusion in Federated
Learning", NeurIPS 2020 (Alg. 1 and 3, §4.1); and pFedDF, its personalised variant in KT-pFL's
Table 1 (specs/ktpfl.md §5, §9).

**FedDF.** Shared: model weights, both ways (each client its architecture's prototype). The
server keeps one prototype per architecture and no client data. Client ``n`` downloads its
architecture's prototype, trains ``E`` epochs on its private data and uploads the weights and
``D_n``. The server (Alg. 3, line 11 onwards):

1. averages the uploads of each architecture group, ``x_g = sum_{k in g} (D_k / D_g) x_k``
   (``weighting: samples``, Alg. 1; ``uniform``: plain mean);
2. forms the teacher from the uploads of *all* clients, whatever their architecture:
   ``p(x) = softmax(mean_k f_k(x) / T)`` on the public set (FedDF's averaged logits);
3. distils ``p`` into each group average, starting from it: minimise
   ``KL(p(x) || softmax(f_g(x) / T))`` (``kd_loss``, see :mod:`pflkit.algorithms.blocks.distill`);
   the result is the group's new prototype.

Step 3, ``server_distill``:

- ``"feddf"`` (default, FedDF §4.1): Adam, learning rate ``server_lr`` = 1e-3 with cosine
  annealing over ``server_steps`` = 10^4 update steps (§4.1: "total 1e4 update steps"),
  mini-batches of ``server_batch_size`` = 128 public samples (§4.1, footnote 6), and early
  stopping: every ``eval_every`` = 100 steps (the authors' code, ``eval_batches_freq``) the
  KL between teacher and student on a held-out part of the public set is measured, distillation
  stops once it has not improved for ``patience`` = 1000 steps (§4.1: "plateaus for 1e3 steps"),
  and the student at the best check is kept (the authors' code returns the best model on its
  validation data). The held-out part is the last ``ceil(holdout_fraction * |public|)``
  public samples (``holdout_fraction`` = 0.1, not stated: FedDF validates on a labelled
  validation split, which a label-free public set does not have; the public set is itself a
  random draw, so its last samples are a random subset); the student trains on the others.
  The server records, per architecture, the steps run, the best step and the held-out KL
  there in its state (``fusion``).
- ``"one_epoch"``: ``distill_epochs`` (R = 1) epochs of SGD over the whole public set at
  ``distill_lr`` (default ``train.lr``) in batches of ``distill_batch_size`` = 256, no
  held-out part and no early stopping: KT-pFL's shared setting read literally for FedDF (its §5:
  "for all the methods ... batch size on public data 256 ... distillation steps 1"). KT-pFL's
  code has no FedDF (specs/ktpfl.md §9), so nothing there says how its FedDF baseline
  distilled. This was pflkit's FedDF before the ``feddf`` default: 2 to 12 steps a round for
  500 to 3000 public samples, far less than FedDF's.

Each client is scored with its architecture's prototype (a global model, not personalised).
Defaults: ``temperature`` T = 1 (FedDF's code: ``KL_temperature = 1``; the same T as the other
distillation methods) and ``kd_loss: kl``. Deviations: no data augmentation of the public set
(FedDF uses random crops), the stopping criterion is the held-out KL, not accuracy on labelled
validation data, and the student's teacher is the plain mean of the logits (FedDF's code
default ``avg_losses`` averages the KL to each teacher instead).

**pFedDF** (KT-pFL's personalised FedDF): FedDF's training; to evaluate, each client starts from
the last fused prototype of its architecture and fine-tunes it on its private data for
``ft_epochs`` (default: ``train.local_epochs``) at ``train.lr``. As FedAvg-FT, fine-tuning never
feeds back into training.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Literal, TypedDict

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
    load_model,
    param,
    register,
    train_from,
    weighted_average,
)
from pflkit.algorithms.blocks.distill import (
    DistillParams,
    distill_configured,
    kd_loss,
    require_public,
)
from pflkit.algorithms.env import ClientEnv, ServerEnv, given
from pflkit.algorithms.records import Empty, WeightsPayload, WeightsUpload
from pflkit.errors import PflkitError
from pflkit.primitives.training import Weights, get_weights, predict, set_weights


class FedDFServer(TypedDict):
    """One global model per architecture, and each architecture's last fusion diagnostics."""

    protos: dict[str, Weights]
    fusion: dict[str, dict[str, float]]


def holdout_size(n: int, fraction: float) -> int:
    """How many of ``n`` public samples FedDF holds out for early stopping."""
    return math.ceil(fraction * n)


def heldout_kl(model: nn.Module, x: Tensor, teacher: Tensor, temperature: float) -> float:
    """Mean over samples of ``KL(teacher || softmax(model(x) / T))``, eval mode."""
    logq = F.log_softmax(predict(model, x).float() / temperature, dim=1)
    return float(F.kl_div(logq, teacher, reduction="batchmean"))


def ensemble_distill(
    model: nn.Module,
    x: Tensor,
    teacher: Tensor,
    x_val: Tensor,
    teacher_val: Tensor,
    *,
    steps: int,
    batch_size: int,
    lr: float,
    temperature: float,
    kind: str = "kl",
    eval_every: int = 100,
    patience: int = 1000,
) -> dict[str, float]:
    """FedDF's server distillation (§4.1): Adam at ``lr`` with cosine annealing over ``steps``
    mini-batch steps on ``(x, teacher)``; every ``eval_every`` steps (and at the last one) the
    KL to ``teacher_val`` on ``x_val`` is measured; it stops once that has not improved for
    ``patience`` steps and loads the student of the best check into ``model``. Returns the
    steps run, the best step and the held-out KL there."""
    model.train()
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=steps)
    loss_fn = kd_loss(temperature, kind)
    n = len(x)
    best, best_step, best_weights = math.inf, 0, get_weights(model)
    done = 0
    while done < steps:
        # drawn on the CPU whatever the device, so a seed gives the same batches everywhere
        perm = torch.randperm(n, device="cpu").to(x.device)
        for i in range(0, n, batch_size):
            idx = perm[i : i + batch_size]
            opt.zero_grad(set_to_none=True)
            loss_fn(model, x[idx], teacher[idx]).backward()
            opt.step()
            sched.step()
            done += 1
            if done % eval_every == 0 or done == steps:
                kl = heldout_kl(model, x_val, teacher_val, temperature)
                model.train()
                if kl < best:
                    best, best_step, best_weights = kl, done, get_weights(model)
                elif done - best_step >= patience:
                    steps = done  # early stop
            if done == steps:
                break
    set_weights(model, best_weights)
    return {"steps": done, "best_step": best_step, "heldout_kl": best}


@register
class FedDF(Algorithm):
    name = "feddf"
    sample_dp_covered = True  # DP-SGD covers it (pflkit.privacy.dpsgd)
    release = {"weights": "weights"}
    uses_each_upload = "distils the ensemble of the clients' models on the public set"
    description = (
        "FedDF (Lin et al. 2020): FedAvg within each architecture group, then server-side "
        "ensemble distillation of all client models into each prototype on a public set"
    )
    payload = WeightsPayload
    upload = WeightsUpload
    state = Empty
    server = FedDFServer

    class Params(Algorithm.Params, DistillParams):
        weighting: Weighting = param(
            "samples", "paper (Alg. 1: n_k-weighted average within each group)"
        )
        server_distill: Literal["feddf", "one_epoch"] = param(
            "feddf", "FedDF §4.1 (Adam, early stopping); one_epoch: KT-pFL §5's R = 1 setting"
        )
        server_lr: float = param(1e-3, "FedDF §4.1 (Adam, cosine annealing)", gt=0)
        server_steps: int = param(10_000, "FedDF §4.1 (total 1e4 update steps)", gt=0)
        server_batch_size: int = param(128, "FedDF §4.1, footnote 6", gt=0)
        patience: int = param(1000, "FedDF §4.1 (stop after a 1e3-step plateau)", gt=0)
        eval_every: int = param(100, "FedDF authors' code (eval_batches_freq)", gt=0)
        holdout_fraction: float = param(
            0.1, "not stated (FedDF validates on labelled data)", gt=0, lt=1
        )

    params: Params

    def check(self, env: ServerEnv) -> None:
        require_public(env, self.name)
        p = self.params
        n = len(given(env.public_x, "public_x"))  # require_public: there is one
        if p.server_distill == "feddf" and n - holdout_size(n, p.holdout_fraction) < 1:
            raise PflkitError(
                f"algorithm '{self.name}': holdout_fraction {p.holdout_fraction} leaves none "
                f"of the {n} public samples to distil on: lower it or raise data.public.size"
            )

    def server_init(self, env: ServerEnv) -> FedDFServer:
        protos = {a: env.init_weights(a) for a in sorted(set(env.archs))}
        return {"protos": protos, "fusion": {}}

    def configure(self, env: ServerEnv, server: State, cid: int, ctx: ServerContext) -> Payload:
        return {"weights": server["protos"][env.arch(cid)]}

    def client_update(
        self, env: ClientEnv, payload: WeightsPayload, state: Empty, ctx: RoundContext
    ) -> Update:
        weights, loss = train_from(env, payload["weights"], ctx)
        upload = {"weights": weights, "num_samples": env.num_train}
        return Update(upload, state, {"train_loss": loss})

    def ensemble_teacher(
        self, env: ServerEnv, uploads: Mapping[int, WeightsUpload]
    ) -> torch.Tensor:
        """``softmax(mean_m f_m(x_pub) / T)`` over every uploaded client model."""
        x = given(env.public_x, "public_x")  # check: require_public
        logits = None
        for cid, up in uploads.items():
            model = env.model(env.arch(cid), slot="feddf_teacher")
            set_weights(model, up["weights"])
            z = predict(model, x, 1000).double()
            logits = z if logits is None else logits + z
        assert logits is not None
        return torch.softmax(logits / len(uploads) / self.params.temperature, dim=1).float()

    def fuse(self, env: ServerEnv, model: nn.Module, teacher: Tensor) -> dict[str, float] | None:
        """Distil ``teacher`` (on the whole public set) into ``model`` in place
        (``server_distill``); FedDF's diagnostics, or None for ``one_epoch``."""
        p, x = self.params, given(env.public_x, "public_x")  # check: require_public
        if p.server_distill == "one_epoch":
            distill_configured(env.run.train, p, model, x, teacher)
            return None
        cut = len(x) - holdout_size(len(x), p.holdout_fraction)
        return ensemble_distill(
            model,
            x[:cut],
            teacher[:cut],
            x[cut:],
            teacher[cut:],
            steps=p.server_steps,
            batch_size=p.server_batch_size,
            lr=p.server_lr,
            temperature=p.temperature,
            kind=p.kd_loss,
            eval_every=p.eval_every,
            patience=p.patience,
        )

    def aggregate(
        self,
        env: ServerEnv,
        server: State,
        uploads: Mapping[int, WeightsUpload],
        ctx: ServerContext,
    ) -> State:
        teacher = self.ensemble_teacher(env, uploads)  # all clients, every architecture
        protos = dict(server["protos"])
        fusion: dict[str, dict[str, float]] = {}
        for arch in sorted(set(env.archs)):
            group = {c: u for c, u in uploads.items() if env.arch(c) == arch}
            if not group:
                continue
            model = env.model(arch, slot="feddf_student")
            set_weights(model, weighted_average(group, uniform=self.params.weighting == "uniform"))
            info = self.fuse(env, model, teacher)
            if info is not None:
                fusion[arch] = info
            protos[arch] = get_weights(model)
        return {**server, "protos": protos, "fusion": fusion}

    def eval_view(
        self, env: ServerEnv, server: State, cid: int | None, ctx: ServerContext
    ) -> Payload:
        """The client's architecture's prototype; with ``cid`` None the global architecture's,
        when every client shares it (else there is no single global model)."""
        if cid is not None:
            return {"proto": server["protos"][env.arch(cid)]}
        if set(env.archs) == {env.global_arch}:
            return {"weights": server["protos"][env.global_arch]}
        return {}

    def personal_model(
        self,
        env: ClientEnv,
        view: Payload,
        state: State,
        ctx: RoundContext,
        upload: Upload | None = None,
    ) -> nn.Module:
        return load_model(env, view["proto"])  # its architecture's prototype


@register
class PFedDF(FedDF):
    name = "pfeddf"
    description = (
        "pFedDF (KT-pFL's personalised FedDF): FedDF, then each client fine-tunes its "
        "architecture's fused prototype on its private data before evaluation"
    )

    class Params(FedDF.Params):
        ft_epochs: int | None = param(
            None, "pflkit (None: train.local_epochs); KT-pFL: 'several epochs'", gt=0
        )

    params: Params

    def personal_model(
        self,
        env: ClientEnv,
        view: Payload,
        state: State,
        ctx: RoundContext,
        upload: Upload | None = None,
    ) -> nn.Module:
        epochs = self.params.ft_epochs or env.run.train.local_epochs
        weights, _ = train_from(env, view["proto"], ctx, epochs=epochs)
        return load_model(env, weights)
