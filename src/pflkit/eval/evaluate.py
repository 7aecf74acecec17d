"""Evaluation, as DESIGN.md fixes it.

- **Global accuracy** (MAP's "aggregation accuracy"): the server's model on the global test
  set, for algorithms that have one.
- **Personalized accuracy**: every client's personalized model on its own local test split,
  summarised as the unweighted mean over clients, the sample-weighted mean, the std across
  clients (population std, ``np.std``, unweighted), its coefficient of variation (std / mean,
  GPFL's fairness measure after Jain et al.) and the mean of the worst 10% of clients (at least
  one client).
- **Validation accuracy** (``data.val_fraction`` > 0): the same two on validation data, for
  choosing hyper-parameters without looking at test accuracy: every client's personalized model
  on its own local validation split (``val_pers_acc_*``, the same summary) and the server's
  model on the union of the clients' validation splits (``val_global_acc``).

Each model is evaluated forward-only, in large batches. A client's own evaluation is
:func:`pflkit.engine.clients.evaluate_client`, which every runner executes where the client
runs (a client whose personalized model is the global model scores the global model). With
``eval.finetune_epochs`` K > 0 it scores :func:`finetuned`: a copy of that model after K local
epochs on the client's training split (both the test and the validation numbers; the global
model's ``global_acc`` and ``val_global_acc`` are not fine-tuned).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Mapping
from typing import TYPE_CHECKING

import numpy as np
from torch import Tensor, nn

from pflkit.algorithms.blocks.training import (
    PLAIN_SGD,
    LocalOptim,
    accuracy_and_loss,
    local_sgd,
    predict,
    set_weights,
)

if TYPE_CHECKING:
    from pflkit.config import TrainConfig


def summarize_clients(acc: np.ndarray, counts: np.ndarray) -> dict[str, float]:
    """Unweighted mean, sample-weighted mean, std (population: ``ddof=0``, unweighted over
    clients), coefficient of variation (std / unweighted mean; 0 when every client scores 0)
    and worst-10% mean of per-client accuracy."""
    worst = np.sort(acc)[: max(math.ceil(0.1 * len(acc)), 1)]
    mean, std = float(acc.mean()), float(acc.std())
    return {
        "pers_acc_mean": mean,
        "pers_acc_weighted": float((acc * counts).sum() / counts.sum()),
        "pers_acc_std": std,
        "pers_acc_cv": std / mean if mean else 0.0,
        "pers_acc_worst10": float(worst.mean()),
    }


def global_metrics(model: nn.Module, weights, data, batch_size: int) -> dict[str, float]:
    """The server's model (``weights``, loaded into ``model``) on the global test set."""
    set_weights(model, weights)
    correct, loss = accuracy_and_loss(predict(model, data.test_x, batch_size), data.test_y)
    return {"global_acc": float(correct.float().mean()), "global_loss": float(loss.mean())}


def accuracy(model: nn.Module, x: Tensor, y: Tensor, batch_size: int) -> float:
    """The share of ``(x, y)`` that ``model`` classifies right (0 for an empty split)."""
    hits = int((predict(model, x, batch_size).argmax(1) == y).sum())
    return hits / max(len(y), 1)


def finetuned(
    model: nn.Module,
    x: Tensor,
    y: Tensor,
    train: TrainConfig,
    epochs: int,
    optim: LocalOptim = PLAIN_SGD,
) -> nn.Module:
    """A copy of ``model`` trained for ``epochs`` epochs of plain local SGD with cross-entropy
    on ``(x, y)`` at ``train``'s lr, batch size, momentum and weight decay (``local_sgd``: the
    optimiser, lr factor and drop_last of ``optim``, the round's); ``model`` itself is
    not touched. ``eval.finetune_epochs``, after FedProto's code (lib/update.py,
    ``LocalTest.fine_tune``: ``--ft_round`` epochs on the client's data before scoring)."""
    tuned = copy.deepcopy(model)
    local_sgd(
        tuned,
        x,
        y,
        epochs=epochs,
        batch_size=train.batch_size,
        lr=train.lr,
        momentum=train.momentum,
        weight_decay=train.weight_decay,
        optim=optim,
    )
    return tuned


def global_val_metrics(
    model: nn.Module, weights, val_x: Tensor, val_y: Tensor, batch_size: int
) -> dict[str, float]:
    """The server's model on validation data: ``val_x``, ``val_y``, the union of the clients'
    local validation splits."""
    set_weights(model, weights)
    return {"val_global_acc": accuracy(model, val_x, val_y, batch_size)}


def _present(acc: Mapping[int, float], counts: np.ndarray) -> dict[str, float]:
    """:func:`summarize_clients` of the clients in ``acc`` (``counts``: every client's)."""
    cids = sorted(acc)
    return summarize_clients(np.array([acc[c] for c in cids]), counts[cids])


def personal_metrics(acc: Mapping[int, float], num_clients: int, counts: np.ndarray):
    """Summary of the per-client accuracies ``acc`` (clients missing from it, e.g. on a failed
    Flower node, are left out of the summary and reported as null)."""
    out: dict = _present(acc, counts)
    out["pers_acc_clients"] = [acc.get(c) for c in range(num_clients)]
    return out


def val_metrics(acc: Mapping[int, float], counts: np.ndarray) -> dict[str, float]:
    """The summary of the per-client validation accuracies ``acc`` (``counts``: every
    client's validation samples; clients missing from ``acc`` are left out), its keys
    prefixed with ``val_`` (the coefficient of variation, a test-fairness number, has no
    validation twin)."""
    out = _present(acc, counts)
    return {f"val_{k}": v for k, v in out.items() if k != "pers_acc_cv"}
