"""Client runners: the one seam through which the round loop runs client work.

The engine (:class:`~pflkit.engine.simulation.Simulation`) decides *what* each client does in a
phase (its payload) and *what* to evaluate (its view), and hands the runner one job per client
with all of its inputs (:class:`TrainJob`, :class:`EvalJob`: payload or view, state, round
context); a runner decides *where* the jobs run (``run(algo, envs, jobs) -> results``) and
holds nothing of the run:

- :class:`InProcess`: here, one client after another (no start-up cost; best for small runs);
- :class:`ProcessPool`: ``engine.workers`` worker processes, each with its own copy of the
  algorithm and client environments (the dataset's tensors are shared, not copied) and
  ``engine.threads_per_worker`` torch threads; the clients of a phase are dispatched to
  whichever worker is free; on a GPU the workers share the device, each with its own context;
- the Ray runner (:mod:`pflkit.engine.ray_runner`): actors on a cluster;
- the Flower runner (:mod:`pflkit.flower.server`): SuperNodes, over the network.

``engine.runner`` names one of them in :data:`~pflkit.engine.runners.RUNNERS` (``pool``, the
default, is :class:`ProcessPool`, or :class:`InProcess` with one worker; a plug-in may
register more); every runner's workers start with :func:`~pflkit.engine.worker.start_worker`.
Every runner executes the same two functions, :func:`train_client` and
:func:`evaluate_client`, and every random draw in them is seeded from (seed, round, phase,
client), so all runners give bit-identical results: the client order and the worker a client
lands on do not matter. With the in-process and process-pool runners client state lives in the
engine (and in its checkpoints): jobs carry it, and the engine keeps the state each training
returns; with Flower it lives on the nodes (``keeps_state`` False: jobs carry none, results
return none).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import os
import pickle
import signal
import traceback
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from pflkit.algorithms import Algorithm
from pflkit.algorithms.base import Payload, RoundContext, State, Update, Upload
from pflkit.algorithms.context import EVALUATE as EVALUATE  # re-exported: the engine's name for it
from pflkit.algorithms.env import ClientEnv, RunFacts
from pflkit.config import ExperimentConfig, SystemConfig
from pflkit.data.federated import FederatedDataset
from pflkit.devices import resolve_device
from pflkit.engine import vectorized, worker
from pflkit.engine.runners import RUNNERS
from pflkit.engine.schedule import lr_factor
from pflkit.errors import PflkitError, WorkerLost
from pflkit.eval.evaluate import finetuned
from pflkit.eval.metrics import resolve as resolve_metrics
from pflkit.eval.metrics import score_split
from pflkit.eval.tasks import get_task
from pflkit.primitives.training import Weights, get_weights
from pflkit.privacy import dpsgd

# -- seeding (the same in every runner) ------------------------------------------------------------


def key_seed(*keys: int) -> int:
    """A torch seed from a tuple of integers (independent streams per tuple)."""
    return int(np.random.SeedSequence(list(keys)).generate_state(1)[0])


def seed_torch(*keys: int) -> None:
    """Seed torch's global RNG from a tuple of integers (:func:`key_seed`). Where no CUDA
    device can exist, only the CPU generator: ``torch.manual_seed`` also queues a seed for a
    CUDA that may start later, which records the Python stack each time (1.5 ms a call, most
    of the evaluation of 10,000 small clients); the CPU stream is the same either way."""
    if _cuda_possible():
        torch.manual_seed(key_seed(*keys))
    else:
        torch.default_generator.manual_seed(key_seed(*keys))


@functools.cache
def _cuda_possible() -> bool:
    return torch.cuda.is_available()


def key_generator(*keys: int) -> torch.Generator:
    """A CPU generator seeded by the integers ``keys`` (:func:`key_seed`): a stream of its own
    that leaves torch's global RNG alone."""
    return torch.Generator().manual_seed(key_seed(*keys))


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
    state: State = algo.client_init(env)
    return state


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
    if env.run.sample_dp is not None:  # DP-SGD, its steps counted in the state (dpsgd.HISTORY)
        update = dpsgd.client_update(algo, env, payload, state, ctx)
    else:
        update = algo.client_update(env, payload, state, ctx)
    return checked(env, update, ctx)


def checked(env: ClientEnv, update: Update, ctx: RoundContext) -> Update | None:
    """``update`` if its training metrics and upload are finite; else None with
    ``train.on_nan: skip_client``, or one sentence (:func:`train_client`)."""
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
    adapt: Sequence[tuple[str, Payload]] | None = None,
    metrics: Sequence[str] = (),
    task: str = "classification",
) -> dict[str, Any]:
    """The client's accuracy on its local test split (``"test"``) and, when it has one
    (``data.val_fraction``), on its local validation split (``"val"``), both scored by the
    one model :func:`scored_model` gives (``adapt``: a held-out client's phases and payloads,
    :func:`adapt_client`) as the data's ``task`` scores predictions
    (:mod:`pflkit.eval.tasks`). With ``metrics`` (``eval.metrics`` beyond accuracy) also
    ``"stats"``: split -> metric name -> the metric's sufficient statistics (plain numbers and
    arrays, :func:`pflkit.eval.metrics.score_split`), which the server sums."""
    model = scored_model(algo, env, view, state, ctx, upload, finetune_epochs, adapt)
    d, how, chosen = env.data, get_task(task), resolve_metrics(metrics, task)
    splits = {"test": (d.test_x, d.test_y)}
    val_x, val_y = d.val_x, d.val_y
    if val_x is not None and val_y is not None:
        splits["val"] = (val_x, val_y)
    out: dict[str, Any] = {}
    stats: dict[str, Any] = {}
    for split, (x, y) in splits.items():
        out[split], stats[split] = score_split(
            model, x, y, batch_size, how, env.num_classes, chosen
        )
    if chosen:
        out["stats"] = stats
    return out


def scored_model(
    algo: Algorithm,
    env: ClientEnv,
    view: Payload,
    state: State,
    ctx: RoundContext,
    upload: Upload | None = None,
    finetune_epochs: int = 0,
    adapt: Sequence[tuple[str, Payload]] | None = None,
) -> nn.Module:
    """The module that evaluation scores for the client:
    :meth:`~pflkit.algorithms.Algorithm.personal_model` of its state (for a held-out client,
    given ``adapt``, of the state its personalization step leaves, :func:`adapt_client`), with
    ``upload`` under MAP's protocol. With ``finetune_epochs`` (``eval.finetune_epochs``) > 0, a
    copy of that model fine-tuned on the client's training split (:func:`finetune_for_eval`).
    Torch is seeded first (:func:`seed_eval`: ``personal_model`` may train, FedAvg-FT's
    fine-tuning), so every caller gets the same model."""
    if adapt is not None:
        state = adapt_client(algo, env, adapt, dpsgd.without_history(state), ctx)
    state = dpsgd.without_history(state)  # DP-SGD's step count is not the algorithm's
    seed_eval(ctx.seed, ctx.round, env.cid, upload is not None)
    model = algo.personal_model(env, view, state, ctx, upload)
    if finetune_epochs:
        model = finetune_for_eval(model, env, ctx, finetune_epochs, upload is not None)
    return model


HOLDOUT = 0xAD  # the torch stream of held-out clients' personalization steps


def adapt_client(
    algo: Algorithm,
    env: ClientEnv,
    payloads: Sequence[tuple[str, Payload]],
    state: State,
    ctx: RoundContext,
) -> State:
    """A held-out client's personalization step (``data.holdout_clients``):
    ``algo.adapt_holdout``
    once per ``(phase, payload)`` of ``payloads`` (the round's phases, each with the payload
    ``configure`` gave the client), in the evaluation round's context with that phase's name,
    torch seeded from (seed, round, ``HOLDOUT``, phase index, client), so every runner gets the
    same adapted state. Returns it; the caller scores it and throws it away."""
    for p, (phase, payload) in enumerate(payloads):
        seed_torch(ctx.seed, ctx.round, HOLDOUT, p, env.cid)
        state = algo.adapt_holdout(env, payload, state, dataclasses.replace(ctx, phase=phase))
    return state


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


# -- jobs: a client's work with all its inputs ---------------------------------------------------------


@dataclass(frozen=True)
class TrainJob:
    """One client's training in one phase: the inputs of :func:`train_client` but the
    algorithm and the client's environment, which the runner has (``envs[cid]``)."""

    cid: int
    payload: Payload
    state: State | None  # None where the client keeps its own state (Flower nodes)
    ctx: RoundContext  # the round, the phase, the round's optimiser, a straggler's work
    phase_index: int  # the phase's position in the round (torch is seeded from it)

    def run(self, algo: Algorithm, env: ClientEnv) -> Update | None:
        state = held_state(self)
        return train_client(algo, env, self.payload, state, self.ctx, self.phase_index)


@dataclass(frozen=True)
class EvalJob:
    """One client's evaluation: the inputs of :func:`evaluate_client` but the algorithm and
    the client's environment."""

    cid: int
    view: Payload
    state: State | None  # None where the client keeps its own state (Flower nodes)
    ctx: RoundContext  # phase EVALUATE
    batch_size: int  # eval.batch_size
    finetune_epochs: int = 0  # eval.finetune_epochs
    upload: Upload | None = None  # MAP's protocol: the client's last upload of the round
    # a held-out client (data.holdout_clients): (phase, payload) per phase of the round, run
    # through Algorithm.adapt_holdout before scoring (adapt_client); None: an ordinary client
    adapt: tuple[tuple[str, Payload], ...] | None = None
    metrics: tuple[str, ...] = ()  # eval.metrics beyond accuracy (their statistics come back)
    task: str = "classification"  # the data's task (pflkit.eval.tasks)

    def run(self, algo: Algorithm, env: ClientEnv) -> dict[str, Any]:
        return evaluate_client(
            algo,
            env,
            self.view,
            held_state(self),
            self.ctx,
            self.batch_size,
            self.upload,
            self.finetune_epochs,
            self.adapt,
            self.metrics,
            self.task,
        )


Job = TrainJob | EvalJob


def held_state(job: Job) -> State:
    """The client state ``job`` carries: every runner but Flower's, whose nodes run the job
    functions with the state they keep (there a job without one is a bug)."""
    if job.state is None:
        raise RuntimeError(f"client {job.cid}'s job carries no state: its node keeps it")
    return job.state


# -- runners --------------------------------------------------------------------------------------------


class ClientRunner:
    """Where client work runs (module docstring). A runner holds no run state: the engine
    hands it jobs and stores what comes back."""

    #: client state lives in the engine: jobs carry it, training results return the new one
    #: (so a run can be checkpointed and resumed); False: it lives where the clients run.
    #: The simulation reads it once, when it starts (``Simulation.states_here``)
    keeps_state: bool = True
    #: trains (and scores) a phase's clients as one batched computation (engine.vectorize)
    vectorize: bool = False
    #: and replays its training steps as CUDA graphs (engine.cuda_graphs)
    graphs: bool = False

    def start(self, cfg: ExperimentConfig, data: FederatedDataset) -> None:
        """Prepare for a run of ``cfg`` on ``data`` (called once, before its first round)."""

    def run(
        self,
        algo: Algorithm,
        envs: Sequence[ClientEnv],
        jobs: Sequence[Job],
        meanwhile: Callable[[], None] | None = None,
    ) -> dict[int, Any]:
        """The result of every job of ``jobs`` (all of one kind, one per client) by client, in
        job order, as ``job.run(algo, envs[job.cid])`` computes it: for a :class:`TrainJob`
        the :class:`~pflkit.algorithms.Update` (its state None where ``keeps_state`` is False)
        or None (the client diverged: ``train.on_nan: skip_client``), for an :class:`EvalJob`
        the client's accuracy per split (and its metrics' statistics, :func:`evaluate_client`).
        A client missing from the result failed (Flower only). ``meanwhile`` is server work (scoring the global model) that runs while the
        clients work, where they run elsewhere."""
        raise NotImplementedError

    def row_extras(self, row: dict[str, Any]) -> dict[str, Any]:
        """Runner-specific fields to add to this round's metrics ``row`` (none here)."""
        return {}

    def close(self) -> None:
        pass


class InProcess(ClientRunner):
    """Client work in this process, one client after another, or with ``vectorize``
    (``engine.vectorize``) as one batched computation (:func:`run_jobs`), with ``graphs``
    (``engine.cuda_graphs``) its steps replayed as CUDA graphs."""

    def __init__(self, vectorize: bool = False, graphs: bool = False):
        self.vectorize, self.graphs = vectorize, graphs

    def run(
        self,
        algo: Algorithm,
        envs: Sequence[ClientEnv],
        jobs: Sequence[Job],
        meanwhile: Callable[[], None] | None = None,
    ) -> dict[int, Any]:
        if meanwhile is not None:
            meanwhile()
        if self.vectorize:
            return run_jobs(algo, envs, jobs, self.graphs)
        return {job.cid: job.run(algo, envs[job.cid]) for job in jobs}


def run_jobs(
    algo: Algorithm, envs: Sequence[ClientEnv], jobs: Sequence[Job], graphs: bool = False
) -> dict[int, Any]:
    """The results of ``jobs`` (all of one kind) by client, in job order, by the vectorised
    engine (:mod:`pflkit.engine.vectorized`): training as one computation (``graphs``: its
    steps replayed as CUDA graphs, :func:`~pflkit.engine.vectorized.train_graphed`); evaluation of the
    clients scored by the default scoring model too, where only accuracy on a classification
    task is asked for (the others one by one, which computes every metric of
    ``eval.metrics`` and every task)."""
    if not jobs:
        return {}
    if isinstance(jobs[0], TrainJob):
        return vectorized.train_cohort(algo, envs, jobs, checked, seed_torch, graphs)

    def weights(job: EvalJob) -> Weights | None:
        if job.adapt is not None or job.finetune_epochs:
            return None
        if job.metrics or job.task != "classification":  # batched_accuracy: accuracy only
            return None
        model = scored_model(algo, envs[job.cid], job.view, held_state(job), job.ctx, job.upload)
        return get_weights(model) if type(model) is type(envs[job.cid].model()) else None

    return vectorized.evaluate_cohort(algo, envs, jobs, weights, lambda j: j.run(algo, envs[j.cid]))


# -- process pool -----------------------------------------------------------------------------------

_WORKER: dict[str, Any] = {}  # in a worker process: its algorithm and environments
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


STOP_SIGNALS = {signal.SIGINT, signal.SIGTERM}


@contextlib.contextmanager
def child_signals_blocked() -> Iterator[None]:
    """Around starting worker processes (a pool's submit): SIGINT and SIGTERM are blocked in
    this thread, so a child starts with them blocked (the mask survives fork and exec) and a
    Ctrl-C to the terminal's process group while it starts and imports is held until
    :func:`ignore_stop_signals` throws it away; here, one that arrives meanwhile is handled
    as soon as the block ends."""
    if not hasattr(signal, "pthread_sigmask"):  # not POSIX: nothing to hold
        yield
        return
    before = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, before)


def ignore_stop_signals() -> None:
    """A worker process's first step: SIGINT and SIGTERM from the terminal are the parent's
    to handle (it prints the one sentence), so they are ignored here, and any that arrived
    while the worker started (held by :func:`child_signals_blocked`) is dropped."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    if hasattr(signal, "pthread_sigmask"):
        signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)


def reply(work: Callable[[], Any]) -> bytes:
    """A worker's pickled reply for ``work()``: ("ok", its result), ("user", the PflkitError's
    sentence, "") or ("error", the exception, the worker's traceback): a bug keeps the
    worker's traceback for the report (:func:`unpack_replies`)."""
    try:
        return pickle.dumps(("ok", work()), protocol=pickle.HIGHEST_PROTOCOL)
    except PflkitError as err:
        return pickle.dumps(("user", str(err), ""))
    except Exception as err:
        return pickle.dumps(("error", f"{type(err).__name__}: {err}", traceback.format_exc()))


def run_job(algo: Algorithm, envs: Sequence[ClientEnv], blob: bytes) -> bytes:
    """Run one pickled job with a worker's algorithm and the job's client environment; the
    pickled :func:`reply`."""

    def work() -> Any:
        job: Job = pickle.loads(blob)
        return job.run(algo, envs[job.cid])

    return reply(work)


def unpack_replies(
    replies: dict[int, bytes], where: str, what: str, rnd: int, stop: Callable[[], None]
) -> dict[int, Any]:
    """The results of the workers' pickled replies (:func:`reply`) by client; the first
    failure stops every worker (``stop``) and is raised: a user error as its sentence, a bug
    as a RuntimeError naming the client and ``where`` it ran, with the worker's traceback."""
    out = {}
    for cid, blob in replies.items():
        status, value, *tb = pickle.loads(blob)
        if status == "user":
            stop()
            raise PflkitError(value)
        if status == "error":
            stop()
            raise RuntimeError(
                f"client {cid} failed in {where} while {what} in round {rnd}: "
                f"{value}\n--- worker traceback ---\n{tb[0]}"
            )
        out[cid] = value
    return out


def _worker_init(spec: worker.WorkerSpec, data: FederatedDataset) -> None:
    # Ctrl-C and a cluster's SIGTERM are the parent's to handle: it finishes the round
    ignore_stop_signals()
    die_with_parent()
    built = worker.start_worker(spec, data)
    _WORKER.update(algo=built.algo, envs=built.envs)


def _worker_job(blob: bytes) -> bytes:
    """Run one pickled job in a pool worker (:func:`run_job`)."""
    return run_job(_WORKER["algo"], _WORKER["envs"], blob)


def _worker_share(blob: bytes, graphs: bool) -> bytes:
    """Run a pickled list of jobs in a pool worker as one computation (:func:`run_jobs`)."""
    algo, envs = _WORKER["algo"], _WORKER["envs"]
    return reply(lambda: run_jobs(algo, envs, pickle.loads(blob), graphs))


def shares(jobs: Sequence[Job], sizes: Sequence[int], parts: int) -> list[list[Job]]:
    """``jobs`` in at most ``parts`` shares of about equal work: largest client (``sizes``)
    first, each to the share with the least so far; every share in job order."""
    load = [0] * parts
    out: list[list[Job]] = [[] for _ in range(parts)]
    for job in sorted(jobs, key=lambda j: -sizes[j.cid]):
        k = load.index(min(load))
        load[k] += sizes[job.cid]
        out[k].append(job)
    order = {job.cid: i for i, job in enumerate(jobs)}
    return [sorted(share, key=lambda j: order[j.cid]) for share in out if share]


class ProcessPool(ClientRunner):
    """Client work in ``workers`` processes with ``threads`` torch threads each (module
    docstring), built once from the run's config and data (:meth:`start`); each has its own
    algorithm and client environments, and runs the jobs it is sent. Workers start on first
    use. With one thread each they are forked from this process (instant, and the dataset is
    shared copy-on-write); with more, a forked copy of a process that has run multi-threaded
    torch kernels can hang, so they start from a fork server (a fresh process; the dataset's
    tensors reach them through shared memory, and a script that starts a run must guard it
    with ``if __name__ == "__main__":``). ``fresh`` asks for that always: on an accelerator,
    where a forked CUDA context is unusable, each worker opens its own context and stream on
    the run's device, and the workers share the GPU."""

    def __init__(
        self,
        workers: int,
        threads: int = 1,
        fresh: bool = False,
        vectorize: bool = False,
        graphs: bool = False,
    ):
        self.workers = workers
        self.threads = threads
        self.fresh = fresh
        self.vectorize = vectorize  # each worker trains its share as one computation
        self.graphs = graphs  # ... its steps replayed as CUDA graphs
        self.executor: ProcessPoolExecutor | None = None
        self.initargs: tuple[Any, ...] | None = None

    def start(self, cfg: ExperimentConfig, data: FederatedDataset) -> None:
        self.initargs = (worker.WorkerSpec(cfg, self.threads), data)

    def _pool(self) -> ProcessPoolExecutor:
        if self.executor is None:
            import multiprocessing as mp

            if self.initargs is None:
                raise RuntimeError("ProcessPool.start(cfg, data) was not called before run")
            methods = mp.get_all_start_methods()
            if self.threads == 1 and not self.fresh and "fork" in methods:
                method = "fork"  # instant; safe while the workers run torch single-threaded
            else:  # a fresh server process to fork from: safe with any thread count
                method = "forkserver" if "forkserver" in methods else "spawn"
            ctx = mp.get_context(method)
            if method == "forkserver":
                ctx.set_forkserver_preload(["pflkit.engine.clients"])
            with child_signals_blocked():
                self.executor = ProcessPoolExecutor(
                    self.workers, mp_context=ctx, initializer=_worker_init, initargs=self.initargs
                )
        return self.executor

    def run(
        self,
        algo: Algorithm,
        envs: Sequence[ClientEnv],
        jobs: Sequence[Job],
        meanwhile: Callable[[], None] | None = None,
    ) -> dict[int, Any]:
        """``jobs`` in the workers, largest clients first, and ``meanwhile`` here while they
        run (``algo`` is the workers' own copy; ``envs`` give the clients' sizes)."""
        pool = self._pool()
        what = "training" if any(isinstance(j, TrainJob) for j in jobs) else "evaluating"
        rnd = jobs[0].ctx.round if jobs else 0
        order = sorted(jobs, key=lambda j: -envs[j.cid].num_train)
        # vectorize: one share of the jobs per worker, keyed by its first client
        parts = shares(jobs, [e.num_train for e in envs], self.workers) if self.vectorize else []
        try:
            with child_signals_blocked():  # a submit may start a worker
                futures: dict[int, Future[bytes]] = {
                    part[0].cid: pool.submit(
                        _worker_share, pickle.dumps(part, pickle.HIGHEST_PROTOCOL), self.graphs
                    )
                    for part in parts
                } or {
                    job.cid: pool.submit(_worker_job, pickle.dumps(job, pickle.HIGHEST_PROTOCOL))
                    for job in order
                }
            if meanwhile is not None:
                meanwhile()
            replies = {cid: futures[cid].result() for cid in futures}
        except BrokenProcessPool:
            self.close(kill=True)
            raise WorkerLost(
                f"a worker process died while {what} in round {rnd} (out of memory, or killed): "
                "set engine.workers: 1 to run in this process",
                "engine.workers=1",
            ) from None
        except BaseException:  # Ctrl-C or a failed submit: stop every worker now
            self.close(kill=True)
            raise
        out = unpack_replies(replies, "a worker process", what, rnd, lambda: self.close(kill=True))
        if self.vectorize:  # one dict of results per share
            out = {cid: r for share in out.values() for cid, r in share.items()}
        return {job.cid: out[job.cid] for job in jobs}

    def close(self, kill: bool = False) -> None:
        ex, self.executor = self.executor, None
        if ex is None:
            return
        if kill:
            for proc in list(getattr(ex, "_processes", {}).values()):
                proc.kill()  # workers ignore SIGINT and SIGTERM
        ex.shutdown(wait=True, cancel_futures=True)


GPU_WORKERS = 8  # auto on a GPU: 8 workers ran the anchor round 4.9x faster than 1 (H100)
GPU_GIB_PER_WORKER = 4  # each worker's CUDA context, torch heap and data: 2.1-2.4 GiB measured


def auto_workers(cfg: ExperimentConfig) -> int:
    """``engine.workers: auto``. On CPU one worker process per core (at most one per client).
    On a GPU several processes share it (one launch-bound process leaves it mostly idle):
    ``GPU_WORKERS``, at most one per core, one per client and one per ``GPU_GIB_PER_WORKER``
    GiB of the device's memory. docs/benchmarks.md has the measurements behind both."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    most = min(cores or 1, cfg.data.num_clients)
    device = resolve_device(cfg.device)
    if device == "cpu":
        return max(1, most)
    gib = torch.cuda.get_device_properties(torch.device(device)).total_memory / 2**30
    return max(1, min(most, GPU_WORKERS, int(gib // GPU_GIB_PER_WORKER)))


@RUNNERS.register(
    "pool", "engine.workers worker processes on this machine (auto: one per core); 1: this process"
)
def make_runner(cfg: ExperimentConfig) -> ClientRunner:
    """``engine.runner: pool`` (the default): a :class:`ProcessPool` of ``engine.workers``
    processes (``auto``: :func:`auto_workers`), or :class:`InProcess` where that is 1."""
    e = cfg.engine
    workers = auto_workers(cfg) if e.workers == "auto" else e.workers
    vectorize, graphs = vectorized.enabled(cfg), vectorized.graphs(cfg)
    if workers <= 1:
        return InProcess(vectorize, graphs)
    # on an accelerator the workers share it, each with its own context (ProcessPool, fresh)
    accelerator = resolve_device(cfg.device) != "cpu"
    threads = e.threads_per_worker
    return ProcessPool(workers, threads, fresh=accelerator, vectorize=vectorize, graphs=graphs)


@RUNNERS.register("in-process", "this process, one client after another (engine.workers unused)")
def in_process(cfg: ExperimentConfig) -> ClientRunner:
    """``engine.runner: in-process``: :class:`InProcess`, whatever ``engine.workers`` says."""
    return InProcess(vectorized.enabled(cfg), vectorized.graphs(cfg))
