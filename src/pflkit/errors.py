"""User-facing errors.

Every mistake a user can make (a bad name, an invalid number, a missing file) raises
:class:`PflkitError` with one sentence that names the bad value and the fix. The CLI prints
that sentence and exits with code 2; it never shows a traceback for these.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable


class PflkitError(Exception):
    """A user mistake, reported as one clear sentence (CLI exit code 2)."""


class RunInterrupted(PflkitError):
    """Ctrl-C stopped a run after its checkpoint was saved; the sentence says how to resume."""


def unknown_name(kind: str, name: str, known: Iterable[str]) -> PflkitError:
    """Error for an unknown registry name, suggesting the closest known one."""
    known = sorted(known)
    close = difflib.get_close_matches(str(name), known, n=1, cutoff=0.5)
    hint = f"did you mean '{close[0]}'?" if close else f"choose one of: {', '.join(known)}."
    return PflkitError(f"unknown {kind} '{name}': {hint} (`pflkit list` shows all)")
