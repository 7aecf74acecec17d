"""The embedded simulation engine: the one round loop over the algorithm contract.

Per round ``r`` (1-based):

1. sample the clients of round ``r`` (:func:`sample_clients`, which depends only on the seed,
   the round and the client count: every algorithm sees the same sequence);
2. for each phase of the algorithm, for each selected client: ``configure`` its payload, seed
   torch from (seed, round, phase, client), run ``client_update``, count the bytes of payload
   and upload, then ``aggregate``;
3. evaluate on the schedule (``eval.every`` and always the last round);
4. append one line to ``metrics.jsonl``; checkpoint every ``output.checkpoint_every`` rounds.

Because every random draw is seeded from (seed, round, phase, client), a run resumed from a
checkpoint continues exactly as the uninterrupted run would have.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pflkit.algorithms import Context, build_algorithm
from pflkit.algorithms.base import State, nbytes, parse_params
from pflkit.config import ExperimentConfig
from pflkit.data.federated import FederatedDataset, build_federated
from pflkit.engine.checkpoint import load_checkpoint, save_checkpoint
from pflkit.eval import evaluate_round, evaluate_selected

Progress = Callable[[int, dict[str, Any]], None]


def sample_clients(seed: int, rnd: int, num_clients: int, fraction: float) -> list[int]:
    """Clients taking part in round ``rnd``: max(round(fraction * K), 1) without replacement."""
    m = max(int(round(fraction * num_clients)), 1)
    if m >= num_clients:
        return list(range(num_clients))
    rng = np.random.default_rng([seed, rnd, 0x5A])
    return sorted(int(c) for c in rng.choice(num_clients, m, replace=False))


def seed_torch(*keys: int) -> None:
    """Seed torch's global RNG from a tuple of integers (independent streams per tuple)."""
    torch.manual_seed(int(np.random.SeedSequence(list(keys)).generate_state(1)[0]))


class Simulation:
    """One run of one algorithm on one federated dataset.

    Construct it (validates everything, builds data, model and algorithm), then call
    :meth:`run`. Nothing is written to disk until :meth:`run` is called, so a bad config never
    leaves a half-written run folder.
    """

    def __init__(self, cfg: ExperimentConfig, data: FederatedDataset | None = None):
        self.cfg = cfg
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        parse_params(cfg.algorithm)  # fail on bad parameters before the (slow) data load
        self.data = data if data is not None else build_federated(cfg.data)
        self.ctx = Context(cfg, self.data, torch.device(cfg.device))
        self.algo = build_algorithm(self.ctx)
        seed_torch(cfg.seed, 0, 0xD0)
        self.server: State = self.algo.server_init()
        self.clients: dict[int, State] = {}
        self.round = 0

    # -- client state store ----------------------------------------------------------------------
    def client_state(self, cid: int) -> State:
        if cid not in self.clients:
            seed_torch(self.cfg.seed, 0, 0xC1, cid)
            self.clients[cid] = self.algo.client_init(cid)
        return self.clients[cid]

    # -- checkpoints -------------------------------------------------------------------------------
    def save(self, path: Path) -> None:
        save_checkpoint(path, {"round": self.round, "server": self.server, "clients": self.clients})

    def restore(self, path: Path) -> None:
        ckpt = load_checkpoint(path)
        self.round, self.server, self.clients = ckpt["round"], ckpt["server"], ckpt["clients"]

    # -- the round loop ----------------------------------------------------------------------------
    def run_round(self, rnd: int) -> dict[str, Any]:
        cfg, algo = self.cfg, self.algo
        t0 = time.perf_counter()
        selected = sample_clients(cfg.seed, rnd, self.data.num_clients, cfg.train.client_fraction)
        down = dict.fromkeys(selected, 0)
        up = dict.fromkeys(selected, 0)
        losses: list[float] = []
        for p, phase in enumerate(algo.phases(rnd)):
            uploads = {}
            for cid in selected:
                payload = algo.configure(self.server, cid, rnd, phase)
                down[cid] += nbytes(payload)
                state = self.client_state(cid)
                seed_torch(cfg.seed, rnd, p, cid)
                upload, self.clients[cid], metrics = algo.client_update(
                    cid, payload, state, rnd, phase
                )
                up[cid] += nbytes(upload)
                uploads[cid] = upload
                if "train_loss" in metrics:
                    losses.append(metrics["train_loss"])
            seed_torch(cfg.seed, rnd, p, 0xA6)
            self.server = algo.aggregate(self.server, uploads, rnd, phase)
        t1 = time.perf_counter()
        row: dict[str, Any] = {"round": rnd, "clients": selected}
        if losses:
            row["train_loss"] = float(np.mean(losses))
        row["bytes_down"] = [down[c] for c in selected]
        row["bytes_up"] = [up[c] for c in selected]
        if rnd % cfg.eval.every == 0 or rnd == cfg.train.rounds:
            seed_torch(cfg.seed, rnd, 0xE7)
            row.update(
                evaluate_round(
                    algo, self.server, self.client_state, cfg.eval.batch_size, cfg.eval.global_model
                )
            )
            if cfg.eval.selected_clients:
                row.update(
                    evaluate_selected(
                        algo, self.server, uploads, self.client_state, cfg.eval.batch_size
                    )
                )
        t2 = time.perf_counter()
        # the only non-deterministic fields of a metrics row start with "seconds_"
        row["seconds_train"] = t1 - t0
        row["seconds_eval"] = t2 - t1
        self.round = rnd
        return row
