"""Simulation engine: round loop, client sampling, state store, checkpoints, run folders."""

from pflkit.engine.runner import RunResult, run_experiment
from pflkit.engine.simulation import Simulation, sample_clients

__all__ = ["RunResult", "Simulation", "run_experiment", "sample_clients"]
