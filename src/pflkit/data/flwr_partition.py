"""Flower Datasets' partitioners in pflkit: ``partition: {name: flwr, partitioner: NAME, ...}``.

The training labels become a ``datasets.Dataset`` with the columns ``label``, ``group`` (the
natural owner of each sample, for sources that have one) and ``pflkit_index`` (the sample's
position); the partitioner ``NAME`` of ``flwr_datasets.partitioner`` is built with the
section's other keys as its arguments, and client ``i`` gets the ``pflkit_index`` values of
``load_partition(i)``, sorted. So a split drawn here has the indices flwr-datasets draws for
the same labels, arguments and seed. pflkit fills in three arguments:

- ``num_partitions``: ``data.num_clients`` (for the partitioners that take it; for the others,
  e.g. ``SizePartitioner`` or ``NaturalIdPartitioner``, the partition count they make must
  equal ``data.num_clients``);
- ``partition_by``: ``label`` unless given (``group`` partitions by natural owner);
- ``seed``: ``data.seed``, the one seed of the partition (flwr-datasets' default is 42: set
  ``data.seed: 42`` for the split its defaults give).

``federated_dataset_seed: S`` first shuffles the rows with ``Dataset.shuffle(seed=S)``, which is
what flwr-datasets' ``FederatedDataset`` does before partitioning (its ``shuffle=True,
seed=42``): with the dataset's own row order (the ``hf`` source keeps it) and no
``data.subset``, the clients then get exactly the rows of
``FederatedDataset(..., partitioners={"train": P}, seed=S).load_partition(i)``.

Needs ``pip install 'pflkit[hf]'`` (flwr-datasets, datasets).
"""

from __future__ import annotations

import difflib
import inspect
from typing import Any

import numpy as np

from pflkit.errors import PflkitError

INDEX = "pflkit_index"
# filled in by pflkit from the config: the user sets data.num_clients and data.seed instead
FILLED = {"num_partitions": "data.num_clients", "seed": "data.seed"}
# in flwr_datasets.partitioner but not usable here: the base class, one that needs a Python
# function, and the vertical ones (they split the columns, not the samples)
UNUSABLE = {"Partitioner", "IdToSizeFncPartitioner"}


def _modules() -> tuple[Any, Any]:
    """(datasets, flwr_datasets.partitioner), or one sentence saying how to install them."""
    try:
        import datasets
        from flwr_datasets import partitioner
    except ImportError:
        raise PflkitError(
            "partition 'flwr' needs the flwr-datasets package, which is not installed; run "
            "`pip install 'pflkit[hf]'`"
        ) from None
    return datasets, partitioner


def library_version() -> str:
    """``flwr-datasets <version>`` (part of the partition cache's key), or the sentence
    saying how to install it."""
    _modules()
    from importlib.metadata import version

    return f"flwr-datasets {version('flwr-datasets')}"


def known_partitioners() -> dict[str, type]:
    """Name -> class of every flwr-datasets partitioner that splits samples and takes only
    plain arguments."""
    _, module = _modules()
    return {
        name: getattr(module, name)
        for name in sorted(module.__all__)
        if name not in UNUSABLE and not name.startswith("Vertical")
    }


def flwr(
    labels: np.ndarray,
    num_clients: int,
    rng: np.random.Generator,
    seed: int,
    groups: np.ndarray | None = None,
    partitioner: str | None = None,
    federated_dataset_seed: int | None = None,
    **arguments: Any,
) -> list[np.ndarray]:
    """Delegate to flwr-datasets' partitioner ``partitioner`` (module docstring). ``rng`` is
    not used: flwr-datasets draws from ``seed``."""
    datasets, _ = _modules()
    known = known_partitioners()
    if partitioner is None:
        raise PflkitError(
            "partition 'flwr' needs 'partitioner', the name of a flwr-datasets partitioner: "
            f"one of {', '.join(known)}"
        )
    if partitioner not in known:
        close = difflib.get_close_matches(str(partitioner), known, n=1, cutoff=0.5)
        hint = f"did you mean '{close[0]}'? " if close else ""
        raise PflkitError(
            f"unknown flwr-datasets partitioner '{partitioner}': {hint}the known ones are "
            f"{', '.join(known)}"
        )
    cls = known[partitioner]
    params = inspect.signature(cls.__init__).parameters
    takes = [p for p in params if p != "self" and p not in FILLED]
    for key in arguments:
        if key in FILLED:
            raise PflkitError(
                f"partition 'flwr' sets {partitioner}'s '{key}' from {FILLED[key]}: remove "
                f"'{key}' from data.partition and set {FILLED[key]}"
            )
        if key not in params:
            raise PflkitError(
                f"flwr-datasets' {partitioner} has no argument '{key}'; it takes: "
                f"{', '.join(takes)}"
            )
    kwargs = dict(arguments)
    if "num_partitions" in params:
        kwargs["num_partitions"] = num_clients
    if "seed" in params:
        kwargs["seed"] = seed
    if "partition_by" in params:
        kwargs.setdefault("partition_by", "label")
    if groups is None and kwargs.get("partition_by") == "group":
        raise PflkitError(
            "partition_by: group needs a dataset with natural owners (e.g. femnist, har); "
            "this one has none: partition by label"
        )

    columns = {"label": np.asarray(labels, dtype=np.int64), INDEX: np.arange(len(labels))}
    if groups is not None:
        columns["group"] = np.asarray(groups)
    table = datasets.Dataset.from_dict(columns)
    if federated_dataset_seed is not None:
        s = federated_dataset_seed
        if isinstance(s, bool) or not isinstance(s, int | np.integer) or not 0 <= s < 2**32:
            raise PflkitError(
                f"partition 'flwr': federated_dataset_seed must be an integer >= 0 and < 2**32 "
                f"(got {s!r}), the seed FederatedDataset shuffled with (its default is 42)"
            )
        table = table.shuffle(seed=int(s))
    try:
        part = cls(**kwargs)
        part.dataset = table
        made = part.num_partitions
        if made != num_clients:
            raise PflkitError(
                f"flwr-datasets' {partitioner} makes {made} partitions but data.num_clients is "
                f"{num_clients}: set data.num_clients: {made} or change its arguments"
            )
        parts = [
            np.sort(np.asarray(part.load_partition(i)[INDEX], dtype=np.int64)) for i in range(made)
        ]
    except PflkitError:
        raise
    except (TypeError, ValueError, KeyError, IndexError) as err:
        detail = " ".join(str(err).split()) or type(err).__name__
        raise PflkitError(
            f"flwr-datasets' {partitioner} refused its arguments {kwargs} ({detail}): fix "
            "data.partition"
        ) from None
    for cid, p in enumerate(parts):
        if not len(p):
            raise PflkitError(
                f"flwr-datasets' {partitioner} gave client {cid} no sample: use fewer clients "
                "or arguments that give every client data"
            )
    return parts
