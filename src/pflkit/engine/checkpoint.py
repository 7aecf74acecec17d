"""Checkpoints: the whole simulation state (server dict, client dicts, round) in one file,
written atomically so an interrupted save never leaves a broken checkpoint behind.

The file is a header line ``pflkit-checkpoint sha256=<hex>`` followed by ``torch.save``'s
bytes; the digest is checked on load, so a checkpoint whose bytes changed after it was written
(a bad disk, a partial copy, an edit) is refused with one sentence instead of resuming into
different results. Checkpoints written before checksums (plain ``torch.save`` files, which
start as zip archives do) still load, unchecked; a file that is neither (a damaged header) is
refused."""

from __future__ import annotations

import hashlib
import io
import os
import pickle
from pathlib import Path
from typing import Any, cast

import torch

from pflkit.errors import PflkitError

MAGIC = b"pflkit-checkpoint sha256="
ZIP = b"PK\x03\x04"  # how every torch.save file (a zip archive) starts


def save_checkpoint(path: Path, state: dict[str, Any]) -> None:
    buf = io.BytesIO()
    torch.save(state, buf)
    payload = buf.getbuffer()
    header = MAGIC + hashlib.sha256(payload).hexdigest().encode() + b"\n"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(header)
            f.write(payload)
        os.replace(tmp, path)
    except OSError as err:  # disk full, quota, read-only
        tmp.unlink(missing_ok=True)
        kept = "the previous checkpoint is kept" if path.exists() else "no checkpoint exists"
        raise PflkitError(
            f"cannot write the checkpoint '{path}' ({err.strerror or err}); "
            f"{kept}: free disk space and resume"
        ) from None


def load_checkpoint(path: Path, device: str | torch.device = "cpu") -> dict[str, Any]:
    """The state :func:`save_checkpoint` wrote, its tensors on ``device``; a file whose
    checksum does not match its content is refused."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise PflkitError(f"no checkpoint at '{path}': nothing to resume") from None
    except OSError as err:
        raise PflkitError(
            f"cannot read the checkpoint '{path}' ({err.strerror}): check it"
        ) from None
    head, _, payload = data.partition(b"\n")
    if not head.startswith(MAGIC):  # written before checksums (2026-11-26): nothing to check
        if not data.startswith(ZIP):  # not a torch.save file either: a damaged header
            raise PflkitError(
                f"checkpoint '{path}' has a damaged header (neither a pflkit checkpoint nor a "
                "torch.save file): delete it and run again from the start, or restore it from "
                "a copy"
            )
        payload = data
    elif hashlib.sha256(payload).hexdigest().encode() != head[len(MAGIC) :]:
        raise PflkitError(
            f"checkpoint '{path}' fails its checksum (its bytes changed after pflkit wrote "
            "it): delete it and run again from the start, or restore it from a copy"
        )
    try:
        state = torch.load(io.BytesIO(payload), weights_only=True, map_location=device)
        return cast(dict[str, Any], state)  # save_checkpoint wrote a dict
    except pickle.UnpicklingError:  # torch's several lines on weights_only
        raise PflkitError(
            f"checkpoint '{path}' holds Python objects other than tensors and plain values, "
            "which pflkit never writes and does not load (unpickling them could run any "
            "code): delete it, or resume from a checkpoint pflkit wrote"
        ) from None
    except Exception as err:  # written by an incompatible torch, say
        first = " ".join(str(err).split("\n", 1)[0].split())[:200] or type(err).__name__
        raise PflkitError(f"checkpoint '{path}' is unreadable ({first}); delete it") from None
