"""What every command shares: the console, -q, output paths and seconds checked before any
work, --set with --seeds, a run's summary line, a compare's or sweep's run (:func:`_many`), and the exit codes of :func:`run_app` (a
:class:`~pflkit.errors.PflkitError` is one line and exit 2, an interrupt 130 or 143, a usage
error click's code)."""

from __future__ import annotations

import math
import sys
from datetime import datetime
from pathlib import Path

import typer
from rich.console import Console

from pflkit.cli.options import ManyRuns
from pflkit.errors import PflkitError, RunInterrupted, terminated

# long lines are never wrapped; into a pipe or file, tables keep their natural width
out_console = Console(soft_wrap=True, width=None if sys.stdout.isatty() else 10_000)


def _hush(quiet: bool) -> None:
    """-q: besides the progress display, no "downloading ..." lines (the data's notices)."""
    from pflkit.data import download

    download.QUIET = quiet


def _usable_path(path: Path, what: str, option: str = "--out") -> None:
    """Refuse, before any work, an output ``path`` (a file or a folder to create) that cannot
    be written: a name the file system refuses, a file where a folder is needed on the way,
    or a place where nothing can be created (e.g. under /proc). Nothing is left behind."""
    import os
    import tempfile

    shown = str(path) if len(str(path)) < 80 else f"{str(path)[:60]}..."
    try:
        place = path.absolute() if path.is_dir() else path.absolute().parent
        while not place.exists():
            place = place.parent
    except OSError as err:  # e.g. a name longer than the file system allows
        raise PflkitError(
            f"{option} '{shown}' is not a usable path ({err.strerror}): choose another {option}"
        ) from None
    if not place.is_dir():
        raise PflkitError(
            f"{option} '{shown}' lies under '{place}', which is a file, not a folder: "
            f"choose another {option}"
        )
    try:
        fd, probe = tempfile.mkstemp(dir=place, prefix=".pflkit-probe-")
        os.close(fd)
        os.unlink(probe)
    except OSError as err:
        raise PflkitError(
            f"cannot write the {what} '{shown}' ({err.strerror or err}): nothing can be "
            f"created in '{place}'; choose another {option}"
        ) from None


def _seconds(option: str, value: float, zero_ok: bool = True) -> float:
    """A number of seconds given on the command line, checked (finite, >= 0 or > 0)."""
    if not math.isfinite(value) or value < 0 or (value == 0 and not zero_ok):
        bound = ">= 0" if zero_ok else "> 0"
        raise PflkitError(f"{option} {value} is not a number of seconds: give seconds {bound}")
    return value


def _lists(set_: list[str] | None, seeds: str | None) -> list[str]:
    """The overrides of compare and sweep: --set, plus --seeds."""
    overrides = list(set_ or [])
    if seeds:
        overrides.append(f"compare.seeds=[{seeds}]")
    return overrides


def _show_summary(run_dir: Path, summary: dict) -> None:
    """Print the run folder and the accuracies of ``summary``'s last round (its ``final``)."""
    from pflkit.report.results import percent

    final = summary.get("final", {})
    shown = ", ".join(  # eval_*: counts; a loss or perplexity (eval.metrics) as it is
        f"{k} {v:g}" if k.startswith("eval_") or not percent(k) else f"{k} {100 * v:.2f}%"
        for k, v in final.items()
        if k != "round" and v is not None
    )
    out_console.print(f"run folder: {run_dir}\nlast round ({final.get('round')}): {shown}")


def _stopped_at_once() -> None:
    """A Ctrl-C (or SIGTERM, :func:`~pflkit.errors.sigterm_as_interrupt`) that no command
    turned into a sentence of its own (``run``'s round loop stops at a round's end and says
    how to resume; ``compare`` says how to continue)."""
    how = "SIGTERM" if terminated() else "Ctrl-C"
    print(f"error: interrupted ({how}): stopped at once", file=sys.stderr)
    sys.exit(143 if terminated() else 130)


def _is_usage_error(err: Exception) -> bool:
    """Whether ``err`` is a click ``ClickException`` (a usage error with its own message)."""
    return any(c.__name__ == "ClickException" for c in type(err).__mro__) and hasattr(err, "show")


def _usage_sentence(err: Exception) -> str:
    """Click's usage error as one line: its sentences (each once: typer and click both add
    "Did you mean ...?") joined into one, and where the command's help is."""
    import re

    parts = re.split(r"(?<=[.?])\s+", " ".join(err.format_message().split()))
    parts = [p.rstrip(".") for p in dict.fromkeys(parts) if p.rstrip(".")]
    text = ": ".join(p[:1].lower() + p[1:] for p in parts) or type(err).__name__
    ctx = getattr(err, "ctx", None)
    path = ctx.command_path if ctx is not None else "pflkit"
    return f"{path}: {text} (`{path} --help` shows how to call it)"


def run_app(app: typer.Typer) -> None:
    """Run ``app`` as the console script: a user mistake is one line on stderr and exit 2, an
    interrupt one line and 130 (Ctrl-C) or 143 (SIGTERM), a usage error one line (the help
    where nothing was given) and click's code."""
    _hush(False)  # until a command's -q says otherwise
    try:
        # with standalone_mode=False, click returns the code of an Exit instead of exiting;
        # typer turns a KeyboardInterrupt into Exit(130)
        code = app(standalone_mode=False, prog_name="pflkit")
    except RunInterrupted as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(143 if err.signal == "SIGTERM" else 130)
    except PflkitError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        _stopped_at_once()
    except typer.Exit as e:
        sys.exit(e.exit_code)
    except Exception as err:  # click usage errors
        # a ClickException of the click that typer runs on: the click package (typer 0.20)
        # or typer's own copy of it (typer 0.27 installs no click), so not matched by class
        if not _is_usage_error(err):
            raise
        if type(err).__name__ == "NoArgsIsHelpError":  # `pflkit`, `pflkit flower`: the help
            err.show()
        else:  # a misspelt command or option, --jobs two
            print(f"error: {_usage_sentence(err)}", file=sys.stderr)
        sys.exit(err.exit_code)
    if code == 130:
        _stopped_at_once()
    if isinstance(code, int) and code != 0:
        sys.exit(code)


def _many(fn, kind: str, cfg, runs: ManyRuns) -> None:
    """Run a compare or sweep (``fn``) into ``runs.out`` (default: runs/<kind>-<name>-<time>)
    and print its tables."""
    from pflkit.engine.folder import folder_name, under

    out = runs.out
    if out is None:
        name = f"{kind}-{folder_name(cfg.name)}-{datetime.now():%Y%m%d-%H%M%S}"
        out = under(Path(cfg.output.dir) / name, cfg.output.dir, f"{kind} folder")
    progress = False if runs.quiet else None
    res = fn(
        cfg,
        out,
        progress=progress,
        jobs=runs.jobs,
        keep_going=runs.keep_going,
        force=runs.force,
        skip_corrupt=runs.skip_corrupt,
    )
    print(res["table"])
    out_console.print(f"written to {res['out']}")
