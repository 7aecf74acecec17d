"""Run-folder safety: one writer at a time, a fingerprint that ties a checkpoint to its
config, and a resume that never rewrites what a checkpoint already covers.

- :class:`FolderLock`: ``run_dir/.lock`` holds the writer's PID, host and start time; a second
  run or resume of the folder is refused in one sentence naming the holder; a lock left by a
  killed process on this host is detected (its PID is gone) and taken over. The client-state
  store locks its own folder the same way (:mod:`pflkit.engine.states`).
- :func:`fingerprint`: a hash of everything that determines a run's numbers (the resolved
  config without the keys a resume may change, the partition id, the pflkit version). It is
  stored in every checkpoint and checked on resume, so a hand-edited ``config.yaml`` or a
  checkpoint copied from another run is refused instead of silently continued.
- :func:`keep_rows`: the metrics rows a checkpoint covers, and the file cut just after them
  (one ``truncate``; the kept bytes are never rewritten, so a kill during a resume loses
  nothing). A torn last line (a kill mid-write) is dropped; rows the checkpoint covers but the
  file lacks are an error, not a silently partial history.
- :func:`write_atomic`: write a small file through a temporary file and a rename.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import socket
from datetime import datetime
from pathlib import Path
from typing import Any, cast

import yaml

from pflkit.config import ExperimentConfig
from pflkit.errors import PflkitError

LOCK = ".lock"
# config keys a resume may change (`pflkit run --resume DIR --set ...`): they do not change the
# numbers of the rounds already run
RESUMABLE = (
    "train.rounds",
    "train.max_loss",
    "train.on_empty_round",
    "eval.",
    "output.",
    "engine.",
)


NAME_MAX = 64  # characters of a config's name kept in a folder name


def folder_name(name: str) -> str:
    """A config's ``name:`` as part of one folder name: every run of characters other than
    letters, digits, ``_``, ``.`` and ``-`` becomes ``-`` (a ``/`` never survives, so the name
    can never add a level to a path), dots and dashes at either end are dropped (no ``..``, no
    hidden folder, no name that reads as an option), and at most :data:`NAME_MAX` characters are kept; ``experiment`` if nothing is
    left. Every folder built from a name goes through here (run, compare, sweep, flower local,
    analyze)."""
    slug = re.sub(r"[^A-Za-z0-9_.-]+", "-", str(name))[:NAME_MAX].strip(".-")
    return slug or "experiment"


def under(path: Path, root: Path | str, what: str) -> Path:
    """``path``, checked to lie inside ``root`` once both are resolved (``..`` and symbolic
    links followed): a folder pflkit builds from a name under ``output.dir`` or ``--out`` that
    would land anywhere else is refused in one sentence before anything is written."""
    try:
        inside = Path(path).resolve().is_relative_to(Path(root).resolve())
    except (OSError, ValueError, RuntimeError) as err:  # a NUL byte, a symbolic-link loop
        raise PflkitError(
            f"the {what} {str(path)[:80]!r} is not a usable path ({err}): rename what it is "
            "built from (the config's name, a compare label)"
        ) from None
    if not inside:
        raise PflkitError(
            f"the {what} '{path}' would lie outside '{root}' (a symbolic link leads out of it): "
            "remove the link, or choose another --out"
        )
    return Path(path)


def make_folder(path: Path, what: str) -> None:
    """``mkdir -p path``, or one sentence saying why it cannot be created."""
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise PflkitError(
            f"cannot create the {what} '{path}' ({err.strerror or err}): choose another path"
        ) from None


def check_out(out: Path, outputs: tuple[str, ...]) -> None:
    """Refuse, before a study trains anything, an ``out`` that is a file or a folder with
    contents other than ``outputs`` (a run folder, say): a study writes a folder of its own."""
    if out.exists() and not out.is_dir():
        raise PflkitError(f"--out '{out}' is a file, not a folder: choose another --out")
    if out.is_dir():
        other = sorted(p.name for p in out.iterdir() if p.name not in outputs)
        if other:
            shown = ", ".join(other[:3]) + (", ..." if len(other) > 3 else "")
            raise PflkitError(
                f"--out '{out}' already holds other files ({shown}): the study needs a new "
                "or empty folder (or one with only an earlier study); choose another --out"
            )


def write_atomic(
    path: Path, data: str | bytes, fix: str = "free disk space and run the same command again"
) -> None:
    """Write ``path`` whole or not at all (through ``<name>.tmp``, removed if the write fails,
    which is one sentence ending with ``fix``)."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        tmp.write_bytes(data) if isinstance(data, bytes) else tmp.write_text(data)
        os.replace(tmp, path)
    except OSError as err:  # disk full, quota, read-only
        tmp.unlink(missing_ok=True)
        raise PflkitError(f"cannot write '{path}' ({err.strerror or err}): {fix}") from None


def fingerprint(cfg: ExperimentConfig, partition_id: str, legacy: bool = False) -> str:
    """The identity of a run's configuration, stored in its checkpoints: every setting except
    the RESUMABLE ones, the partition and the pflkit version. Settings at their default are
    left out, algorithm parameters included, so a release that adds a setting or an algorithm
    parameter (at a default that keeps the old behaviour) does not invalidate existing
    checkpoints. ``legacy``: the form checkpoints were written with before 2026-11-24 (every
    algorithm parameter, defaults included), which a resume still accepts."""
    from pflkit import __version__
    from pflkit.experiment import algorithm_of

    dump = cfg.model_dump(mode="json", exclude_defaults=True)
    if not legacy:
        typed = algorithm_of(cfg)
        dump["algorithm"] = {
            "name": typed.cls.name,
            **typed.params.model_dump(mode="json", exclude_defaults=True),
        }
    for key in RESUMABLE:
        section, _, field = key.rstrip(".").partition(".")
        if field:
            dump.get(section, {}).pop(field, None)
        else:
            dump.pop(section, None)
    dump["_partition_id"] = partition_id
    dump["_pflkit"] = __version__
    return hashlib.sha256(yaml.safe_dump(dump, sort_keys=True).encode()).hexdigest()[:16]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class FolderLock:
    """``with FolderLock(run_dir):`` holds the folder's lock (module docstring)."""

    def __init__(self, run_dir: Path, what: str = "run folder"):
        self.path = Path(run_dir) / LOCK
        self.what = what
        self.held = False

    def __enter__(self) -> FolderLock:
        me = {"pid": os.getpid(), "host": socket.gethostname(), "since": f"{datetime.now():%c}"}
        for _ in range(2):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                holder = self._holder()
                stale = holder is not None and holder.get("host") == me["host"]
                if holder is None or (stale and not _alive(int(holder.get("pid", -1)))):
                    self.path.unlink(missing_ok=True)  # left by a killed process: take it
                    continue
                raise PflkitError(
                    f"{self.what} '{self.path.parent}' is in use by process {holder.get('pid')} "
                    f"on {holder.get('host')} (since {holder.get('since')}): wait for it or "
                    f"stop it; if that process is gone, delete {self.path}"
                ) from None
            with os.fdopen(fd, "w") as f:
                json.dump(me, f)
            self.held = True
            return self
        raise PflkitError(
            f"cannot take the lock {self.path}: delete it if no run uses the {self.what}"
        )

    def _holder(self) -> dict[str, Any] | None:
        try:
            return cast(dict[str, Any], json.loads(self.path.read_text()))  # __enter__ wrote a dict
        except (OSError, ValueError):
            return None  # torn or vanished: treat as stale

    def __exit__(self, *exc: object) -> None:
        if self.held:
            self.path.unlink(missing_ok=True)
            self.held = False


def keep_rows(path: Path, covered: int) -> list[dict[str, Any]]:
    """The rows of ``path`` for rounds 1..``covered``; the file is cut after them."""
    rows: list[dict[str, Any]] = []
    offset = 0
    if path.exists():
        with path.open("rb") as f:
            for line in f:
                try:
                    row = json.loads(line)
                except ValueError:
                    break  # a torn last line
                if row.get("round", covered + 1) > covered:
                    break
                rows.append(row)
                offset += len(line)
    if [r["round"] for r in rows] != list(range(1, covered + 1)):
        raise PflkitError(
            f"'{path}' lacks rounds that the checkpoint covers (it has {len(rows)} of "
            f"{covered}): the run's history is incomplete; start a new run"
        )
    if path.exists():
        os.truncate(path, offset)
    return rows
