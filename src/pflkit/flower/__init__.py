"""Run any pflkit algorithm on Flower (optional extra: ``pip install 'pflkit[flower]'``).

- :mod:`pflkit.flower.apps`: the ServerApp and ClientApp a Flower app project points at;
- :mod:`pflkit.flower.server`, :mod:`pflkit.flower.client`: the two sides of the round loop;
- :mod:`pflkit.flower.codec`: pflkit's plain data to Flower records and back;
- :mod:`pflkit.flower.local`: start a SuperLink and SuperNodes on this machine and run a config.

See docs/flower.md.
"""

from __future__ import annotations

from pflkit.errors import PflkitError

FLOWER_PIN = "flwr>=1.41,<1.42"


def require_flower() -> None:
    """Fail with one sentence when the Flower extra is not installed."""
    try:
        import flwr  # noqa: F401
    except ImportError:
        raise PflkitError(
            f"Flower is not installed: pip install 'pflkit[flower]' (which pins {FLOWER_PIN})"
        ) from None
