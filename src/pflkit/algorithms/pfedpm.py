"""pFedPM: Xing, Shi, Peng, Hu & Li, "Personalized federated learning based on feature fusion",
arXiv 2406.16583, 2024 (CSCWD 2024); Algorithm 1, Eqs. 6-13 (specs/pfedpm.md).

pFedPM is FedProto (:mod:`pflkit.algorithms.fedproto`, whose prototype core it subclasses)
plus (i) per-client *mixed* anchors that blend the client's own previous prototype with the
global one and (ii) a private relation module, a second decision head that scores
(feature, anchor) pairs. One registered name, ``pfedpm``: the paper's variants are
configurations of it: **R-pFedPM** (Table II) is the same run with ``inference: relation``,
and the **-mh** runs are ``model.per_client`` with ``fedproto_cnn`` clients whose
``channels`` option is 18, 20 and 22 (feature size 50 everywhere).

**Shared** (exactly as FedProto): up, each held class's prototype ``C_i^(j)`` (Eq. 6), its index
and ``|D_ij|`` (``n_i * d * 4`` bytes plus 8 per index and count); down, every global
prototype ``C_bar^(j)`` (nothing in round 1). **Private**: the model (extractor + first head,
any architecture with the common ``feature_dim``), the relation module ``psi_i`` (client state
``relation``), the prototypes the client uploaded last round (``protos``, ``C_prev``) and the
anchors it trained with (``anchors``, kept for relation inference). No model is averaged;
there is no global model.

Client i, round t, given the global prototypes ``C_bar`` (Alg. 1, spec §2.4):

1. Anchors (Eq. 8), built once and held fixed (detached) during the round (spec §8.1):
   ``A^(j) = a C_prev^(j) + (1 - a) C_bar^(j)`` for a class with both; ``A^(j) = C_bar^(j)``
   for a class with only a global prototype (a class the client lacks, paper text after
   Eq. 13; also a held class of a client that has not uploaded yet); ``A^(j) = C_prev^(j)``
   for a class with only a previous prototype (cannot happen: the server keeps every class
   it has received); no anchor otherwise (round 1: no anchor at all). ``a = 0`` gives
   exactly FedProto's targets.
2. Per batch: one step of the run's optimiser (``env.train``) on the extractor and head with
   ``CE + lam * L_R(h, A)`` (Eq. 9; ``reg`` as in FedProto: ``"class_mean_l2"`` default,
   ``"sample_mse"`` FedProto code), then one relation step (Eqs. 12-13) with the extractor
   frozen: the batch's features are recomputed after the body step, in eval mode, without
   gradient (no parameter, BatchNorm statistic or random draw of the extractor changes), and
   ``psi`` takes one step on ``L_rel = sum_{s, j anchored} (R(h_s, A^(j)) - 1[y_s = j])^2``
   (``relation_loss: sum``, paper; ``mean`` divides by ``B K``). The relation optimiser is the
   run's (SGD with ``train.momentum``, ``train.weight_decay`` unless ``train.optimizer`` says
   otherwise, and the round's lr schedule) at ``relation_lr`` (default ``train.lr``), rebuilt
   every round; ``train.grad_clip`` does not apply to it. No relation step in a round without
   anchors (round 1).
3. Upload the local prototypes (``proto_timing`` as FedProto: ``"posthoc"`` default) and keep
   them as next round's ``C_prev``.

Server: FedProto's (``proto_agg``: ``"weighted"`` default, ``"uniform"`` FedProto code).

Relation module (``relation``): ``"conv"`` (default, [ours] from spec §2.1: the paper says
"one conv + two FC" and gives no sizes): the pair as a 2-channel signal of length d,
Conv1d(2->16, k 3, pad 1) + BatchNorm + ReLU + MaxPool(2), FC(16 floor(d/2) -> 8) + ReLU,
FC(8 -> 1) + Sigmoid; ``"mlp"``: FC(2d -> ``relation_hidden``) + ReLU + FC(-> 1) + Sigmoid on
``[h ; anchor]``. It starts from one initial value shared by all clients (seeded by the run
seed), like the model.

Inference (``inference``): ``"head"`` (default; Table I's pFedPM: the first head's logits) or
``"relation"`` (Table II's R-pFedPM: the argmax over the anchored classes of the relation
scores against the anchors the client trained with last; a class with no anchor is never
predicted; ``restrict_to_local_classes: true`` scores only the client's training classes,
spec §8.8, reported separately). Training is identical for both.

Defaults: ``a = 0.4`` [ours]: the middle of the paper's best values 0.3 / 0.4 / 0.6 on FEMNIST
(Fig. 3); the paper tunes ``a`` per setting. ``lam = 1`` (paper: MNIST, FEMNIST; 0.1 for
CIFAR-10). ``relation_loss: sum`` (paper, Eq. 13). ``relation_hidden = 8`` [ours] (the conv
variant's FC width, Relation Networks' FC(-> 8)). ``relation_lr = None`` [ours] (the paper
gives no relation optimiser: ``train.lr``, as the body). The local optimiser, batch size and
epochs come from the config (paper: SGD lr 0.01, momentum 0.5, batch 10, 1 epoch).

Caution: the summed relation loss has ``B K`` terms, so its step is ``B K`` times the mean's;
at ``train.lr`` 0.05 with batch 16 and 10 classes it drives the sigmoid into saturation in the
first round with anchors (every score ~0, relation accuracy at or below chance) and the
module never recovers. A smaller ``relation_lr`` (0.005 there: ~0.8 relation accuracy after 3
rounds in the tests) or ``relation_loss: mean`` trains it.

Deviations: Eq. 8 writes the mixed feature with the client's ``C_i^(j)`` and no round index;
read with the live, differentiable class mean, ``a`` would only rescale lam (spec §8.1). Here,
as the alternating minimisation of Eq. 10 implies, the anchor is fixed and built from last
round's uploaded prototype. The relation step's frozen features are
taken in eval mode (the paper does not say; it is the mode the relation module sees at
inference). Relation inference before any anchor exists (after round 1) predicts class 0 for
every sample. Partial participation as in FedProto.
"""

from __future__ import annotations

from typing import Literal, NotRequired, cast

import torch
from torch import Tensor, nn

from pflkit.algorithms.base import (
    Payload,
    RoundContext,
    ServerContext,
    State,
    Upload,
    load_model,
    param,
    register,
)
from pflkit.algorithms.blocks.split import common_seed
from pflkit.algorithms.env import ClientEnv, ServerEnv
from pflkit.algorithms.fedproto import (
    FedProto,
    FedProtoState,
    Prototypes,
    class_mask,
    proto_table,
    require_same_feature_dim,
    to_protoset,
)
from pflkit.algorithms.records import Empty
from pflkit.errors import PflkitError
from pflkit.models import PFLModel
from pflkit.primitives.training import LossFn, Weights, make_optimizer


class PFedPMState(FedProtoState):
    """FedProto's state, the relation module, and last round's anchors."""

    relation: Weights
    anchors: NotRequired[Prototypes]


PAIR_CHUNK = 8192  # (sample, anchor) pairs scored at once at inference


# -- anchors (Eq. 8) --------------------------------------------------------------------------------


def mixed_anchors(
    local: Prototypes | None,
    glob: Prototypes | Empty | None,
    a: float,
    num_classes: int,
    d: int,
    device: torch.device,
) -> tuple[Tensor, Tensor]:
    """Eq. 8 as a dense table ``[num_classes, d]`` and mask: ``a * local + (1 - a) * global``
    where both exist, the global prototype where only it exists, the local one where only it
    exists; detached."""
    lt, lh = proto_table(local, num_classes, d, device)
    gt, gh = proto_table(glob, num_classes, d, device)
    both = (lh & gh).unsqueeze(1)
    mixed = torch.where(both, a * lt + (1 - a) * gt, torch.where(gh.unsqueeze(1), gt, lt))
    return mixed.detach(), lh | gh


# -- the relation module (Eqs. 12-13) ---------------------------------------------------------------


class RelationModule(nn.Module):
    """``R(h, anchor) in (0, 1)`` for feature/anchor pairs ``[N, d]`` each (see the module
    docstring for the two architectures)."""

    def __init__(self, kind: str, d: int, hidden: int = 8):
        super().__init__()
        self.kind = kind
        if kind == "conv":
            self.conv = nn.Sequential(
                nn.Conv1d(2, 16, 3, padding=1), nn.BatchNorm1d(16), nn.ReLU(), nn.MaxPool1d(2)
            )
            width = 16 * (d // 2)
            self.fc = nn.Sequential(
                nn.Flatten(), nn.Linear(width, 8), nn.ReLU(), nn.Linear(8, 1), nn.Sigmoid()
            )
        else:
            self.fc = nn.Sequential(
                nn.Linear(2 * d, hidden), nn.ReLU(), nn.Linear(hidden, 1), nn.Sigmoid()
            )

    def forward(self, h: Tensor, anchor: Tensor) -> Tensor:
        if self.kind == "conv":
            r: Tensor = self.fc(self.conv(torch.stack([h, anchor], dim=1))).squeeze(1)
        else:
            r = self.fc(torch.cat([h, anchor], dim=1)).squeeze(1)
        return r


def relation_scores(rel: nn.Module, h: Tensor, anchors: Tensor) -> Tensor:
    """``R[s, k] = rel(h_s, anchors_k)`` for ``h [B, d]``, ``anchors [K, d]``: ``[B, K]``."""
    b, k, d = h.shape[0], anchors.shape[0], h.shape[1]
    hh = h.unsqueeze(1).expand(b, k, d).reshape(b * k, d)
    aa = anchors.unsqueeze(0).expand(b, k, d).reshape(b * k, d)
    scores: Tensor = rel(hh, aa).view(b, k)
    return scores


def relation_targets(y: Tensor, classes: Tensor) -> Tensor:
    """One-hot relation targets ``1[y_s = classes_k]``, ``[B, K]``."""
    return (y.unsqueeze(1) == classes.unsqueeze(0)).float()


def relation_loss(scores: Tensor, y: Tensor, classes: Tensor, reduction: str = "sum") -> Tensor:
    """Eq. 13: squared error of the scores ``[B, K]`` against the one-hot targets over the
    anchored ``classes``, summed (paper) or averaged."""
    err = (scores - relation_targets(y, classes).to(scores)).pow(2)
    return err.sum() if reduction == "sum" else err.mean()


@torch.no_grad()
def frozen_features(model: PFLModel, x: Tensor) -> Tensor:
    """The extractor's features in eval mode, without gradient; the mode is restored (no
    parameter, BatchNorm statistic or random state changes)."""
    was = model.training
    model.eval()
    try:
        return model.features(x).detach()
    finally:
        model.train(was)


def build_relation(kind: str, d: int, hidden: int, device: torch.device) -> RelationModule:
    """A relation module on ``device`` (its construction draws no global random numbers)."""
    with torch.random.fork_rng(devices=[]):
        return RelationModule(kind, d, hidden).to(device)


class RelationClassifier(nn.Module):
    """R-pFedPM's scores: relation scores against the anchors (``-inf`` for classes without an
    anchor and, with ``allowed``, for classes outside it)."""

    def __init__(
        self,
        model: PFLModel,
        rel: nn.Module,
        classes: Tensor,
        anchors: Tensor,
        num_classes: int,
        allowed: Tensor | None,
    ):
        super().__init__()
        self.model, self.rel, self.num_classes = model, rel, num_classes
        self.classes, self.anchors, self.allowed = classes, anchors, allowed

    def forward(self, x: Tensor) -> Tensor:
        h = self.model.features(x)
        out = torch.full((len(h), self.num_classes), -torch.inf, device=h.device, dtype=h.dtype)
        k = len(self.classes)
        if k:
            step = max(1, PAIR_CHUNK // k)
            scores = [
                relation_scores(self.rel, h[i : i + step], self.anchors.to(h))
                for i in range(0, len(h), step)
            ]
            out[:, self.classes] = torch.cat(scores).to(h.dtype)
        if self.allowed is not None:
            out[:, ~self.allowed] = -torch.inf
        return out


# -- the algorithm ----------------------------------------------------------------------------------


@register
class PFedPM(FedProto):
    name = "pfedpm"
    secagg_refusal = "its server weights each client's prototypes by that client's class counts"
    description = (
        "pFedPM (Xing et al. 2024): FedProto with mixed local/global anchors (a) and a private "
        "relation-module head; R-pFedPM = inference: relation"
    )
    state = PFedPMState

    class Params(FedProto.Params):
        a: float = param(
            0.4, "pflkit: middle of the paper's FEMNIST optima 0.3/0.4/0.6 (§V)", ge=0, le=1
        )
        relation: Literal["conv", "mlp"] = param(
            "conv", "pflkit: spec §2.1's sizes (paper §V: 1 conv + 2 FC, no sizes)"
        )
        relation_hidden: int = param(8, "pflkit (hidden width of relation: mlp)", ge=1)
        relation_loss: Literal["sum", "mean"] = param("sum", "paper (Eq. 13: sum of squares)")
        relation_lr: float | None = param(
            None, "pflkit (None: train.lr, as the body; paper: unstated)", gt=0
        )
        inference: Literal["head", "relation"] = param(  # type: ignore[assignment]  # R-pFedPM
            "head", "paper Table I (first head); relation: Table II (R-pFedPM)"
        )

    params: Params

    def check(self, env: ServerEnv) -> None:
        d = require_same_feature_dim(env, self.name)
        if self.params.relation == "conv" and d < 2:
            raise PflkitError(
                f"algorithm '{self.name}' relation: conv pools the feature in pairs, but "
                f"feature_dim is {d}: use relation: mlp or a model with feature_dim >= 2"
            )

    def _relation(self, env: ClientEnv, d: int) -> RelationModule:
        return build_relation(self.params.relation, d, self.params.relation_hidden, env.device)

    def client_init(self, env: ClientEnv) -> PFedPMState:
        state = cast(PFedPMState, super().client_init(env))  # "relation" is set below
        d = env.model().feature_dim
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(common_seed(env.run.seed, 1))
            rel = RelationModule(self.params.relation, d, self.params.relation_hidden)
        rel = rel.to(env.device)
        state["relation"] = {k: v.detach().clone() for k, v in rel.state_dict().items()}
        return state

    # -- one round ------------------------------------------------------------------------------
    def targets(
        self, env: ClientEnv, payload: Empty | Prototypes, state: FedProtoState, d: int
    ) -> tuple[Tensor, Tensor]:
        """Eq. 8's anchors from last round's own prototypes and the downloaded global ones."""
        return mixed_anchors(
            state.get("protos"), payload, self.params.a, env.num_classes, d, env.device
        )

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
        if not bool(has.any()):  # round 1: no anchors, no relation step
            return env.train(model, ctx, loss_fn=loss_fn), {}, {}
        p, t = self.params, env.run.train
        anchors = to_protoset(targets, has)
        classes, anchor_protos = anchors["classes"], anchors["protos"]
        rel = self._relation(env, model.feature_dim)
        rel.load_state_dict(cast(PFedPMState, state)["relation"])  # client_update passes its own
        rel.train()
        lr = t.lr if p.relation_lr is None else p.relation_lr
        opt = make_optimizer(list(rel.parameters()), lr, t.momentum, t.weight_decay, ctx.optim)
        pending: list[tuple[Tensor, Tensor]] = []
        rel_losses: list[Tensor] = []

        def relation_step(x: Tensor, y: Tensor) -> None:
            hd = frozen_features(model, x)
            loss = relation_loss(
                relation_scores(rel, hd, anchor_protos), y, classes, p.relation_loss
            )
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            rel_losses.append(loss.detach())

        def with_relation_step(m: nn.Module, x: Tensor, y: Tensor) -> Tensor:
            # the previous batch's relation step runs after that batch's body step
            if pending:
                relation_step(*pending.pop())
            pending.append((x, y))
            return loss_fn(m, x, y)

        loss = env.train(model, ctx, loss_fn=with_relation_step)
        if pending:
            relation_step(*pending.pop())
        extra = {
            "relation": {k: v.detach().clone() for k, v in rel.state_dict().items()},
            "anchors": anchors,
        }
        metrics = {"relation_loss": float(torch.stack(rel_losses).mean())} if rel_losses else {}
        return loss, extra, metrics

    # -- evaluation -----------------------------------------------------------------------------
    def eval_view(
        self, env: ServerEnv, server: State, cid: int | None, ctx: ServerContext
    ) -> Payload:
        return {}  # both inference modes use only the client's own state

    def personal_model(
        self,
        env: ClientEnv,
        view: Payload,
        state: State,
        ctx: RoundContext,
        upload: Upload | None = None,
    ) -> nn.Module:
        """The client's model, scored by its head or (``inference: relation``) by its relation
        module against its anchors."""
        model = load_model(env, state["weights"])
        if self.params.inference == "head":
            return model
        rel = self._relation(env, model.feature_dim)
        rel.load_state_dict(state["relation"])
        anchors = state.get("anchors", {})
        classes = anchors.get("classes", torch.zeros(0, dtype=torch.long)).to(env.device)
        protos = anchors.get("protos", torch.zeros(0, model.feature_dim)).to(env.device)
        allowed = None
        if self.params.restrict_to_local_classes:
            allowed = class_mask(torch.unique(env.data.train_y), env.num_classes, env.device)
        return RelationClassifier(model, rel, classes, protos, env.num_classes, allowed)
