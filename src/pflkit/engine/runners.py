"""The runner registry: ``engine.runner`` names the :class:`~pflkit.engine.clients.ClientRunner`
that runs a simulation's client work, as ``algorithm.name`` names an algorithm.

An entry is a :class:`RunnerInfo`: a name, a one-line description and a factory
``factory(cfg, **options) -> ClientRunner`` (``options``: what the caller alone has, such as
Flower's grid). The built-in entries are registered by the modules that define them:

- ``in-process`` and ``pool`` (:mod:`pflkit.engine.clients`): ``pool``, the default, runs
  ``engine.workers`` worker processes, or this process when that is 1;
- ``ray`` (:mod:`pflkit.engine.ray_runner`): actors on a Ray cluster;
- ``flower`` (:mod:`pflkit.flower.server`, registered once that module is imported): the
  SuperNodes of Flower's ServerApp, which passes the runner its grid.

A plug-in registers its own with :func:`pflkit.plugins.register_runner` (or
``RUNNERS.register``) and no file of the engine changes: whichever runner a config names
builds its workers with :func:`pflkit.engine.worker.start_worker` and runs the jobs it is
handed. This module imports nothing of the engine (plug-ins import it first).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pflkit.errors import PflkitError
from pflkit.registry import Registry


@dataclass(frozen=True)
class RunnerInfo:
    """A registered runner: ``factory(cfg, **options)`` builds it for the run of ``cfg``."""

    name: str
    description: str
    factory: Callable[..., Any]


RUNNERS: Registry[RunnerInfo] = Registry("runner", RunnerInfo)
"""Runner name -> :class:`RunnerInfo` (module docstring); ``engine.runner`` names one."""


def lookup_runner(name: str) -> RunnerInfo:
    """The runner registered as ``name`` (``engine.runner``), or one sentence listing the
    registered names."""
    if isinstance(name, str) and name in RUNNERS:
        return RUNNERS[name]
    shown = repr(name) if not isinstance(name, str) or not name.isprintable() else f"'{name}'"
    raise PflkitError(
        f"unknown engine.runner {shown}: choose one of {', '.join(sorted(RUNNERS))} (a plug-in "
        "registers more with pflkit.plugins.register_runner)"
    )
