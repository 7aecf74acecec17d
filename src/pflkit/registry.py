"""The one registry type behind pflkit's four registries: algorithms
(:data:`pflkit.algorithms.ALGORITHMS`), models (:data:`pflkit.models.MODELS`), datasets
(:data:`pflkit.data.sources.SOURCES`) and partitioners (:data:`pflkit.data.partition.PARTITIONERS`).

A registry maps a name to an *entry*: any object with a ``name`` and a one-line
``description`` (an algorithm class, or the small info record of a model factory, a dataset
loader or a partitioner). Every registry adds, refuses and looks up the same way:

- :meth:`Registry.add` registers an entry (a class decorator for algorithms); a second,
  different entry under a taken name is one :class:`~pflkit.errors.PflkitError` sentence;
- :meth:`Registry.register` is the decorator for functions: it wraps the function in the
  registry's info record under the name and description given;
- :meth:`Registry.lookup` returns the entry or says "unknown <kind> 'x': did you mean 'y'?".

Plugins (:mod:`pflkit.plugins`) go through the same two methods.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any, Generic, TypeVar

from pflkit.errors import PflkitError, unknown_name

T = TypeVar("T")


class Registry(dict[str, T], Generic[T]):
    """Name -> entry, for one ``kind`` of thing ("algorithm", "model", ...). ``info`` builds an
    entry from ``(name, description, function, **extra)`` for :meth:`register`; a registry of
    classes (algorithms) has none and registers with :meth:`add` only."""

    def __init__(
        self, kind: str, info: Callable[..., T] | None = None, entries: Iterable[T] = ()
    ) -> None:
        super().__init__()
        self.kind = kind
        """What the entries are ("algorithm", "model", "dataset", "partitioner"), as the
        error sentences name them."""
        self.info = info
        """Builds an entry from ``(name, description, function, **extra)``; None for a
        registry of classes."""
        for entry in entries:
            self.add(entry)

    def add(self, entry: T) -> T:
        """Register ``entry`` under its ``name`` and return it (so it decorates a class).
        Registering the same entry again is a no-op; another under a taken name is refused."""
        name = getattr(entry, "name", None)
        if not isinstance(name, str) or not name:
            raise PflkitError(f"a {self.kind} needs a non-empty string name, got {name!r}")
        if name in self and self[name] != entry:
            raise PflkitError(
                f"a {self.kind} named '{name}' is already registered: choose another name"
            )
        self[name] = entry
        return entry

    def register(self, name: str, description: str, **extra: Any) -> Callable[[Any], Any]:
        """Decorator: register the decorated function as ``name`` (its info record, with
        ``description`` and ``extra`` fields) and return the function unchanged."""
        info = self.info
        if info is None:
            raise TypeError(f"{self.kind}s register with add(), not register()")

        def decorate(fn: Any) -> Any:
            self.add(info(name, description, fn, **extra))
            return fn

        return decorate

    def lookup(self, name: str) -> T:
        """The entry registered as ``name``, or an error naming the closest known name."""
        if not isinstance(name, str) or name not in self:
            raise unknown_name(self.kind, str(name), self)
        return self[name]

    def descriptions(self) -> dict[str, str]:
        """Each name's one-line description (``pflkit list``)."""
        entries: Mapping[str, Any] = self  # every entry has a description (module docstring)
        return {name: entry.description for name, entry in entries.items()}
