"""Checkpoints: the whole simulation state (server dict, client dicts, round) in one file,
written atomically so an interrupted save never leaves a broken checkpoint behind."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from pflkit.errors import PflkitError


def save_checkpoint(path: Path, state: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    try:
        torch.save(state, tmp)
        os.replace(tmp, path)
    except (OSError, RuntimeError) as err:  # disk full, quota, read-only (torch wraps some)
        tmp.unlink(missing_ok=True)
        kept = "the previous checkpoint is kept" if path.exists() else "no checkpoint exists"
        raise PflkitError(
            f"cannot write the checkpoint '{path}' ({getattr(err, 'strerror', None) or err}); "
            f"{kept}: free disk space and resume"
        ) from None


def load_checkpoint(path: Path, device: str | torch.device = "cpu") -> dict[str, Any]:
    """The state :func:`save_checkpoint` wrote, its tensors on ``device``."""
    try:
        return torch.load(path, weights_only=True, map_location=device)
    except FileNotFoundError:
        raise PflkitError(f"no checkpoint at '{path}': nothing to resume") from None
    except Exception as err:  # a torn or foreign file
        raise PflkitError(f"checkpoint '{path}' is unreadable ({err}); delete it") from None
