"""Running an experiment into a run folder, with progress, checkpoints and ``--resume``.

A run folder holds::

    config.yaml          the resolved config (every default filled in)
    metrics.jsonl        one JSON line per round
    summary.json         written when the run completes
    curves.png           accuracy and loss curves
    checkpoints/latest.pt  when output.checkpoint_every > 0 (then always of the last round:
                         a finished run keeps its final state, :func:`load_finished`), or
                         after an interrupt
    states/              client states, one safetensors file each: those a checkpoint names,
                         and those beyond engine.state_memory (pflkit.engine.states)

Everything that can fail because of user input (config, data, model, algorithm parameters)
is checked before the folder is created.
"""

from __future__ import annotations

import json
import math
import shutil
import signal
import sys
import threading
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from pflkit.config import ExperimentConfig, TrainConfig, need_config
from pflkit.config_io import apply_overrides, read_yaml
from pflkit.data.federated import FederatedDataset
from pflkit.devices import resolve_device
from pflkit.engine.clients import ClientRunner, InProcess
from pflkit.engine.folder import (
    LOCK,
    RESUMABLE,
    FolderLock,
    fingerprint,
    folder_name,
    keep_rows,
    make_folder,
    under,
    write_atomic,
)
from pflkit.engine.simulation import Simulation
from pflkit.errors import PflkitError, RunInterrupted, WorkerLost
from pflkit.experiment import validate
from pflkit.report.provenance import record as record_provenance
from pflkit.report.summary import summarize
from pflkit.report.trackers import Reporter, check_trackers

CHECKPOINT = Path("checkpoints") / "latest.pt"
STATES = Path("states")  # client states beyond engine.state_memory, and checkpoints' versions


@dataclass
class RunResult:
    """What :func:`run_experiment` returns: the run folder and what it wrote there."""

    run_dir: Path
    """The run folder (config.yaml, metrics.jsonl, summary.json, plots)."""
    summary: dict[str, Any]
    """summary.json's contents: the final, mean-of-last and best-round numbers, cost."""
    rows: list[dict[str, Any]]
    """metrics.jsonl's rows, one per round."""


def default_run_dir(cfg: ExperimentConfig) -> Path:
    """``output.dir``/<name>-<algorithm>-s<seed>-<time>, the name made safe
    (:func:`~pflkit.engine.folder.folder_name`) and the folder checked to lie in output.dir."""
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    name = f"{folder_name(cfg.name)}-{folder_name(cfg.algorithm['name'])}-s{cfg.seed}-{stamp}"
    return under(Path(cfg.output.dir) / name, cfg.output.dir, "run folder")


def new_run_dir(cfg: ExperimentConfig, out: str | Path | None) -> Path:
    """The folder a new run writes (``out`` or a dated default); refused if not empty."""
    run_dir = Path(out) if out is not None else default_run_dir(cfg)
    try:
        exists, is_dir = run_dir.exists(), run_dir.is_dir()
    except OSError as err:  # e.g. a name longer than the file system allows
        shown = str(run_dir) if len(str(run_dir)) < 80 else f"{str(run_dir)[:60]}..."
        raise PflkitError(
            f"'{shown}' is not a usable folder path ({err.strerror}): choose another --out"
        ) from None
    if exists and not is_dir:
        raise PflkitError(f"'{run_dir}' is a file, not a folder: choose another --out")
    if exists and not _nothing_written(run_dir):
        raise PflkitError(
            f"run folder '{run_dir}' already exists and is not empty: choose another --out, "
            f"or continue it with --resume {run_dir}"
        )
    return run_dir


def _nothing_written(run_dir: Path) -> bool:
    """The folder holds at most a lock and temporary files: what a run killed before it wrote
    its config leaves (a new run may use the folder)."""
    return all(p.name == LOCK or p.name.endswith(".tmp") for p in run_dir.iterdir())


def resume_config(run_dir: Path, overrides: list[str]) -> ExperimentConfig:
    for item in overrides:
        if not item.startswith(RESUMABLE):
            raise PflkitError(
                f"--set {item} cannot change a run being resumed; only "
                f"{', '.join(RESUMABLE)}* may change: start a new run instead"
            )
    if run_dir.is_dir() and _nothing_written(run_dir):
        raise PflkitError(
            f"the run in '{run_dir}' stopped before it wrote its config: nothing to resume; "
            f"start it again with --out {run_dir}"
        )
    if not (run_dir / "config.yaml").exists():
        raise PflkitError(
            f"'{run_dir}' is not a pflkit run folder (no config.yaml): check the path"
        )
    raw = read_yaml(run_dir / "config.yaml", "the run config", written=True)
    return validate(apply_overrides(raw, overrides))


def load_finished(run_dir: Path) -> Simulation:
    """The simulation of the finished run in ``run_dir`` at its final state: built from its
    ``config.yaml`` (data, models, algorithm; client work in this process) and restored from
    its checkpoint, which is the last round's when ``output.checkpoint_every`` > 0 (it is
    kept when the run ends). Anything else is one sentence naming the fix: a path that is not
    a run folder, a run that has not finished, one that kept no checkpoint. Close it after use."""
    run_dir = Path(run_dir)
    if not run_dir.exists():
        raise PflkitError(f"'{run_dir}' does not exist: give the folder of a finished run")
    if not run_dir.is_dir():
        raise PflkitError(f"'{run_dir}' is a file, not a run folder: give a run's folder")
    if not (run_dir / "config.yaml").exists():
        from pflkit.report.results import PLAN

        runs = sorted(p.name for p in run_dir.iterdir() if (p / "config.yaml").exists())
        if (run_dir / PLAN).exists() and runs:
            raise PflkitError(
                f"'{run_dir}' is a compare or sweep folder: give one of its run folders, "
                f"e.g. {run_dir / runs[0]}"
            )
        raise PflkitError(
            f"'{run_dir}' is not a pflkit run folder (no config.yaml): check the path"
        )
    cfg = resume_config(run_dir, [])
    ckpt, rounds = run_dir / CHECKPOINT, cfg.train.rounds
    if not (run_dir / "summary.json").exists():
        raise PflkitError(
            f"the run in '{run_dir}' has not finished (no summary.json): finish it with "
            f"pflkit run --resume {run_dir}"
        )
    if not ckpt.exists():
        raise PflkitError(
            f"the run in '{run_dir}' kept no final state (no {CHECKPOINT}: "
            "output.checkpoint_every was 0): run it again with --set output.checkpoint_every="
            f"{rounds} (any value above 0 keeps the last round's)"
        )
    sim = Simulation(cfg, runner=InProcess(), state_dir=run_dir / STATES)
    try:
        sim.restore(
            ckpt,
            (
                fingerprint(cfg, sim.data.partition_id),
                fingerprint(cfg, sim.data.partition_id, legacy=True),
            ),
            prune=False,  # only reads: a run resumed in this folder meanwhile keeps its files
        )
        if sim.round != rounds:
            raise PflkitError(
                f"the checkpoint of '{run_dir}' is of round {sim.round}, not of the run's last "
                f"round {rounds}: finish the run with pflkit run --resume {run_dir}"
            )
    except BaseException:
        sim.close()
        raise
    return sim


def run_experiment(
    cfg: ExperimentConfig | None = None,
    out: str | Path | None = None,
    resume: str | Path | None = None,
    overrides: list[str] | None = None,
    data: FederatedDataset | None = None,
    progress: bool | None = None,
    runner: ClientRunner | None = None,
    force: bool = False,
) -> RunResult:
    """Run ``cfg`` into a new run folder ``out`` (default: a new folder under ``runs/``), or
    continue the run in ``resume`` with ``overrides`` (``key=value`` strings). ``runner`` runs
    the client work (default: what ``engine.workers`` asks for; :mod:`pflkit.flower` passes
    its Flower runner). ``force``: run even what the pre-flight check
    (:mod:`pflkit.engine.limits`) finds past this machine."""
    if resume is not None:
        if cfg is not None or out is not None:
            raise PflkitError(
                "run_experiment(resume=...) takes the config and the folder from the run "
                "folder: drop cfg and out (give changes as overrides=['key=value'])"
            )
        run_dir = Path(resume)
        cfg = resume_config(run_dir, overrides or [])
    else:
        if cfg is None:
            raise PflkitError("run_experiment needs a config (load_config) or resume=RUN_FOLDER")
        cfg = need_config(cfg, "run_experiment")
        if overrides:
            raise PflkitError(
                "run_experiment(cfg) takes no overrides (they are for resume=): apply them "
                "with load_config(path, overrides)"
            )
        run_dir = new_run_dir(cfg, out)
    # validates and builds everything before anything is written
    check_trackers(cfg)
    sim = Simulation(cfg, data, runner, state_dir=run_dir / STATES, force=force)
    try:
        return _run(sim, cfg, run_dir, resume is not None, progress)
    finally:
        sim.close()


def _json_safe(row: dict[str, Any]) -> dict[str, Any]:
    """``row`` with non-finite numbers as null, so metrics.jsonl stays valid JSON."""
    return {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in row.items()}


class StopSignals:
    """While active (main thread only), SIGINT and SIGTERM ask the round loop to stop at the
    end of the current round (``signal`` names the first one received); a later SIGINT stops
    at once (KeyboardInterrupt), a later SIGTERM changes nothing."""

    #: what the first signal is said to do
    stopping = "stopping when this round ends"
    #: say so at once on stderr, when that is a terminal (in a log, the closing sentence is the
    #: one line); a compare's job process never does: the compare speaks for it
    announce = True

    def __init__(self) -> None:
        self.signal: str | None = None
        self._saved: dict[int, Any] = {}

    def _handle(self, signum: int, frame: Any) -> None:
        if self.signal is not None:
            if signum == signal.SIGINT:
                raise KeyboardInterrupt
            return
        self.signal = signal.Signals(signum).name
        if self.announce and sys.stderr.isatty():
            print(
                f"{self.signal} received: {self.stopping} (Ctrl-C again to stop now)",
                file=sys.stderr,
                flush=True,
            )

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._saved[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._saved.items():
            signal.signal(sig, handler)


def diverged(row: dict[str, Any], train: TrainConfig) -> tuple[str, str] | None:
    """Why the run stops after ``row``'s round, and the setting that lets it go on, or None:
    a mean training loss above ``train.max_loss`` (divergence that stays finite), or, with
    ``train.on_empty_round: stop``, a round whose every selected client dropped out or was
    left out by ``train.on_nan: skip_client`` (nothing reached the server)."""
    rnd, loss = row["round"], row.get("train_loss")
    if train.max_loss is not None and loss is not None and loss > train.max_loss:
        return (
            f"round {rnd}'s mean training loss {loss:.3g} exceeds train.max_loss "
            f"({train.max_loss:g}): training diverged; lower train.lr or set train.grad_clip",
            "train.max_loss=null",
        )
    out = {*row.get("dropped_clients", ()), *row.get("diverged_clients", ())}
    if train.on_empty_round == "stop" and out >= set(row["clients"]):
        return (
            f"in round {rnd} every selected client dropped out (system.dropout) or diverged "
            "(train.on_nan: skip_client), so nothing reached the server; lower system.dropout "
            "or train.lr",
            "train.on_empty_round=continue",
        )
    return None


def _stopped_mid_round(run_dir: Path, resume: bool) -> RunInterrupted:
    """The error for a run stopped inside a round: its state there is not saved (half the
    clients may have trained), so the last checkpoint is what continues; a new run without
    one is removed."""
    ckpt = run_dir / CHECKPOINT
    if ckpt.exists():
        return RunInterrupted(
            "stopped in the middle of a round; the last checkpoint is kept: continue with: "
            f"pflkit run --resume {run_dir}"
        )
    if not resume:
        shutil.rmtree(run_dir, ignore_errors=True)
    return RunInterrupted(
        f"stopped before any checkpoint: nothing was kept ({run_dir} removed); start the run again"
    )


def _after_fault(run_dir: Path, kept: int, every: int, setting: str) -> str:
    """How to go on with a run a lost worker stopped, from its checkpoint of round ``kept``
    (0: none, ``every``: output.checkpoint_every)."""
    command = f"pflkit run --resume {run_dir} --set {setting}"
    if kept:
        return f"to continue from its checkpoint of round {kept}: {command}"
    why = "" if every else " (output.checkpoint_every: 0)"
    return f"it has no checkpoint{why}: {command} runs it again from round 1"


def _run(
    sim: Simulation, cfg: ExperimentConfig, run_dir: Path, resume: bool, progress: bool | None
) -> RunResult:
    """The round loop of ``sim`` into ``run_dir`` under the folder's lock, with progress and
    checkpoints. What is written is never left half-done: config.yaml atomically, metrics and
    run.log append-only (a resume cuts metrics.jsonl after the checkpoint's round)."""
    make_folder(run_dir, "run folder")
    with FolderLock(run_dir):
        return _run_locked(sim, cfg, run_dir, resume, progress)


def _run_locked(
    sim: Simulation, cfg: ExperimentConfig, run_dir: Path, resume: bool, progress: bool | None
) -> RunResult:
    metrics_path = run_dir / "metrics.jsonl"
    fp = fingerprint(cfg, sim.data.partition_id)
    rows: list[dict[str, Any]] = []
    restored = resume and (run_dir / CHECKPOINT).exists()
    if restored:  # first: a checkpoint of another config is refused before anything is written
        sim.restore(
            run_dir / CHECKPOINT, (fp, fingerprint(cfg, sim.data.partition_id, legacy=True))
        )
        rows = keep_rows(metrics_path, sim.round)
    write_atomic(run_dir / "config.yaml", cfg.to_yaml())  # it makes the folder resumable
    if not restored:
        sim.restore(None)  # a run started again: no state file of an earlier attempt counts
        if resume:
            print(
                f"pflkit: '{run_dir}' has no checkpoint (the run stopped before its first one): "
                "running it again from round 1",
                file=sys.stderr,
            )
        metrics_path.write_text("")
    record_provenance(run_dir, resolve_device(cfg.device))

    show = cfg.output.progress if progress is None else progress
    report = Reporter(run_dir, cfg, rows, sim.round, show)
    every = cfg.output.checkpoint_every
    stop = StopSignals()
    kept = sim.round  # the round of the checkpoint a resume would continue from
    try:
        with stop, metrics_path.open("a") as f:
            for rnd in range(sim.round + 1, cfg.train.rounds + 1):
                row = sim.run_round(rnd)
                rows.append(row)
                f.write(json.dumps(_json_safe(row)) + "\n")
                f.flush()
                report.round(row)
                if every and (rnd % every == 0 or rnd == cfg.train.rounds):
                    sim.save(run_dir / CHECKPOINT, fp)
                    kept = rnd
                why = diverged(row, cfg.train)
                if why:
                    sim.save(run_dir / CHECKPOINT, fp)
                    then = (
                        f"pflkit run --resume {run_dir} --set {why[1]}"
                        if sim.states_here
                        else f"set {why[1]} and run it again"
                    )
                    raise PflkitError(f"{why[0]}; stopped after round {rnd}: to go on, {then}")
                if stop.signal and rnd < cfg.train.rounds:  # the safe point: a round's end
                    sim.save(run_dir / CHECKPOINT, fp)
                    raise RunInterrupted(
                        f"{stop.signal} received: stopped after round {rnd} with a checkpoint; "
                        f"continue with: pflkit run --resume {run_dir}",
                        stop.signal,
                    )
    except KeyboardInterrupt:  # a second Ctrl-C: stop now, in the middle of a round
        report.close("stopped in the middle of a round (second Ctrl-C)", echo=False)
        raise _stopped_mid_round(run_dir, resume) from None
    except WorkerLost as err:  # a fault: the sentence says how to go on
        lost = WorkerLost(f"{err}; {_after_fault(run_dir, kept, every, err.setting)}", err.setting)
        report.close(f"stopped: {lost}", echo=False)
        raise lost from None
    except BaseException as err:
        report.close(f"stopped: {err}", echo=False)
        raise
    report.close(f"finished after round {cfg.train.rounds}")

    summary = {
        "name": cfg.name,
        "algorithm": cfg.algorithm["name"],
        "seed": cfg.seed,
        "partition_id": sim.data.partition_id,
    } | summarize(rows, cfg.eval.last)
    # summary.json marks a finished run (compare skips it): never half-written
    write_atomic(run_dir / "summary.json", json.dumps(summary, indent=2) + "\n")
    from pflkit.report.plots import plot_run, setting_title

    plot_run(rows, run_dir / "curves.png", f"{cfg.algorithm['name']} | {setting_title(cfg)}")
    return RunResult(run_dir, summary, rows)
