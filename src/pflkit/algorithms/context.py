"""The two contexts of the contract, one per side, both frozen: hooks read them, never change
them.

- :class:`RoundContext`: what a client's work in one round needs to know besides its
  environment, its payload and its state, passed to every client-side hook
  (:meth:`~pflkit.algorithms.Algorithm.client_update`, ``personal_model``, ``adapt_holdout``)
  and from there to :meth:`~pflkit.algorithms.ClientEnv.train`. The engine builds one per
  client and exchange (:func:`pflkit.engine.clients.round_context`).
- :class:`ServerContext`: the same for the server-side hooks (``configure``, ``aggregate``,
  ``eval_view``): the round, the exchange and the run's seed.

A test builds them by hand, e.g. ``RoundContext(1)`` for plain SGD in round 1 and
``ServerContext(1)`` for its aggregation.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from pflkit.primitives.training import LocalOptim

EVALUATE = "evaluate"
"""The phase name of evaluation contexts (client and server side)."""


@dataclass(frozen=True)
class RoundContext:
    """One client's round, as the engine runs it (frozen: hooks read it, never change it)."""

    round: int
    """The round, 1-based."""
    phase: str = "train"
    """The exchange (one of ``phases(round)``), ``"evaluate"`` for evaluation."""
    seed: int = 0
    """The run's seed (``seed``)."""
    lr_factor: float = 1.0
    """The round's learning-rate factor (``train.lr_schedule``)."""
    optimizer: str = "sgd"
    """sgd, adam or adamw (``train.optimizer``)."""
    drop_last: bool = False
    """Epochs skip their last, incomplete batch (``train.drop_last``)."""
    work: float = 1.0
    """The share of its local steps the client runs this round: below 1 for a straggler
    (``system.straggler_work``)."""

    @property
    def optim(self) -> LocalOptim:
        """The optimiser, lr factor and batching that ``local_sgd`` runs with this round."""
        return LocalOptim(self.optimizer, self.lr_factor, self.drop_last)

    def work_steps(self, steps: int) -> int:
        """How many of ``steps`` local steps the client runs this round: all of them, or a
        straggler's ``max(1, floor(work * steps))`` (none of none)."""
        if self.work >= 1 or steps == 0:
            return steps
        return max(1, math.floor(self.work * steps))


@dataclass(frozen=True)
class ServerContext:
    """One server-side step of a round, as the engine runs it: the arguments of every
    server hook after the server state (frozen, like :class:`RoundContext`)."""

    round: int
    """The round, 1-based."""
    phase: str = "train"
    """The exchange (one of ``phases(round)``), :data:`EVALUATE` for evaluation views."""
    seed: int = 0
    """The run's seed (``seed``)."""
