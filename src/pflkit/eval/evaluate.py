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
    return float((predict(model, c.test_x, batch_size).argmax(1) == c.test_y).float().mean())


def evaluate_selected(
    algo: Algorithm,
    server: State,
    uploads: Mapping[int, Upload],
    client_state: Callable[[int], State],
    batch_size: int,
) -> dict[str, float]:
    """MAP's personalization accuracy: the selected clients' models right after their local
    training (``Algorithm.trained_weights``) on their local test splits, unweighted mean."""
    accs = [
        client_accuracy(
            algo.ctx, cid, algo.trained_weights(server, cid, up, client_state(cid)), batch_size
        )
        for cid, up in uploads.items()
    ]
    return {"pers_acc_selected": float(np.mean(accs))}


def evaluate_round(
    algo: Algorithm,
    server: State,
    client_state: Callable[[int], State],
    batch_size: int,
    global_model: bool = True,
) -> dict[str, float]:
    """Global and personalized metrics of the current round (accuracies in [0, 1])."""
    ctx = algo.ctx
    data = ctx.data
    out: dict[str, float] = {}
    gw = algo.global_weights(server)
    gmodel = None
    if gw is not None:
        gmodel = ctx.model(ctx.arch(None), slot="eval_global")  # not clobbered below
        set_weights(gmodel, gw)
        if global_model:
            correct, loss = accuracy_and_loss(predict(gmodel, data.test_x, batch_size), data.test_y)
            out["global_acc"] = float(correct.float().mean())
            out["global_loss"] = float(loss.mean())

    n = data.num_clients
    acc = np.zeros(n)
    counts = np.array([len(c.test_y) for c in data.clients], dtype=float)
    uses_global: list[int] = []
    for cid in range(n):
        pw = algo.personal_weights(server, cid, client_state(cid))
        if pw is None:
            uses_global.append(cid)
            continue
        acc[cid] = client_accuracy(ctx, cid, pw, batch_size)
    if uses_global:
        if gmodel is None:
            raise RuntimeError(
                f"{algo.name}: personal_weights returned None but there is no global model"
            )
        xs = torch.cat([data.clients[c].test_x for c in uses_global])
        ys = torch.cat([data.clients[c].test_y for c in uses_global])
        hits = (predict(gmodel, xs, batch_size).argmax(1) == ys).numpy()
        ends = np.cumsum(counts[uses_global]).astype(int)
        for cid, seg in zip(uses_global, np.split(hits, ends[:-1]), strict=True):
            acc[cid] = seg.mean()
    out.update(summarize_clients(acc, counts))
    out["pers_acc_clients"] = acc.tolist()
    return out
