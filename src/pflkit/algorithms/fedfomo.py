"""FedFomo: Zhang, Sapra, Fidler, Yeung & Alvarez, "Personalized Federated Learning with First
Order Model Optimization", ICLR 2021 (Algorithm 1, Eq. 5-7).

Shared: per round, the server sends each selected client M other clients' latest models; the
client uploads its trained model and its weight vector. Private: the client's own model
theta_i (client state ``weights``) and its validation split (a fixed ``val_fraction`` of its
training data; it trains on the rest). Server state: every client's last uploaded model, the
ids of the clients whose models arrived in the last round, and the affinity matrix P (n x n,
zeros at first).

Client i, with the downloaded models theta_n (n in the round's M neighbours)::

    w_n   = (L_i(theta_i^{t-1}) - L_i(theta_n)) / ||theta_n - theta_i^{t-1}||     (Eq. 5)
    w_n  <- max(w_n, 0) / sum_m max(w_m, 0)                                        (Eq. 6)
    theta_i^t = theta_i^{t-1} + sum_n w_n (theta_n - theta_i^{t-1})                (Eq. 7)

with L_i the cross-entropy on i's validation split (eval mode) and the norm over all
parameters. If no weight is positive the client keeps theta_i^{t-1}. It then trains E local
epochs from theta_i^t and uploads the result with the weights; the server stores the model and
adds the weights to its affinity row, P_in <- P_in + w_n.

Neighbour choice: epsilon-greedy on row i of P (paper); the details follow the authors' code
(NVlabs/FedFomo, ``client.py`` ``Client.get_federating_clients``, ``server.py``, ``main.py``):

- Candidates: the clients whose models the server received in the previous round, client i
  excluded (``server.py``: "Uploaded client models at t-1 can be downloaded by clients at t";
  FL-bench ``src/server/fedfomo.py`` also takes the top-M among the previous round's clients).
  With at most M candidates the client gets all of them; in round 1 there are none and the
  client just trains.
- Ranking: by P_i., highest first, ties broken by a seeded random draw (the authors' code
  sorts with random tie-breaking), so no client is favoured by its id.
- Each of the M slots is filled, with probability epsilon, by the next client of a seeded
  random permutation of the candidates, otherwise by the next client of the ranking (clients
  already chosen are skipped).
- epsilon decays linearly per round to 0: round r uses epsilon - (r - 1) * decay (the authors'
  code: 0.3 - 0.05 * epoch, its epoch 0 being the local-only first round).

Defaults: M = 5 and val_fraction = 0.2 (pFedSim App. A.5); epsilon = 0.3 decaying by 0.05 per
round (the authors' code, ``federated/configs.py`` CLIENT_WEIGHT.EPSILON and EPSILON_DECAY;
the paper only names epsilon-greedy). Deviations: a client's first theta_i^{t-1} is the shared
initial model, sent with its first download (counted); FedFomo has no global model, so
``global_acc`` is not reported; P accumulates the clipped, normalised w_n of Eq. 6 (the
authors' code adds the signed Eq. 5 values divided by the absolute value of their sum,
FL-bench and PFLlib the raw Eq. 5 values).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import NotRequired, TypedDict, cast

import numpy as np
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
    train_from,
)
from pflkit.algorithms.env import ClientEnv, ServerEnv
from pflkit.data.federated import ClientData
from pflkit.primitives.training import Weights, predict, set_weights


class FedFomoPayload(TypedDict):
    """The M neighbours' ids and models, and theta^0 on the client's first round."""

    ids: Tensor
    models: list[Weights]
    init: NotRequired[Weights]


class FedFomoUpload(TypedDict):
    """The trained model, the neighbours' ids and their weights w (updates the affinities)."""

    weights: Weights
    ids: Tensor
    w: Tensor


class FedFomoState(TypedDict):
    """The client's model (from its first round on)."""

    weights: NotRequired[Weights]


class FedFomoServer(TypedDict):
    """theta^0, every client's last model, last round's uploaders and the affinities P."""

    init: Weights
    models: dict[int, Weights]
    recent: list[int]
    P: Tensor


def fomo_weights(own_loss: float, losses: Sequence[float], dists: Sequence[float]) -> torch.Tensor:
    """Eq. 5-6: (L(own) - L(n)) / ||theta_n - own||, negatives to 0, normalised (all zero when
    none is positive). float64."""
    raw = torch.tensor(
        [(own_loss - l) / d if d > 0 else 0.0 for l, d in zip(losses, dists, strict=True)],
        dtype=torch.float64,
        device="cpu",
    )
    raw = raw.clamp(min=0.0)
    total = raw.sum()
    return raw / total if total > 0 else raw


def fomo_combine(
    own: Mapping[str, torch.Tensor], models: Sequence[Mapping[str, torch.Tensor]], w: torch.Tensor
) -> Weights:
    """Eq. 7: own + sum_n w_n (theta_n - own) on floating entries (integer ones: own)."""
    out: Weights = {}
    for k, v in own.items():
        if not v.is_floating_point():
            out[k] = v.clone()
            continue
        acc = v.clone()
        for m, wn in zip(models, w.tolist(), strict=True):
            if wn > 0:
                acc.add_(m[k] - v, alpha=wn)
        out[k] = acc
    return out


def param_distance(
    a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor], keys: Sequence[str]
) -> float:
    """||a - b|| over the entries ``keys`` (the model's parameters), float64."""
    sq = cast(Tensor, sum(((a[k].double() - b[k].double()) ** 2).sum() for k in keys))
    return float(torch.sqrt(sq))


def val_split(env: ClientEnv, fraction: float) -> tuple[ClientData, torch.Tensor, torch.Tensor]:
    """(the client's data without its validation part, val x, val y): a fixed split drawn from
    (run seed, client), the same in every engine and round."""
    d = env.data
    x, y = d.train_x, d.train_y
    n = len(y)
    n_val = int(round(fraction * n)) if n >= 2 else 0
    g = torch.Generator().manual_seed(
        int(np.random.SeedSequence([env.run.seed, env.cid, 0xF0]).generate_state(1)[0])
    )
    perm = torch.randperm(n, generator=g, device="cpu").to(env.device)
    val, tr = perm[:n_val], perm[n_val:]
    test_x, test_y = d.test_x, d.test_y
    train = ClientData(x[tr], y[tr], test_x, test_y)
    return train, x[val], y[val]


def val_loss(
    model: torch.nn.Module, weights: Mapping[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor
) -> float:
    set_weights(model, weights)
    return float(F.cross_entropy(predict(model, x), y)) if len(y) else 0.0


@register
class FedFomo(Algorithm):
    name = "fedfomo"
    release = None
    release_refusal = "its upload carries the mixing weights w it derived from its validation losses, with no clipping defined"
    uses_each_upload = "sends each client other clients' own models"
    description = "FedFomo (Zhang et al. 2021): clients weight M downloaded models by val-loss gain"
    payload = FedFomoPayload
    upload = FedFomoUpload
    state = FedFomoState
    server = FedFomoServer

    class Params(Algorithm.Params):
        m: int = param(5, "pFedSim App. A.5 (M)", ge=1)
        val_fraction: float = param(0.2, "pFedSim App. A.5", ge=0, lt=1)
        epsilon: float = param(0.3, "FedFomo code (configs.py EPSILON)", ge=0, le=1)
        epsilon_decay: float = param(0.05, "FedFomo code (configs.py EPSILON_DECAY)", ge=0)

    params: Params

    def server_init(self, env: ServerEnv) -> FedFomoServer:
        n = env.num_clients
        return {
            "init": env.init_weights(),
            "models": {},
            "recent": [],  # the clients whose models arrived in the last round (candidates)
            "P": torch.zeros(n, n, dtype=torch.float64, device=env.device),
        }

    def neighbours(self, env: ServerEnv, server: State, cid: int, rnd: int) -> list[int]:
        """The M clients whose models ``cid`` downloads in round ``rnd`` (module docstring)."""
        p = self.params
        recent = server.get("recent", sorted(server["models"]))  # (checkpoints before "recent")
        avail = [j for j in recent if j != cid]
        if len(avail) <= p.m:
            return avail
        rng = np.random.default_rng([env.run.seed, rnd, cid, 0xF0])
        eps = max(p.epsilon - p.epsilon_decay * (rnd - 1), 0.0)
        aff = server["P"][cid, avail].cpu().numpy()
        top = list(np.lexsort((rng.random(len(avail)), -aff)))  # highest first, random ties
        shuffled = list(rng.permutation(len(avail)))
        chosen: list[int] = []
        for _ in range(p.m):
            pool = shuffled if rng.random() < eps else top
            while (i := int(pool.pop(0))) in chosen:
                pass
            chosen.append(i)
        return sorted(avail[i] for i in chosen)

    def configure(self, env: ServerEnv, server: State, cid: int, ctx: ServerContext) -> Payload:
        ids = self.neighbours(env, server, cid, ctx.round)
        payload: Payload = {
            "ids": torch.tensor(ids, dtype=torch.int64, device=env.device),
            "models": [server["models"][j] for j in ids],
        }
        if cid not in server["models"]:
            payload["init"] = server["init"]  # the client's theta^{t-1} on its first round
        return payload

    def client_update(
        self, env: ClientEnv, payload: FedFomoPayload, state: FedFomoState, ctx: RoundContext
    ) -> Update:
        own = state.get("weights") or payload["init"]
        train, vx, vy = val_split(env, self.params.val_fraction)
        model = env.model("fomo_eval")
        keys = [k for k, _ in model.named_parameters()]
        models = payload["models"]
        w = torch.zeros(len(models), dtype=torch.float64, device=env.device)
        start = own
        if models:
            own_loss = val_loss(model, own, vx, vy)
            losses = [val_loss(model, m, vx, vy) for m in models]
            dists = [param_distance(m, own, keys) for m in models]
            w = fomo_weights(own_loss, losses, dists).to(env.device)
            start = fomo_combine(own, models, w)
        weights, loss = train_from(dataclasses.replace(env, data=train), start, ctx)
        upload = {"weights": weights, "ids": payload["ids"], "w": w}
        return Update(upload, {**state, "weights": weights}, {"train_loss": loss})

    def aggregate(
        self,
        env: ServerEnv,
        server: State,
        uploads: Mapping[int, FedFomoUpload],
        ctx: ServerContext,
    ) -> State:
        models = dict(server["models"])
        P = server["P"].clone()
        for cid, up in uploads.items():
            models[cid] = up["weights"]
            if len(up["ids"]):
                P[cid, up["ids"]] += up["w"]
        return {**server, "models": models, "recent": sorted(uploads), "P": P}

    def eval_view(
        self, env: ServerEnv, server: State, cid: int | None, ctx: ServerContext
    ) -> Payload:
        # used only before the client's first round; no global model (cid None: nothing)
        return {} if cid is None else {"weights": server["init"]}

    def personal_model(
        self,
        env: ClientEnv,
        view: Payload,
        state: State,
        ctx: RoundContext,
        upload: Upload | None = None,
    ) -> nn.Module:
        if state.get("weights") is None:
            return super().personal_model(env, view, state, ctx, upload)
        return load_model(env, state["weights"])
