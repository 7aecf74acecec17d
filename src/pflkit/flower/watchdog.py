"""Process-tree helpers for :mod:`pflkit.flower.local`, and the watchdog that takes a local
federation down when the ``pflkit`` process that started it dies without stopping it (SIGKILL,
out of memory).

The watchdog runs as ``python watchdog.py PARENT_PID ROOTS_FILE`` (this file by path, stdlib
only, so it starts in milliseconds and holds no torch): every 0.2 s it checks whether its
parent is still ``PARENT_PID``; once not, it kills, SIGTERM then SIGKILL, the process groups of
the PIDs listed in ``ROOTS_FILE`` (the SuperLink and SuperNodes) and of all their descendants.
:class:`pflkit.flower.local.Federation` starts it and stops it with the federation.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path


def process_table() -> list[tuple[int, int, int, bool]]:
    """(pid, parent pid, process group, is a zombie) of every process."""
    rows = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        rows.append((int(entry.name), int(fields[1]), int(fields[2]), fields[0] == "Z"))
    return rows


def groups_below(pid: int) -> set[int]:
    """Process groups of ``pid``'s live descendants."""
    children: dict[int, list[tuple[int, int]]] = {}
    for p, parent, group, zombie in process_table():
        if not zombie:
            children.setdefault(parent, []).append((p, group))
    groups, todo = set(), [pid]
    while todo:
        for p, group in children.get(todo.pop(), []):
            groups.add(group)
            todo.append(p)
    return groups


def alive(group: int) -> bool:
    """Whether a live process is left in process group ``group``."""
    return any(g == group and not zombie for _, _, g, zombie in process_table())


def kill_groups(groups: set[int], sig: int) -> None:
    for group in groups:
        try:
            os.killpg(group, sig)
        except (ProcessLookupError, PermissionError):
            pass


def watch(parent: int, roots_file: Path, grace: float = 5.0) -> None:
    while os.getppid() == parent:
        time.sleep(0.2)
    try:
        roots = [int(x) for x in roots_file.read_text().split()]
    except (OSError, ValueError):
        return
    groups = set(roots)
    for pid in roots:
        groups |= groups_below(pid)
    kill_groups(groups, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while any(alive(g) for g in groups) and time.monotonic() < deadline:
        time.sleep(0.1)
    kill_groups(groups, signal.SIGKILL)


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C is the parent's to handle
    watch(int(sys.argv[1]), Path(sys.argv[2]))
