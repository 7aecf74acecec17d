"""Algorithms: one file each, registered by name in :data:`ALGORITHMS`."""

from pflkit.algorithms import (  # noqa: F401  (registration)
    ditto,
    fedavg,
    fedavg_ft,
    fedphp,
    fedprox,
    fedrs,
    kd_baselines,
    ktpfl,
    local,
    map,
    scaffold,
)
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
