"""Client runners: the one seam through which the round loop runs client work.

The engine (:class:`~pflkit.engine.simulation.Simulation`) decides *what* each client does in a
phase (its payload) and *what* to evaluate (its view); a runner decides *where* it runs:

- :class:`InProcess`: here, one client after another (no start-up cost; best for small runs
  and for one GPU);
- :class:`ProcessPool`: ``engine.workers`` worker processes, each with its own copy of the
  algorithm and client environments (the dataset's tensors are shared, not copied) and
  ``engine.threads_per_worker`` torch threads; the clients of a phase are dispatched to
  whichever worker is free;
- the Flower runner (:mod:`pflkit.flower.server`): SuperNodes, over the network.

Every runner executes the same two functions, :func:`train_client` and
:func:`evaluate_client`, and every random draw in them is seeded from (seed, round, phase,
client), so all runners give bit-identical results: the client order and the worker a client
lands on do not matter. With the in-process and process-pool runners client state lives in the
engine (and in its checkpoints); with Flower it lives on the nodes.
"""

from __future__ import annotations

import math
import os
import pickle
import signal
import traceback
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import nn

from pflkit.algorithms import Algorithm, build_algorithm, make_envs
from pflkit.algorithms.base import Payload, RoundContext, State, Update, Upload
from pflkit.algorithms.env import ClientEnv, RunFacts
from pflkit.config import ExperimentConfig, SystemConfig, lr_factor, resolve_device, validate
from pflkit.errors import PflkitError
from pflkit.eval.evaluate import accuracy, finetuned

if TYPE_CHECKING:
    from pflkit.data.federated import FederatedDataset
    from pflkit.engine.simulation import Simulation

TrainResults = dict[int, tuple[Upload, dict[str, float]]]


# -- seeding (the same in every runner) ------------------------------------------------------------


def seed_torch(*keys: int) -> None:
    """Seed torch's global RNG from a tuple of integers (independent streams per tuple)."""
    torch.manual_seed(int(np.random.SeedSequence(list(keys)).generate_state(1)[0]))


def seed_eval(seed: int, rnd: int, cid: int, selected: bool = False) -> None:
    """Seed torch before a client's evaluation (its personalized model may be trained first,
    e.g. FedAvg-FT's fine-tuning), the same way in every engine."""
    seed_torch(seed, rnd, 0xE5 if selected else 0xE7, cid)


def system_draw(system: SystemConfig, seed: int, rnd: int, cid: int) -> tuple[bool, bool]:
    """Whether client ``cid`` drops out of round ``rnd`` and, if not, whether it is a straggler
    (``system.dropout``, ``system.stragglers``): numpy draws seeded by (seed, round, client), so
    the server (which leaves dropped clients out) and whichever runner trains a straggler agree;
    torch's stream is not touched, and with the defaults nothing is drawn."""
    if not system.dropout and not system.stragglers:
        return False, False
    u_drop, u_slow = np.random.default_rng([seed, rnd, cid, 0x5D]).random(2)
    dropped = bool(u_drop < system.dropout)
    return dropped, not dropped and bool(u_slow < system.stragglers)


# -- the client-side work, as every runner runs it --------------------------------------------------


def init_client(algo: Algorithm, env: ClientEnv, seed: int) -> State:
    """A client's first state (``client_init``, seeded by (seed, client))."""
    seed_torch(seed, 0, 0xC1, env.cid)
    return algo.client_init(env)


EVALUATE = "evaluate"  # the phase name of evaluation contexts


def round_context(run: RunFacts, rnd: int, phase: str, straggler: bool = False) -> RoundContext:
    """The :class:`~pflkit.algorithms.RoundContext` of a client's work in phase ``phase`` of
    round ``rnd`` (:data:`EVALUATE` for evaluation): the run's seed, the round's local
    optimiser, learning-rate factor and batching (``train.optimizer``, ``train.lr_schedule``,
    ``train.drop_last``) and, for a straggler of the round (:func:`system_draw`), its work
    share ``system.straggler_work``."""
    t = run.train
    return RoundContext(
        round=rnd,
        phase=phase,
        seed=run.seed,
        lr_factor=lr_factor(t, rnd),
        optimizer=t.optimizer,
        drop_last=t.drop_last,
        work=run.system.straggler_work if straggler else 1.0,
    )


def straggler_context(env: ClientEnv, rnd: int, phase: str) -> RoundContext:
    """:func:`round_context` of client ``env.cid``'s training, a straggler or not."""
    run = env.run
    return round_context(run, rnd, phase, system_draw(run.system, run.seed, rnd, env.cid)[1])


def train_client(
    algo: Algorithm,
    env: ClientEnv,
    payload: Payload,
    state: State,
    ctx: RoundContext,
    phase_index: int,
) -> Update | None:
    """``client_update`` in round context ``ctx`` with torch seeded from (seed, round, phase
    index, client). A training metric or uploaded tensor that is not finite stops the run with
    one sentence (the usual cause: the lr), or with ``train.on_nan: skip_client`` returns None:
    the client is left out of the round and keeps its previous state."""
    seed_torch(ctx.seed, ctx.round, phase_index, env.cid)
    update = algo.client_update(env, payload, state, ctx)
    bad = [f"{k} is {v}" for k, v in update.metrics.items() if not math.isfinite(v)]
    if not bad and not _finite(update.upload):
        bad = ["upload holds inf or nan values"]
    if not bad:
        return update
    if env.run.train.on_nan == "skip_client":
        return None
    raise PflkitError(
        f"client {env.cid}'s {bad[0]} in round {ctx.round}: local training diverged; lower "
        "train.lr, or set train.grad_clip (e.g. 100), or train.on_nan: skip_client"
    )


def _finite(obj: Any) -> bool:
    """Every floating tensor and number in ``obj`` (nested dicts, lists) is finite."""
    if isinstance(obj, torch.Tensor):
        return not obj.is_floating_point() or bool(torch.isfinite(obj).all())
    if isinstance(obj, dict):
        return all(_finite(v) for v in obj.values())
    if isinstance(obj, list | tuple):
        return all(_finite(v) for v in obj)
    if isinstance(obj, float):
        return math.isfinite(obj)
    return True


def evaluate_client(
    algo: Algorithm,
    env: ClientEnv,
    view: Payload,
    state: State,
    ctx: RoundContext,
    batch_size: int,
    upload: Upload | None = None,
    finetune_epochs: int = 0,
) -> dict[str, float]:
    """The client's accuracy on its local test split (``"test"``) and, when it has one
    (``data.val_fraction``), on its local validation split (``"val"``): one set of weights,
    its personalized model (``personal_weights``) or with ``upload`` MAP's protocol
    (``trained_weights``), scored on both by the algorithm's
    :meth:`~pflkit.algorithms.Algorithm.scoring_model` (default: the client's model). A client
    whose personalized model is the global model is scored with ``view["weights"]``. With
    ``finetune_epochs`` (``eval.finetune_epochs``) > 0 both are scored on a copy of that model
    fine-tuned on the client's training split (:func:`finetune_for_eval`)."""
    selected = upload is not None
    seed_eval(ctx.seed, ctx.round, env.cid, selected)
    # ctx: personal_weights may train (FedAvg-FT's fine-tuning)
    if upload is not None:
        weights = algo.trained_weights(env, view, upload, state, ctx)
    else:
        weights = algo.personal_weights(env, view, state, ctx)
    if weights is None:
        if "weights" not in view:
            raise RuntimeError(
                f"{algo.name}: personal_weights returned None but there is no global model"
            )
        weights = view["weights"]
    model, d = algo.scoring_model(env, weights), env.data
    if finetune_epochs:
        model = finetune_for_eval(model, env, ctx, finetune_epochs, selected)
    acc = {"test": accuracy(model, d.test_x, d.test_y, batch_size)}
    if d.val_y is not None:
        acc["val"] = accuracy(model, d.val_x, d.val_y, batch_size)
    return acc


def finetune_for_eval(
    model: nn.Module, env: ClientEnv, ctx: RoundContext, epochs: int, selected: bool = False
) -> nn.Module:
    """A copy of the scoring ``model`` fine-tuned for ``epochs`` epochs on the client's
    training split (:func:`~pflkit.eval.evaluate.finetuned`) with the round's optimiser, lr
    factor and drop_last (``ctx.optim``), its batches drawn from a stream of its own, seeded by
    (seed, round, client), inside ``fork_rng``: torch's global RNG state is the same
    afterwards, and the client's state and the server model never see the copy."""
    devices = [env.device] if env.device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        seed_torch(ctx.seed, ctx.round, 0xF5 if selected else 0xF7, env.cid)
        d = env.data
        return finetuned(model, d.train_x, d.train_y, env.run.train, epochs, ctx.optim)


# -- runners --------------------------------------------------------------------------------------------


class ClientRunner:
    """Where client work runs (module docstring). ``train`` and ``evaluate`` return results in
    the order of their input; a client missing from a result failed (Flower only)."""

    #: client state lives in the engine (so a run can be checkpointed and resumed)
    keeps_state: bool = True

    def start(self, sim: Simulation) -> None:
        """Bind to a run (called once, before its first round)."""
        self.sim = sim
        self.diverged: list[int] = []  # this round's clients left out by train.on_nan

    def train(self, rnd: int, p: int, phase: str, payloads: dict[int, Payload]) -> TrainResults:
        raise NotImplementedError

    def evaluate(
        self,
        rnd: int,
        views: dict[int, Payload],
        uploads: dict[int, Upload] | None = None,
        meanwhile: Callable[[], None] | None = None,
    ) -> dict[int, dict[str, float]]:
        """Each client's accuracies (:func:`evaluate_client`: ``"test"``, and ``"val"`` with a
        validation split), from the server's ``views``. ``uploads``: MAP's protocol, the
        round's last uploads. ``meanwhile`` is server work (scoring the global model) that
        runs while the clients evaluate, where they run elsewhere."""
        raise NotImplementedError

    def _store(self, updates: Iterable[tuple[int, Any]]) -> TrainResults:
        """Keep each client's new state from its ``(cid, train_client result)``, in order, and
        return the uploads and metrics; a diverged client (None) is noted and left out."""
        out: TrainResults = {}
        for cid, update in updates:
            if update is None:  # diverged, train.on_nan: skip_client
                self.diverged.append(cid)
                continue
            upload, self.sim.clients[cid], metrics = update
            out[cid] = (upload, metrics)
        return out

    def row_extras(self, row: dict[str, Any]) -> dict[str, Any]:
        """Runner-specific fields to add to this round's metrics ``row``: here the clients
        that diverged and were left out (``train.on_nan: skip_client``)."""
        diverged, self.diverged = self.diverged, []
        return {"diverged_clients": diverged} if diverged else {}

    def close(self) -> None:
        pass


class InProcess(ClientRunner):
    """Client work in this process, one client after another."""

    def train(self, rnd, p, phase, payloads):
        sim = self.sim

        def one(cid: int, payload: Payload):
            state = sim.client_state(cid)
            ctx = straggler_context(sim.envs[cid], rnd, phase)
            return train_client(sim.algo, sim.envs[cid], payload, state, ctx, p)

        return self._store((cid, one(cid, payload)) for cid, payload in payloads.items())

    def evaluate(self, rnd, views, uploads=None, meanwhile=None):
        sim = self.sim
        if meanwhile is not None:
            meanwhile()
        return {
            cid: evaluate_client(
                sim.algo,
                sim.envs[cid],
                view,
                sim.client_state(cid),
                round_context(sim.senv.run, rnd, EVALUATE),
                sim.cfg.eval.batch_size,
                upload=None if uploads is None else uploads[cid],
                finetune_epochs=sim.cfg.eval.finetune_epochs,
            )
            for cid, view in views.items()
        }


# -- process pool -----------------------------------------------------------------------------------

_WORKER: dict[str, Any] = {}  # in a worker process: its algorithm, environments and config
PR_SET_PDEATHSIG = 1  # linux/prctl.h


def die_with_parent(parent: int | None = None) -> None:
    """Make this worker process end when its parent ends, even by SIGKILL (a parent killed
    that way cannot stop its pool): Linux's ``PR_SET_PDEATHSIG``, elsewhere a watchdog thread
    that polls the parent's id every second. ``parent``: the pid the worker expects as its
    parent (the worker exits at once if that one has already gone); None: whichever it has.
    A fork-server worker's parent is the fork server, which ends with the process that
    started it."""
    import ctypes
    import threading
    import time

    parent = os.getppid() if parent is None else parent
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        watched = libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) == 0
    except (OSError, AttributeError):  # not Linux
        watched = False
    if os.getppid() != parent:  # the parent died before the line above took effect
        os._exit(1)
    if not watched:

        def watch() -> None:
            while os.getppid() == parent:
                time.sleep(1)
            os._exit(1)

        threading.Thread(target=watch, daemon=True).start()


def _worker_init(cfg_dump: dict[str, Any], data: FederatedDataset, threads: int) -> None:
    die_with_parent()
    # Ctrl-C and a cluster's SIGTERM are the parent's to handle: it finishes the round
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    torch.set_num_threads(threads)
    cfg = validate(cfg_dump)
    _, envs = make_envs(cfg, data)
    _WORKER.update(cfg=cfg, algo=build_algorithm(cfg.algorithm), envs=envs)


def _worker_job(blob: bytes) -> bytes:
    """Run one pickled job in a worker; reply ("ok", result), ("user", the PflkitError's
    sentence, "") or ("error", the exception, the worker's traceback)."""
    kind, cid, args = pickle.loads(blob)
    cfg, algo, env = _WORKER["cfg"], _WORKER["algo"], _WORKER["envs"][cid]
    try:
        if kind == "train":
            rnd, p, phase, payload, state = args
            ctx = straggler_context(env, rnd, phase)
            update = train_client(algo, env, payload, state, ctx, p)
            result: Any = None if update is None else tuple(update)
        else:
            rnd, view, state, upload = args
            e = cfg.eval
            ctx = round_context(env.run, rnd, EVALUATE)
            result = evaluate_client(
                algo, env, view, state, ctx, e.batch_size, upload, e.finetune_epochs
            )
        return pickle.dumps(("ok", result), protocol=pickle.HIGHEST_PROTOCOL)
    except PflkitError as err:
        return pickle.dumps(("user", str(err), ""))
    except Exception as err:  # a bug: keep the worker's traceback for the report
        return pickle.dumps(("error", f"{type(err).__name__}: {err}", traceback.format_exc()))


class ProcessPool(ClientRunner):
    """Client work in ``workers`` processes with ``threads`` torch threads each (module
    docstring). Workers start on first use. With one thread each they are forked from this
    process (instant, and the dataset is shared copy-on-write); with more, a forked copy of a
    process that has run multi-threaded torch kernels can hang, so they start from a fork
    server (a fresh process; the dataset's tensors reach them through shared memory, and a
    script that starts a run must guard it with ``if __name__ == "__main__":``)."""

    def __init__(self, workers: int, threads: int = 1):
        self.workers = workers
        self.threads = threads
        self.executor: ProcessPoolExecutor | None = None

    def _pool(self) -> ProcessPoolExecutor:
        if self.executor is None:
            import multiprocessing as mp

            methods = mp.get_all_start_methods()
            if self.threads == 1 and "fork" in methods:
                method = "fork"  # instant; safe while the workers run torch single-threaded
            else:  # a fresh server process to fork from: safe with any thread count
                method = "forkserver" if "forkserver" in methods else "spawn"
            ctx = mp.get_context(method)
            if method == "forkserver":
                ctx.set_forkserver_preload(["pflkit.engine.clients"])
            sim = self.sim
            self.executor = ProcessPoolExecutor(
                self.workers,
                mp_context=ctx,
                initializer=_worker_init,
                initargs=(sim.cfg.dump(), sim.data, self.threads),
            )
        return self.executor

    def _run(
        self, what: str, rnd: int, jobs: dict[int, tuple], meanwhile: Callable[[], None] | None
    ) -> dict[int, Any]:
        """Run ``jobs`` (client -> job tuple), largest clients first, and ``meanwhile`` here
        while they run; results in job order."""
        pool = self._pool()
        envs = self.sim.envs
        order = sorted(jobs, key=lambda c: -envs[c].num_train)
        try:
            futures: dict[int, Future] = {
                cid: pool.submit(_worker_job, pickle.dumps(jobs[cid], pickle.HIGHEST_PROTOCOL))
                for cid in order
            }
            if meanwhile is not None:
                meanwhile()
            replies = {cid: pickle.loads(futures[cid].result()) for cid in jobs}
        except BrokenProcessPool:
            self.close(kill=True)
            raise PflkitError(
                f"a worker process died while {what} in round {rnd} (out of memory, or killed): "
                "set engine.workers: 1 to run in this process"
            ) from None
        except BaseException:  # Ctrl-C or a failed submit: stop every worker now
            self.close(kill=True)
            raise
        out = {}
        for cid, (status, value, *tb) in replies.items():
            if status == "user":
                self.close(kill=True)
                raise PflkitError(value)
            if status == "error":
                self.close(kill=True)
                raise RuntimeError(
                    f"client {cid} failed in a worker process while {what} in round {rnd}: "
                    f"{value}\n--- worker traceback ---\n{tb[0]}"
                )
            out[cid] = value
        return out

    def train(self, rnd, p, phase, payloads):
        sim = self.sim
        jobs = {
            cid: ("train", cid, (rnd, p, phase, payload, sim.client_state(cid)))
            for cid, payload in payloads.items()
        }
        return self._store(self._run("training", rnd, jobs, None).items())

    def evaluate(self, rnd, views, uploads=None, meanwhile=None):
        sim = self.sim
        jobs = {
            cid: (
                "evaluate",
                cid,
                (rnd, view, sim.client_state(cid), None if uploads is None else uploads[cid]),
            )
            for cid, view in views.items()
        }
        return self._run("evaluating", rnd, jobs, meanwhile)

    def close(self, kill: bool = False) -> None:
        ex, self.executor = self.executor, None
        if ex is None:
            return
        if kill:
            for proc in list(getattr(ex, "_processes", {}).values()):
                proc.kill()  # workers ignore SIGINT and SIGTERM
        ex.shutdown(wait=True, cancel_futures=True)


def auto_workers(cfg: ExperimentConfig) -> int:
    """``engine.workers: auto``: one process per CPU core (at most one per client) on CPU,
    in-process on an accelerator. See docs/benchmarks.md for the measurements behind it."""
    if resolve_device(cfg.device) != "cpu":
        return 1
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, min(cores or 1, cfg.data.num_clients))


def make_runner(cfg: ExperimentConfig) -> ClientRunner:
    """The runner ``cfg.engine`` asks for."""
    e = cfg.engine
    workers = auto_workers(cfg) if e.workers == "auto" else e.workers
    if workers <= 1:
        return InProcess()
    if resolve_device(cfg.device) != "cpu":
        raise PflkitError(
            f"engine.workers {workers} needs device: cpu (got {cfg.device!r}): one process "
            "drives an accelerator; set engine.workers: 1"
        )
    return ProcessPool(workers, e.threads_per_worker)
