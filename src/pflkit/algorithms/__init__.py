"""Algorithms: one module per defining paper, each registering its classes by name in
:data:`ALGORITHMS`; building blocks above the contract live in :mod:`pflkit.algorithms.blocks`, primitives below it in :mod:`pflkit.primitives`.

Every module of this package is imported here (no hand-kept list), so a new algorithm module
is registered as soon as it exists; ``tests/test_conformance.py`` checks that every module
registers at least one algorithm and runs every registered one through the contract checks.
"""

import importlib
import pkgutil

from pflkit.algorithms.base import (
    ALGORITHMS,
    Algorithm,
    RoundContext,
    ServerContext,
    Update,
    build_algorithm,
    load_model,
    param,
    parse_params,
    register,
    resolve_params,
    weighted_average,
)
from pflkit.algorithms.env import ClientEnv, ServerEnv

# modules that define the contract, its records or environments, not algorithms
NOT_ALGORITHMS = {"base", "context", "env", "records", "blocks"}
ALGORITHM_MODULES = sorted(
    m.name for m in pkgutil.iter_modules(__path__) if m.name not in NOT_ALGORITHMS
)
for _name in ALGORITHM_MODULES:
    importlib.import_module(f"{__name__}.{_name}")

__all__ = [
    "ALGORITHMS",
    "ALGORITHM_MODULES",
    "Algorithm",
    "ClientEnv",
    "RoundContext",
    "ServerContext",
    "ServerEnv",
    "Update",
    "load_model",
    "build_algorithm",
    "param",
    "parse_params",
    "register",
    "resolve_params",
    "weighted_average",
]
