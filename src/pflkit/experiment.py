"""A config ready to run: :func:`load_config` and :func:`validate` type it (:mod:`pflkit.config`),
load its plugins (:mod:`pflkit.plugins`) and have its algorithm's ``Params`` validate the
``algorithm:`` keys and fill in every default (:func:`pflkit.algorithms.resolve_params`).

The layers import one way, each only from those before it (tests/test_structure.py checks it):
errors, strict and devices; config (the schema) and config_io (its text); data and models; algorithms (the contract: base, env, blocks) and
plugins; this module; engine; cli and flower. The config knows no algorithm: this module joins
the two, so every caller (the command line, the Python API, the engine's resume and worker
processes, Flower's apps) gets the same checks in the same order.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pflkit.config import ExperimentConfig, parse
from pflkit.config_io import apply_overrides, read_yaml, select_algorithms
from pflkit.devices import resolve_device
from pflkit.errors import PflkitError
from pflkit.examples import resolve

if TYPE_CHECKING:
    from pflkit.algorithms import Algorithm


@dataclass(frozen=True)
class TypedAlgorithm:
    """A config's algorithm section parsed into its class and typed ``Params`` (pydantic:
    it pickles, so workers receive it as it is instead of parsing the section again)."""

    cls: type[Algorithm]
    params: Any  # an instance of cls.Params
    source: dict[str, Any]  # the algorithm section it was parsed from

    def build(self) -> Algorithm:
        """A new instance of the algorithm (what ``build_algorithm`` of the section gives)."""
        return self.cls(self.params)

    def record(self) -> dict[str, Any]:
        """The section with every default filled in: what a run's config.yaml records (as
        :func:`pflkit.algorithms.resolve_params` gives it)."""
        return {"name": self.cls.name, **self.params.model_dump(mode="json")}


def validate(raw: dict[str, Any]) -> ExperimentConfig:
    """The typed config of ``raw``; the algorithm's parameters are validated by its ``Params``
    once and every default is filled in (so a run's config.yaml records all of them); the
    config keeps the parsed section (:func:`algorithm_of`), and the device is checked to exist
    on this machine."""
    # imported on use: the command line imports this module at its start, before torch
    from pflkit.algorithms.base import typed_params
    from pflkit.eval.metrics import resolve as resolve_metrics
    from pflkit.plugins import load_plugins

    plugins = raw.get("plugins") or []
    if not isinstance(plugins, list):
        raise PflkitError(f"plugins must be a list of module names (got {plugins!r})")
    load_plugins(plugins)  # before validation: they may register the names used below
    cfg = parse(raw)
    resolve_device(cfg.device)  # a wrong or missing device fails here, in one sentence
    typed = TypedAlgorithm(*typed_params(cfg.algorithm, cfg.train.weighting), {})
    cfg.algorithm = typed.record()
    cfg._typed_algorithm = TypedAlgorithm(typed.cls, typed.params, dict(cfg.algorithm))
    resolve_metrics(cfg.eval.metrics, None)  # registered names (a plug-in's too)
    return cfg


def algorithm_of(cfg: ExperimentConfig) -> TypedAlgorithm:
    """``cfg``'s algorithm section parsed: the one :func:`validate` parsed, or, for a config
    typed another way or whose section changed since, the section parsed now (once: the
    config keeps it). Unknown names and parameters are one sentence."""
    typed = cfg._typed_algorithm
    if not isinstance(typed, TypedAlgorithm) or typed.source != cfg.algorithm:
        from pflkit.algorithms.base import typed_params

        typed = TypedAlgorithm(*typed_params(cfg.algorithm), dict(cfg.algorithm))
        cfg._typed_algorithm = typed
    return typed


def load_config(
    path: str | Path | Mapping[str, Any] | None,
    overrides: list[str] | None = None,
    plugins: list[str] | None = None,
    algorithms: str | None = None,
) -> ExperimentConfig:
    """Read a YAML config (``path``: a file, or the name of an example bundled with pflkit,
    e.g. ``"quickstart"``: :func:`pflkit.examples.resolve`), take a dict of what such a file
    holds, or start from defaults (None); apply ``overrides`` (a list of ``key=value``
    strings), add ``plugins`` (module names, e.g. from ``--import``) to its ``plugins`` list,
    choose ``compare.algorithms`` from ``algorithms`` (``--algorithms``;
    :func:`pflkit.config_io.select_algorithms`), validate."""
    if isinstance(overrides, str):
        raise PflkitError(
            f"overrides is one string ('{overrides}'): give a list of key=value strings, "
            f"e.g. ['{overrides}']"
        )
    if isinstance(path, Mapping):
        raw = dict(path)  # apply_overrides copies it
    elif path is None:
        raw = {}
    elif isinstance(path, str | os.PathLike):
        raw = read_yaml(resolve(path))
    else:
        raise PflkitError(
            "load_config takes a config file's path, an example's name or a dict, got "
            f"{type(path).__name__}"
        )
    raw = apply_overrides(raw, overrides or [])
    if algorithms:
        raw = select_algorithms(raw, algorithms)
    if plugins:
        raw["plugins"] = list(dict.fromkeys([*(raw.get("plugins") or []), *plugins]))
    return validate(raw)
