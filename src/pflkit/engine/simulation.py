"""The embedded simulation engine: the one round loop over the algorithm contract.

Per round ``r`` (1-based):

1. sample the clients of round ``r`` (:func:`sample_clients`, which depends only on the seed,
   the round and the client count: every algorithm sees the same sequence);
2. for each phase of the algorithm, for each selected client: ``configure`` its payload, seed
   torch from (seed, round, phase, client), run ``client_update``, count the bytes of payload
   and upload, then ``aggregate``;
3. evaluate on the schedule (``eval.every`` and always the last round);
4. append one line to ``metrics.jsonl``; checkpoint every ``output.checkpoint_every`` rounds.

The client side of steps 2 and 3 (``train_clients``, ``personal_accuracies``,
``selected_accuracies``) is what :mod:`pflkit.flower` overrides to run on SuperNodes; a client
whose work fails there is listed in ``failed_clients`` and left out of that round's aggregate.

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
from pflkit.algorithms.base import Payload, State, Upload, nbytes, parse_params
from pflkit.config import ExperimentConfig
from pflkit.data.federated import FederatedDataset, build_federated
from pflkit.engine.checkpoint import load_checkpoint, save_checkpoint
from pflkit.eval import (
    global_metrics,
    personal_accuracies,
    personal_metrics,
    selected_accuracy,
)

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
        failed: list[int] = []
        uploads: dict[int, Upload] = {}
        for p, phase in enumerate(algo.phases(rnd)):
            payloads = {
                cid: algo.configure(self.server, cid, rnd, phase)
                for cid in selected
                if cid not in failed
            }
            for cid, payload in payloads.items():
                down[cid] += nbytes(payload)
            results = self.train_clients(rnd, p, phase, payloads)
            failed += [cid for cid in payloads if cid not in results]
            uploads = {cid: upload for cid, (upload, _) in results.items()}
            for cid, (upload, metrics) in results.items():
                up[cid] += nbytes(upload)
                if "train_loss" in metrics:
                    losses.append(metrics["train_loss"])
            if uploads:  # nothing to aggregate when every client of the round failed
                seed_torch(cfg.seed, rnd, p, 0xA6)
                self.server = algo.aggregate(self.server, uploads, rnd, phase)
        t1 = time.perf_counter()
        row: dict[str, Any] = {"round": rnd, "clients": selected}
        if failed:
            row["failed_clients"] = failed
        if losses:
            row["train_loss"] = float(np.mean(losses))
        row["bytes_down"] = [down[c] for c in selected]
        row["bytes_up"] = [up[c] for c in selected]
        if rnd % cfg.eval.every == 0 or rnd == cfg.train.rounds:
            if cfg.eval.global_model:
                row.update(global_metrics(algo, self.server, cfg.eval.batch_size))
            acc = self.personal_accuracies(rnd)
            counts = np.array([len(c.test_y) for c in self.data.clients], dtype=float)
            row.update(personal_metrics(acc, self.data.num_clients, counts))
            if cfg.eval.selected_clients and uploads:
                sel = self.selected_accuracies(rnd, uploads)
                row["pers_acc_selected"] = float(np.mean(list(sel.values())))
            missing = sorted(set(range(self.data.num_clients)) - set(acc))
            if missing:
                row["eval_failed_clients"] = missing
        t2 = time.perf_counter()
        # the only non-deterministic fields of a metrics row start with "seconds_"
        row["seconds_train"] = t1 - t0
        row["seconds_eval"] = t2 - t1
        self.round = rnd
        return row

    # -- client work: the embedded engine runs it here; pflkit.flower sends it to SuperNodes -------
    def train_clients(
        self, rnd: int, p: int, phase: str, payloads: dict[int, Payload]
    ) -> dict[int, tuple[Upload, dict[str, float]]]:
        """Run ``client_update`` for each client of ``payloads``; return (upload, metrics) per
        client (a client missing from the result failed)."""
        out = {}
        for cid, payload in payloads.items():
            state = self.client_state(cid)
            seed_torch(self.cfg.seed, rnd, p, cid)
            upload, self.clients[cid], metrics = self.algo.client_update(
                cid, payload, state, rnd, phase
            )
            out[cid] = (upload, metrics)
        return out

    def personal_accuracies(self, rnd: int) -> dict[int, float]:
        """Every client's personalized accuracy (torch seeded per client, see :func:`seed_eval`)."""
        return personal_accuracies(
            self.algo,
            self.server,
            self.client_state,
            self.cfg.eval.batch_size,
            lambda cid: seed_eval(self.cfg.seed, rnd, cid),
        )

    def selected_accuracies(self, rnd: int, uploads: dict[int, Upload]) -> dict[int, float]:
        """MAP's protocol: each selected client's model right after its local training."""
        out = {}
        for cid, upload in uploads.items():
            state = self.client_state(cid)
            seed_eval(self.cfg.seed, rnd, cid, selected=True)
            out[cid] = selected_accuracy(
                self.algo, self.server, cid, upload, state, self.cfg.eval.batch_size
            )
        return out


def seed_eval(seed: int, rnd: int, cid: int, selected: bool = False) -> None:
    """Seed torch before a client's evaluation (its personalized model may be trained first,
    e.g. FedAvg-FT's fine-tuning), the same way in every engine."""
    seed_torch(seed, rnd, 0xE5 if selected else 0xE7, cid)
