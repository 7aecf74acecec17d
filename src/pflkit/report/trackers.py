"""Where a run reports its rounds: the console, ``run.log``, and experiment trackers.

- Console: a rich progress bar on a terminal; one plain line per round when stdout is not a
  terminal (nohup, a cluster job), so logs show progress.
- ``run.log`` in the run folder: the same lines with a timestamp, plus start, resume and stop
  lines; appended by every process that writes the folder.
- Trackers: ``metrics.csv`` always (long format: ``round,metric,value``, every numeric field
  of ``metrics.jsonl``); ``output.trackers: [tensorboard]`` writes TensorBoard event files under
  ``tensorboard/`` (package ``tensorboard``); ``[wandb]`` logs to Weights & Biases in the mode
  ``output.wandb_mode`` (default ``offline``: files under ``wandb/``, ``wandb sync`` uploads them).
"""

from __future__ import annotations

import csv
import importlib.util
import sys
from datetime import datetime
from pathlib import Path
from typing import Any

from pflkit.config import ExperimentConfig
from pflkit.errors import PflkitError

_PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb"}


def check_trackers(cfg: ExperimentConfig) -> None:
    """Refuse, before anything is written, a tracker whose package is not installed."""
    for name in cfg.output.trackers:
        if importlib.util.find_spec(_PACKAGES[name]) is None:
            raise PflkitError(
                f"output.trackers lists {name}, but the '{_PACKAGES[name]}' package is not "
                f"installed: pip install {_PACKAGES[name]} (or remove {name} from the list)"
            )


def scalars(row: dict[str, Any]) -> dict[str, float]:
    """The numeric fields of a metrics row (lists such as per-client bytes are left out)."""
    return {
        k: float(v)
        for k, v in row.items()
        if k != "round" and isinstance(v, int | float) and not isinstance(v, bool)
    }


def round_line(row: dict[str, Any], total: int) -> str:
    """One plain line for a round: losses, accuracies in %, seconds."""
    parts = [f"round {row['round']}/{total}"]
    if "train_loss" in row:
        parts.append(f"train_loss {row['train_loss']:.4f}")
    for key in ("global_acc", "pers_acc_mean", "pers_acc_selected"):
        if key in row:
            parts.append(f"{key} {100 * row[key]:.2f}%")
    parts.append(f"{row['seconds_train'] + row['seconds_eval']:.1f} s")
    return "  ".join(parts)


class _CSV:
    def __init__(self, run_dir: Path, kept: list[dict[str, Any]]):
        self.file = (run_dir / "metrics.csv").open("w", newline="")
        self.writer = csv.writer(self.file)
        self.writer.writerow(["round", "metric", "value"])
        for row in kept:
            self.log(row)

    def log(self, row: dict[str, Any]) -> None:
        for k, v in scalars(row).items():
            self.writer.writerow([row["round"], k, repr(v)])
        self.file.flush()

    def close(self) -> None:
        self.file.close()


class _TensorBoard:
    def __init__(self, run_dir: Path, first_round: int):
        from torch.utils.tensorboard import SummaryWriter

        # purge_step: a resumed run replaces the rounds after its checkpoint
        self.writer = SummaryWriter(str(run_dir / "tensorboard"), purge_step=first_round)

    def log(self, row: dict[str, Any]) -> None:
        for k, v in scalars(row).items():
            self.writer.add_scalar(k, v, row["round"])
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class _Wandb:
    def __init__(self, run_dir: Path, cfg: ExperimentConfig):
        import wandb

        self.wandb = wandb
        self.run = wandb.init(
            project="pflkit",
            name=run_dir.name,
            group=cfg.name,
            dir=str(run_dir),
            mode=cfg.output.wandb_mode,
            config=cfg.model_dump(mode="json"),
            reinit="create_new",
        )

    def log(self, row: dict[str, Any]) -> None:
        self.run.log(scalars(row), step=row["round"])

    def close(self) -> None:
        self.run.finish()


class Reporter:
    """The console, ``run.log`` and the trackers of one run (module docstring)."""

    def __init__(
        self,
        run_dir: Path,
        cfg: ExperimentConfig,
        kept: list[dict[str, Any]],
        done: int,
        show: bool,
    ):
        self.total = cfg.train.rounds
        self.log_file = (run_dir / "run.log").open("a")
        self.plain = show and not sys.stdout.isatty()
        self.bar = None
        if show and not self.plain:
            self.bar = _bar(f"{cfg.algorithm['name']} s{cfg.seed}", self.total, done)
        self.trackers: list[Any] = [_CSV(run_dir, kept)]
        if "tensorboard" in cfg.output.trackers:
            self.trackers.append(_TensorBoard(run_dir, done + 1))
        if "wandb" in cfg.output.trackers:
            self.trackers.append(_Wandb(run_dir, cfg))
        what = f"resumed after round {done}" if done else "started"
        self.message(f"{cfg.name}: {cfg.algorithm['name']}, seed {cfg.seed}, {what}")

    def message(self, text: str, echo: bool = True) -> None:
        self.log_file.write(f"{datetime.now():%Y-%m-%d %H:%M:%S} {text}\n")
        self.log_file.flush()
        if self.plain and echo:
            print(text, flush=True)

    def round(self, row: dict[str, Any]) -> None:
        self.message(round_line(row, self.total))
        if self.bar is not None:
            progress, task = self.bar
            info = " ".join(
                f"{name} {row[key]:.3f}"
                for key, name in (("global_acc", "global"), ("pers_acc_mean", "pers"))
                if key in row
            )
            progress.update(task, advance=1, **({"info": info} if info else {}))
        for t in self.trackers:
            t.log(row)

    def close(self, message: str | None = None, echo: bool = True) -> None:
        """End the run's report with ``message``; ``echo=False`` writes it to run.log only
        (a run that stops raises an error whose sentence the caller shows once)."""
        if self.log_file.closed:
            return
        if self.bar is not None:
            self.bar[0].stop()
            self.bar = None
        if message:
            self.message(message, echo)
        for t in self.trackers:
            t.close()
        self.trackers = []
        self.log_file.close()


def _bar(label: str, total: int, done: int):
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    progress = Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[info]}"),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        transient=False,
    )
    task = progress.add_task(label, total=total, completed=done, info="")
    progress.start()
    return progress, task
