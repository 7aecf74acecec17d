"""FEMNIST as LEAF (Caldas et al., 2018) generates it: 28x28 handwritten characters grouped by
writer, read from LEAF's json files.

``femnist``
    The ``*.json`` files of LEAF's ``data/femnist/data/train`` and ``data/femnist/data/test``
    (or ``all_data``), copied into ``<root>/femnist/`` (or its ``data/``); they are not
    downloaded: LEAF's scripts generate them (the error says how). Every file's ``user_data``
    gives each writer's flattened 784-pixel images (already in [0, 1]) and labels 0..61 (digits,
    upper-case, lower-case letters); the samples of every file are pooled, and each writer is
    one natural group (``train_groups``, ``group_names`` = the LEAF user ids). There is no
    global test set. Pixels become float32 ``[N, 1, 28, 28]`` mapped with ``(x - 0.5)/0.5``.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from pflkit.data.base import (
    _FEMNIST_CLASSES,
    Source,
    SourceInfo,
    _corrupt,
    _gray_to_tensor,
)
from pflkit.errors import PflkitError

_LEAF_HOWTO = (
    "; generate them with LEAF (github.com/TalwalkarLab/leaf, in data/femnist run "
    "./preprocess.sh -s niid --sf 1.0 -k 0 -t sample) and copy data/femnist/data/train and "
    "data/femnist/data/test there"
)


def _leaf_dirs(home: Path) -> list[Path] | None:
    for base in (home, home / "data"):
        if (base / "train").is_dir() and (base / "test").is_dir():
            return [base / "train", base / "test"]
    for base in (home, home / "data"):
        if (base / "all_data").is_dir():
            return [base / "all_data"]
    return None


def _load_femnist(root: Path, download: bool) -> Source:
    ds = "femnist"
    home = root / ds
    dirs = _leaf_dirs(home)
    files = [f for d in dirs or [] for f in sorted(d.glob("*.json"))]
    if not files:
        raise PflkitError(f"FEMNIST (LEAF) json files not found in {home}{_LEAF_HOWTO}")
    per_user: dict[str, tuple[list[np.ndarray], list[np.ndarray]]] = {}
    for path in files:
        try:
            with open(path, encoding="utf-8") as f:
                blob = json.load(f)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise _corrupt(path, f"invalid JSON: {e}") from None
        except OSError as e:
            raise PflkitError(f"cannot read file {path} ({e}); check the path") from None
        if not isinstance(blob, dict) or not isinstance(blob.get("user_data"), dict):
            raise _corrupt(path, "not a LEAF json file (no 'user_data' object)")
        users = blob.get("users", list(blob["user_data"]))
        for user in users:
            ud = blob["user_data"].get(user)
            if not isinstance(ud, dict) or "x" not in ud or "y" not in ud:
                raise _corrupt(path, f"user {user!r} has no 'x'/'y' data")
            try:
                x = np.asarray(ud["x"], dtype=np.float32)
                y = np.asarray(ud["y"], dtype=np.int64)
            except (ValueError, TypeError) as e:
                raise _corrupt(path, f"user {user!r} has malformed samples ({e})") from None
            if len(y) == 0:
                continue
            if x.ndim != 2 or x.shape[1] != 784 or x.shape[0] != y.shape[0] or y.ndim != 1:
                raise _corrupt(
                    path,
                    f"user {user!r} has x of shape {x.shape} and {y.shape[0]} labels, "
                    "expected [n, 784] and n",
                )
            if y.min() < 0 or y.max() >= 62:
                raise _corrupt(path, f"user {user!r} has labels {y.min()}..{y.max()}, not 0..61")
            xs, ys = per_user.setdefault(str(user), ([], []))
            xs.append(x)
            ys.append(y)
    if not per_user:
        raise PflkitError(f"FEMNIST json files in {home} hold no samples{_LEAF_HOWTO}")
    names = list(per_user)
    counts = [sum(len(y) for y in per_user[u][1]) for u in names]
    x = np.concatenate([a for u in names for a in per_user[u][0]])
    y = np.concatenate([a for u in names for a in per_user[u][1]])
    groups = np.repeat(np.arange(len(names), dtype=np.int64), counts)
    return Source(
        ds,
        _gray_to_tensor(x.reshape(-1, 28, 28), scale=1.0),
        torch.from_numpy(y),
        None,
        None,
        62,
        train_groups=groups,
        group_names=names,
        class_names=list(_FEMNIST_CLASSES),
        mean=(0.5,),
        std=(0.5,),
    )


ENTRIES: list[SourceInfo] = [
    SourceInfo(
        "femnist",
        "FEMNIST (LEAF): 28x28 handwritten characters, 62 classes, grouped by writer; "
        "no global test set (LEAF json files)",
        _load_femnist,
    ),
]
