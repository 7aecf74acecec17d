"""The client-level accountant: Google's dp-accounting (RDP or PLD), never a hand-written one.

A run with client-level DP (:mod:`pflkit.privacy.client_dp`) releases, once a round, a
Gaussian mechanism of noise multiplier z on the clipped updates of a cohort drawn with rate
q = m / N (m clients of the N that train). The privacy event of r rounds is that mechanism,
Poisson-subsampled with rate q, composed r times (for q = 1, the Gaussian mechanism composed r
times); its epsilon at the run's delta is what every metrics row reports as ``dp_epsilon``.

Deviation (the common approximation, as in DP-FedAvg, McMahan et al. 2018 §3): pflkit draws a
cohort of fixed size m without replacement, and the accountant treats it as Poisson sampling
with rate m / N under add-or-remove-one neighbouring; the server divides the noised sum by the
fixed m (the paper's fixed-denominator estimator).
"""

from __future__ import annotations

import math
from typing import Any, Literal

from pflkit.errors import PflkitError

Kind = Literal["rdp", "pld"]


def _lib() -> Any:
    """dp-accounting, imported on first use (an optional dependency)."""
    try:
        import dp_accounting
        import dp_accounting.pld
        import dp_accounting.rdp
    except ImportError:
        raise PflkitError(
            "differential privacy needs dp-accounting: pip install 'pflkit[privacy]'"
        ) from None
    return dp_accounting


def dp_event(noise_multiplier: float, sampling_rate: float, rounds: int) -> Any:
    """The privacy event of ``rounds`` releases of the subsampled Gaussian mechanism."""
    dp_accounting = _lib()
    gauss = dp_accounting.GaussianDpEvent(noise_multiplier)
    one = gauss if sampling_rate >= 1 else dp_accounting.PoissonSampledDpEvent(sampling_rate, gauss)
    return dp_accounting.SelfComposedDpEvent(one, rounds)


def accountant(kind: Kind) -> Any:
    lib = _lib()
    return lib.rdp.RdpAccountant() if kind == "rdp" else lib.pld.PLDAccountant()


def epsilon(
    noise_multiplier: float, sampling_rate: float, rounds: int, delta: float, kind: Kind = "rdp"
) -> float:
    """Epsilon at ``delta`` after ``rounds`` releases (0 before any; inf without noise)."""
    if rounds == 0:
        return 0.0
    if noise_multiplier == 0:
        return math.inf
    acc = accountant(kind)
    acc.compose(dp_event(noise_multiplier, sampling_rate, rounds))
    return float(acc.get_epsilon(delta))


def calibrate(
    target_epsilon: float, sampling_rate: float, rounds: int, delta: float, kind: Kind = "rdp"
) -> float:
    """The smallest noise multiplier whose epsilon after ``rounds`` releases is at most
    ``target_epsilon`` at ``delta`` (dp-accounting's bisection, to 1e-4 relative)."""
    dp_accounting = _lib()
    z = dp_accounting.calibrate_dp_mechanism(
        lambda: accountant(kind),
        lambda z: dp_event(z, sampling_rate, rounds),
        target_epsilon,
        delta,
        bracket_interval=dp_accounting.LowerEndpointAndGuess(0.0, 1.0),
        tol=1e-4,
    )
    return float(z)
