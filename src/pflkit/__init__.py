"""pflkit: personalized federated learning with faithful algorithms, fast simulation and
honest evaluation.

Python API in three lines::

    from pflkit import load_config, run_experiment
    cfg = load_config("quickstart", ["train.rounds=5"])   # a bundled example, or a YAML path
    result = run_experiment(cfg)          # RunResult(run_dir, summary, rows)

Grids and results: ``run_sweep(cfg, out)``, ``make_report(folder)`` (its ``.markdown()``, ``.csv()``, ``.latex()``, ``.write(dir)``) and
``load_runs(folder)`` (a pandas DataFrame; ``pip install 'pflkit[report]'``).
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

__version__ = "0.1.0"
# the API, imported on first use: ``import pflkit`` (and the command line's start, where a
# Ctrl-C must be caught) does not load torch
_API = {
    "ExperimentConfig": "pflkit.config",
    "load_config": "pflkit.experiment",
    "export_partition": "pflkit.data.export",
    "RunResult": "pflkit.engine",
    "Simulation": "pflkit.engine",
    "run_experiment": "pflkit.engine",
    "run_compare": "pflkit.engine.compare",
    "run_sweep": "pflkit.engine.compare",
    "PflkitError": "pflkit.errors",
    "load_runs": "pflkit.report.results",
    "make_report": "pflkit.report.results",
}
__all__ = sorted(_API)


def __getattr__(name: str) -> Any:
    if name not in _API:
        raise AttributeError(f"module 'pflkit' has no attribute {name!r}")
    value = getattr(import_module(_API[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_API])
