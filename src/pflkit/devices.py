"""The torch device a config's ``device`` names, checked to exist on this machine.

A run-time helper, not part of the schema: :func:`pflkit.experiment.validate` calls it once so
that a wrong device fails before anything runs, and the engine, its workers and Flower's
server call it again where they place tensors. It imports torch only when called.
"""

from __future__ import annotations

import re

from pflkit.errors import PflkitError


def resolve_device(name: str) -> str:
    """The torch device ``name`` stands for: ``auto`` is ``cuda`` when a CUDA device is
    available and ``cpu`` otherwise; ``cpu``, ``cuda`` and ``cuda:N`` are checked to exist
    here. A wrong or unavailable device is one sentence (:class:`PflkitError`)."""
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if name == "auto":
        return "cuda" if count else "cpu"
    if name == "cpu":
        return name
    m = re.fullmatch(r"cuda(?::(\d+))?", str(name))
    if not m:
        raise PflkitError(f"unknown device {name!r}: use auto, cpu, cuda or cuda:N")
    if int(m.group(1) or 0) >= count:
        have = f"{count} CUDA device(s)" if count else "no CUDA device (or a CPU-only torch)"
        raise PflkitError(
            f"device {name!r} is not available: this machine has {have}; use device: auto or cpu"
        )
    return name
