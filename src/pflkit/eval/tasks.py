"""Tasks: what a dataset's targets are and how a model's outputs are scored against them.

A :class:`~pflkit.data.base.Source` names its task (``Source.task``); the engine and the
metrics (:mod:`pflkit.eval.metrics`) ask the task object, never the task's name:

- ``classification``: one integer class per sample (``y`` ``[N]``), logits ``[N, C]``;
  every registered partitioner applies (they read the labels);
- ``next_token``: next-token prediction on token sequences: ``x`` ``[N, L]`` token ids (float32,
  exact integers, like the classification text sources), ``y`` ``[N, L]`` the next token at each
  position, logits ``[N, V, L]`` (V the vocabulary, as ``num_classes``). The class dimension
  is dimension 1 for both tasks, so ``F.cross_entropy(logits, y)``, the loss of local
  training (:func:`pflkit.primitives.training.cross_entropy`), is the mean token
  cross-entropy here without a change. Only ``iid`` and ``natural`` (one client per document
  or user, when the source has groups) partition it: the other partitioners split by class
  label, which a token sequence has not.

Adding a task is one class registered in :data:`TASKS` (docs/guide.md, "Adding a task").
"""

from __future__ import annotations

import numpy as np
import torch.nn.functional as F
from torch import Tensor

from pflkit.errors import PflkitError
from pflkit.registry import Registry


class Task:
    """A prediction task (module docstring). Subclasses set the class attributes and override
    :meth:`flat` (and :meth:`partition_labels` when the targets are not one class per sample)."""

    name: str = ""
    description: str = ""
    #: the partitioners that may split it; None: every registered one
    partitions: tuple[str, ...] | None = None

    def flat(self, logits: Tensor, y: Tensor) -> tuple[Tensor, Tensor]:
        """The scored predictions as ``[M, C]`` logits and their ``[M]`` integer targets (one
        row per predicted target: a sample, or a token)."""
        return logits, y

    def loss(self, logits: Tensor, y: Tensor) -> Tensor:
        """The mean cross-entropy over every target of ``y``."""
        return F.cross_entropy(logits, y)

    def partition_labels(self, y: np.ndarray) -> np.ndarray:
        """One integer per training sample for the partitioners (the class labels)."""
        return y

    def check_partition(self, partitioner: str, dataset: str) -> None:
        """Refuse a partitioner this task cannot use, in one sentence."""
        if self.partitions is not None and partitioner not in self.partitions:
            raise PflkitError(
                f"partitioner '{partitioner}' splits by class label, which the {self.name} "
                f"task of dataset '{dataset}' does not have: use data.partition.name "
                f"{' or '.join(self.partitions)}"
            )


TASKS: Registry[type[Task]] = Registry("task")
"""Name -> :class:`Task` subclass: the tasks a source may name (``Source.task``)."""


@TASKS.add
class Classification(Task):
    """One class per sample."""

    name = "classification"
    description = "one class per sample: labels [N], logits [N, C]"


@TASKS.add
class NextToken(Task):
    """The next token at every position of a token sequence (module docstring)."""

    name = "next_token"
    description = (
        "next-token prediction: token ids [N, L], targets the next token at each position "
        "[N, L], logits [N, V, L]"
    )
    partitions = ("iid", "natural")

    def flat(self, logits: Tensor, y: Tensor) -> tuple[Tensor, Tensor]:
        return logits.movedim(1, -1).reshape(-1, logits.shape[1]), y.reshape(-1)

    def partition_labels(self, y: np.ndarray) -> np.ndarray:
        return np.zeros(len(y), dtype=np.int64)  # iid and natural read only the count


def get_task(name: str) -> Task:
    """The registered task ``name``, as an object."""
    return TASKS.lookup(name)()
