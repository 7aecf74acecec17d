"""A config ready to run: :func:`load_config` and :func:`validate` type it (:mod:`pflkit.config`),
load its plugins (:mod:`pflkit.plugins`) and have its algorithm's ``Params`` validate the
``algorithm:`` keys and fill in every default (:func:`pflkit.algorithms.resolve_params`).

The layers import one way, each only from those before it (tests/test_structure.py checks it):
errors and strict; config; data and models; algorithms (the contract: base, env, blocks) and
plugins; this module; engine; cli and flower. The config knows no algorithm: this module joins
the two, so every caller (the command line, the Python API, the engine's resume and worker
processes, Flower's apps) gets the same checks in the same order.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pflkit.config import ExperimentConfig, apply_overrides, parse, read_yaml, select_algorithms
from pflkit.errors import PflkitError
from pflkit.examples import resolve


def validate(raw: dict[str, Any]) -> ExperimentConfig:
    """The typed config of ``raw``; the algorithm's parameters are validated by its ``Params``
    and every default is filled in (so a run's config.yaml records all of them)."""
    # imported on use: the command line imports this module at its start, before torch
    from pflkit.algorithms import resolve_params
    from pflkit.eval.metrics import resolve as resolve_metrics
    from pflkit.plugins import load_plugins

    plugins = raw.get("plugins") or []
    if not isinstance(plugins, list):
        raise PflkitError(f"plugins must be a list of module names (got {plugins!r})")
    load_plugins(plugins)  # before validation: they may register the names used below
    cfg = parse(raw)
    cfg.algorithm = resolve_params(cfg.algorithm, cfg.train.weighting)
    resolve_metrics(cfg.eval.metrics, None)  # registered names (a plug-in's too)
    return cfg


def load_config(
    path: str | Path | None,
    overrides: list[str] | None = None,
    plugins: list[str] | None = None,
    algorithms: str | None = None,
) -> ExperimentConfig:
    """Read a YAML config (``path``: a file, or the name of an example bundled with pflkit,
    e.g. ``"quickstart"``: :func:`pflkit.examples.resolve`) or start from defaults, apply
    overrides, add ``plugins`` (module names, e.g. from ``--import``) to its ``plugins`` list,
    choose ``compare.algorithms`` from ``algorithms`` (``--algorithms``;
    :func:`pflkit.config.select_algorithms`), validate."""
    raw = apply_overrides(read_yaml(resolve(path)) if path is not None else {}, overrides or [])
    if algorithms:
        raw = select_algorithms(raw, algorithms)
    if plugins:
        raw["plugins"] = list(dict.fromkeys([*(raw.get("plugins") or []), *plugins]))
    return validate(raw)
