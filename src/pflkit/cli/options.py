"""The options and arguments several commands share (typer's ``Annotated`` types), and the
options of many runs that compare and sweep share (:class:`ManyRuns`, :func:`many_runs`)."""

from __future__ import annotations

import dataclasses
import inspect
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Annotated

import typer

ConfigArg = Annotated[
    Path | None,
    typer.Argument(
        help="Experiment config (YAML), or the name of a bundled example (`pflkit examples`).",
        show_default=False,
    ),
]


SetOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--set", "-s", help="Override a config key, e.g. --set train.rounds=5 (repeatable)."
    ),
]


OutOpt = Annotated[Path | None, typer.Option("--out", "-o", help="Output folder.")]


QuietOpt = Annotated[
    bool, typer.Option("--quiet", "-q", help="No progress display, no 'downloading' lines.")
]


ImportOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--import",
        help="A module that registers your algorithms, models, datasets or partitioners "
        "(repeatable; looked up on PYTHONPATH and in the current folder; docs/plugins.md).",
    ),
]


AlgorithmsOpt = Annotated[
    str | None,
    typer.Option(
        help="Comma-separated algorithms (default: config's compare.algorithms). A name or label "
        "of the config's own entries runs those entries with their parameters; any other name "
        "runs at its defaults; {name: fedprox, mu: 0.1} gives parameters."
    ),
]


SeedsOpt = Annotated[str | None, typer.Option(help="Comma-separated training seeds, e.g. 0,1,2.")]


JobsOpt = Annotated[
    int,
    typer.Option(
        help="Whole runs at once, one process each (1 torch thread each unless `threads` "
        "is set). Rerunning into the same --out continues it."
    ),
]


KeepGoingOpt = Annotated[
    bool,
    typer.Option(
        "--keep-going",
        help="A failed run (a diverged loss, say) stops only itself; the error naming every "
        "failed run comes at the end. Default: the first failure stops every run.",
    ),
]


ForceOpt = Annotated[
    bool,
    typer.Option(
        "--force",
        help="Run even when the pre-flight check finds the run past this machine (workers or "
        "threads above 4 per core or the process limit, more memory or disk than is free).",
    ),
]


SkipCorruptOpt = Annotated[
    bool,
    typer.Option(
        "--skip-corrupt",
        help="Leave out corrupt lines of the runs' metrics.jsonl (the table's footnote names "
        "them) instead of refusing the run.",
    ),
]


AtOpt = Annotated[
    str | None,
    typer.Option(
        "--at",
        help="Which number of each run: last (round), mean_last (mean of the last eval.last "
        "rounds), val_round (the round chosen on validation) or best_test (the paper protocol, "
        "optimistic: the evaluated round with the best weighted accuracy on test, with the std "
        "and CV over clients there).",
    ),
]


MetricOpt = Annotated[
    str | None,
    typer.Option(
        help="The compared and selected metric: pers_acc_mean, pers_acc_weighted, "
        "pers_acc_worst10 or global_acc; or a metric of eval.metrics by name (loss, f1_macro, "
        "balanced_accuracy, ece, perplexity: its pers_<key>_mean) or field (pers_loss_weighted, "
        "global_ece, ...)."
    ),
]


SelectOpt = Annotated[
    str | None,
    typer.Option(
        help="Per algorithm, choose a setting on: val (the validation split), test (labelled "
        "optimistic) or none."
    ),
]


@dataclasses.dataclass(frozen=True)
class ManyRuns:
    """The options of a command that runs many runs into one folder (compare, sweep), each
    field an option (its type says how typer reads it); :func:`many_runs` adds them to a
    command."""

    out: OutOpt = None
    quiet: QuietOpt = False
    jobs: JobsOpt = 1
    keep_going: KeepGoingOpt = False
    force: ForceOpt = False
    skip_corrupt: SkipCorruptOpt = False


DEFAULTS = ManyRuns()  # frozen: a default shared safely


def many_runs(command: Callable[..., None]) -> Callable[..., None]:
    """``command``, whose last parameter is ``runs: ManyRuns``, as typer is to see it: its other
    parameters, then one option per field of :class:`ManyRuns` (in their order), which the
    call gathers into ``runs`` again."""
    hints = typing.get_type_hints(ManyRuns, include_extras=True)
    fields = dataclasses.fields(ManyRuns)
    own = inspect.signature(command, eval_str=True).parameters.values()
    kind = inspect.Parameter.POSITIONAL_OR_KEYWORD
    options = [
        inspect.Parameter(f.name, kind, default=f.default, annotation=hints[f.name]) for f in fields
    ]

    def typed(**kwargs: typing.Any) -> None:
        runs = ManyRuns(**{f.name: kwargs.pop(f.name) for f in fields})
        command(**kwargs, runs=runs)

    for attr in ("__name__", "__qualname__", "__doc__", "__module__"):
        setattr(typed, attr, getattr(command, attr))
    typed.__signature__ = inspect.Signature([p for p in own if p.name != "runs"] + options)  # type: ignore[attr-defined]
    return typed
