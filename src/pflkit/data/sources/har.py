"""UCI HAR, read from its official files: GPFL's (Zhang et al., "GPFL: Simultaneously Learning
Global and Personalized Feature Information for Personalized Federated Learning", ICCV 2023)
"HAR" column (specs/gpfl.md §4.1-4.3, §9.6).

``har``
    UCI "Human Activity Recognition Using Smartphones" (Anguita et al., ESANN 2013), the
    official ``UCI HAR Dataset/`` folder: for split s in train/test,
    ``s/Inertial Signals/{body_acc,body_gyro,total_acc}_{x,y,z}_s.txt`` (one 128-step window
    per line, whitespace-separated floats), ``s/y_s.txt`` (activity 1..6, mapped to 0..5 in
    the order of ``activity_labels.txt``: walking, walking upstairs, walking downstairs,
    sitting, standing, laying) and ``s/subject_s.txt`` (volunteer 1..30). Values are the raw
    signals (g and rad/s), not normalised, as PFLlib leaves them.

    - Windows are ``[N, 9, 1, 128]`` float32 (HAR-CNN's 9x1x128 input), channels in PFLlib's
      order: body_acc x, y, z, body_gyro x, y, z, total_acc x, y, z.
    - ``layout: channels`` (default): ``x[n, c, 0, t]`` = signal ``c`` at time ``t``, i.e. each
      of the 9 input channels is one sensor axis, the reading of HAR-CNN's (Zeng et al. 2014)
      9 x 1 x 128 input (the GPFL paper does not describe the layout). ``layout: pfllib``: the
      exact tensors of PFLlib's ``generate_HAR.py`` (its ``HAR_utils.py`` is taken from
      jindongwang/Deep-learning-activity-recognition), which build a ``[128, 9]`` time-major
      window and then ``reshape`` (not transpose) it to ``[9, 1, 128]``, so its "channel" ``k``
      position ``j`` holds time step ``(128k + j) // 9`` of axis ``(128k + j) % 9``: the axes
      interleaved. GPFL's data come from PFLlib's scripts (specs/gpfl.md §9.6), so its HAR
      numbers were obtained on that layout.
    - GPFL's protocol (default): the official train (7,352 windows, 21 volunteers) and test
      (2,947, 9 volunteers) sets are merged (10,299 windows) and grouped by volunteer: 30
      natural groups (``train_groups`` = index of the volunteer in ``group_names``, the
      volunteer ids "1".."30" in ascending order), so ``partition: {name: natural}`` with 30
      clients gives one client per volunteer, whose local train/test split is
      ``data.test_fraction`` (PFLlib: 75/25). No global test set (``test_x`` is None: the
      union of the clients' local test splits is used). ``official_test: true`` keeps the
      official split instead: train = the 21 training volunteers (21 groups), test = the
      official test set.
    - Download: the official ``UCI HAR Dataset.zip`` from the UCI archive (URL folder
      ``00240``), checked against SHA-256 ``2045e435...`` (quoted by two independent public
      loaders, see :mod:`pflkit.data.download`); removed after extraction.

Errors (missing or damaged files, wrong shapes, labels out of range) are one
:class:`~pflkit.errors.PflkitError` sentence naming the file and the fix.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from pflkit.data import download as dl
from pflkit.data.base import (
    Source,
    SourceInfo,
    _corrupt,
    _extract,
    _first_parts,
    _missing,
    _opt_bool,
    _opt_mirrors,
)
from pflkit.errors import PflkitError

__all__ = ["HAR_CLASSES", "HAR_SIGNALS"]

HAR = "har"
HAR_FOLDER = "UCI HAR Dataset"
HAR_ZIP = "UCI HAR Dataset.zip"  # the name a user's own copy has
HAR_ZIP_URL_NAME = "UCI%20HAR%20Dataset.zip"  # the name in the archive's URL (and on disk)
HAR_SIGNALS = (
    "body_acc_x",
    "body_acc_y",
    "body_acc_z",
    "body_gyro_x",
    "body_gyro_y",
    "body_gyro_z",
    "total_acc_x",
    "total_acc_y",
    "total_acc_z",
)
HAR_CLASSES = [
    "WALKING",
    "WALKING_UPSTAIRS",
    "WALKING_DOWNSTAIRS",
    "SITTING",
    "STANDING",
    "LAYING",
]
HAR_WINDOW = 128
HAR_LAYOUTS = ("channels", "pfllib")
_HAR_REEXTRACT = f"extract {HAR_ZIP} again"


def _har_files(split: str) -> list[str]:
    """The official files of ``split`` (train/test), relative to the dataset folder."""
    signals = [f"{split}/Inertial Signals/{s}_{split}.txt" for s in HAR_SIGNALS]
    return [*signals, f"{split}/y_{split}.txt", f"{split}/subject_{split}.txt"]


def _har_skip(name: str) -> bool:
    """Archive members not extracted: the macOS resource forks next to the dataset folder."""
    return _first_parts(name, 1) == ("__MACOSX",)


def _har_base(home: Path) -> Path | None:
    for d in (home / HAR_FOLDER, home):
        if (d / "train").is_dir() or (d / "test").is_dir():
            return d
    return None


def _har_check(base: Path) -> None:
    for rel in _har_files("train") + _har_files("test"):
        if not (base / rel).is_file():
            raise PflkitError(
                f"UCI HAR file {base / rel} is missing; {base} must hold the official "
                f"'{HAR_FOLDER}' layout (train/ and test/ with their 'Inertial Signals'): "
                f"{_HAR_REEXTRACT}"
            )


def _loadtxt(path: Path, dtype: Any, ndmin: int) -> np.ndarray:
    try:
        return np.loadtxt(path, dtype=dtype, ndmin=ndmin)
    except ValueError as e:
        raise _corrupt(path, str(e).split(";")[0]) from None
    except UnicodeDecodeError as e:
        raise _corrupt(path, f"not a text file: {e}") from None
    except OSError as e:
        raise PflkitError(f"cannot read file {path} ({e}); check the path") from None


def _read_windows(path: Path) -> np.ndarray:
    """float32 [N, 128]: one whitespace-separated window per line."""
    a = _loadtxt(path, np.float32, 2)
    if a.shape[0] == 0:
        raise _corrupt(path, "it holds no window")
    if a.shape[1] != HAR_WINDOW:
        raise _corrupt(path, f"its lines hold {a.shape[1]} values, expected {HAR_WINDOW}")
    if not np.isfinite(a).all():
        raise _corrupt(path, "it holds non-finite values")
    return a


def _read_ints(path: Path, n: int, low: int, high: int | None, ref: str) -> np.ndarray:
    """int64 [n]: one integer per line, each in low..high."""
    a = _loadtxt(path, np.int64, 1)
    if a.ndim != 1:
        raise _corrupt(path, "expected one integer per line")
    if len(a) != n:
        raise _corrupt(path, f"it has {len(a)} lines but {ref} has {n} windows")
    if n and (a.min() < low or (high is not None and a.max() > high)):
        want = f"{low}..{high}" if high is not None else f">= {low}"
        raise _corrupt(path, f"values range {a.min()}..{a.max()}, expected {want}")
    return a


def _har_split(base: Path, split: str, layout: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(windows [N, 9, 1, 128] float32, labels 0..5, volunteer ids) of one official split."""
    paths = [base / rel for rel in _har_files(split)]
    signals = [_read_windows(p) for p in paths[:9]]
    n = len(signals[0])
    for p, s in zip(paths[1:9], signals[1:], strict=True):
        if len(s) != n:
            raise _corrupt(p, f"it has {len(s)} windows but {paths[0].name} has {n}")
    y = _read_ints(paths[9], n, 1, len(HAR_CLASSES), paths[0].name) - 1
    subjects = _read_ints(paths[10], n, 1, None, paths[0].name)
    stacked = np.stack(signals, axis=1)  # [N, 9, 128]: x[n, c, t] = signal c at time t
    if layout == "channels":
        x = stacked[:, :, None, :]
    else:  # PFLlib: a [128, 9] time-major window reshaped (not transposed) to [9, 1, 128]
        x = stacked.transpose(0, 2, 1).reshape(n, len(HAR_SIGNALS), 1, HAR_WINDOW)
    return np.ascontiguousarray(x, dtype=np.float32), y, subjects


def _load_har(
    root: Path,
    download: bool,
    *,
    layout: str = "channels",
    official_test: bool = False,
    mirrors: str | list[str] | None = None,
) -> Source:
    if layout not in HAR_LAYOUTS:
        raise PflkitError(
            f"option 'layout' of dataset 'har' must be 'channels' or 'pfllib', got {layout!r}"
        )
    official_test = _opt_bool(HAR, "official_test", official_test)
    mirrors_t = _opt_mirrors(HAR, mirrors)
    home = root / HAR
    base = _har_base(home)
    if base is None:
        own = home / HAR_ZIP
        archive = own if own.is_file() else home / HAR_ZIP_URL_NAME
        downloaded = False
        if not archive.is_file():
            if not download:
                raise _missing(
                    "UCI HAR", home, [f"{HAR_FOLDER}/ (train/, test/)"], f" (or {HAR_ZIP})"
                )
            dl.fetch_files(HAR, [HAR_ZIP_URL_NAME], home, mirrors=mirrors_t, what="UCI HAR")
            downloaded = True
        base = _extract(archive, home, HAR_FOLDER, "train/Inertial Signals", _har_skip, "UCI HAR")
        if downloaded:
            archive.unlink()
    _har_check(base)
    tr_x, tr_y, tr_s = _har_split(base, "train", layout)
    te_x, te_y, te_s = _har_split(base, "test", layout)
    if official_test:
        x, y, subjects = tr_x, tr_y, tr_s
        test_x, test_y = torch.from_numpy(te_x), torch.from_numpy(te_y)
    else:  # GPFL / PFLlib: merge, then one group per volunteer
        x = np.concatenate([tr_x, te_x])
        y = np.concatenate([tr_y, te_y])
        subjects = np.concatenate([tr_s, te_s])
        test_x = test_y = None
    ids = np.unique(subjects)
    groups = np.searchsorted(ids, subjects).astype(np.int64)
    return Source(
        HAR,
        torch.from_numpy(x),
        torch.from_numpy(y),
        test_x,
        test_y,
        len(HAR_CLASSES),
        train_groups=groups,
        group_names=[str(int(i)) for i in ids],
        class_names=list(HAR_CLASSES),
    )


ENTRIES: list[SourceInfo] = [
    SourceInfo(
        "har",
        "UCI HAR: 10,299 9-axis 128-step inertial windows [9, 1, 128], 6 activities, "
        "grouped by volunteer (30); options layout, official_test (downloaded)",
        _load_har,
    ),
]
