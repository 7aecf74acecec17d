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
    torch.save(state, tmp)
    os.replace(tmp, path)


def load_checkpoint(path: Path) -> dict[str, Any]:
    try:
        return torch.load(path, weights_only=True)
    except FileNotFoundError:
        raise PflkitError(f"no checkpoint at '{path}': nothing to resume") from None
    except Exception as err:  # a torn or foreign file
        raise PflkitError(f"checkpoint '{path}' is unreadable ({err}); delete it") from None
