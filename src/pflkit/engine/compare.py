"""``pflkit compare`` and ``pflkit sweep``: several settings (algorithms; in a sweep, every
point of a grid for each) on the same partition and client-sampling sequence, over several
training seeds; tables (mean ± std over seeds, :mod:`pflkit.report.results`) and curves.

Output folder::

    <out>/compare.yaml         the config the compare was started with (its identity)
    <out>/plan.json            its settings, their run folders, the report options
    <out>/<label>-s<seed>/     one run folder per setting and seed
    <out>/results.md           the tables (results.tex: the same in LaTeX)
    <out>/results.csv          every run's numbers, one line per run
    <out>/results.json         the tables' numbers, machine-readable
    <out>/accuracy.png         personalized (and global) accuracy curves, mean and band over seeds

Resumable: running the same compare into the same folder again skips every finished run
(``summary.json``), resumes every interrupted one from its checkpoint and starts the rest; a
folder started with another config is refused. ``jobs`` > 1 runs that many whole runs at
once, each in its own process with one client runner in-process (``engine.workers: 1``) and
``threads`` torch threads (default 1): the numbers equal a one-job compare at the same
thread count. The job workers start with SIGINT and SIGTERM blocked (so a Ctrl-C to the
terminal's process group cannot reach them even while they import), then ignore both and move
to their own process group: they hear signals only through the compare, and never print
anything about one (the compare says the one sentence). SIGINT or SIGTERM to it lets no new run start and stops every running one at its
round's end with a checkpoint (a second Ctrl-C: at once); so does a run's failure, whose error
is then raised. With ``keep_going`` a failed run (a diverged loss, say) stops only itself: the
others run to the end, and then one error names every failed run and why; no report is written
until every run has finished. A signal while the report is written stops it at once, in one
sentence (every run has finished; the same command writes it).
"""

from __future__ import annotations

import itertools
import json
import multiprocessing
import os
import re
import signal
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path
from typing import Any, TypeGuard, cast

import yaml

from pflkit.algorithms.base import resolve_params
from pflkit.config import ExperimentConfig, need_config
from pflkit.config_io import apply_overrides, read_yaml
from pflkit.data.federated import FederatedDataset, build_federated
from pflkit.engine.clients import child_signals_blocked
from pflkit.engine.folder import make_folder, under, write_atomic
from pflkit.engine.runner import StopSignals, run_experiment
from pflkit.errors import PflkitError, RunInterrupted
from pflkit.experiment import validate
from pflkit.report.results import PLAN, build_report, find_settings

MANIFEST = "compare.yaml"
# keys that may differ when a compare is continued: they do not change a run's numbers
_FREE = ("engine", "output", "threads", "compare", "sweep")
# a setting: its label, its algorithm config (no `label` key), its other overrides (key=value)
Planned = tuple[str, dict[str, Any], list[str]]


def _label(algo: dict[str, Any]) -> str:
    """The entry's ``label`` if it has one, else its name and parameters: ``fedprox(mu=0.01)``."""
    # both strings: _normalise checks the label, resolve_params the name
    if "label" in algo:
        return cast(str, algo["label"])
    extra = ",".join(f"{k}={v}" for k, v in algo.items() if k != "name")
    return f"{algo['name']}({extra})" if extra else cast(str, algo["name"])


def _unlabelled(algo: dict[str, Any]) -> dict[str, Any]:
    """The algorithm config of a compare entry (its ``label`` is only the setting's name)."""
    return {k: v for k, v in algo.items() if k != "label"}


def _normalise(
    algorithms: list[str | dict[str, Any]], weighting: str | None
) -> list[dict[str, Any]]:
    out = [{"name": a} if isinstance(a, str) else dict(a) for a in algorithms]
    for a in out:
        if "name" not in a:
            raise PflkitError(
                f"compare algorithm entry {a} has no 'name': write {{name: fedavg, ...}}"
            )
        label = a.get("label")
        if label is not None and not (
            isinstance(label, str) and re.fullmatch(r"[A-Za-z0-9_.=,()\[\]+-]+", label)
        ):
            raise PflkitError(
                f"compare entry label {label!r} cannot name a run folder: use letters, digits "
                "and _ . = , ( ) [ ] + - only"
            )
        # unknown names, bad parameters and a clash with train.weighting fail before anything runs
        resolve_params(_unlabelled(a), weighting)
    labels = [_label(a) for a in out]
    if len(set(labels)) != len(labels):
        raise PflkitError(
            f"compare lists the same algorithm twice ({labels}): remove the duplicate"
        )
    return out


def _claim(out: Path, cfg: ExperimentConfig) -> None:
    """Start ``out`` as a compare of ``cfg``, or accept it as one already started with the same
    config."""
    identity = {k: v for k, v in cfg.model_dump(mode="json").items() if k not in _FREE}
    text = yaml.safe_dump(identity, sort_keys=True)
    manifest = out / MANIFEST
    if manifest.exists():
        changed = cfg.model_dump(mode="json", exclude_defaults=True)
        if _differs(read_yaml(manifest, "compare manifest", written=True), identity, changed):
            raise PflkitError(
                f"compare folder '{out}' holds a compare of another config (only engine, "
                "output, threads and compare may change when continuing one): choose another --out"
            )
        return
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise PflkitError(
            f"'{out}' already exists and is not an empty folder or a pflkit compare folder: "
            "choose another --out"
        )
    make_folder(out, "compare folder")
    write_atomic(manifest, text)


def _differs(stored: Any, current: Any, changed: Any) -> bool:
    """Whether a compare folder's stored config ``stored`` differs from ``current`` (both
    ``model_dump`` trees). A setting missing from ``stored`` counts as equal when ``current``
    holds it at its default (it is not in ``changed``, the ``exclude_defaults`` dump): a
    setting added to pflkit after the folder was started, at the default that keeps the old
    behaviour, does not stop the compare from continuing."""
    if not (isinstance(stored, dict) and isinstance(current, dict)):
        return bool(stored != current)
    changed = changed if isinstance(changed, dict) else {}
    if set(stored) - set(current):
        return True
    return any(
        (k in changed) if k not in stored else _differs(stored[k], current[k], changed.get(k))
        for k in current
    )


def _run_one(
    cfg: ExperimentConfig, folder: Path, data: FederatedDataset | None, progress: bool | None
) -> None:
    """Run ``cfg`` into ``folder``, or continue the run there (from its checkpoint, or from
    round 1 when it stopped before the first one). A continued run keeps its stored settings
    except where client work runs, which is ``cfg``'s (one worker process a run at
    ``--jobs`` > 1, however many the run had when it started; no number changes)."""
    if (folder / "config.yaml").exists():
        engine = [f"engine.{k}={v}" for k, v in cfg.engine.model_dump().items()]
        run_experiment(resume=folder, overrides=engine, data=data, progress=progress, force=True)
    else:  # force: the compare checked the machine for all its runs (_check_settings)
        run_experiment(cfg, out=folder, data=data, progress=progress, force=True)


_stopping: Any = None  # in a job worker: the compare's "start no new run" event


def _init_worker(stopping: Any, parent: int) -> None:
    """A job worker: out of the terminal's process group, so that a Ctrl-C reaches it once,
    through the compare; signals are ignored except while a run listens (StopSignals); it dies
    with the compare (``parent``), even when that is killed with SIGKILL."""
    from pflkit.engine.clients import die_with_parent, ignore_stop_signals

    ignore_stop_signals()  # blocked since its start (child_signals_blocked): imports included
    global _stopping
    _stopping = stopping
    StopSignals.announce = False  # the compare says what a signal does, once
    die_with_parent(parent)
    os.setpgrp()


def _job(cfg_json: dict[str, Any], folder: str) -> str | None:
    """One whole run in a ``jobs`` worker process (None: not started, the compare is stopping)."""
    if _stopping.is_set():
        return None
    _run_one(validate(cfg_json), Path(folder), None, progress=False)
    return Path(folder).name


def _tell_workers(sig: int) -> None:
    for child in multiprocessing.active_children():
        assert child.pid is not None  # an active child has been started, so it has a pid
        try:
            os.kill(child.pid, sig)
        except ProcessLookupError:  # it has just exited
            pass


class _PassOn(StopSignals):
    """The compare's signals while jobs run: the first one is recorded (``_run_all`` then
    stops the workers), a second SIGINT is passed on to them (stop at once)."""

    stopping = "every run stops when its round ends"

    def _handle(self, signum: int, frame: Any) -> None:
        if self.signal is not None and signum == signal.SIGINT:
            _tell_workers(signal.SIGINT)
        else:
            super()._handle(signum, frame)


class _AtOnce(StopSignals):
    """The report phase's signals: SIGINT and SIGTERM stop it at once (nothing is lost: the
    runs have finished, and the same command writes the report again)."""

    def _handle(self, signum: int, frame: Any) -> None:
        self.signal = signal.Signals(signum).name
        raise KeyboardInterrupt


def _goes_on(err: BaseException | None, keep_going: bool) -> TypeGuard[PflkitError]:
    """Whether a run's error is recorded and the compare goes on: with ``keep_going``, a run
    that failed (a PflkitError); never a signalled one (RunInterrupted)."""
    return keep_going and isinstance(err, PflkitError) and not isinstance(err, RunInterrupted)


def _failed(failures: dict[str, Exception], total: int) -> PflkitError:
    """The one error of a ``keep_going`` compare whose ``failures`` (run folder -> error) are
    all that is left."""
    named = "; ".join(f"{name}: {err}" for name, err in sorted(failures.items()))
    return PflkitError(
        f"{len(failures)} of {total} runs failed, every other run finished ({named}): fix their "
        "setting (new algorithm parameters run in new folders) and run the same command again"
    )


def _check_settings(
    configs: list[ExperimentConfig],
    datasets: dict[str, FederatedDataset],
    jobs: int = 1,
    force: bool = False,
    out: Path | None = None,
) -> None:
    """Build every setting's simulation once (``configs``: one run of each), on the CPU in
    this process, and drop it: an unknown model, a bad model option, an algorithm that does not
    fit the model or the data, a missing tracker package is one sentence before anything is
    written (what ``run_experiment`` checks before it creates a run folder). So is a setting
    past this machine (:mod:`pflkit.engine.limits`, unless ``force``): with its own workers,
    or with ``jobs`` > 1 runs side by side, one process each. ``datasets`` collects the
    federated datasets, one per data config (a sweep may vary it)."""
    from pflkit.engine.clients import InProcess, make_runner
    from pflkit.engine.simulation import Simulation
    from pflkit.report.trackers import check_trackers

    for cfg in configs:
        check_trackers(cfg)
        key = cfg.data.model_dump_json()
        if key not in datasets:
            datasets[key] = build_federated(cfg.data)
        cpu = cfg.model_copy(update={"device": "cpu"})
        with Simulation(cpu, datasets[key], InProcess(), force=True) as sim:
            if force:
                continue
            if jobs > 1:
                sim.check_machine(out, jobs, "--jobs")
            elif cfg.engine.runner == "pool":
                sim.runner = make_runner(cfg)  # the run's own workers (none started here)
                sim.check_machine(out)


def _run_all(
    tasks: list[tuple[ExperimentConfig, Path]],
    jobs: int,
    progress: bool | None,
    keep_going: bool = False,
    datasets: dict[str, FederatedDataset] | None = None,
) -> None:
    todo = [(c, f) for c, f in tasks if not (f / "summary.json").exists()]
    failures: dict[str, Exception] = {}  # keep_going: run folder name -> its error
    if jobs == 1:
        # one per data config (a sweep may vary it)
        datasets = {} if datasets is None else datasets
        for run_cfg, folder in todo:
            key = run_cfg.data.model_dump_json()
            if key not in datasets:
                datasets[key] = build_federated(run_cfg.data)
            try:
                _run_one(run_cfg, folder, datasets[key], progress)
            except PflkitError as exc:
                if not _goes_on(exc, keep_going):
                    raise
                failures[folder.name] = exc
        if failures:
            raise _failed(failures, len(tasks))
        return
    from rich.console import Console

    console = Console(stderr=True)
    ctx = multiprocessing.get_context("spawn")  # a fresh interpreter: safe after torch threads
    done = len(tasks) - len(todo)
    stopping, failure = ctx.Event(), None
    workers = min(jobs, max(len(todo), 1))
    with (
        _PassOn() as signalled,
        ProcessPoolExecutor(workers, ctx, _init_worker, (stopping, os.getpid())) as pool,
    ):
        pending = {}
        with child_signals_blocked():  # a submit starts a worker (module docstring)
            for run_cfg, folder in todo:
                solo = run_cfg.model_copy(
                    update={
                        "threads": run_cfg.threads or 1,
                        "engine": run_cfg.engine.model_copy(update={"workers": 1}),
                    }
                )
                job = pool.submit(_job, solo.model_dump(mode="json"), str(folder))
                pending[job] = folder.name
        while pending:
            finished, _ = wait(pending, timeout=0.5, return_when=FIRST_COMPLETED)
            for f in finished:
                name, err = pending.pop(f), f.exception()
                if isinstance(err, BrokenProcessPool):
                    if signalled.signal:  # a worker the compare's own signal stopped early
                        continue
                    err = PflkitError(
                        f"a job worker process died while running '{name}' (killed, or out of "
                        "memory): run the same command again to continue (finished runs are "
                        "kept, interrupted ones resume from their checkpoints)"
                    )
                if isinstance(err, RunInterrupted):  # signalled (through the compare or not)
                    signalled.signal = signalled.signal or err.signal
                elif _goes_on(err, keep_going):
                    failures[name] = err
                    if progress is not False:
                        console.print(f"{name} failed, the others go on: {err}")
                elif err is not None:
                    failure = failure or err
                elif f.result() is not None:
                    done += 1
                    if progress is not False:
                        console.print(f"[{done}/{len(tasks)}] {f.result()} finished")
            if signalled.signal or failure is not None:
                # repeated: a run still setting up ignores it until its round loop listens
                stopping.set()
                _tell_workers(signal.SIGTERM)
    if failure is not None:
        raise failure
    if signalled.signal:
        raise RunInterrupted("", signalled.signal)
    if failures:
        raise _failed(failures, len(tasks))


def run_config(
    cfg: ExperimentConfig, algo: dict[str, Any], sets: list[str], seed: int
) -> ExperimentConfig:
    """The config of one run: ``cfg`` with ``algo``, the setting's overrides and ``seed``."""
    raw = cfg.dump() | {"algorithm": algo, "seed": seed}
    return validate(apply_overrides(raw, sets))


def plan_entries(algorithms: list[str | dict[str, Any]], weighting: str | None) -> list[Planned]:
    """Each algorithm entry (a name or ``{name: ..., [label: ...], params...}``), checked, as
    a setting: its label, its algorithm config, no overrides."""
    return [(_label(a), _unlabelled(a), []) for a in _normalise(algorithms, weighting)]


def compare_plan(cfg: ExperimentConfig) -> list[Planned]:
    """``compare``'s settings: each algorithm of ``compare.algorithms`` as it is."""
    return plan_entries(cfg.compare.algorithms, cfg.train.weighting)


def sweep_plan(cfg: ExperimentConfig) -> list[Planned]:
    """``sweep``'s settings: for each algorithm of ``compare.algorithms``, every point of
    ``sweep.grid``. A grid key ``algorithm.<p>`` varies parameter ``p`` of the algorithms that
    have one (the others do not repeat over it); any other key applies to every algorithm."""
    grid = cfg.sweep.grid
    if not grid:
        raise PflkitError('a sweep needs a grid: --grid "train.lr=[0.01,0.05]" or sweep.grid')
    algorithms = _normalise(cfg.compare.algorithms, cfg.train.weighting)
    full = [resolve_params(_unlabelled(a), cfg.train.weighting) for a in algorithms]
    for key in grid:
        top = key.split(".")[0]
        if key in ("seed", "algorithm", "algorithm.name") or top in ("compare", "sweep"):
            raise PflkitError(
                f"sweep grid key '{key}' cannot be swept: list algorithms with --algorithms "
                "and seeds with --seeds"
            )
        param = key.removeprefix("algorithm.")
        if key.startswith("algorithm.") and not any(param in f for f in full):
            names = ", ".join(a["name"] for a in algorithms)
            raise PflkitError(
                f"sweep grid key '{key}': none of the algorithms ({names}) has a parameter "
                f"'{param}': check its spelling (pflkit list --params NAME shows them)"
            )
    plan = []
    for algo, params in zip(algorithms, full, strict=True):
        axes = {k: v for k, v in grid.items() if not k.startswith("algorithm.") or k[10:] in params}
        for point in itertools.product(*axes.values()):
            chosen = dict(zip(axes, point, strict=True))
            entry = algo | {k[10:]: v for k, v in chosen.items() if k.startswith("algorithm.")}
            rest = {k: v for k, v in chosen.items() if not k.startswith("algorithm.")}
            sets = [f"{k}={json.dumps(v)}" for k, v in rest.items()]
            tagged = rest if "label" not in algo else chosen  # a label hides the parameters
            tag = "[" + ",".join(f"{k}={v}" for k, v in tagged.items()) + "]" if tagged else ""
            plan.append((_label(entry) + tag, _unlabelled(entry), sets))
    labels = [p[0] for p in plan]
    if len(set(labels)) != len(labels):
        raise PflkitError("the sweep grid lists a value twice: remove the duplicate")
    return plan


def run_compare(
    cfg: ExperimentConfig,
    out: str | Path,
    progress: bool | None = None,
    jobs: int = 1,
    plan: list[Planned] | None = None,
    options: dict[str, Any] | None = None,
    keep_going: bool = False,
    force: bool = False,
    skip_corrupt: bool = False,
) -> dict[str, Any]:
    """Run every setting of ``plan`` (default: :func:`compare_plan`) over ``compare.seeds``
    into ``out`` and write its report (:mod:`pflkit.report.results`; ``options``: its
    ``at``, ``metric`` and ``select``). ``keep_going``: a failed run does not stop the others
    (module docstring). ``force``: run even settings that the pre-flight check
    (:mod:`pflkit.engine.limits`) finds past this machine. ``skip_corrupt``: a finished run
    whose metrics.jsonl has corrupt lines is reported without them (named in the footnote)
    instead of refused."""
    cfg, out = need_config(cfg, "run_compare"), Path(out)
    if jobs < 1:
        raise PflkitError(f"jobs must be at least 1 (got {jobs}): pass --jobs 1 or more")
    plan = compare_plan(cfg) if plan is None else plan
    options = options or {}
    seeds = cfg.compare.seeds
    folder = {label: label.replace("/", "_") for label, _, _ in plan}
    tasks = [
        (
            run_config(cfg, algo, sets, seed),
            under(out / f"{folder[label]}-s{seed}", out, "run folder"),
        )
        for label, algo, sets in plan
        for seed in seeds
    ]  # every config is checked before anything runs
    datasets: dict[str, FederatedDataset] = {}
    # and every setting
    _check_settings([c for c, _ in tasks[:: len(seeds)]], datasets, jobs, force, out)
    if jobs > 1:
        datasets.clear()  # each job process builds its own
    _claim(out, cfg)
    settings = [
        {"label": label, "folders": [f"{folder[label]}-s{seed}" for seed in seeds]}
        for label, _, _ in plan
    ]
    write_atomic(out / PLAN, json.dumps({"settings": settings, "options": options}, indent=1))
    try:
        _run_all(tasks, jobs, progress, keep_going, datasets)
    except (KeyboardInterrupt, RunInterrupted) as err:
        raise RunInterrupted(
            f"interrupted: run the same command with --out {out} to continue it "
            "(finished runs are kept, interrupted ones resume from their checkpoints)",
            getattr(err, "signal", "SIGINT"),
        ) from None
    at_once = _AtOnce()
    try:
        with at_once:
            found, _ = find_settings([out], skip_corrupt)
            report = build_report(found, **options)
            report.write(out)
            table = report.markdown()
    except KeyboardInterrupt:
        raise RunInterrupted(
            f"interrupted while writing the report (every run has finished): run the same "
            f"command with --out {out} to write it",
            at_once.signal or "SIGINT",
        ) from None
    return {"table": table, "results": report.numbers, "out": out}


def run_sweep(
    cfg: ExperimentConfig,
    out: str | Path,
    progress: bool | None = None,
    jobs: int = 1,
    keep_going: bool = False,
    force: bool = False,
    skip_corrupt: bool = False,
) -> dict[str, Any]:
    """``pflkit sweep``: every point of ``cfg.sweep.grid`` for each algorithm over
    ``compare.seeds`` (:func:`sweep_plan`), reported with ``cfg.sweep``'s options."""
    cfg = need_config(cfg, "run_sweep")
    sw, plan = cfg.sweep, sweep_plan(cfg)
    if sw.select == "val" and cfg.data.val_fraction == 0:
        raise PflkitError(
            "the sweep selects on validation but the config has no validation split: set "
            "data.val_fraction (e.g. --set data.val_fraction=0.1), or select on test "
            "(--select test, reported as optimistic) or not at all (--select none)"
        )
    options = {"at": sw.at, "metric": sw.metric, "select": sw.select}
    return run_compare(
        cfg,
        out,
        progress,
        jobs,
        plan=plan,
        options=options,
        keep_going=keep_going,
        force=force,
        skip_corrupt=skip_corrupt,
    )
