"""pflkit: personalized federated learning with faithful algorithms, fast simulation and
honest evaluation.

Python API in three lines::

    from pflkit import load_config, run_experiment
    cfg = load_config("configs/quickstart.yaml", ["train.rounds=5"])
    result = run_experiment(cfg)          # RunResult(run_dir, summary, rows)

Grids and results: ``run_sweep(cfg, out)``, ``make_report(folder)`` (its ``.markdown()``, ``.csv()``, ``.latex()``, ``.write(dir)``) and
``load_runs(folder)`` (a pandas DataFrame; ``pip install 'pflkit[report]'``).
"""

from pflkit.config import ExperimentConfig, load_config
from pflkit.data.export import export_partition
from pflkit.engine import RunResult, Simulation, run_experiment
from pflkit.engine.compare import run_compare, run_sweep
from pflkit.errors import PflkitError
from pflkit.report.results import load_runs, make_report

__version__ = "0.1.0"
__all__ = [
    "ExperimentConfig",
    "PflkitError",
    "RunResult",
    "Simulation",
    "export_partition",
    "load_config",
    "load_runs",
    "make_report",
    "run_compare",
    "run_experiment",
    "run_sweep",
]
