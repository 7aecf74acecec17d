"""Evaluation, as DESIGN.md fixes it.

- **Global accuracy** (MAP's "aggregation accuracy"): the server's model on the global test
  set, for algorithms that have one.
- **Personalized accuracy**: every client's personalized model on its own local test split,
  summarised as the unweighted mean over clients, the sample-weighted mean, the std across
  clients and the mean of the worst 10% of clients (at least one client).

Each model is evaluated once, forward-only, in large batches: clients whose personalized model
*is* the global model (``personal_weights`` returns None) are scored by one pass of the global
model over the concatenation of their test splits.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping

import numpy as np
import torch

from pflkit.algorithms.base import Algorithm, State, Upload
from pflkit.algorithms.training import accuracy_and_loss, predict, set_weights


def summarize_clients(acc: np.ndarray, counts: np.ndarray) -> dict[str, float]:
    """Unweighted mean, sample-weighted mean, std and worst-10% mean of per-client accuracy."""
    worst = np.sort(acc)[: max(math.ceil(0.1 * len(acc)), 1)]
    return {
        "pers_acc_mean": float(acc.mean()),
        "pers_acc_weighted": float((acc * counts).sum() / counts.sum()),
        "pers_acc_std": float(acc.std()),
        "pers_acc_worst10": float(worst.mean()),
    }


def client_accuracy(ctx, cid: int, weights, batch_size: int) -> float:
    model = ctx.model(ctx.arch(cid))
    set_weights(model, weights)
    c = ctx.data.clients[cid]
    hits = int((predict(model, c.test_x, batch_size).argmax(1) == c.test_y).sum())
    return hits / max(len(c.test_y), 1)


def personal_model(algo: Algorithm, view: State, cid: int, state: State):
    """Client ``cid``'s personalized weights: ``personal_weights``, else the global model.
    ``view`` is the server state, or on a Flower node ``algo.eval_payload(server, cid)``."""
    weights = algo.personal_weights(view, cid, state)
    return global_model(algo, view) if weights is None else weights


def global_model(algo: Algorithm, view: State):
    """The global weights, for clients whose personalized model is the global model."""
    weights = algo.global_weights(view)
    if weights is None:
        raise RuntimeError(
            f"{algo.name}: personal_weights returned None but there is no global model"
        )
    return weights


def selected_accuracy(
    algo: Algorithm, view: State, cid: int, upload: Upload, state: State, batch_size: int
) -> float:
    """MAP's personalization accuracy of one selected client: its model right after local
    training (``Algorithm.trained_weights``) on its local test split."""
    weights = algo.trained_weights(view, cid, upload, state)
    return client_accuracy(algo.ctx, cid, weights, batch_size)


def global_metrics(algo: Algorithm, server: State, batch_size: int) -> dict[str, float]:
    """The server's model on the global test set (nothing if the algorithm has none)."""
    gw = algo.global_weights(server)
    if gw is None:
        return {}
    data = algo.ctx.data
    model = algo.ctx.model(algo.ctx.arch(None), slot="eval_global")
    set_weights(model, gw)
    correct, loss = accuracy_and_loss(predict(model, data.test_x, batch_size), data.test_y)
    return {"global_acc": float(correct.float().mean()), "global_loss": float(loss.mean())}


def personal_metrics(acc: Mapping[int, float], num_clients: int, counts: np.ndarray):
    """Summary of the per-client accuracies ``acc`` (clients missing from it, e.g. on a failed
    Flower node, are left out of the summary and reported as null)."""
    cids = sorted(acc)
    out: dict = summarize_clients(np.array([acc[c] for c in cids]), counts[cids])
    out["pers_acc_clients"] = [acc.get(c) for c in range(num_clients)]
    return out


def personal_accuracies(
    algo: Algorithm,
    server: State,
    client_state: Callable[[int], State],
    batch_size: int,
    seed_client: Callable[[int], None],
) -> dict[int, float]:
    """Every client's personalized accuracy on its local test split. ``seed_client(cid)``
    seeds torch before the client's ``personal_weights`` (which may train, e.g. FedAvg-FT)."""
    ctx = algo.ctx
    data = ctx.data
    acc: dict[int, float] = {}
    uses_global: list[int] = []
    for cid in range(data.num_clients):
        state = client_state(cid)
        seed_client(cid)
        pw = algo.personal_weights(server, cid, state)
        if pw is None:
            uses_global.append(cid)
        else:
            acc[cid] = client_accuracy(ctx, cid, pw, batch_size)
    if uses_global:  # one batched pass of the global model over their test splits
        model = ctx.model(ctx.arch(None), slot="eval_global")
        set_weights(model, global_model(algo, server))
        xs = torch.cat([data.clients[c].test_x for c in uses_global])
        ys = torch.cat([data.clients[c].test_y for c in uses_global])
        hits = (predict(model, xs, batch_size).argmax(1) == ys).numpy()
        ends = np.cumsum([len(data.clients[c].test_y) for c in uses_global])
        for cid, seg in zip(uses_global, np.split(hits, ends[:-1]), strict=True):
            acc[cid] = float(seg.mean())
    return acc
