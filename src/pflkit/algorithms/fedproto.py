"""FedProto: Tan, Long, Liu, Zhou, Lu, Jiang & Zhang, "FedProto: Federated Prototype Learning
across Heterogeneous Clients", AAAI 2022 (Algorithm 1; prototypes Eq. 6 and aggregation Eq. 7
in pFedPM's numbering, specs/pfedpm.md §2.1, §9). This module is also the prototype core that
pFedPM (:mod:`pflkit.algorithms.pfedpm`) extends.

**Shared**: class prototypes only. Client i uploads, for every class j it holds, its local
prototype ``C_i^(j)`` (``protos [n_i, d]`` float), the class indices (``classes [n_i]`` int64)
and, for the weighted mean only, ``|D_ij|`` (``counts [n_i]`` int64): ``n_i * d * 4`` bytes plus
8 per class index and count. The server sends back every global prototype it has
(``classes [K]``, ``protos [K, d]``); nothing in round 1, when it has none.
**Private**: each client's whole model, of any architecture whose ``feature_dim`` equals the
others' (client state ``weights``; it starts from the run's common initial model of its
architecture, :func:`~pflkit.algorithms.blocks.split.common_init`) and its last uploaded
prototypes (client state ``protos``). No model is ever averaged
and there is no global model (``eval_view`` gives the server none, no ``global_acc``).

Client i, given the global prototypes ``C_bar`` (the features ``h = model.features(x)``):

- local training: ``train.local_epochs`` epochs of the run's optimiser (``env.train``: lr,
  momentum, batch size come from the config) on ``CE(head(h), y) + lam * L_R``, where ``L_R``
  (``reg``) pulls features toward the prototypes of their labels:

  - ``"class_mean_l2"`` (default, paper: pFedPM Eqs. 9, 11): ``sum_{j in batch, C_bar^(j)
    exists} || mean_{s: y_s = j} h_s - C_bar^(j) ||_2``, the unsquared L2 distance between each
    of the batch's classes' mean feature (the mini-batch estimate of ``C_i^(j)``) and its
    global prototype, differentiable through the mean;
  - ``"sample_mse"`` (FedProto code): ``(1 / (B d)) sum_s ||h_s - C_bar^(y_s)||^2`` over the
    samples whose label has a global prototype; the others add 0 but count in ``B`` (the code
    gives them their own detached feature as target).

  Round 1 (no global prototype yet): ``L_R = 0``, plain cross-entropy. The paper's lam values
  were tuned under the code's ``sample_mse`` (spec §8.3); ``class_mean_l2`` is far stronger
  at the same lam (on the tests' digits MLP, lam = 1 drives most features to zero within a
  few rounds; lam = 0.2 does not).
- local prototypes (Eq. 6), ``proto_timing``: ``"posthoc"`` (default, Eq. 6 exactly): after
  training, ``C_i^(j) = mean of f(x)`` over the client's whole training split, in eval mode;
  ``"running"`` (FedProto code): the mean of the train-mode features of the batches of the last
  local epoch (the code restarts its collection each epoch), taken before each batch's step;
  a class not seen there is not uploaded. The uploaded counts are ``|D_ij|`` either way.

Server (Eq. 7 without the double normalisation, specs/pfedpm.md §2.1, §8.2), per class j over
the round's uploads, ``proto_agg``:

- ``"weighted"`` (default, spec §2.1 A): ``C_bar^(j) = sum_i (|D_ij| / N_j) C_i^(j)``,
  ``N_j = sum_i |D_ij|`` over the round's clients that hold j;
- ``"uniform"`` (FedProto code): ``C_bar^(j) = (1 / |aleph_j|) sum_i C_i^(j)``.

Evaluation (``inference``): ``"head"`` (default; the client's own model's logits, the pFedPM
tables' protocol and the FedProto code's "w/o protos" accuracy) or ``"prototype"`` (FedProto
paper: the class of the nearest global prototype, by L2 distance, among all classes that have
one; ``restrict_to_local_classes: true`` considers only the client's training classes, the
FedProto code's "with protos" accuracy, which inflates accuracy since local test sets hold only
local classes, spec §8.8; ignored by ``head``). The prototypes scored are the server's
latest, sent in the evaluation view. Classes without a prototype score ``-inf`` (never
predicted).

Defaults: ``lam = 1`` (paper: MNIST and FEMNIST; 0.1 for CIFAR-10/ResNet-18); ``reg``,
``proto_timing``, ``proto_agg``, ``inference`` as above. Set the local optimiser in the config:
SGD lr 0.01, momentum 0.5, batch 10 (pFedPM; FedProto's code: batch 4), 1 local epoch.

Deviations: with partial participation (the papers use all clients every round), a class that
no client of the round uploads keeps its previous global prototype, and ``N_j`` counts the
round's clients only. The local optimiser is rebuilt every round (as the FedProto code does;
no momentum is carried over). The code's ``drop_last`` batching is not reproduced (the last
short batch is used).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import ClassVar, Literal, NotRequired, TypedDict, cast

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
    load_model,
    param,
    register,
)
from pflkit.algorithms.blocks.split import common_init
from pflkit.algorithms.env import ClientEnv, ServerEnv
from pflkit.algorithms.records import Empty
from pflkit.errors import PflkitError
from pflkit.models import PFLModel
from pflkit.primitives.training import (
    LossFn,
    Weights,
    get_weights,
    set_weights,
    steps_per_epoch,
)


class Prototypes(TypedDict):
    """Class prototypes: the classes that have one (int64 [K]) and their prototypes [K, d]."""

    classes: Tensor
    protos: Tensor


class FedProtoUpload(Prototypes):
    """The client's prototypes, and their sample counts (``proto_agg: weighted``)."""

    counts: NotRequired[Tensor]


class FedProtoState(TypedDict):
    """The client's model, and its last uploaded prototypes."""

    weights: Weights
    protos: NotRequired[Prototypes]


Reg = Literal["class_mean_l2", "sample_mse"]
ProtoSet = dict[str, Tensor]  # {"classes": int64 [K], "protos": float [K, d]}


# -- prototypes -------------------------------------------------------------------------------------


def class_prototypes(h: Tensor, y: Tensor, num_classes: int) -> tuple[Tensor, Tensor, Tensor]:
    """Eq. 6: ``(classes, prototypes, counts)`` of features ``h [N, d]`` with labels ``y``: for
    every class present (ascending), the mean feature and the number of samples."""
    counts = torch.bincount(y, minlength=num_classes)
    sums = torch.zeros(num_classes, h.shape[1], dtype=h.dtype, device=h.device)
    sums.index_add_(0, y, h)
    classes = torch.nonzero(counts > 0).flatten()
    n = counts[classes]
    return classes, sums[classes] / n.unsqueeze(1).to(h.dtype), n


def aggregate_prototypes(
    uploads: Sequence[FedProtoUpload], num_classes: int, mode: str = "weighted"
) -> ProtoSet:
    """The global prototype of every class in ``uploads`` (each ``classes``, ``protos`` and,
    for ``mode="weighted"``, ``counts``): the ``|D_ij| / N_j``-weighted mean (``"weighted"``)
    or the plain mean over the clients holding the class (``"uniform"``). Accumulates in
    float64; returns the uploads' dtype."""
    first = uploads[0]["protos"]
    d, device = first.shape[1], first.device
    sums = torch.zeros(num_classes, d, dtype=torch.float64, device=device)
    mass = torch.zeros(num_classes, dtype=torch.float64, device=device)
    for u in uploads:
        cls = u["classes"].to(device)
        if mode == "weighted":
            w = u["counts"].to(device=device, dtype=torch.float64)
        else:
            w = torch.ones(len(cls), dtype=torch.float64, device=device)
        sums.index_add_(0, cls, u["protos"].to(device, torch.float64) * w.unsqueeze(1))
        mass.index_add_(0, cls, w)
    classes = torch.nonzero(mass > 0).flatten()
    protos = sums[classes] / mass[classes].unsqueeze(1)
    return {"classes": classes, "protos": protos.to(first.dtype)}


def merge_prototypes(old: ProtoSet | None, new: ProtoSet) -> ProtoSet:
    """``new``, plus the classes of ``old`` that ``new`` lacks (partial participation)."""
    if not old:
        return new
    keep = ~torch.isin(old["classes"], new["classes"])
    classes = torch.cat([new["classes"], old["classes"][keep]])
    protos = torch.cat([new["protos"], old["protos"][keep].to(new["protos"])])
    order = torch.argsort(classes)
    return {"classes": classes[order], "protos": protos[order]}


def proto_table(
    pset: Prototypes | Empty | None, num_classes: int, d: int, device: torch.device
) -> tuple[Tensor, Tensor]:
    """A prototype set as a dense table ``[num_classes, d]`` (zeros where absent) and the
    mask ``[num_classes]`` of the classes it has."""
    table = torch.zeros(num_classes, d, device=device)
    has = torch.zeros(num_classes, dtype=torch.bool, device=device)
    if pset and "classes" in pset and len(pset["classes"]):
        cls = pset["classes"].to(device)
        table[cls] = pset["protos"].to(device=device, dtype=table.dtype)
        has[cls] = True
    return table, has


def to_protoset(table: Tensor, has: Tensor) -> ProtoSet:
    return {"classes": torch.nonzero(has).flatten(), "protos": table[has].clone()}


# -- the regulariser --------------------------------------------------------------------------------


def proto_reg(h: Tensor, y: Tensor, targets: Tensor, has: Tensor, form: str) -> Tensor:
    """``L_R`` of features ``h [B, d]`` with labels ``y`` toward ``targets [C, d]`` (rows with
    ``has`` False are absent): ``"class_mean_l2"``: the sum over the batch's classes with a
    target of ``||batch mean of the class - target||_2``; ``"sample_mse"``: ``sum_s
    ||h_s - target_{y_s}||^2 / (B d)`` over the samples whose label has a target."""
    if form == "sample_mse":
        mask = has[y].to(h.dtype).unsqueeze(1)
        return ((h - targets[y]).pow(2) * mask).sum() / h.numel()
    num_classes = targets.shape[0]
    counts = torch.bincount(y, minlength=num_classes)
    sums = torch.zeros(num_classes, h.shape[1], dtype=h.dtype, device=h.device)
    sums = sums.index_add(0, y, h)
    present = (counts > 0) & has
    means = sums[present] / counts[present].unsqueeze(1).to(h.dtype)
    reg: Tensor = torch.linalg.vector_norm(means - targets[present], dim=1).sum()
    return reg


class RunningMeans:
    """FedProto code's prototypes: per-class sums of the training batches' features, restarted
    at the start of every local epoch (so the last epoch's mean is kept)."""

    def __init__(self, num_classes: int, d: int, device: torch.device, epoch_steps: int):
        self.sums = torch.zeros(num_classes, d, device=device)
        self.counts = torch.zeros(num_classes, dtype=torch.long, device=device)
        self.epoch_steps, self.step = epoch_steps, 0

    def add(self, h: Tensor, y: Tensor) -> None:
        if self.step and self.step % self.epoch_steps == 0:
            self.sums.zero_()
            self.counts.zero_()
        self.step += 1
        self.sums.index_add_(0, y, h.detach().to(self.sums.dtype))
        self.counts += torch.bincount(y, minlength=len(self.counts))

    def prototypes(self) -> tuple[Tensor, Tensor]:
        classes = torch.nonzero(self.counts > 0).flatten()
        return classes, self.sums[classes] / self.counts[classes].unsqueeze(1).to(self.sums)


def prototype_loss(
    targets: Tensor,
    has: Tensor,
    lam: float,
    form: str,
    running: RunningMeans | None = None,
) -> LossFn:
    """``CE(head(h), y) + lam * L_R(h, y)`` (:func:`proto_reg`; no ``L_R`` when no class has a
    target), feeding the features to ``running`` when given."""
    active = bool(has.any()) and lam > 0

    def loss_fn(module: nn.Module, x: Tensor, y: Tensor) -> Tensor:
        model = cast(PFLModel, module)  # the client's PFLModel (env.model)
        h = model.features(x)
        loss = F.cross_entropy(model.head(h), y)
        if running is not None:
            running.add(h, y)
        if active:
            loss = loss + lam * proto_reg(h, y, targets, has, form)
        return loss

    return loss_fn


@torch.no_grad()
def eval_features(model: PFLModel, x: Tensor, batch_size: int = 1000) -> Tensor:
    """``model.features(x)`` in eval mode, in large batches; the model's mode is restored."""
    was = model.training
    model.eval()
    try:
        return torch.cat(
            [model.features(x[i : i + batch_size]) for i in range(0, len(x), batch_size)]
        )
    finally:
        model.train(was)


# -- evaluation -------------------------------------------------------------------------------------


def class_mask(classes: Tensor, num_classes: int, device: torch.device) -> Tensor:
    mask = torch.zeros(num_classes, dtype=torch.bool, device=device)
    mask[classes.to(device)] = True
    return mask


class NearestPrototype(nn.Module):
    """Scores ``-||f(x) - C_bar^(j)||_2`` for the classes with a prototype (``-inf`` for the
    others and, with ``allowed``, for classes outside it)."""

    def __init__(self, model: PFLModel, pset: ProtoSet, num_classes: int, allowed: Tensor | None):
        super().__init__()
        self.model, self.num_classes = model, num_classes
        self.classes, self.protos, self.allowed = pset["classes"], pset["protos"], allowed

    def forward(self, x: Tensor) -> Tensor:
        h = self.model.features(x)
        out = torch.full((len(h), self.num_classes), -torch.inf, device=h.device, dtype=h.dtype)
        if len(self.classes):
            out[:, self.classes] = -torch.cdist(h, self.protos.to(h))
        if self.allowed is not None:
            out[:, ~self.allowed] = -torch.inf
        return out


def require_same_feature_dim(env: ServerEnv, name: str) -> int:
    """The clients' common ``feature_dim``, or a :class:`PflkitError` when they differ."""
    dims = {arch: env.model(arch).feature_dim for arch in sorted(set(env.archs))}
    if len(set(dims.values())) > 1:
        got = ", ".join(f"{a}: {d}" for a, d in dims.items())
        raise PflkitError(
            f"algorithm '{name}' exchanges class prototypes, so every client model needs the "
            f"same feature_dim (got {got}): choose model.per_client architectures with one "
            "feature size"
        )
    return next(iter(dims.values()))


# -- the algorithm ----------------------------------------------------------------------------------


@register
class FedProto(Algorithm):
    name = "fedproto"
    secagg_refusal = "its server weights each client's prototypes by that client's class counts"
    release = None
    release_refusal = "its upload names the classes the client holds (and, with count weighting, their sample counts), statistics with no clipping defined"
    description = (
        "FedProto (Tan et al. 2022): clients share class prototypes only (any architecture "
        "with one feature size); local CE + lam * distance to the global prototypes"
    )
    payload = Empty | Prototypes
    upload = FedProtoUpload
    state: ClassVar[object] = FedProtoState
    server = Empty | Prototypes

    class Params(Algorithm.Params):
        lam: float = param(1.0, "FedProto paper (1 on MNIST and FEMNIST, set for sample_mse)", ge=0)
        reg: Reg = param(
            "class_mean_l2", "pFedPM paper (Eq. 11: L2 to class means); sample_mse: FedProto code"
        )
        proto_timing: Literal["posthoc", "running"] = param(
            "posthoc", "pFedPM Eq. 6 (after training); running: FedProto code"
        )
        proto_agg: Literal["weighted", "uniform"] = param(
            "weighted", "specs/pfedpm.md §2.1 A (|D_ij|/N_j); uniform: FedProto code"
        )
        inference: Literal["head", "prototype"] = param(
            "head", "pFedPM tables (model logits); prototype: FedProto paper"
        )
        restrict_to_local_classes: bool = param(
            False, "pFedPM (all classes with a prototype); true: FedProto code's proto accuracy"
        )

    params: Params

    def check(self, env: ServerEnv) -> None:
        require_same_feature_dim(env, self.name)

    # -- state ----------------------------------------------------------------------------------
    def server_init(self, env: ServerEnv) -> Empty | Prototypes:
        return {}  # no global prototype yet

    def client_init(self, env: ClientEnv) -> FedProtoState:
        return {"weights": common_init(env)}

    # -- one round ------------------------------------------------------------------------------
    def configure(self, env: ServerEnv, server: State, cid: int, ctx: ServerContext) -> Payload:
        if "classes" not in server:
            return {}
        return {"classes": server["classes"], "protos": server["protos"]}

    def targets(
        self, env: ClientEnv, payload: Empty | Prototypes, state: FedProtoState, d: int
    ) -> tuple[Tensor, Tensor]:
        """The regulariser's targets as a dense table and mask: the global prototypes."""
        return proto_table(payload, env.num_classes, d, env.device)

    def local_train(
        self,
        env: ClientEnv,
        model: PFLModel,
        loss_fn: LossFn,
        targets: Tensor,
        has: Tensor,
        state: FedProtoState,
        ctx: RoundContext,
    ) -> tuple[float, State, dict[str, float]]:
        """Train ``model`` in place; return (mean loss, extra client state, extra metrics)."""
        return env.train(model, ctx, loss_fn=loss_fn), {}, {}

    def local_prototypes(
        self, env: ClientEnv, model: PFLModel, running: RunningMeans | None
    ) -> tuple[Tensor, Tensor, Tensor]:
        """(classes, prototypes, |D_ij|) to upload (Eq. 6 post hoc, or the running means)."""
        data = env.data
        if running is None:
            x, y = data.train_x, data.train_y
            return class_prototypes(eval_features(model, x), y, env.num_classes)
        classes, protos = running.prototypes()
        y = data.train_y
        counts = torch.bincount(y, minlength=env.num_classes)[classes]
        return classes, protos, counts

    def client_update(
        self, env: ClientEnv, payload: Empty | Prototypes, state: FedProtoState, ctx: RoundContext
    ) -> Update:
        p, t = self.params, env.run.train
        model = env.model()
        set_weights(model, state["weights"])
        d = model.feature_dim
        targets, has = self.targets(env, payload, state, d)
        running = None
        if p.proto_timing == "running":
            running = RunningMeans(
                env.num_classes,
                d,
                env.device,
                steps_per_epoch(env.num_train, t.batch_size, ctx.drop_last),
            )
        loss_fn = prototype_loss(targets, has, p.lam, p.reg, running)
        loss, extra, metrics = self.local_train(env, model, loss_fn, targets, has, state, ctx)
        classes, protos, counts = self.local_prototypes(env, model, running)
        upload: FedProtoUpload = {"classes": classes, "protos": protos.detach().clone()}
        if p.proto_agg == "weighted":
            upload["counts"] = counts
        new_state = {**state, **extra, "weights": get_weights(model)}
        new_state.update(self.keep_local(upload))
        return Update(upload, new_state, {"train_loss": loss, **metrics})

    def keep_local(self, upload: FedProtoUpload) -> dict[str, dict[str, Tensor]]:
        """The client keeps its last uploaded prototypes (client state ``protos``; pFedPM's
        ``C_prev``)."""
        return {"protos": {k: upload[k].clone() for k in ("classes", "protos")}}

    def aggregate(
        self,
        env: ServerEnv,
        server: State,
        uploads: Mapping[int, FedProtoUpload],
        ctx: ServerContext,
    ) -> State:
        ups = [uploads[c] for c in sorted(uploads) if len(uploads[c]["classes"])]
        if not ups:
            return server
        new = aggregate_prototypes(ups, env.num_classes, self.params.proto_agg)
        old = {"classes": server["classes"], "protos": server["protos"]} if server else None
        return {**server, **merge_prototypes(old, new)}

    # -- evaluation -----------------------------------------------------------------------------
    def eval_view(
        self, env: ServerEnv, server: State, cid: int | None, ctx: ServerContext
    ) -> Payload:
        """The global prototypes when the client scores by them; nothing otherwise (no global
        model: ``cid`` None gives nothing)."""
        if cid is not None and self.params.inference == "prototype" and "classes" in server:
            return {"classes": server["classes"], "protos": server["protos"]}
        return {}

    def personal_model(
        self,
        env: ClientEnv,
        view: Payload,
        state: State,
        ctx: RoundContext,
        upload: Upload | None = None,
    ) -> nn.Module:
        """The client's model, scored by its head or (``inference: prototype``) by the nearest
        global prototype of the view (none before the first aggregation)."""
        model = load_model(env, state["weights"])
        if self.params.inference == "head":
            return model
        if "classes" in view:
            pset = {"classes": view["classes"], "protos": view["protos"]}
        else:
            pset = {
                "classes": torch.zeros(0, dtype=torch.long, device=env.device),
                "protos": torch.zeros(0, model.feature_dim, device=env.device),
            }
        pset = {k: v.to(env.device) for k, v in pset.items()}
        return NearestPrototype(model, pset, env.num_classes, self.allowed_classes(env))

    def allowed_classes(self, env: ClientEnv) -> Tensor | None:
        if not self.params.restrict_to_local_classes:
            return None
        return class_mask(torch.unique(env.data.train_y), env.num_classes, env.device)
