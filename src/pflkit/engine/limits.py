"""Pre-flight: a run that asks for more than this machine has is refused before it writes
anything, in one sentence naming the value, the limit and the fix (docs/guide.md, "Limits").

Checked (:func:`check_machine`), each refused only when clearly past the machine:

- worker processes (``engine.workers``; ``--jobs`` of a compare) above ``WORKERS_PER_CORE``
  times the cores this process may use (``os.sched_getaffinity``), or above the processes
  that may still start (the soft ``RLIMIT_NPROC`` for a user other than root, the cgroup's
  ``pids.max``);
- torch threads (``threads``, ``engine.workers`` x ``engine.threads_per_worker``) above
  ``WORKERS_PER_CORE`` times the cores;
- memory: the client states kept in memory (``engine.state_memory``, or all the states of
  the clients that train if fewer) plus, per worker, ``WORKER_BASE`` and one training
  client's model copies, state and batch activations (:class:`Footprint`, measured on the
  built run), above ``MemAvailable`` (/proc/meminfo);
- disk: the client states the run writes (all of them with checkpoints, those beyond
  ``engine.state_memory`` without) above the free space where they go.

Up to ``WORKERS_PER_CORE`` processes or threads per core are allowed because a few more
processes than cores costs little (the tests ask for 2-4 workers on 2 cores), while
thousands exhaust the process table and memory before any round runs (``engine.workers:
10000`` did). ``force`` (``--force``) skips every check.
"""

from __future__ import annotations

import os
import resource
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from pflkit.config import ExperimentConfig
from pflkit.errors import PflkitError

WORKERS_PER_CORE = 4
# a pool worker's own memory after one round of the tiny MLP run (USS from smaps_rollup):
# 168 MiB forked, 141 MiB from the fork server; the smaller one, so the estimate stays low
WORKER_BASE = 141 * 2**20
# copies of the model one training client holds: its weights, their gradients, the optimiser's
# momentum and the payload it started from
TRAIN_COPIES = 4
FORCE = "or pass --force (Python: force=True) to run anyway"


@dataclass(frozen=True)
class Footprint:
    """What one client costs, measured on a built run (:func:`footprint`)."""

    model_bytes: int  # parameters and buffers of the largest client model
    # one client's state as the store counts it, measured on its init: a lower bound where an
    # algorithm builds the state in its first training (Ditto's personal model counts 0)
    state_bytes: int
    act_bytes: int  # activations of one training batch (train.batch_size, capped by the data)
    stateful: int  # clients that keep a state: those that train (a lower bound)


def cores() -> int:
    """The CPU cores this process may run on."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def process_headroom() -> tuple[int, str] | None:
    """How many more processes may start, and the limit that says so (None: no limit known)."""
    found: list[tuple[int, str]] = []
    soft, _ = resource.getrlimit(resource.RLIMIT_NPROC)
    if soft != resource.RLIM_INFINITY and os.geteuid() != 0:  # root is not held to it
        found.append((soft - _user_tasks(), f"ulimit -u {soft}"))
    try:
        most = Path("/sys/fs/cgroup/pids.max").read_text().strip()
        now = int(Path("/sys/fs/cgroup/pids.current").read_text())
        if most != "max":
            found.append((int(most) - now, f"the cgroup's pids.max {most}"))
    except (OSError, ValueError):
        pass
    return min(found) if found else None


def _user_tasks() -> int:
    """The processes and threads of this user (what RLIMIT_NPROC counts)."""
    uid, count = os.geteuid(), 0
    for status in Path("/proc").glob("[0-9]*/status"):
        try:
            text = status.read_text()
        except OSError:
            continue
        fields = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
        if int(fields.get("Uid", "-1 0").split()[1]) == uid:
            count += int(fields.get("Threads", "1"))
    return count


def available_memory() -> int | None:
    """``MemAvailable`` of /proc/meminfo in bytes (None where there is none)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def free_disk(folder: Path | None) -> tuple[int, Path]:
    """Free bytes where ``folder`` is (or would be created; None: the temporary folder)."""
    place = Path(tempfile.gettempdir()) if folder is None else Path(folder).absolute()
    while not place.exists():
        place = place.parent
    return shutil.disk_usage(place).free, place


def size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError


def footprint(cfg: ExperimentConfig, algo: Any, envs: list[Any], stateful: int) -> Footprint:
    """Measure one client's cost on the built run: model parameters and the activations of
    one training batch (forward hooks on a model of each architecture), and the state of
    client 0 (its init). Torch's random stream is left as it was."""
    from pflkit.algorithms.base import nbytes
    from pflkit.engine.clients import init_client

    largest = max(envs, key=lambda e: e.num_train)
    batch = min(cfg.train.batch_size, max(largest.num_train, 1))
    model_bytes = act_bytes = 0
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        for arch in {e.arch for e in envs}:
            env = next(e for e in envs if e.arch == arch)
            model = env.models.new_model(arch)
            tensors = [*model.parameters(), *model.buffers()]
            model_bytes = max(model_bytes, sum(t.numel() * t.element_size() for t in tensors))
            act_bytes = max(act_bytes, batch * _activations_per_sample(model, env))
        state_bytes = nbytes(init_client(algo, envs[0], cfg.seed))
    return Footprint(model_bytes, state_bytes, act_bytes, stateful)


def _activations_per_sample(model: torch.nn.Module, env: Any) -> int:
    """Bytes of every module's output for one sample (what training keeps for backward)."""
    x = env.data.train_x[:2]
    if len(x) == 0:
        return 0
    total = [0]

    def hook(module: Any, args: Any, out: Any) -> None:
        if isinstance(out, torch.Tensor):
            total[0] += out.numel() * out.element_size()

    leaves = [m for m in model.modules() if not list(m.children())]
    handles = [m.register_forward_hook(hook) for m in leaves]
    try:
        model.eval()
        model(x)
    except Exception:  # a model this probe cannot feed: its activations go uncounted
        return 0
    finally:
        for h in handles:
            h.remove()
    return total[0] // len(x)


def check_machine(
    cfg: ExperimentConfig,
    fp: Footprint,
    workers: int,
    threads_per_worker: int,
    state_dir: Path | None,
    what: str = "engine.workers",
) -> None:
    """Refuse ``cfg`` run with ``workers`` processes (1: in this process) of
    ``threads_per_worker`` torch threads when it is clearly past this machine (module
    docstring); ``what`` names the setting that asked for the workers."""
    n, most = cores(), WORKERS_PER_CORE * cores()
    auto = " (auto: one per core)" if what == "engine.workers" else ""
    if workers > most:
        raise PflkitError(
            f"{what} {workers} is more than {WORKERS_PER_CORE} worker processes per core of "
            f"this machine's {n} ({most}): more only add memory and start-up time; lower "
            f"{what}{auto}, {FORCE}"
        )
    headroom = process_headroom() if workers > 1 else None
    if headroom is not None and workers > headroom[0]:
        raise PflkitError(
            f"{what} {workers} needs {workers} new processes but only {max(headroom[0], 0)} "
            f"may start here ({headroom[1]}): lower {what}, or raise the limit, {FORCE}"
        )
    if cfg.threads is not None and cfg.threads > most:
        raise PflkitError(
            f"threads {cfg.threads} is more than {WORKERS_PER_CORE} torch threads per core of "
            f"this machine's {n} ({most}): lower threads (1 gives the same numbers everywhere), "
            f"{FORCE}"
        )
    if workers > 1 and workers * threads_per_worker > most:
        raise PflkitError(
            f"{what} x engine.threads_per_worker = {workers} x {threads_per_worker} = "
            f"{workers * threads_per_worker} torch threads is more than {WORKERS_PER_CORE} per "
            f"core of this machine's {n} ({most}): lower either, {FORCE}"
        )
    _check_memory(cfg, fp, workers)
    _check_disk(cfg, fp, state_dir)


def _check_memory(cfg: ExperimentConfig, fp: Footprint, workers: int) -> None:
    free = available_memory()
    if free is None:
        return
    states = min(cfg.engine.state_memory, fp.stateful * fp.state_bytes)
    task = TRAIN_COPIES * fp.model_bytes + fp.state_bytes + fp.act_bytes
    per_worker = task + (WORKER_BASE if workers > 1 else 0)
    need = states + workers * per_worker
    if need > free:
        raise PflkitError(
            f"the run needs about {size(need)} of memory ({size(states)} of client states "
            f"kept in memory + {workers} x {size(per_worker)} per worker: its base, the model "
            f"x {TRAIN_COPIES}, a state and a batch of {cfg.train.batch_size}) but "
            f"{size(free)} is available: lower engine.state_memory, engine.workers or "
            f"train.batch_size, {FORCE}"
        )


def _check_disk(cfg: ExperimentConfig, fp: Footprint, state_dir: Path | None) -> None:
    total = fp.stateful * fp.state_bytes
    on_disk = total if cfg.output.checkpoint_every else max(0, total - cfg.engine.state_memory)
    if not on_disk:
        return
    free, place = free_disk(state_dir)
    if on_disk > free:
        raise PflkitError(
            f"the run writes about {size(on_disk)} of client states to disk ({fp.stateful} "
            f"clients x {size(fp.state_bytes)}) but '{place}' has {size(free)} free: free "
            f"disk space or choose another output.dir, {FORCE}"
        )
