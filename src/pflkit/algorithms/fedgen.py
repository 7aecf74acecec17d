"""FedGen: Zhu, Hong & Zhou, "Data-Free Knowledge Distillation for Heterogeneous Federated
Learning", ICML 2021 (Algorithm 1, Eq. 4-5); hyper-parameters as the pFedSim paper runs it
(App. A.5).

Shared: the global model (FedAvg) and a server-side generator G_w(z, y) of latent features
(the input of the classifier head), downloaded with the model from round 2 on. Uploaded: the
trained model and the client's label counts (the paper's label-count statistics).
Private: nothing.

Server, after FedAvg over the round's models theta_k (Eq. 4, with the ensemble of the clients'
heads h(.; theta_k^p) weighted per label by the clients' counts, alpha_{k,y} = n_{k,y} /
sum_k n_{k,y})::

    min_w  E_{y ~ U(labels), z ~ N(0, I)} [ CE( sum_k alpha_{k,y} h(G_w(z, y); theta_k^p), y ) ]
           + eta * diversity(z, G_w(z, y))

for ``gen_iters`` Adam steps of ``gen_batch`` samples; y is drawn from the labels seen so far.
The diversity term is the FedGen code's exp(-mean_{i,j} |z_i - z_j|^2_mean * |G_i - G_j|_mean).

Client k (Eq. 5, with the code's latent-matching term): E local epochs on

    CE(theta_k; x, y) + alpha_t * CE(h(G_w(z, y~); theta_k^p), y~)
                      + beta_t * KL( softmax(h(G_w(z, y); theta_k^p)) || softmax(f(x; theta_k)) )

with y~ drawn uniformly from the downloaded labels (``gen_batch`` per step; ``teacher_labels:
server``, the default), z ~ N(0, I), the generator frozen (eval mode), and alpha_t = alpha *
decay^(t-1), beta_t likewise. Round 1 has no generator yet: plain FedAvg. ``teacher_labels:
client`` draws y~ uniformly from the labels of the client's own training split instead, as
FL-bench's client does (``np.random.choice(self.clients_available_labels[self.client_id],
gen_batch_size)``, ``src/client/fedgen.py`` lines 66-72 with lines 23-25, FL-bench 06e658b).

Defaults (pFedSim App. A.5): generator hidden 32, noise 32, 5 generator iterations per round,
generated batch 32, alpha = beta = 10 decaying by 0.98 per round; eta = 1 and the generator's
Adam lr 3e-4 are the FedGen code's. The generator is one hidden layer: Linear(noise + |Y| ->
hidden) -> BatchNorm1d -> ReLU -> Linear(hidden -> feature_dim), y one-hot (FedGen code).
Deviations: the code's KD of the server model on the ensemble is off there too (beta = 0);
its per-round lr decay of the generator is not applied; the teacher loss is not rescaled by
gen_batch / batch_size (1 at the defaults).

FL-bench's FedGen (06e658b) differs further. Its generator's teacher is the server model's
own classifier (``self.model.classifier``, before the round's aggregation), not the clients'
heads (``src/server/fedgen.py`` lines 98-111: the loaded ``teacher_model`` is unused, and the
per-label shares sum to 1 over the clients, so the ensemble is that one head): ``teacher:
server`` trains the generator so (the head of the model the round started from), ``teacher:
clients`` (default) as the paper's Eq. 4. It draws the generator's labels from those whose mean
count over the round's clients exceeds ``min_samples_per_label`` = 1 (lines 139-143; ``gen_labels:
round``; default ``seen``: every label a client has reported so far), decays the generator's
Adam lr by 0.98 after every round (lines 51-53, 128; ``gen_lr_decay: 0.98``, the lr of round t
is gen_lr * gen_lr_decay^(t-1); default 1, no decay), and its clients run the generator in train
mode (``src/client/fedgen.py`` line 45; ``client_gen_mode: train``): BatchNorm normalises each
generated batch by its own statistics, so a batch whose labels are all one class carries no
label information; default ``eval``, the running statistics. In train mode a batch of one
sample is skipped, as FL-bench does (line 49): its loss is zero (no step under plain SGD; with
momentum or weight decay the optimiser still moves). FL-bench draws ``common.batch_size``
generator labels a step (line 88): set ``gen_batch`` to it (they agree in the cross-check).
"""

from __future__ import annotations

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
    Weighting,
    param,
    register,
    train_from,
    weighted_average,
)
from pflkit.algorithms.env import ClientEnv, ServerEnv
from pflkit.algorithms.records import Empty, WeightsUpload
from pflkit.models import PFLModel
from pflkit.primitives.training import LossFn, Weights, cross_entropy, get_weights, unprefixed


class FedGenPayload(TypedDict):
    """The global model, and the generator and its labels once the server has trained it."""

    weights: Weights
    gen: NotRequired[Weights]
    labels: NotRequired[Tensor]


class FedGenUpload(WeightsUpload):
    """FedAvg's upload and the client's label counts (they weigh the generator's teachers)."""

    label_counts: Tensor


class FedGenServer(TypedDict):
    """The global model, the generator, whether it has trained, its labels, its optimiser."""

    weights: Weights
    gen: Weights
    trained: bool
    labels: Tensor
    gen_opt: NotRequired[dict[str, Any]]  # torch.optim.Adam.state_dict()


class Generator(nn.Module):
    """G_w(z, y): [z, onehot(y)] -> hidden -> BN -> ReLU -> latent feature."""

    def __init__(self, noise_dim: int, num_classes: int, hidden: int, latent: int):
        super().__init__()
        self.noise_dim, self.num_classes = noise_dim, num_classes
        self.fc = nn.Linear(noise_dim + num_classes, hidden)
        self.bn = nn.BatchNorm1d(hidden)
        self.out = nn.Linear(hidden, latent)

    def forward(self, z: Tensor, y: Tensor) -> Tensor:
        h = torch.cat([z, F.one_hot(y, self.num_classes).float()], 1)
        out: Tensor = self.out(F.relu(self.bn(self.fc(h))))
        return out


def noise(n: int, dim: int, like: Tensor) -> Tensor:
    """``[n, dim]`` standard normal noise from the CPU RNG (a seed draws the same noise on every
    device), on ``like``'s device."""
    return torch.randn(n, dim, device="cpu").to(like.device)


def draw(high: int, n: int, like: Tensor) -> Tensor:
    """``n`` uniform indices in ``[0, high)`` from the CPU RNG, on ``like``'s device."""
    return torch.randint(high, (n,), device="cpu").to(like.device)


def diversity_loss(z: Tensor, feat: Tensor) -> Tensor:
    """FedGen code's DiversityLoss: exp(-mean(noise_dist * feature_dist)), noise distance the
    mean squared difference and feature distance the mean absolute difference per pair."""
    nd = (z[:, None] - z[None]).pow(2).mean(2)
    fd = (feat[:, None] - feat[None]).abs().mean(2)
    return torch.exp(-(nd * fd).mean())


def head_logits(model: PFLModel, weights: Mapping[str, Tensor], feat: Tensor) -> Tensor:
    """The classifier head of ``weights`` (full-model keys) applied to features ``feat``."""
    head = unprefixed(weights, "head.")
    logits: Tensor = torch.func.functional_call(model.head, head, (feat,))
    return logits


@register
class FedGen(Algorithm):
    name = "fedgen"
    secagg_refusal = "its server trains its generator on each client's label counts"
    release = None
    release_refusal = "its upload carries the client's label counts, with no clipping defined"
    description = "FedGen (Zhu et al. 2021): FedAvg + a server generator of latent features"
    payload = FedGenPayload
    upload = FedGenUpload
    state = Empty
    server = FedGenServer

    class Params(Algorithm.Params):
        hidden: int = param(32, "pFedSim App. A.5", gt=0)
        noise_dim: int = param(32, "pFedSim App. A.5", gt=0)
        gen_iters: int = param(5, "pFedSim App. A.5", ge=0)
        gen_batch: int = param(32, "pFedSim App. A.5", gt=0)
        alpha: float = param(10.0, "pFedSim App. A.5 (alpha_generative)", ge=0)
        beta: float = param(10.0, "pFedSim App. A.5 (beta_generative)", ge=0)
        decay: float = param(0.98, "pFedSim App. A.5 (per round)", gt=0, le=1)
        eta: float = param(1.0, "FedGen code (diversity weight)", ge=0)
        gen_lr: float = param(3e-4, "FedGen code (Adam)", gt=0)
        weighting: Weighting = param("samples", "paper (FedAvg aggregation)")
        teacher_labels: Literal["server", "client"] = param(
            "server", "paper (labels seen by the server); client: FL-bench src/client/fedgen.py"
        )
        teacher: Literal["clients", "server"] = param(
            "clients", "paper Eq. 4 (clients' heads); server: FL-bench src/server/fedgen.py l. 104"
        )
        gen_labels: Literal["seen", "round"] = param(
            "seen", "pflkit (labels reported so far); round: FL-bench src/server/fedgen.py l. 141"
        )
        gen_lr_decay: float = param(
            1.0, "paper (no decay); 0.98: FL-bench src/server/fedgen.py l. 128", gt=0, le=1
        )
        client_gen_mode: Literal["eval", "train"] = param(
            "eval", "pflkit (frozen generator); train: FL-bench src/client/fedgen.py l. 45"
        )

    params: Params

    def generator(
        self, env: ServerEnv | ClientEnv, weights: Mapping[str, Tensor] | None = None
    ) -> Generator:
        p = self.params
        latent = env.model().feature_dim
        with torch.random.fork_rng(devices=[]), torch.device("cpu"):
            gen = Generator(p.noise_dim, env.num_classes, p.hidden, latent)
        if weights is not None:
            gen.load_state_dict(weights)
        return gen.to(env.device)

    def server_init(self, env: ServerEnv) -> FedGenServer:
        p = self.params
        with torch.device("cpu"):
            gen = Generator(p.noise_dim, env.num_classes, p.hidden, env.model().feature_dim)
        return {
            "weights": env.init_weights(),
            "gen": get_weights(gen.to(env.device)),
            "trained": False,
            "labels": torch.zeros(0, dtype=torch.int64, device=env.device),
        }

    def configure(self, env: ServerEnv, server: State, cid: int, ctx: ServerContext) -> Payload:
        if not server["trained"]:
            return {"weights": server["weights"]}
        return {"weights": server["weights"], "gen": server["gen"], "labels": server["labels"]}

    def local_loss(self, env: ClientEnv, payload: FedGenPayload, rnd: int) -> LossFn:
        p = self.params
        gen = self.generator(env, payload["gen"]).train(p.client_gen_mode == "train")
        labels = payload["labels"]
        if p.teacher_labels == "client":  # the labels of the client's training split
            labels = torch.unique(env.data.train_y)
        a_t = p.alpha * p.decay ** (rnd - 1)
        b_t = p.beta * p.decay ** (rnd - 1)

        def loss_fn(module: nn.Module, x: Tensor, y: Tensor) -> Tensor:
            model = cast(PFLModel, module)  # the client's PFLModel (env.model)
            logits = model(x)
            if gen.training and len(y) < 2:  # FL-bench skips the batch (BatchNorm needs two)
                zero: Tensor = 0.0 * logits.sum()
                return zero
            loss = F.cross_entropy(logits, y)
            with torch.no_grad():
                target = F.softmax(model.head(gen(noise(len(y), p.noise_dim, y), y)), 1)
                y_gen = labels[draw(len(labels), p.gen_batch, labels)]
                feat = gen(noise(p.gen_batch, p.noise_dim, y), y_gen)
            latent = F.kl_div(F.log_softmax(logits, 1), target, reduction="batchmean")
            teacher = F.cross_entropy(model.head(feat), y_gen)
            return loss + a_t * teacher + b_t * latent

        return loss_fn

    def client_update(
        self, env: ClientEnv, payload: FedGenPayload, state: Empty, ctx: RoundContext
    ) -> Update:
        loss_fn = self.local_loss(env, payload, ctx.round) if "gen" in payload else cross_entropy
        weights, loss = train_from(env, payload["weights"], ctx, loss_fn=loss_fn)
        y = env.data.train_y
        counts = torch.bincount(y, minlength=env.num_classes).double()
        upload = {"weights": weights, "num_samples": env.num_train, "label_counts": counts}
        return Update(upload, state, {"train_loss": loss})

    def train_generator(
        self, env: ServerEnv, server: State, uploads: Mapping[int, FedGenUpload], rnd: int
    ) -> tuple[dict[str, Any], Tensor]:
        p = self.params
        gen = self.generator(env, server["gen"]).train()
        opt = torch.optim.Adam(gen.parameters(), lr=p.gen_lr)
        if "gen_opt" in server:
            opt.load_state_dict(server["gen_opt"])
        opt.param_groups[0]["lr"] = p.gen_lr * p.gen_lr_decay ** (rnd - 1)
        ups = list(uploads.values())
        counts = torch.stack([u["label_counts"] for u in ups])  # [K, C]
        if p.gen_labels == "round":  # FL-bench: mean count over the round's clients above 1
            labels = torch.nonzero(counts.sum(0) / len(ups) > 1).flatten()
        else:
            seen = torch.stack([counts.sum(0), torch.zeros_like(counts[0])])
            if server["labels"].numel():
                seen[1, server["labels"]] = 1.0
            labels = torch.nonzero(seen.sum(0) > 0).flatten()
        share = counts / counts.sum(0).clamp(min=1e-12)  # alpha_{k,y}
        heads = [u["weights"] for u in ups]
        if p.teacher == "server":  # FL-bench: the round's starting model, share 1 for every label
            heads, share = [server["weights"]], torch.ones_like(counts[:1])
        model = env.model()
        for _ in range(p.gen_iters if len(labels) else 0):  # no label qualifies: no step
            y = labels[draw(len(labels), p.gen_batch, labels)]
            z = noise(p.gen_batch, p.noise_dim, labels)
            feat = gen(z, y)
            logits = cast(
                Tensor,
                sum(
                    share[k, y].float()[:, None] * head_logits(model, h, feat)
                    for k, h in enumerate(heads)
                ),
            )
            loss = F.cross_entropy(logits, y) + p.eta * diversity_loss(z, feat)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        return {"gen": get_weights(gen), "gen_opt": opt.state_dict()}, labels

    def aggregate(
        self,
        env: ServerEnv,
        server: State,
        uploads: Mapping[int, FedGenUpload],
        ctx: ServerContext,
    ) -> State:
        avg = weighted_average(uploads, uniform=self.params.weighting == "uniform")
        gen, labels = self.train_generator(env, server, uploads, ctx.round)
        return {**server, **gen, "weights": avg, "labels": labels, "trained": True}
