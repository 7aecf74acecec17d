"""Client work on a Ray cluster (``engine.runner: ray``): the runner for runs that one
machine's process pool cannot hold.

:class:`RayRunner` keeps ``engine.workers`` Ray actors, each with ``engine.ray_cpus`` CPUs and
``engine.ray_gpus`` GPUs of the cluster (a fraction shares a GPU between actors) and
``engine.threads_per_worker`` torch threads. Each actor builds its own algorithm and client
environments once, from the run's validated config and the dataset, with
:func:`~pflkit.engine.worker.start_worker` as every runner's workers do; the dataset goes to
the cluster's object store once (``ray.put``) and every actor reads it from there. Per round only the jobs (a
client's payload, state and round context) travel to the actors and the results back, both
pickled as the pool pickles them. Jobs go to whichever actor is free, largest clients first,
so the round ends with small clients.

The actors run :func:`~pflkit.engine.clients.train_client` and
:func:`~pflkit.engine.clients.evaluate_client` like every runner, and every random draw in
them is seeded from (seed, round, phase, client): with one torch thread per actor the
numbers equal the process pool's and the in-process runner's bit for bit (same torch and
same CPU kind on every node).

``engine.ray_address`` null starts a Ray instance on this machine for the run (no dashboard)
and stops it at the end; an address (``ray start --head`` prints it) joins that cluster, and
the runner leaves the cluster running. pflkit (the same version) must be installed on every
node: the actors import it there. Ray itself is optional: ``pip install 'pflkit[ray]'``.
"""

from __future__ import annotations

import collections
import logging
import math
import os
import pickle
import socket
from collections.abc import Callable, Sequence
from typing import Any

from pflkit.algorithms import Algorithm
from pflkit.algorithms.env import ClientEnv
from pflkit.config import ExperimentConfig
from pflkit.data.federated import FederatedDataset
from pflkit.devices import resolve_device
from pflkit.engine import worker
from pflkit.engine.clients import (
    ClientRunner,
    Job,
    TrainJob,
    reply,
    run_job,
    unpack_replies,
)
from pflkit.engine.runners import RUNNERS
from pflkit.errors import PflkitError, WorkerLost

NEEDS_RAY = "engine.runner: ray needs Ray: pip install 'pflkit[ray]'"
CONNECT_TIMEOUT = 10.0  # seconds to reach a cluster's address before giving up
SETUP_TIMEOUT = 600.0  # seconds for every actor to start and build its environments
DEPTH = 2  # jobs queued per actor: the next job is there when one ends (hides the round trip)


def _import_ray() -> Any:
    try:
        import ray
    except ImportError:
        raise PflkitError(NEEDS_RAY) from None
    return ray


@RUNNERS.register("ray", "actors on a Ray cluster (engine.ray_address; pip install 'pflkit[ray]')")
def ray_runner(cfg: ExperimentConfig) -> RayRunner:
    """``engine.runner: ray``: the :class:`RayRunner` that ``cfg.engine`` asks for, its settings
    checked here, before anything is built: Ray importable, and the device and
    ``engine.ray_gpus`` agreeing (actors with GPUs train on the GPU Ray gives them, actors
    without on their CPUs, and the server on ``device``)."""
    _import_ray()
    e = cfg.engine
    on_gpu = resolve_device(cfg.device) != "cpu"
    if on_gpu and not e.ray_gpus:
        raise PflkitError(
            f"device {cfg.device} runs the server on a GPU but engine.ray_gpus is 0, so the "
            "Ray workers would train on CPUs: set engine.ray_gpus (e.g. 0.25: four workers "
            "share a GPU), or device: cpu"
        )
    if e.ray_gpus and not on_gpu:
        raise PflkitError(
            f"engine.ray_gpus is {e.ray_gpus} but device {cfg.device} is the CPU here: set "
            "device: cuda (the server's machine needs a GPU too), or engine.ray_gpus: 0"
        )
    workers = None if e.workers == "auto" else e.workers
    return RayRunner(workers, e.threads_per_worker, e.ray_address, e.ray_cpus, e.ray_gpus)


class ClientActor:
    """One Ray actor's process: the run's algorithm and client environments, built once
    (:meth:`setup`), and the jobs it is sent (:meth:`run`). Ray wraps this class with the
    actor's resources (:meth:`RayRunner._actors`)."""

    def __init__(self) -> None:
        self.algo: Algorithm | None = None
        self.envs: list[ClientEnv] = []

    def setup(self, spec: worker.WorkerSpec, data: FederatedDataset) -> bytes:
        """Build the algorithm and the environments (:func:`~pflkit.engine.worker.start_worker`)
        on ``spec.device`` (``cuda``: the GPU, or share of one, that Ray gave this actor); the
        pickled reply (:func:`~pflkit.engine.clients.reply`) of this actor's Ray node id."""

        def work() -> str:
            import ray

            built = worker.start_worker(spec, data)
            self.algo, self.envs = built.algo, built.envs
            return ray.get_runtime_context().get_node_id()

        return reply(work)

    def run(self, blob: bytes) -> bytes:
        """One pickled job; the pickled reply (:func:`~pflkit.engine.clients.run_job`)."""
        if self.algo is None:
            raise RuntimeError("the actor runs jobs only after start()")
        return run_job(self.algo, self.envs, blob)


class RayRunner(ClientRunner):
    """Client work in Ray actors (module docstring). ``workers``: the number of actors; None
    (``engine.workers: auto``) is as many as the cluster's CPUs hold at ``cpus`` each (and
    its GPUs at ``gpus`` each, where ``gpus`` > 0), at most one per client. ``address``: the
    cluster to join; None starts one on this machine for the run. Ray is started, and the
    actors built, on first use; :meth:`close` stops the actors, and Ray where this runner
    started it (or connected this process to a cluster)."""

    def __init__(
        self,
        workers: int | None = None,
        threads: int = 1,
        address: str | None = None,
        cpus: float = 1.0,
        gpus: float = 0.0,
    ):
        self.workers = workers
        self.threads = threads
        self.address = address
        self.cpus = cpus
        self.gpus = gpus
        self.cfg: ExperimentConfig | None = None
        self.num_clients = 0
        self.data: FederatedDataset | None = None
        self.data_ref: Any = None  # the dataset in the cluster's object store
        self.actors: list[Any] = []
        self.actor_nodes: list[str] = []  # the Ray node id of each actor
        self.jobs_per_node: collections.Counter[str] = collections.Counter()
        self.owns_ray = False  # this runner called ray.init (so close calls ray.shutdown)

    def start(self, cfg: ExperimentConfig, data: FederatedDataset) -> None:
        self.cfg = cfg
        self.data = data
        self.num_clients = data.num_clients

    # -- the cluster -------------------------------------------------------------------------------
    def _connect(self) -> Any:
        ray = _import_ray()
        if ray.is_initialized():  # this process already joined a cluster: use it
            return ray
        os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
        quiet = {"logging_level": logging.WARNING, "include_dashboard": False}
        if self.address is None:
            # "local": a new instance even where a cluster runs on this machine already
            ray.init(address="local", **quiet)
        else:
            _reachable(self.address)
            try:
                ray.init(address=self.address, **quiet)
            except Exception as err:  # a version mismatch, a cluster that went away
                if type(err).__name__ == "AuthenticationError":
                    why = "it asks for a token this machine does not have"
                    fix = "copy the head's ~/.ray/auth_token here (or set RAY_AUTH_TOKEN)"
                else:  # a token refused (Ray says no more), a version mismatch
                    text = str(err).strip()
                    why = text.splitlines()[0] if text else type(err).__name__
                    fix = (
                        "give this machine the head's token (~/.ray/auth_token or "
                        "RAY_AUTH_TOKEN) and the same Ray and Python versions as the nodes"
                    )
                raise PflkitError(
                    f"cannot join the Ray cluster at engine.ray_address {self.address} ({why}): "
                    f"{fix}, or set engine.ray_address: null for Ray on this machine"
                ) from None
        self.owns_ray = True
        return ray

    def _count(self, ray: Any) -> int:
        """The number of actors (``workers``, or auto), checked against the cluster."""
        have = ray.cluster_resources()
        fit = math.floor(have.get("CPU", 0) / self.cpus + 1e-9)
        if self.gpus:
            fit = min(fit, math.floor(have.get("GPU", 0) / self.gpus + 1e-9))
        n = self.workers if self.workers is not None else max(1, min(fit, self.num_clients))
        if n > fit:
            gpus = f" and {have.get('GPU', 0):g} GPUs" if self.gpus else ""
            raise PflkitError(
                f"{n} Ray workers of {self.cpus:g} CPUs and {self.gpus:g} GPUs each do not fit "
                f"the cluster's {have.get('CPU', 0):g} CPUs{gpus}: lower engine.workers, "
                "engine.ray_cpus or engine.ray_gpus, or add nodes (ray start --address=...)"
            )
        return n

    def _actors(self) -> list[Any]:
        if self.actors:
            return self.actors
        if self.cfg is None:
            raise RuntimeError("RayRunner.start(cfg, data) was not called before run")
        ray = self._connect()
        n = self._count(ray)
        if self.data_ref is None:
            self.data_ref = ray.put(self.data)  # once: every actor reads this copy
        remote = ray.remote(num_cpus=self.cpus, num_gpus=self.gpus)(ClientActor)
        # spread the actors over the nodes (the default packs them onto the first)
        actors = [remote.options(scheduling_strategy="SPREAD").remote() for _ in range(n)]
        self.actors = actors
        spec = worker.WorkerSpec(self.cfg, self.threads, "cuda" if self.gpus else "cpu")
        refs = [a.setup.remote(spec, self.data_ref) for a in actors]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=SETUP_TIMEOUT)
        if len(ready) < len(refs):
            self.close(kill=True)
            raise PflkitError(
                f"{len(refs) - len(ready)} of {n} Ray workers did not start within "
                f"{SETUP_TIMEOUT:g} s: check `ray status` for free CPUs and GPUs, or lower "
                "engine.workers"
            )
        try:
            replies = dict(enumerate(ray.get(refs)))
        except Exception as err:
            self.close(kill=True)
            raise WorkerLost(_died("starting", 0, err), "engine.runner=pool") from None
        nodes = unpack_replies(
            replies, "a Ray worker", "building its clients", 0, lambda: self.close(kill=True)
        )
        self.actor_nodes = [nodes[i] for i in range(n)]
        return actors

    # -- rounds ------------------------------------------------------------------------------------
    def run(
        self,
        algo: Algorithm,
        envs: Sequence[ClientEnv],
        jobs: Sequence[Job],
        meanwhile: Callable[[], None] | None = None,
    ) -> dict[int, Any]:
        """``jobs`` on the actors, largest clients first, and ``meanwhile`` here while they
        run; the results by client in job order, as :meth:`ProcessPool.run
        <pflkit.engine.clients.ProcessPool.run>` returns them (``algo`` is the actors' own
        copy; ``envs`` give the clients' sizes)."""
        what = "training" if any(isinstance(j, TrainJob) for j in jobs) else "evaluating"
        rnd = jobs[0].ctx.round if jobs else 0
        actors = self._actors()
        import ray

        queue = collections.deque(sorted(jobs, key=lambda j: -envs[j.cid].num_train))
        pending: dict[Any, tuple[int, int]] = {}  # reply -> (client, actor index)

        def submit(i: int) -> None:
            job = queue.popleft()
            blob = pickle.dumps(job, pickle.HIGHEST_PROTOCOL)
            pending[actors[i].run.remote(blob)] = (job.cid, i)

        blobs: dict[int, bytes] = {}
        cid = -1  # the client whose reply is being read
        try:
            for _ in range(DEPTH):
                for i in range(len(actors)):
                    if queue:
                        submit(i)
            if meanwhile is not None:
                meanwhile()
            while pending:
                done, _ = ray.wait(list(pending), num_returns=1)
                for ref in done:
                    cid, i = pending.pop(ref)
                    blobs[cid] = ray.get(ref)
                    self.jobs_per_node[self.actor_nodes[i]] += 1
                    if queue:
                        submit(i)
        except ray.exceptions.RayTaskError as err:  # raised past ClientActor.run's handler
            self.close(kill=True)
            raise RuntimeError(
                f"client {cid} failed in a Ray worker while {what} in round {rnd}: {err}"
            ) from None
        except ray.exceptions.RayError as err:  # the actor or its node died, an object lost
            self.close(kill=True)
            raise WorkerLost(_died(what, rnd, err), "engine.runner=pool") from None
        except BaseException:  # Ctrl-C or a failed submit: stop every actor now
            self.close(kill=True)
            raise
        replies = {job.cid: blobs[job.cid] for job in jobs}
        return unpack_replies(replies, "a Ray worker", what, rnd, lambda: self.close(kill=True))

    def close(self, kill: bool = False) -> None:
        """Stop the actors (``kill``: the same; actors hold nothing worth a graceful end), and
        disconnect from Ray (stopping it, where it was started for the run) if this runner
        connected."""
        actors, self.actors = self.actors, []
        if not actors and not self.owns_ray:
            return
        import ray

        if ray.is_initialized():
            for actor in actors:
                try:
                    ray.kill(actor)
                except Exception:  # its node is gone already
                    pass
        self.actor_nodes = []
        if self.owns_ray and not kill:
            self.data_ref = None
            self.owns_ray = False
            ray.shutdown()


def _died(what: str, rnd: int, err: BaseException) -> str:
    where = f" in round {rnd}" if rnd else ""
    return (
        f"a Ray worker died while {what}{where} ({type(err).__name__}: its node left the "
        "cluster, ran out of memory, or was killed): check `ray status` and the nodes' logs, "
        "or set engine.runner: pool to run on this machine"
    )


def _reachable(address: str) -> None:
    """Refuse, within :data:`CONNECT_TIMEOUT` seconds, a cluster address that nothing answers
    at (``ray.init`` alone retries for minutes)."""
    hostport = address.removeprefix("ray://")
    if hostport == "auto":  # the cluster started on this machine: Ray finds it
        return
    host, _, port = hostport.rpartition(":")
    host = host.strip("[]")
    fix = (
        "start the head there (`ray start --head --port=PORT`), or set engine.ray_address: "
        "null for a Ray instance on this machine"
    )
    if not host or not port.isdigit():
        raise PflkitError(
            f"engine.ray_address {address!r} is not HOST:PORT (e.g. 10.0.0.5:6379): {fix}"
        )
    try:
        socket.create_connection((host, int(port)), timeout=CONNECT_TIMEOUT).close()
    except OSError as err:
        raise PflkitError(
            f"no Ray cluster answers at engine.ray_address {address} "
            f"({err.strerror or type(err).__name__}): {fix}"
        ) from None
