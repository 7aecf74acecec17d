"""``pflkit compare``: algorithms on one partition over several seeds."""

from __future__ import annotations

from pflkit.cli.common import _hush, _lists, _many
from pflkit.cli.options import (
    DEFAULTS,
    AlgorithmsOpt,
    ConfigArg,
    ImportOpt,
    ManyRuns,
    MetricOpt,
    SeedsOpt,
    SetOpt,
    many_runs,
)
from pflkit.experiment import load_config


@many_runs
def compare(
    config: ConfigArg = None,
    set_: SetOpt = None,
    imports: ImportOpt = None,
    algorithms: AlgorithmsOpt = None,
    seeds: SeedsOpt = None,
    metric: MetricOpt = None,
    runs: ManyRuns = DEFAULTS,
) -> None:
    """Compare algorithms on one partition over several seeds: markdown table + curves.
    Into an existing compare folder of the same config it continues: finished runs are
    kept, interrupted ones resume from their checkpoints."""
    _hush(runs.quiet)
    from pflkit.engine.compare import run_compare

    cfg = load_config(config, _lists(set_, seeds), imports, algorithms)
    if metric is not None:  # checked before anything runs; the plan keeps it for reports
        import functools

        from pflkit.report.results import compare_options

        run_compare = functools.partial(run_compare, options=compare_options(metric))
    _many(run_compare, "compare", cfg, runs)
