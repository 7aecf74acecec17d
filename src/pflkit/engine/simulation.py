"""The simulation engine: the one round loop over the algorithm contract.

Per round ``r`` (1-based):

1. sample the clients of round ``r`` (:func:`sample_clients`, which depends only on the seed,
   the round, the client count and ``train.client_fraction``: every algorithm sees the same
   sequence; a range ``[a, b]`` draws the round's share first, :func:`round_fraction`, and the
   row records it as ``client_fraction``);
2. for each phase of the algorithm: ``configure`` each selected client's payload, hand one job
   per client (payload, state, round context) to the client runner
   (:mod:`pflkit.engine.clients`: in-process, process pool, Ray or Flower), keep the client
   states it returns (in the store bounded by ``engine.state_memory``,
   :mod:`pflkit.engine.states`), count the bytes of payloads and uploads, then ``aggregate``
   (torch seeded from (seed, round, phase));
3. evaluate on the schedule (``eval.every`` and always the last round): the global model on the
   global test set here, and, at the same time, every client's personalized model through the
   runner, from the view ``eval_view`` gives it; with a validation split (``data.val_fraction``)
   both are also scored on validation data (``val_*`` metrics);
4. return one metrics row (the run loop appends it to ``metrics.jsonl`` and checkpoints).

A client whose work fails (Flower) is listed in ``failed_clients`` and left out of that round's
aggregate. Simulated system heterogeneity (``system.*``,
:func:`~pflkit.engine.clients.system_draw`) works the same way: a selected client that drops
out of the round gets no payload (it trains, uploads and costs nothing) and is listed in
``dropped_clients``; a straggler trains a share of its local steps and is listed in
``straggler_clients``. Because every random draw is seeded from (seed, round, phase, client),
a run resumed from a checkpoint continues exactly as the uninterrupted run would have,
whichever runner runs the clients.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pflkit.algorithms.base import State, Upload, nbytes
from pflkit.algorithms.context import ServerContext
from pflkit.algorithms.env import given
from pflkit.config import ExperimentConfig, need_config
from pflkit.data.federated import FederatedDataset, build_federated
from pflkit.devices import resolve_device
from pflkit.engine import ray_runner, vectorized, worker  # noqa: F401 ray_runner: its entry
from pflkit.engine.checkpoint import load_checkpoint, save_checkpoint
from pflkit.engine.clients import (
    EVALUATE,
    ClientRunner,
    EvalJob,
    InProcess,
    ProcessPool,
    TrainJob,
    init_client,
    round_context,
    seed_torch,
    system_draw,
)
from pflkit.engine.limits import check_machine, footprint
from pflkit.engine.population import TrainedClients, eval_sample, held_out, training_clients
from pflkit.engine.runners import lookup_runner
from pflkit.engine.states import ClientStates, StatesElsewhere
from pflkit.errors import PflkitError
from pflkit.eval import global_metrics, global_val_metrics, personal_metrics, val_metrics
from pflkit.eval.evaluate import holdout_metrics, sampled_metrics, trained_split
from pflkit.eval.metrics import extra, global_fields, metric_fields
from pflkit.eval.metrics import resolve as resolve_metrics
from pflkit.eval.tasks import get_task
from pflkit.experiment import algorithm_of
from pflkit.privacy import client_dp, dpsgd


def round_fraction(seed: int, rnd: int, fraction: float | list[float]) -> float:
    """The share of clients of round ``rnd``: ``fraction`` itself, or for a range ``[a, b]``
    (GPFL's random participation) a draw uniform in [a, b] from its own generator seeded by
    (seed, round), so every runner and a resumed run see the same shares."""
    if isinstance(fraction, int | float):
        return float(fraction)
    a, b = fraction
    return float(np.random.default_rng([seed, rnd, 0x5B]).uniform(a, b))


def sample_clients(
    seed: int,
    rnd: int,
    num_clients: int,
    fraction: float | list[float],
    holdout: tuple[int, ...] = (),
) -> list[int]:
    """Clients taking part in round ``rnd``: max(round(share * K), 1) without replacement of
    the K clients that train, ``share`` = :func:`round_fraction` (``fraction`` itself for a
    number). ``holdout``: clients that never train (``data.holdout_clients``,
    :func:`~pflkit.engine.population.holdout_clients`); K counts the others, and the draw is
    of positions among them, so without held-out clients it is the one it always was."""
    pool = training_clients(num_clients, holdout)
    k = len(pool)
    m = max(int(round(round_fraction(seed, rnd, fraction) * k)), 1)
    if m >= k:
        return list(pool)
    rng = np.random.default_rng([seed, rnd, 0x5A])
    return sorted(int(pool[c]) for c in rng.choice(k, m, replace=False))


def runner_for(cfg: ExperimentConfig, **options: Any) -> ClientRunner:
    """The runner ``engine.runner`` names (:data:`~pflkit.engine.runners.RUNNERS`: ``pool``,
    the default, ``in-process``, ``ray``, ``flower`` and any a plug-in registers), built by
    its factory from ``cfg`` and ``options``; an unknown name is one sentence."""
    runner: ClientRunner = lookup_runner(cfg.engine.runner).factory(cfg, **options)
    return runner


EVAL_CHUNK = 1024  # evaluation jobs handed to the runner at once, at most
MIN_CHUNK = 8  # ... and at least, however large the states (the workers stay busy)


class Simulation:
    """One run of one algorithm on one federated dataset.

    Construct it (validates everything, builds data, environments and algorithm), then call
    :meth:`run_round` per round, and :meth:`close` at the end (or use it as a context manager).
    ``runner`` runs the client work (default: the one ``engine`` asks for, :func:`runner_for`).
    ``state_dir``: where client states beyond ``engine.state_memory`` and those of checkpoints
    go (:class:`~pflkit.engine.states.ClientStates`; the run folder's ``states/``; None: a
    temporary folder). Nothing is written to disk here, so a bad config never leaves a
    half-written run folder. A run past this machine (too many workers or threads, more memory
    or disk than is free) is refused here (:mod:`pflkit.engine.limits`) unless ``force``.
    """

    def __init__(
        self,
        cfg: ExperimentConfig,
        data: FederatedDataset | None = None,
        runner: ClientRunner | None = None,
        state_dir: Path | None = None,
        force: bool = False,
    ):
        self.cfg = cfg = need_config(cfg, "Simulation")
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        algorithm_of(cfg)  # parsed once (validate did); bad parameters fail before the data load
        vectorized.check(cfg)  # engine.vectorize, engine.cuda_graphs: whatever the runner
        self.runner = runner if runner is not None else runner_for(cfg)
        # where client states live, decided once: here (jobs carry them, checkpoints hold
        # them) or where the runner's clients run (Flower's nodes: jobs carry none)
        self.states_here = self.runner.keeps_state
        if held_out(cfg) and not self.states_here:
            raise PflkitError(
                "data.holdout_clients needs client states in the engine, which this runner "
                "(Flower) keeps on its nodes: run it in the simulation, or set it to 0"
            )
        data = data if data is not None else build_federated(cfg.data)
        self.data = data.to(resolve_device(cfg.device))  # once, for the whole run
        # the union of the clients' validation splits, where the global model is scored
        self.val_xy: tuple[torch.Tensor, torch.Tensor] | None = None
        if self.data.has_val:
            clients = self.data.clients
            val_x = torch.cat([given(c.val_x, "a validation split") for c in clients])
            self.val_xy = (
                val_x,
                torch.cat([given(c.val_y, "a validation split") for c in clients]),
            )
        # the metrics of eval.metrics beyond accuracy, checked against the data's task
        self.metrics = resolve_metrics(extra(cfg.eval.metrics), self.data.task)
        self.task = get_task(self.data.task)
        # this process's algorithm and environments, built as every runner's workers build theirs
        self.algo, self.senv, self.envs = worker.start_worker(worker.WorkerSpec(cfg), self.data)
        self.algo.check(self.senv)
        if self.runner.vectorize:
            vectorized.check_models(self.senv)
        # client-level DP of the uploads (privacy.client_dp): None when off
        self.dp = client_dp.build(
            cfg, self.algo, len(training_clients(cfg.data.num_clients, held_out(cfg)))
        )
        # sample-level DP-SGD (privacy.sample_dp): every client's latest epsilon, for the rows
        self.sample_dp = dpsgd.EpsilonTable() if cfg.privacy.sample_dp is not None else None
        seed_torch(cfg.seed, 0, 0xD0)
        self.server: State = self.algo.server_init(self.senv)
        # the clients' states, bounded in memory, where the engine holds them
        self.clients: ClientStates | StatesElsewhere = (
            ClientStates(
                lambda cid: init_client(self.algo, self.envs[cid], cfg.seed),
                cfg.engine.state_memory,
                state_dir,
                self.senv.device,
            )
            if self.states_here
            else StatesElsewhere()
        )
        # who has trained by a round: derived from the seeds alone (nothing to checkpoint)
        self.trained = TrainedClients(cfg, self.data.num_clients, sample_clients)
        if not force:
            self.check_machine(state_dir)
        # every client's local test (and validation) sample count, the weights of evaluation
        self.counts = {
            split: np.array([c.size(split) for c in self.data.clients], dtype=float)
            for split in ("test", "val")
        }
        self.round = 0
        self.runner.start(cfg, data)  # on the CPU: a worker moves it to its own device

    def stateful_clients(self) -> int:
        """How many clients train in the run (and so keep a state): counted from the seeds
        when that takes at most 100,000 draws, else those of round 1 (a lower bound)."""
        cfg, n = self.cfg, self.data.num_clients
        first = sample_clients(cfg.seed, 1, n, cfg.train.client_fraction, held_out(cfg))
        if len(first) * cfg.train.rounds > 100_000:
            return len(first)
        trained = TrainedClients(cfg, n, sample_clients)
        return int(trained.upto_round(cfg.train.rounds).sum())

    def check_machine(
        self, state_dir: Path | None, workers: int | None = None, what: str = "engine.workers"
    ) -> None:
        """Refuse the run if it is past this machine (:func:`~pflkit.engine.limits.check_machine`)
        with the runner's workers, or ``workers`` in-process runs side by side (``what``
        asked for them: a compare's ``--jobs``). Runners whose clients run elsewhere (Ray,
        Flower) are not checked."""
        r = self.runner
        if workers is None and not isinstance(r, ProcessPool | InProcess):
            return
        stateful = self.stateful_clients() if self.states_here else 0
        fp = footprint(self.cfg, self.algo, self.envs, stateful)
        if workers is not None:
            check_machine(self.cfg, fp, workers, 1, state_dir, what)
        elif isinstance(r, ProcessPool):
            check_machine(self.cfg, fp, r.workers, r.threads, state_dir)
        else:
            check_machine(self.cfg, fp, 1, 1, state_dir)

    def close(self) -> None:
        """Stop the runner's workers (if any) and remove a temporary state folder."""
        self.runner.close()
        self.clients.close()

    def __enter__(self) -> Simulation:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- client state store (runners whose clients keep no state of their own) --------------------
    def client_state(self, cid: int) -> State | None:
        return self.clients.get_or_init(cid)

    def job_state(self, cid: int) -> State | None:
        """Client ``cid``'s state as its job carries it: None where the runner's clients keep
        their own (Flower nodes; :class:`~pflkit.engine.states.StatesElsewhere`)."""
        return self.clients.get_or_init(cid)

    # -- checkpoints -------------------------------------------------------------------------------
    def save(self, path: Path, fingerprint: str = "") -> None:
        """Checkpoint the round, the server state and the client states, tagged with the run's
        ``fingerprint`` (:func:`pflkit.engine.folder.fingerprint`). Incremental: the client
        states that changed since the last checkpoint are written to the state folder, and
        the checkpoint records the index of the versions it stands for
        (:meth:`~pflkit.engine.states.ClientStates.commit`)."""
        if not isinstance(self.clients, ClientStates):  # it lives elsewhere (Flower nodes)
            return
        index = self.clients.commit()
        state = {"round": self.round, "server": self.server, "client_states": index}
        if self.dp is not None:
            state["privacy"] = self.dp.state()  # the adaptive clipping norm
        if self.sample_dp is not None:
            state["sample_dp"] = self.sample_dp.state()  # every client's latest epsilon
        save_checkpoint(path, state | {"fingerprint": fingerprint})
        self.clients.committed(index)

    def restore(
        self, path: Path | None, fingerprints: tuple[str, ...] = (), prune: bool = True
    ) -> None:
        """Continue from a checkpoint; one written for another configuration (a fingerprint
        not in ``fingerprints``, the run's current and legacy forms) is refused. Checkpoints
        from before fingerprints were stored load as they are, and those from before the state
        store (client states inside the checkpoint) too. ``path`` None: start from round 0,
        removing any state file an earlier attempt left. ``prune`` False leaves the state
        files the checkpoint does not name (a reader of a finished run)."""
        if path is None:
            self.clients.restore(None)
            return
        ckpt = load_checkpoint(path, self.senv.device)
        theirs = ckpt.get("fingerprint")
        if fingerprints and theirs and theirs not in fingerprints:
            raise PflkitError(
                f"the checkpoint '{path}' belongs to another configuration than the folder's "
                "config.yaml (edited by hand, or copied from another run): resume only "
                "continues a run with its own config; start a new run instead"
            )
        self.round, self.server = ckpt["round"], ckpt["server"]
        if self.dp is not None:
            self.dp.load(ckpt.get("privacy"))
        if self.sample_dp is not None:
            self.sample_dp.load(ckpt.get("sample_dp"))
        self.clients.restore(ckpt.get("client_states"), prune)
        for cid, state in ckpt.get("clients", {}).items():  # a checkpoint from before the store
            self.clients[cid] = state

    def run_bounded(
        self, jobs: Iterable[EvalJob], meanwhile: Callable[[], None] | None = None
    ) -> dict[int, Any]:
        """The runner's results of ``jobs``, run in chunks whose jobs carry at most half of
        ``engine.state_memory`` in states and views (a worker gets its own copy of each), and
        at most ``EVAL_CHUNK`` jobs (at least ``MIN_CHUNK``), so scoring a population never
        holds every client's job at once; ``meanwhile`` runs with the first chunk."""
        out: dict[int, Any] = {}
        budget, chunk, size = self.cfg.engine.state_memory // 2, [], 0
        for j in jobs:
            chunk.append(j)
            size += nbytes((j.state, j.view, j.adapt))  # what the job carries to a worker
            if len(chunk) >= EVAL_CHUNK or (size > budget and len(chunk) >= MIN_CHUNK):
                out.update(self.runner.run(self.algo, self.envs, chunk, meanwhile))
                chunk, size, meanwhile = [], 0, None
        if chunk or meanwhile is not None:
            out.update(self.runner.run(self.algo, self.envs, chunk, meanwhile))
        return out

    # -- the round loop ----------------------------------------------------------------------------
    def run_round(self, rnd: int) -> dict[str, Any]:
        cfg, algo, senv = self.cfg, self.algo, self.senv
        t0 = time.perf_counter()
        fraction = cfg.train.client_fraction
        selected = sample_clients(cfg.seed, rnd, self.data.num_clients, fraction, held_out(cfg))
        draws = {cid: system_draw(cfg.system, cfg.seed, rnd, cid) for cid in selected}
        dropped = [cid for cid in selected if draws[cid][0]]
        stragglers = [cid for cid in selected if draws[cid][1]]
        down = dict.fromkeys(selected, 0)
        up = dict.fromkeys(selected, 0)
        losses: list[float] = []
        failed: list[int] = []
        diverged: list[int] = []  # left out by train.on_nan: skip_client (keep their state)
        uploads: dict[int, Upload] = {}
        seconds_aggregate = 0.0
        for p, phase in enumerate(algo.phases(rnd)):
            sctx = ServerContext(rnd, phase, cfg.seed)
            payloads = {
                cid: algo.configure(senv, self.server, cid, sctx)
                for cid in selected
                if cid not in failed and cid not in dropped
            }
            for cid, payload in payloads.items():
                down[cid] += nbytes(payload)
            jobs = [
                TrainJob(
                    cid,
                    payload,
                    self.job_state(cid),
                    round_context(senv.run, rnd, phase, straggler=cid in stragglers),
                    phase_index=p,
                )
                for cid, payload in payloads.items()
            ]
            results = self.runner.run(algo, self.envs, jobs)
            diverged += [cid for cid, update in results.items() if update is None]
            updates = {cid: update for cid, update in results.items() if update is not None}
            failed += [cid for cid in payloads if cid not in updates]
            uploads = {cid: update.upload for cid, update in updates.items()}
            for cid, update in updates.items():
                self.clients[cid] = update.state  # where states live elsewhere: None, ignored
                up[cid] += nbytes(update.upload)
                if self.sample_dp is not None:
                    self.sample_dp.record(cid, update.metrics)
                if "train_loss" in update.metrics:
                    losses.append(update.metrics["train_loss"])
            if uploads:  # nothing to aggregate when every client failed or dropped
                released = uploads
                if self.dp is not None:  # what the server may see: clipped, noised
                    released = self.dp.release(algo, uploads, payloads, rnd, p)
                seed_torch(cfg.seed, rnd, p, 0xA6)
                t_agg = time.perf_counter()
                self.server = algo.aggregate(senv, self.server, released, sctx)
                seconds_aggregate += time.perf_counter() - t_agg
        t1 = time.perf_counter()
        row: dict[str, Any] = {"round": rnd, "clients": selected}
        if isinstance(fraction, list):  # random participation: the round's drawn share
            row["client_fraction"] = round_fraction(cfg.seed, rnd, fraction)
        if dropped:
            row["dropped_clients"] = dropped
        if stragglers:
            row["straggler_clients"] = stragglers
        if failed:
            row["failed_clients"] = failed
        if losses:
            row["train_loss"] = float(np.mean(losses))
        row["bytes_down"] = [down[c] for c in selected]
        row["bytes_up"] = [up[c] for c in selected]
        if rnd % cfg.eval.every == 0 or rnd > cfg.train.rounds - max(cfg.eval.last, 1):
            row.update(self.evaluate(rnd, uploads))
        if diverged:
            row["diverged_clients"] = diverged
        if self.dp is not None:
            row.update(self.dp.row(rnd))
        if self.sample_dp is not None:
            row.update(self.sample_dp.row())
        row.update(self.runner.row_extras(row))
        t2 = time.perf_counter()
        # the only non-deterministic fields of a metrics row start with "seconds_"
        row["seconds_train"] = t1 - t0  # the whole training phase, aggregation included
        row["seconds_aggregate"] = seconds_aggregate  # the server's aggregate calls alone
        row["seconds_eval"] = t2 - t1
        self.round = rnd
        return row

    def evaluate(self, rnd: int, uploads: dict[int, Upload]) -> dict[str, Any]:
        """The evaluation fields of round ``rnd``'s row (``uploads``: the round's last ones).
        The server scores the global model on the global test set while the runner has the
        clients score their personalized models on their local test splits; with a validation
        split, both also on validation data (the ``val_*`` fields).

        Which clients (:mod:`pflkit.engine.population`): with ``eval.clients: all`` every
        training client, with ``eval.clients: n`` a sample of n of them drawn from (seed,
        round) alone, the row then giving estimates with standard errors and ``eval_clients``
        (:func:`~pflkit.eval.evaluate.sampled_metrics`). Scored clients that have not trained
        yet are reported apart (:func:`~pflkit.eval.evaluate.trained_split`) whenever there are
        any, and always under sampling. Held-out clients (``data.holdout_clients``; all, or a
        sample of at most n) are scored after their personalization step
        (:meth:`~pflkit.algorithms.Algorithm.adapt_holdout`, run by the runner on a state
        thrown away afterwards) and reported as ``holdout_acc_*``. The metrics of
        ``eval.metrics`` beyond accuracy come back from the clients as sufficient statistics
        and are summed into the row's fields by :func:`~pflkit.eval.metrics.metric_fields`
        (the global model's by :func:`~pflkit.eval.metrics.global_fields`)."""
        cfg, algo, senv, data = self.cfg, self.algo, self.senv, self.data
        row: dict[str, Any] = {}
        sctx = ServerContext(rnd, EVALUATE, cfg.seed)
        gw = algo.eval_view(senv, self.server, None, sctx).get("weights")
        how = (cfg.eval.batch_size, self.task, data.num_classes)  # how a split is scored

        def score_global() -> None:
            if cfg.eval.global_model and gw is not None:
                model = senv.model(slot="eval_global")
                row.update(global_metrics(model, gw, data, cfg.eval.batch_size))
                if self.val_xy is not None:
                    row.update(global_val_metrics(model, gw, *self.val_xy, cfg.eval.batch_size))
                if self.metrics:  # the model's weights are loaded (global_metrics)
                    xy = {"global": (data.test_x, data.test_y)}
                    if self.val_xy is not None:
                        xy["val_global"] = self.val_xy
                    for where, (x, y) in xy.items():
                        got = global_fields(self.metrics, model, x, y, *how, where)
                        row.update({k: v for k, v in got.items() if k not in row})

        n, ctx, e = data.num_clients, round_context(senv.run, rnd, EVALUATE), cfg.eval
        names = tuple(m.name for m in self.metrics)
        holdout = held_out(cfg)
        population = training_clients(n, holdout)
        scored = eval_sample(cfg.seed, rnd, population, e.clients)
        scored_holdout = eval_sample(cfg.seed, rnd, list(holdout), e.clients, stream=0xE5B)
        views: dict[int, Any] = {}

        def view(cid: int) -> Any:  # only of the clients scored: a sample costs its size
            if cid not in views:
                views[cid] = algo.eval_view(senv, self.server, cid, sctx)
            return views[cid]

        def job(cid: int, upload: Upload | None = None) -> EvalJob:
            state = self.job_state(cid)
            return EvalJob(
                cid,
                view(cid),
                state,
                ctx,
                e.batch_size,
                e.finetune_epochs,
                upload,
                metrics=names if upload is None else (),
                task=data.task,
            )

        def holdout_job(cid: int) -> EvalJob:
            steps = tuple(
                (phase, algo.configure(senv, self.server, cid, ServerContext(rnd, phase, cfg.seed)))
                for phase in algo.phases(rnd)
            )
            return dataclasses.replace(job(cid), adapt=steps)  # never trained: its first state

        jobs = itertools.chain(map(job, scored), map(holdout_job, scored_holdout))
        acc = self.run_bounded(jobs, score_global)
        counts = self.counts["test"]
        test = {cid: acc[cid]["test"] for cid in scored if cid in acc}
        if e.clients == "all":
            row.update(personal_metrics(test, n, counts))
        else:
            row.update(sampled_metrics(test, len(population), counts))
            row["pers_acc_clients"] = [test.get(c) for c in range(n)]
            row["eval_clients"] = len(test)
        if self.val_xy is not None:
            val = {cid: acc[cid]["val"] for cid in scored if cid in acc}
            row.update(val_metrics(val, self.counts["val"]))
        split = trained_split(test, self.trained.upto_round(rnd))
        if split["eval_untrained"] or e.clients != "all":
            row.update(split)
        if holdout:
            held = {cid: acc[cid]["test"] for cid in scored_holdout if cid in acc}
            row.update(holdout_metrics(held, len(holdout), counts, n))
        if self.metrics:  # eval.metrics beyond accuracy (pflkit.eval.metrics)
            row.update(metric_fields(self.metrics, acc, scored, n, scored_holdout))
        if cfg.eval.selected_clients and uploads:
            selected = [job(cid, upload) for cid, upload in uploads.items()]
            sel = self.runner.run(algo, self.envs, selected)
            row["pers_acc_selected"] = float(np.mean([a["test"] for a in sel.values()]))
        missing = sorted((set(scored) | set(scored_holdout)) - set(acc))
        if missing:
            row["eval_failed_clients"] = missing
        return row
