"""``pflkit sweep``: a grid of settings per algorithm, chosen on validation."""

from __future__ import annotations

from typing import Annotated

import typer

from pflkit.cli.common import _hush, _lists, _many
from pflkit.cli.options import (
    DEFAULTS,
    AlgorithmsOpt,
    AtOpt,
    ConfigArg,
    ImportOpt,
    ManyRuns,
    MetricOpt,
    SeedsOpt,
    SelectOpt,
    SetOpt,
    many_runs,
)
from pflkit.errors import PflkitError
from pflkit.experiment import load_config


@many_runs
def sweep(
    config: ConfigArg = None,
    grid: Annotated[
        list[str] | None,
        typer.Option(
            help='A config key and its values, e.g. --grid "train.lr=[0.01,0.05]" or '
            '--grid "algorithm.mu=[0.001,0.01]" (repeatable; a product grid).'
        ),
    ] = None,
    set_: SetOpt = None,
    imports: ImportOpt = None,
    algorithms: AlgorithmsOpt = None,
    seeds: SeedsOpt = None,
    select: SelectOpt = None,
    metric: MetricOpt = None,
    at: AtOpt = None,
    runs: ManyRuns = DEFAULTS,
) -> None:
    """Run a grid of settings for each algorithm over several seeds, then choose each
    algorithm's setting on validation accuracy and report its test accuracy (next to the best
    on test, labelled). Into an existing sweep folder of the same config it continues."""
    _hush(runs.quiet)
    import json

    from pflkit.config_io import parse_value
    from pflkit.engine.compare import run_sweep
    from pflkit.experiment import validate

    overrides = _lists(set_, seeds) + [
        f"sweep.{k}={json.dumps(v)}"  # quoted: an empty value is refused, not read as null
        for k, v in (("select", select), ("metric", metric), ("at", at))
        if v is not None
    ]
    cfg = load_config(config, overrides, imports, algorithms)
    extra = {}
    for item in grid or []:
        key, sep, text = item.partition("=")
        values = parse_value(text, "--grid") if sep else None
        if not key or not isinstance(values, list) or not values:
            raise PflkitError(
                f"invalid --grid '{item}': write a key and a list of values, e.g. "
                '--grid "train.lr=[0.01,0.05]"'
            )
        if key in extra:
            raise PflkitError(
                f"--grid gives '{key}' twice: give each key once, with all its values in one "
                f'list, e.g. --grid "{key}=[...]"'
            )
        extra[key] = values
    if extra:
        raw = cfg.dump()
        raw["sweep"]["grid"] = raw["sweep"]["grid"] | extra
        cfg = validate(raw)
    _many(run_sweep, "sweep", cfg, runs)
