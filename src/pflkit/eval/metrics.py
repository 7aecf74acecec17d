"""Metrics as plug-ins: the :data:`METRICS` registry, and the fields a run's rows give them.

``eval.metrics`` chooses among the registered metrics (default ``[accuracy]``). Accuracy is
always scored: its fields (``pers_acc_*``, ``global_acc``, ...) are every row's headline, as
:mod:`pflkit.eval.evaluate` describes. Each other metric chosen adds, under its row ``key``:

- ``pers_<key>_mean``: the unweighted mean over the scored clients of their own value;
- ``pers_<key>_weighted``: the *pooled* value, the metric of all scored clients' test
  predictions together (the sum of their sufficient statistics, then the metric); for accuracy
  and loss that is the sample-weighted mean, for macro-F1, balanced accuracy and ECE it is not
  any mean of the clients' values;
- ``pers_<key>_std`` (population std over clients), ``pers_<key>_worst10`` (the mean of the
  worst 10% of clients, at least one: the lowest values, or the highest where lower is better)
  and ``pers_<key>_clients`` (every client's value, null for a client not scored);
- ``global_<key>``: the server's model on the global test set (``global_loss`` is in every row
  already, the same number);
- with a validation split (``data.val_fraction``): ``val_pers_<key>_mean`` / ``_weighted`` /
  ``_std`` / ``_worst10`` and ``val_global_<key>``;
- with held-out clients (``data.holdout_clients``): ``holdout_<key>_mean`` / ``_weighted`` /
  ``_std`` / ``_worst10``.

Under sampled evaluation (``eval.clients: n``) the same fields are the sample's values, with no
standard error. MAP's protocol (``pers_acc_selected``) scores accuracy only.

A client never sends its predictions: it sends each metric's *sufficient statistics*
(:meth:`Metric.stats`: counts and sums, numbers and small NumPy arrays, which every runner
carries as plain data); the server sums them over clients (:func:`add_stats`) and computes the
metric of the sum (:meth:`Metric.value`).

The registered metrics (``key`` in brackets):

- ``accuracy`` [acc]: correct predictions / predictions (tokens, for next-token prediction);
- ``loss`` [loss]: the mean cross-entropy (natural log) over predictions;
- ``perplexity`` [ppl]: exp of that mean;
- ``f1_macro`` [f1_macro]: the unweighted mean over classes of F1 = 2 TP / (2 TP + FP + FN),
  over the classes present in the targets or the predictions (a class in neither is left
  out; scikit-learn's ``f1_score(average="macro")`` with its default labels);
- ``balanced_accuracy`` [bal_acc]: the unweighted mean over the classes present in the targets
  of their recall TP / (TP + FN) (scikit-learn's ``balanced_accuracy_score``);
- ``ece`` [ece]: expected calibration error with 15 equal-width confidence bins (Guo et al.,
  "On Calibration of Modern Neural Networks", ICML 2017, eq. 3): the confidence of a
  prediction is its largest softmax probability, bin m holds the confidences in
  ((m-1)/15, m/15], and ECE = sum over bins of |correct in bin - sum of confidences in bin| / n.

Macro-F1 and balanced accuracy need a confusion matrix, C x C counts: classification only.
Adding a metric is one class registered here or from a plug-in (docs/guide.md, "Adding a
metric").
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from pflkit.errors import PflkitError
from pflkit.eval.tasks import Task
from pflkit.primitives.training import predict
from pflkit.registry import Registry

Stats = dict[str, Any]
"""A metric's sufficient statistics: numbers and NumPy arrays that add up over clients."""
DEFAULT = ("accuracy",)
"""``eval.metrics``' default."""
ECE_BINS = 15
"""The equal-width confidence bins of :class:`ECE`."""


class Metric:
    """A metric (module docstring). Subclasses set the class attributes and implement
    :meth:`stats` and :meth:`value`; statistics of several clients are summed key by key."""

    name: str = ""  # in eval.metrics and the registry
    key: str = ""  # in the row's field names
    description: str = ""
    higher_is_better: bool = True
    percent: bool = True  # a share, which reports show x 100
    tasks: tuple[str, ...] = ("classification",)  # the tasks it applies to

    def stats(self, logits: Tensor, target: Tensor, num_classes: int) -> Stats:
        """The sufficient statistics of ``[M, C]`` ``logits`` against ``[M]`` ``target``."""
        raise NotImplementedError

    def value(self, stats: Stats) -> float | None:
        """The metric of (summed) statistics; None where it is undefined (no predictions)."""
        raise NotImplementedError


METRICS: Registry[type[Metric]] = Registry("metric")
"""Name -> :class:`Metric` subclass: what ``eval.metrics`` chooses among."""


@METRICS.add
class Accuracy(Metric):
    """Correct predictions / predictions; statistics: ``correct``, ``n``."""

    name, key = "accuracy", "acc"
    description = "correct predictions / predictions (tokens for next-token prediction)"
    tasks = ("classification", "next_token")

    def stats(self, logits, target, num_classes):
        return {"correct": int((logits.argmax(1) == target).sum()), "n": int(target.numel())}

    def value(self, stats):
        return stats["correct"] / max(stats["n"], 1)  # 0 for an empty split, as always


def _ce_sum(logits: Tensor, target: Tensor) -> float:
    if not target.numel():
        return 0.0
    return float(F.cross_entropy(logits, target, reduction="none").double().sum())


@METRICS.add
class Loss(Metric):
    """The mean cross-entropy; statistics: ``loss_sum`` (float64), ``n``."""

    name, key = "loss", "loss"
    description = "mean cross-entropy (natural log) over predictions"
    higher_is_better = False
    percent = False
    tasks = ("classification", "next_token")

    def stats(self, logits, target, num_classes):
        return {"loss_sum": _ce_sum(logits, target), "n": int(target.numel())}

    def value(self, stats):
        return stats["loss_sum"] / stats["n"] if stats["n"] else None


@METRICS.add
class Perplexity(Loss):
    """exp of the mean cross-entropy; the statistics of :class:`Loss`."""

    name, key = "perplexity", "ppl"
    description = "exp(mean cross-entropy)"

    def value(self, stats):
        mean = super().value(stats)
        return None if mean is None else math.exp(min(mean, 700.0))  # no overflow


def confusion(logits: Tensor, target: Tensor, num_classes: int) -> np.ndarray:
    """``[C, C]`` int64 counts: row = true class, column = predicted class."""
    cells = target.long() * num_classes + logits.argmax(1)
    counts = torch.bincount(cells.cpu(), minlength=num_classes * num_classes)
    return counts.numpy().reshape(num_classes, num_classes).astype(np.int64)


@METRICS.add
class MacroF1(Metric):
    """Macro-averaged F1 (module docstring); statistics: the ``confusion`` counts."""

    name, key = "f1_macro", "f1_macro"
    description = "unweighted mean over classes of F1 (classes in the targets or predictions)"

    def stats(self, logits, target, num_classes):
        return {"confusion": confusion(logits, target, num_classes)}

    def value(self, stats):
        m = np.asarray(stats["confusion"])
        tp = np.diag(m).astype(float)
        denom = m.sum(0) + m.sum(1)  # 2 TP + FP + FN
        seen = denom > 0
        return float((2 * tp[seen] / denom[seen]).mean()) if seen.any() else None


@METRICS.add
class BalancedAccuracy(Metric):
    """The mean recall over the classes in the targets; statistics: the ``confusion``."""

    name, key = "balanced_accuracy", "bal_acc"
    description = "unweighted mean over the classes in the targets of their recall"

    def stats(self, logits, target, num_classes):
        return {"confusion": confusion(logits, target, num_classes)}

    def value(self, stats):
        m = np.asarray(stats["confusion"])
        support = m.sum(1)
        seen = support > 0
        return float((np.diag(m)[seen] / support[seen]).mean()) if seen.any() else None


@METRICS.add
class ECE(Metric):
    """Expected calibration error (module docstring); statistics per bin: ``count``,
    ``conf`` (summed confidence), ``correct``."""

    name, key = "ece", "ece"
    description = f"expected calibration error, {ECE_BINS} equal-width confidence bins"
    higher_is_better = False
    tasks = ("classification", "next_token")

    def stats(self, logits, target, num_classes):
        conf, pred = F.softmax(logits.double(), 1).max(1)
        b = (torch.ceil(conf * ECE_BINS).long() - 1).clamp(0, ECE_BINS - 1).cpu()
        hit = (pred == target).double().cpu()

        def per_bin(w: Tensor | None) -> np.ndarray:
            return torch.bincount(b, weights=w, minlength=ECE_BINS).double().numpy()

        return {"count": per_bin(None), "conf": per_bin(conf.cpu()), "correct": per_bin(hit)}

    def value(self, stats):
        n = float(np.sum(stats["count"]))
        gap = np.abs(np.asarray(stats["correct"]) - np.asarray(stats["conf"])).sum()
        return float(gap / n) if n else None


# -- choosing metrics -------------------------------------------------------------------------


def resolve(names: Sequence[str], task: str | None = "classification") -> list[Metric]:
    """The metric objects of ``names`` (``eval.metrics``); an unknown one, or one the data's
    ``task`` does not support (None: not checked), is one sentence."""
    out = []
    for name in names:
        if name not in METRICS:
            known = ", ".join(sorted(METRICS))
            raise PflkitError(
                f"unknown metric '{name}' in eval.metrics: the registered metrics are {known}"
            )
        metric = METRICS[name]()
        if task is not None and task not in metric.tasks:
            raise PflkitError(
                f"metric '{name}' does not apply to the {task} task of this dataset (it "
                f"applies to {', '.join(metric.tasks)}): remove it from eval.metrics"
            )
        out.append(metric)
    return out


def extra(names: Sequence[str]) -> tuple[str, ...]:
    """The metrics of ``names`` beyond accuracy, which every row has anyway."""
    return tuple(n for n in dict.fromkeys(names) if n != "accuracy")


# -- one model on one split (where the client runs) -------------------------------------------------


def score_split(
    model: nn.Module,
    x: Tensor,
    y: Tensor,
    batch_size: int,
    task: Task,
    num_classes: int,
    metrics: Sequence[Metric] = (),
) -> tuple[float, dict[str, Stats]]:
    """``model``'s accuracy on ``(x, y)`` (correct / predictions; 0 for an empty split) and
    each of ``metrics``' statistics by name, from one forward pass (``predict``)."""
    logits, target = task.flat(predict(model, x, batch_size), y)
    acc = Accuracy().value(Accuracy().stats(logits, target, num_classes))
    return acc, {m.name: m.stats(logits, target, num_classes) for m in metrics}


# -- the row fields (where the server assembles the row) ----------------------------------------------


def add_stats(parts: Iterable[Stats]) -> Stats:
    """The key-by-key sum of several statistics (numbers and arrays)."""
    total: Stats = {}
    for part in parts:
        for k, v in part.items():
            total[k] = total[k] + np.asarray(v) if k in total else np.asarray(v)
    return total


def _float(v: float | None) -> float | None:
    return None if v is None else float(v)


def client_fields(
    metric: Metric,
    stats: Mapping[int, Stats],
    prefix: str,
    num_clients: int | None = None,
) -> dict[str, Any]:
    """``<prefix>_<key>_{mean,weighted,std,worst10}`` of the clients' statistics ``stats``
    (module docstring) and, given ``num_clients``, ``<prefix>_<key>_clients``."""
    name = f"{prefix}_{metric.key}"
    values = {cid: _float(metric.value(s)) for cid, s in stats.items()}
    got = np.array([v for v in values.values() if v is not None], dtype=float)
    out: dict[str, Any] = {}
    if len(got):
        order = np.sort(got) if metric.higher_is_better else -np.sort(-got)
        out[f"{name}_mean"] = float(got.mean())
        pooled = metric.value(add_stats(stats.values()))
        out[f"{name}_weighted"] = None if pooled is None else float(pooled)
        out[f"{name}_std"] = float(got.std())
        out[f"{name}_worst10"] = float(order[: max(math.ceil(0.1 * len(got)), 1)].mean())
    if num_clients is not None:
        out[f"{name}_clients"] = [values.get(c) for c in range(num_clients)]
    return out


def metric_fields(
    metrics: Sequence[Metric],
    results: Mapping[int, Any],
    scored: Sequence[int],
    num_clients: int,
    holdout: Sequence[int] = (),
) -> dict[str, Any]:
    """The row fields of ``metrics`` from the clients' evaluation results (``results[cid]
    ["stats"][split][metric]``, :func:`pflkit.engine.clients.evaluate_client`) of the
    ``scored`` clients and the ``holdout`` ones (module docstring)."""

    def of(m: Metric, cids: Sequence[int], split: str) -> dict[int, Stats]:
        return {
            c: results[c]["stats"][split][m.name]
            for c in cids
            if c in results and split in results[c].get("stats", {})
        }

    out: dict[str, Any] = {}
    for m in metrics:
        out |= client_fields(m, of(m, scored, "test"), "pers", num_clients)
        if val := of(m, scored, "val"):
            out |= client_fields(m, val, "val_pers")
        if held := of(m, holdout, "test"):
            out |= client_fields(m, held, "holdout")
    return out


def global_fields(
    metrics: Sequence[Metric],
    model: nn.Module,
    x: Tensor,
    y: Tensor,
    batch_size: int,
    task: Task,
    num_classes: int,
    prefix: str = "global",
) -> dict[str, Any]:
    """``<prefix>_<key>`` of ``model`` (the server's, weights loaded) on ``(x, y)``."""
    _, stats = score_split(model, x, y, batch_size, task, num_classes, metrics)
    return {f"{prefix}_{m.key}": _float(m.value(stats[m.name])) for m in metrics}


def row_keys(metric: Metric) -> dict[str, str]:
    """The summary fields a chosen ``metric`` adds that ``pflkit report --metric`` can
    compare, with a column title each."""
    k, what = metric.key, metric.name.replace("_", " ")
    return {
        f"pers_{k}_mean": f"personalized {what}",
        f"pers_{k}_weighted": f"pooled {what}",
        f"pers_{k}_worst10": f"worst 10% {what}",
        f"global_{k}": f"global {what}",
    }


def field_metric(field: str) -> Metric | None:
    """The registered metric (accuracy aside) that a row field such as ``pers_loss_mean``,
    ``val_global_ece`` or ``holdout_f1_macro_worst10`` belongs to; None for any other."""
    base = field.removeprefix("val_")
    for cls in METRICS.values():
        m = cls()
        if m.name == "accuracy":
            continue
        stats = ("mean", "weighted", "std", "worst10")
        names = {f"{p}_{m.key}_{s}" for p in ("pers", "holdout") for s in stats}
        if base in names or base == f"global_{m.key}":
            return m
    return None


def fields_in(row: Mapping[str, Any]) -> dict[str, Metric]:
    """The fields of ``row`` that chosen metrics (accuracy aside) gave it, each with its
    metric: a metric counts as chosen when the row has its ``pers_<key>_mean``, ``global_<key>``
    alone being in every row for loss (``global_loss``)."""
    out: dict[str, Metric] = {}
    for cls in METRICS.values():
        m = cls()
        if m.name == "accuracy" or f"pers_{m.key}_mean" not in row:
            continue
        out |= {k: m for k in row if _of(k, m)}
    return out


def _of(field: str, metric: Metric) -> bool:
    found = field_metric(field)
    return found is not None and found.name == metric.name
