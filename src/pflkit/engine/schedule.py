"""The learning-rate schedule over rounds (``train.lr_schedule``): the factor each round's
local learning rates are multiplied by. The engine puts it in every client's round context
(:func:`pflkit.engine.clients.round_context`, ``RoundContext.lr_factor``)."""

from __future__ import annotations

import math

from pflkit.config import TrainConfig


def lr_factor(t: TrainConfig, rnd: int) -> float:
    """The factor ``t.lr_schedule`` multiplies the learning rates of round ``rnd`` (1-based)
    by: 1 for constant; ``lr_gamma ** ((rnd - 1) // lr_step_rounds)`` for step; for cosine,
    ``(lr_min + (lr - lr_min) (1 + cos(pi (rnd - 1) / rounds)) / 2) / lr``."""
    if t.lr_schedule == "step":
        return t.lr_gamma ** ((rnd - 1) // t.lr_step_rounds)
    if t.lr_schedule == "cosine":
        cos = (1 + math.cos(math.pi * (rnd - 1) / t.rounds)) / 2
        return (t.lr_min + (t.lr - t.lr_min) * cos) / t.lr
    return 1.0
