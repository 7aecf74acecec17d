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

**Sampled evaluation** (``eval.clients: n``): an evaluation round scores a simple random sample
(without replacement) of n of the N training clients (:func:`sampled_metrics`); the summary
numbers are then plug-in estimates from the sample, and the two means carry a standard error:

- ``pers_acc_mean`` (the mean of per-client accuracy y_i), ``pers_acc_mean_se``: the SRS
  standard error with the finite-population correction,
  ``sqrt((1 - n/N) * s^2 / n)``, ``s^2 = sum_i (y_i - ybar)^2 / (n - 1)`` over the sample;
- ``pers_acc_weighted`` (the pooled ratio R = sum c_i / sum m_i, c_i the client's correct
  predictions, m_i its test samples), ``pers_acc_weighted_se``: the ratio estimator's
  linearised standard error, ``sqrt((1 - n/N) / (n * mbar^2) * sum_i (c_i - R m_i)^2 / (n - 1))``,
  ``mbar`` the sample mean of m_i (Cochran, Sampling Techniques, 3rd ed., §6.4).

Both are 0 when n = N and null when n = 1 < N (no variance from one client). ``pers_acc_std``,
``pers_acc_cv`` and ``pers_acc_worst10`` are the sample's own values, without a standard error.
The same rules give the held-out clients' ``holdout_acc_*`` (:func:`holdout_metrics`).
:func:`trained_split` reports the scored clients that have trained and those that have not apart.

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

from pflkit.primitives.training import (
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
    """The share of the targets of ``(x, y)`` that ``model`` predicts right (0 for an empty
    split): samples for classification, tokens for next-token prediction (class dimension 1
    in both, :mod:`pflkit.eval.tasks`)."""
    hits = int((predict(model, x, batch_size).argmax(1) == y).sum())
    return hits / max(y.numel(), 1)


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


def mean_se(acc: np.ndarray, population: int) -> float | None:
    """Standard error of the mean of ``acc``, a simple random sample without replacement of
    ``len(acc)`` = n of ``population`` = N clients: ``sqrt((1 - n/N) * s^2 / n)`` with the
    sample variance ``s^2`` (``ddof=1``); 0 when n = N, None when n = 1 < N."""
    n = len(acc)
    if n >= population:
        return 0.0
    if n < 2:
        return None
    return math.sqrt((1 - n / population) * float(acc.var(ddof=1)) / n)


def ratio_se(correct: np.ndarray, counts: np.ndarray, population: int) -> float | None:
    """Standard error of the ratio estimator ``R = sum(correct) / sum(counts)`` (the pooled,
    sample-weighted accuracy) from a simple random sample without replacement of n of
    ``population`` = N clients, linearised: ``sqrt((1 - n/N) / (n * mbar^2) *
    sum((correct - R * counts)^2) / (n - 1))``, ``mbar`` the sample mean of ``counts``; 0
    when n = N, None when n = 1 < N or the sample has no test samples."""
    n = len(counts)
    if n >= population:
        return 0.0
    if n < 2 or counts.sum() <= 0:
        return None
    r = correct.sum() / counts.sum()
    resid = correct - r * counts
    mbar = counts.mean()
    return math.sqrt((1 - n / population) / (n * mbar**2) * float((resid**2).sum()) / (n - 1))


def sampled_metrics(
    acc: Mapping[int, float], population: int, counts: np.ndarray, prefix: str = "pers_acc"
) -> dict[str, float | None]:
    """The summary of a sample of clients' accuracies ``acc`` (:func:`summarize_clients`, its
    keys under ``prefix``) as estimates for a population of ``population`` clients, with
    ``<prefix>_mean_se`` (:func:`mean_se`) and ``<prefix>_weighted_se`` (:func:`ratio_se`;
    ``counts``: every client's test samples)."""
    cids = sorted(acc)
    a, m = np.array([acc[c] for c in cids], dtype=float), counts[cids]
    out: dict[str, float | None] = _renamed(summarize_clients(a, m), prefix)
    out[f"{prefix}_mean_se"] = mean_se(a, population)
    out[f"{prefix}_weighted_se"] = ratio_se(a * m, m, population)
    return out


def _renamed(summary: dict[str, float], prefix: str) -> dict[str, float]:
    return {prefix + k.removeprefix("pers_acc"): v for k, v in summary.items()}


def trained_split(acc: Mapping[int, float], trained: np.ndarray) -> dict[str, float | int]:
    """The scored clients (``acc``) that have trained (``trained[cid]``: selected in a round
    so far and not dropped out) and those that have not, apart: ``pers_acc_trained`` and
    ``pers_acc_untrained`` (unweighted means; a group without clients is left out) and their
    counts ``eval_trained``, ``eval_untrained``."""
    out: dict[str, float | int] = {}
    for name, want in (("trained", True), ("untrained", False)):
        group = [acc[c] for c in sorted(acc) if bool(trained[c]) is want]
        out[f"eval_{name}"] = len(group)
        if group:
            out[f"pers_acc_{name}"] = float(np.mean(group))
    return out


def holdout_metrics(
    acc: Mapping[int, float], population: int, counts: np.ndarray, num_clients: int
) -> dict:
    """The held-out clients' accuracies ``acc`` after their personalization step
    (``data.holdout_clients``): :func:`summarize_clients` as ``holdout_acc_*`` (mean,
    weighted, std, cv, worst10), with standard errors as :func:`sampled_metrics` gives them
    when fewer than ``population`` (the held-out clients) were scored, their count
    ``eval_holdout`` and the per-client list ``holdout_acc_clients`` (None for the others)."""
    out: dict = {}
    if acc:
        out = sampled_metrics(acc, population, counts, "holdout_acc")
        if len(acc) >= population:  # every held-out client: no sampling error to report
            del out["holdout_acc_mean_se"], out["holdout_acc_weighted_se"]
    out["eval_holdout"] = len(acc)
    out["holdout_acc_clients"] = [acc.get(c) for c in range(num_clients)]
    return out
