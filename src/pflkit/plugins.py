"""User extensions: algorithms, models, datasets, partitioners and client runners defined in
the user's own modules, usable from ``pflkit run``, ``compare``, ``partition`` and the Flower
apps.

A plugin is a Python module that registers things when imported:

- an algorithm: a subclass of :class:`pflkit.algorithms.Algorithm` decorated with
  :func:`register_algorithm` (``pflkit.algorithms.register``);
- a model: :func:`register_model` (``factory(input_shape, num_classes, **options)`` returning
  a :class:`pflkit.models.PFLModel`);
- a dataset: :func:`register_dataset` (``loader(root, download, **options)`` returning a
  :class:`pflkit.data.sources.Source`);
- a partitioner: :func:`register_partitioner` (``fn(labels, num_clients, rng, **params)``
  returning one index array per client);
- a client runner: :func:`register_runner` (``factory(cfg)`` returning a
  :class:`pflkit.engine.clients.ClientRunner`), chosen by ``engine.runner``.

It is loaded by name from the config's ``plugins: [module, ...]`` list (recorded in every run
folder, so ``--resume`` and Flower's SuperNodes import it too), from ``--import MODULE`` on
the command line (added to that list), and from the ``pflkit.plugins`` entry-point group of
installed packages (always). docs/plugins.md has a complete, tested example.
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Callable, Iterable
from importlib import metadata
from pathlib import Path
from typing import Any

from pflkit.algorithms.base import register as register_algorithm
from pflkit.errors import PflkitError
from pflkit.registry import Registry

ENTRY_POINT_GROUP = "pflkit.plugins"
_loaded_entry_points = False


def _register(registry: Registry, name: str, description: str, fn: Callable | None) -> Any:
    """``registry.register(name, description)`` applied to ``fn``, or the decorator itself."""
    decorate = registry.register(name, description)
    return decorate if fn is None else decorate(fn)


def register_model(name: str, description: str, factory: Callable | None = None) -> Any:
    """Register a model factory (call it with the factory, or use it as a decorator)."""
    from pflkit.models.registry import MODELS

    return _register(MODELS, name, description, factory)


def register_dataset(name: str, description: str, loader: Callable | None = None) -> Any:
    """Register a dataset loader (call it with the loader, or use it as a decorator)."""
    from pflkit.data.sources import SOURCES

    return _register(SOURCES, name, description, loader)


def register_partitioner(name: str, description: str, fn: Callable | None = None) -> Any:
    """Register a partitioner (call it with the function, or use it as a decorator)."""
    from pflkit.data.partition import PARTITIONERS

    return _register(PARTITIONERS, name, description, fn)


def register_runner(name: str, description: str, factory: Callable | None = None) -> Any:
    """Register a client runner's factory (call it with the factory, or use it as a
    decorator); ``engine.runner: <name>`` then runs the clients' work on it."""
    from pflkit.engine.runners import RUNNERS

    return _register(RUNNERS, name, description, factory)


def load_plugins(modules: Iterable[str] = ()) -> None:
    """Import the installed packages' ``pflkit.plugins`` entry points (once) and ``modules``."""
    global _loaded_entry_points
    if not _loaded_entry_points:
        _loaded_entry_points = True
        for ep in metadata.entry_points(group=ENTRY_POINT_GROUP):
            ep.load()
    if modules and os.getcwd() not in sys.path:
        sys.path.append(os.getcwd())  # `--import my_module` finds ./my_module.py
    for name in modules:
        if not isinstance(name, str) or not name:
            raise PflkitError(f"plugins lists {name!r}: write module names, e.g. [my_algorithms]")
        _import(name)


def _import(name: str) -> None:
    """Import plugin module ``name``; whatever goes wrong inside it (a syntax error, a missing
    dependency, an exception, a call of ``exit``) is one sentence naming the module. A
    ``PflkitError`` it raises (a name registered twice, say) is passed on as it is."""
    try:
        importlib.import_module(name)
    except PflkitError:
        raise
    except ModuleNotFoundError as err:
        if err.name is None or name == err.name or name.startswith(err.name + "."):
            raise PflkitError(
                f"cannot import plugin module '{name}': no module named '{err.name or name}'; "
                "check the name and that its folder is on PYTHONPATH"
            ) from None
        raise PflkitError(
            f"plugin module '{name}' imports '{err.name}', which is not installed: install "
            "the package that provides it, or remove that import"
        ) from None
    except SyntaxError as err:  # IndentationError and TabError too
        where = f"{Path(err.filename).name if err.filename else name}, line {err.lineno}"
        raise PflkitError(
            f"plugin module '{name}' has a syntax error ({where}: {err.msg}): fix it"
        ) from None
    except SystemExit as err:
        code = "" if err.code is None else _one_line(repr(err.code))
        raise PflkitError(
            f"plugin module '{name}' called exit({code}) while being "
            "imported: a plugin must only define and register things; remove the call"
        ) from None
    except Exception as err:
        raise PflkitError(
            f"plugin module '{name}' failed while being imported ({type(err).__name__}: "
            f"{_one_line(str(err))}): fix it (python -c 'import {name}' shows where)"
        ) from None


def _one_line(text: str, limit: int = 200) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


__all__ = [
    "load_plugins",
    "register_algorithm",
    "register_dataset",
    "register_model",
    "register_partitioner",
    "register_runner",
]
