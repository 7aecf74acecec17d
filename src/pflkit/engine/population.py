"""Which clients train, which are held out, which an evaluation round scores, and which have
trained so far: every answer a function of seeds and the config alone, so every algorithm of a
compare, every runner and a resumed run get the same (docs/guide.md, "Evaluation").

- :func:`holdout_clients`: ``data.holdout_clients`` f of the K clients (round(f K)) never
  train; drawn from ``data.seed`` alone, so the same across training seeds and algorithms.
- :func:`eval_sample`: ``eval.clients: n``, the clients an evaluation round scores, a simple
  random sample without replacement from (seed, round) alone.
- :func:`trained_clients`: the clients that took part in at least one round up to round r
  (selected by :func:`~pflkit.engine.simulation.sample_clients` and not dropped out by
  :func:`~pflkit.engine.clients.system_draw`), recomputed from the seeds: no state to
  checkpoint. A client whose work failed (Flower) or diverged (``train.on_nan:
  skip_client``) in every round it was selected still counts as trained.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import numpy as np

from pflkit.config import ExperimentConfig
from pflkit.engine.clients import system_draw
from pflkit.errors import PflkitError

# sample_clients(seed, round, num_clients, fraction, holdout) -> the round's clients
Sampler = Callable[[int, int, int, "float | list[float]", tuple[int, ...]], list[int]]


@functools.lru_cache(maxsize=64)
def holdout_clients(data_seed: int, num_clients: int, fraction: float) -> tuple[int, ...]:
    """The held-out clients, sorted: round(``fraction`` * K) of the K clients, without
    replacement, from a generator seeded by (``data.seed``, 0x401D). One sentence when they
    would leave no client to train."""
    h = int(round(fraction * num_clients))
    if h == 0:
        return ()
    if h >= num_clients:
        raise PflkitError(
            f"data.holdout_clients {fraction} holds out {h} of the {num_clients} clients and "
            "leaves none to train: lower it (at most "
            f"{(num_clients - 1) / num_clients:.3g} here), or use more clients"
        )
    rng = np.random.default_rng([data_seed, 0x401D])
    return tuple(sorted(int(c) for c in rng.choice(num_clients, h, replace=False)))


def held_out(cfg: ExperimentConfig) -> tuple[int, ...]:
    """The run's held-out clients (:func:`holdout_clients` of its ``data`` section)."""
    d = cfg.data
    return holdout_clients(d.seed, d.num_clients, d.holdout_clients)


def training_clients(num_clients: int, holdout: tuple[int, ...]) -> Sequence[int]:
    """The clients that may be selected to train: all but the held-out ones, in order (a
    ``range`` when there are none)."""
    if not holdout:
        return range(num_clients)
    out = set(holdout)
    return [c for c in range(num_clients) if c not in out]


def eval_sample(
    seed: int, rnd: int, population: Sequence[int], size: int | str, stream: int = 0xE5A
) -> list[int]:
    """The clients of ``population`` that evaluation round ``rnd`` scores: all of them
    (``size`` "all", or a number at least the population's size: capped), else a simple random
    sample of ``size`` without replacement from a generator seeded by (seed, round,
    ``stream``; the held-out clients draw from 0xE5B), sorted. The same for every algorithm
    and runner."""
    if size == "all" or int(size) >= len(population):
        return list(population)
    rng = np.random.default_rng([seed, rnd, stream])
    picked = rng.choice(len(population), int(size), replace=False)
    return sorted(population[int(i)] for i in picked)


class TrainedClients:
    """Whether each client has trained by round r (:func:`trained_clients`), computed
    incrementally: asking for round r after round r' < r draws only rounds r'+1..r.
    ``sample``: the engine's :func:`~pflkit.engine.simulation.sample_clients`."""

    def __init__(self, cfg: ExperimentConfig, num_clients: int, sample: Sampler):
        self.cfg, self.num_clients, self.sample = cfg, num_clients, sample
        self.mask = np.zeros(num_clients, dtype=bool)
        self.upto = 0

    def upto_round(self, rnd: int) -> np.ndarray:
        """A bool array: client c trained in one of rounds 1..``rnd``."""
        if rnd < self.upto:
            self.mask[:], self.upto = False, 0
        cfg, n = self.cfg, self.num_clients
        holdout = held_out(cfg)
        for r in range(self.upto + 1, rnd + 1):
            for cid in self.sample(cfg.seed, r, n, cfg.train.client_fraction, holdout):
                if not system_draw(cfg.system, cfg.seed, r, cid)[0]:
                    self.mask[cid] = True
        self.upto = rnd
        return self.mask.copy()


def trained_clients(
    cfg: ExperimentConfig, num_clients: int, rnd: int, sample: Sampler
) -> np.ndarray:
    """Whether each client took part in at least one of rounds 1..``rnd`` (bool array;
    ``sample``: the engine's :func:`~pflkit.engine.simulation.sample_clients`)."""
    return TrainedClients(cfg, num_clients, sample).upto_round(rnd)
