"""Algorithms: one file each, registered by name in :data:`ALGORITHMS`."""

from pflkit.algorithms import fedavg, fedavg_ft, fedprox, local  # noqa: F401  (registration)
from pflkit.algorithms.base import (
    ALGORITHMS,
    Algorithm,
    Context,
    Update,
    build_algorithm,
    parse_params,
    register,
    weighted_average,
)

__all__ = [
    "ALGORITHMS",
    "Algorithm",
    "Context",
    "Update",
    "build_algorithm",
    "parse_params",
    "register",
    "weighted_average",
]
