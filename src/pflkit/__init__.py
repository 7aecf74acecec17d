"""pflkit: personalized federated learning with faithful algorithms, fast simulation and
honest evaluation.

Python API in three lines::

    from pflkit import load_config, run_experiment
    cfg = load_config("configs/quickstart.yaml", ["train.rounds=5"])
    result = run_experiment(cfg)          # RunResult(run_dir, summary, rows)
"""

from pflkit.config import ExperimentConfig, load_config
from pflkit.engine import RunResult, Simulation, run_experiment
from pflkit.engine.compare import run_compare
from pflkit.errors import PflkitError

__version__ = "0.1.0"
__all__ = [
    "ExperimentConfig",
    "PflkitError",
    "RunResult",
    "Simulation",
    "load_config",
    "run_compare",
    "run_experiment",
]
