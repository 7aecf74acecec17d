"""User-facing errors.

Every mistake a user can make (a bad name, an invalid number, a missing file) raises
:class:`PflkitError` with one sentence that names the bad value and the fix. The CLI prints
that sentence and exits with code 2; it never shows a traceback for these.
"""

from __future__ import annotations

import difflib
import signal
from collections.abc import Iterable


class PflkitError(Exception):
    """A user mistake, reported as one clear sentence (CLI exit code 2)."""


class RunInterrupted(PflkitError):
    """A run stopped by SIGINT (Ctrl-C) or SIGTERM; the sentence says what was kept and how to
    continue. The CLI exits with 130 (SIGINT) or 143 (SIGTERM)."""

    def __init__(self, message: str, signal: str = "SIGINT"):
        super().__init__(message)
        self.signal = signal
        """The signal that stopped the run: ``"SIGINT"`` or ``"SIGTERM"``."""

    # survives pickling (compare's worker processes)
    def __reduce__(self) -> tuple[type[RunInterrupted], tuple[str, str]]:
        return (type(self), (str(self), self.signal))


class WorkerLost(PflkitError):
    """A worker process or Ray actor died in the middle of a round (killed, out of memory, its
    node gone): a fault, not a mistake. ``setting`` is the ``--set`` that avoids the kind of
    worker that died; a run adds how to continue it with that setting."""

    def __init__(self, message: str, setting: str):
        super().__init__(message)
        self.setting = setting

    def __reduce__(self) -> tuple[type[WorkerLost], tuple[str, str]]:
        return (type(self), (str(self), self.setting))


def unknown_name(
    kind: str, name: str, known: Iterable[str], listing: str = "pflkit list"
) -> PflkitError:
    """Error for an unknown registry name, suggesting the closest known one; ``listing`` is
    the command that shows every name."""
    known = sorted(known)
    close = difflib.get_close_matches(str(name), known, n=1, cutoff=0.5)
    hint = f"did you mean '{close[0]}'?" if close else f"choose one of: {', '.join(known)}."
    shown = str(name) if str(name).isprintable() else repr(str(name))[1:-1]  # one line, always
    return PflkitError(f"unknown {kind} '{shown}': {hint} (`{listing}` shows all)")


_TERMINATED: list[str] = []  # set once SIGTERM arrived through sigterm_as_interrupt's handler


def sigterm_as_interrupt() -> None:
    """From now until a command installs its own handler (a run's round loop, a compare),
    SIGTERM stops the process like a Ctrl-C, through the same clean-up, and
    :func:`terminated` then says so (the CLI exits 143 instead of 130)."""

    def handle(signum: int, frame: object) -> None:
        _TERMINATED.append("SIGTERM")
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, handle)


def terminated() -> bool:
    """Whether the KeyboardInterrupt being handled came from SIGTERM (sigterm_as_interrupt)."""
    return bool(_TERMINATED)
