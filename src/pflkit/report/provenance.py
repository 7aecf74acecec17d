"""Provenance of a run: what produced it, written to ``provenance.json`` in the run folder.

Versions (pflkit's own ``pflkit.__version__``, which is also the installed wheel's version,
torch, numpy, Python, and Flower when installed), the git commit of the pflkit source when it
runs from a git checkout (with ``dirty`` when it has uncommitted changes), the
machine (platform, CPU count, torch threads, the accelerator's name) and the exact command.
A resumed run appends its own record, so the file lists every process that wrote the folder.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from datetime import UTC, datetime
from importlib import metadata
from pathlib import Path
from typing import Any

import numpy as np
import torch

import pflkit


def _git(args: list[str], cwd: Path) -> str | None:
    try:
        out = subprocess.run(
            ["git", *args], cwd=cwd, capture_output=True, text=True, timeout=5, check=True
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip()


def git_commit() -> dict[str, Any] | None:
    """The commit of the pflkit source tree, when it is a git checkout: ``None`` for an
    installed wheel, also one installed in a virtual environment that lies inside some other
    git repository (pflkit's own files must be tracked by the repository found)."""
    src = Path(pflkit.__file__).resolve().parent
    if _git(["ls-files", "--error-unmatch", "__init__.py"], src) is None:
        return None
    commit = _git(["rev-parse", "HEAD"], src)
    if not commit:
        return None
    status = _git(["status", "--porcelain", "--untracked-files=no"], src)
    return {"commit": commit, "dirty": bool(status)}


def provenance(device: str) -> dict[str, Any]:
    versions = {
        "pflkit": pflkit.__version__,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "numpy": np.__version__,
    }
    try:
        versions["flwr"] = metadata.version("flwr")
    except metadata.PackageNotFoundError:
        pass
    accelerator = None
    if device.startswith("cuda") and torch.cuda.is_available():
        accelerator = torch.cuda.get_device_name(torch.device(device))
    return {
        "time": datetime.now(UTC).isoformat(timespec="seconds"),
        "command": [Path(sys.argv[0]).name, *sys.argv[1:]],
        "cwd": os.getcwd(),
        "versions": versions,
        "git": git_commit(),
        "machine": {
            "platform": platform.platform(),
            "processor": platform.machine(),
            "cpu_count": os.cpu_count(),
            "torch_threads": torch.get_num_threads(),
            "device": device,
            "accelerator": accelerator,
        },
    }


def record(run_dir: Path, device: str) -> None:
    """Append this process's provenance to ``run_dir/provenance.json`` (atomically)."""
    path = run_dir / "provenance.json"
    history = json.loads(path.read_text()) if path.exists() else []
    history.append(provenance(device))
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(history, indent=2) + "\n")
    tmp.replace(path)
