"""FederatedDataset: a source split over clients, each with local train/test (and validation)
tensors.

Built from a :class:`~pflkit.config.DataConfig`:

1. load the source (official train set, official test set when it has one);
2. optionally keep a random ``subset`` of the training set;
3. partition the training set over ``num_clients`` clients (``data.partition``);
4. split each client's samples at random into local train / local test
   (``test_fraction`` of them, at least one, go to test) and, with ``val_fraction`` > 0, local
   validation (``val_fraction`` of them, at least one, drawn after the test part: the test split
   is the one the same config without validation gets), the rest to train. A partitioner with
   its own local test sets (``nway_kshot``: FedProto's ``test_shots`` per class from the
   official test set) replaces the local test part; ``test_fraction`` is then not used;
5. keep the official test set whole as the global test set (sources without one, e.g. FEMNIST
   or the MNIST-5k subset, use the union of the clients' local test splits, as LEAF does);
6. optionally draw a public set (``data.public``). From the task's own dataset, it is carved
   out of the training set *before* steps 2-4, so no client trains or tests on a public
   image (KT-pFL's "unlabeled open dataset carved out of Fashion-MNIST").

All randomness comes from ``data.seed``, so the partition does not change with the training
seed: ``pflkit compare`` runs every seed on the same partition. Steps 2-4 are cached on disk,
keyed by a hash of every parameter that affects them (:attr:`FederatedDataset.partition_id`).
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import zipfile
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from pflkit.config import DataConfig
from pflkit.data.partition import PARTITIONERS, class_table, delegated_version, partition
from pflkit.data.sources import check_data_root, default_data_root, load_source
from pflkit.errors import PflkitError
from pflkit.eval.tasks import get_task


@dataclass(init=False, repr=False, eq=False)
class ClientData:
    """One client's local splits: ``train_x``/``train_y``, ``test_x``/``test_y`` and
    ``val_x``/``val_y`` (None without ``data.val_fraction``).

    Two ways to hold them, the same to read:

    - ``ClientData(train_x, train_y, test_x, test_y, val_x=None, val_y=None)`` keeps the given
      tensors as they are (tests, toy clients, an algorithm's own sub-splits);
    - :meth:`indexed` (what :func:`build_federated` makes) keeps the dataset's shared tensors and
      the client's sample indices: every client references the same ``x``/``y`` tensors, so the
      data's memory does not grow with the client count (one index array per client, 8 bytes a
      sample). Each access to a split gathers its rows (``x[indices]``): a new tensor, equal bit
      for bit to a copy made at build time; nothing per client is kept in memory between
      accesses. Changing a gathered tensor in place changes no client.

    ``vars(client)`` holds only tensors (the index arrays and split sizes are slots), so code that
    walks a client's tensors, e.g. to check their device, sees just the data.
    """

    # Fields only so that dataclasses.replace(client, train_x=..., train_y=...) works: it reads
    # the other splits through the properties set below and builds a client from tensors. The
    # train and test splits always exist (the constructor requires them): typed as tensors.
    train_x: Tensor = None  # type: ignore[assignment]
    train_y: Tensor = None  # type: ignore[assignment]
    test_x: Tensor = None  # type: ignore[assignment]
    test_y: Tensor = None  # type: ignore[assignment]
    val_x: Tensor | None = None
    val_y: Tensor | None = None

    __slots__ = ("__dict__", "_idx", "_n_train", "_n_val")

    def __init__(
        self,
        train_x: Tensor,
        train_y: Tensor,
        test_x: Tensor,
        test_y: Tensor,
        val_x: Tensor | None = None,
        val_y: Tensor | None = None,
    ) -> None:
        self._idx, self._n_train, self._n_val = None, 0, 0
        self._x, self._y, self._tx, self._ty = train_x, train_y, test_x, test_y
        if val_x is not None or val_y is not None:
            self._vx, self._vy = val_x, val_y

    @classmethod
    def indexed(
        cls,
        x: Tensor,
        y: Tensor,
        train: np.ndarray,
        test: np.ndarray,
        val: np.ndarray | None = None,
        test_x: Tensor | None = None,
        test_y: Tensor | None = None,
    ) -> ClientData:
        """A client whose splits are rows of shared tensors: ``train`` and ``val`` index
        ``x``/``y``, ``test`` indexes ``test_x``/``test_y`` (default: ``x``/``y``)."""
        self = cls.__new__(cls)
        val = np.empty(0, dtype=np.int64) if val is None else val
        self._idx = np.concatenate([train, val, test]).astype(np.int64, copy=False)
        self._n_train, self._n_val = len(train), len(val)
        self._x, self._y = x, y
        self._tx, self._ty = (x, y) if test_x is None else (test_x, test_y)
        return self

    @property
    def has_val(self) -> bool:
        """Whether the client has a validation split."""
        if self._idx is not None:
            return self._n_val > 0
        return self.__dict__.get("_vy") is not None

    @property
    def is_indexed(self) -> bool:
        return self._idx is not None

    def indices(self, split: str) -> np.ndarray:
        """The split's row indices into its shared tensors (an indexed client only)."""
        assert self._idx is not None, "a client built from tensors has no indices"
        a, b = self._n_train, self._n_train + self._n_val
        return {"train": self._idx[:a], "val": self._idx[a:b], "test": self._idx[b:]}[split]

    def source(self, split: str) -> tuple[Tensor, Tensor]:
        """The shared (x, y) tensors a split's indices point into (an indexed client only)."""
        return (self._tx, self._ty) if split == "test" else (self._x, self._y)

    def size(self, split: str) -> int:
        """Number of samples in ``split`` without gathering them (0: no such split)."""
        if self._idx is not None:
            return len(self.indices(split))
        t = getattr(self, f"{split}_y")
        return 0 if t is None else len(t)

    def _gather(self, split: str, axis: int) -> Tensor | None:
        if self._idx is None:
            key = {"train": ("_x", "_y"), "test": ("_tx", "_ty"), "val": ("_vx", "_vy")}[split]
            return self.__dict__.get(key[axis])
        if split == "val" and self._n_val == 0:
            return None
        t = self.source(split)[axis]
        return t[torch.from_numpy(self.indices(split)).to(t.device)]

    def to(self, device: str | torch.device, memo: dict[int, Tensor] | None = None) -> ClientData:
        """The same client with its tensors on ``device``; ``memo`` (id -> moved tensor) moves a
        tensor that several clients share once."""
        memo = {} if memo is None else memo
        new = object.__new__(ClientData)
        new._idx, new._n_train, new._n_val = self._idx, self._n_train, self._n_val
        for k, t in vars(self).items():
            if t is not None and id(t) not in memo:
                memo[id(t)] = t.to(device)
            setattr(new, k, None if t is None else memo[id(t)])
        return new

    def __repr__(self) -> str:
        sizes = ", ".join(f"{s}={self.size(s)}" for s in ("train", "test", "val"))
        return f"ClientData({sizes}{', indexed' if self._idx is not None else ''})"


for _split in ("train", "test", "val"):
    for _axis, _name in enumerate(("x", "y")):
        setattr(
            ClientData,
            f"{_split}_{_name}",
            property(
                lambda self, s=_split, a=_axis: self._gather(s, a),
                doc=f"The client's {_split} {'inputs' if _axis == 0 else 'labels'} "
                "(gathered on access for an indexed client).",
            ),
        )
del _split, _axis, _name


@dataclass
class FederatedDataset:
    name: str
    clients: list[ClientData]
    test_x: Tensor  # global test set
    test_y: Tensor
    num_classes: int
    input_shape: tuple[int, ...]
    partition_id: str
    train_indices: list[np.ndarray]  # per client, into the source's training set
    # per client, into the training set, or into the official test set when the partitioner
    # builds the local test sets (nway_kshot)
    test_indices: list[np.ndarray]
    public_x: Tensor | None = None  # unlabelled public set, when configured
    # the public set's indices into its source's training set (disjoint from every client's
    # indices when the source is the task's own dataset)
    public_indices: np.ndarray | None = None
    class_names: list[str] | None = None  # the source's names of the classes, when it has them
    val_indices: list[np.ndarray] | None = None  # per client, when data.val_fraction > 0
    task: str = "classification"  # the source's task (pflkit.eval.tasks)

    @property
    def num_clients(self) -> int:
        return len(self.clients)

    @property
    def has_val(self) -> bool:
        """Whether every client has a local validation split (``data.val_fraction`` > 0)."""
        return bool(self.clients) and all(c.has_val for c in self.clients)

    def to(self, device: str | torch.device) -> FederatedDataset:
        """The same dataset with every tensor on ``device`` (itself when they already are):
        the engine moves the data once, before the first round. A tensor that several clients
        (or the global test set) share is moved once and stays shared."""
        if self.test_x.device == torch.device(device):
            return self
        memo: dict[int, Tensor] = {}

        def move(t: Tensor) -> Tensor:
            if id(t) not in memo:
                memo[id(t)] = t.to(device)
            return memo[id(t)]

        moved = {"test_x": move(self.test_x), "test_y": move(self.test_y)}
        clients = [c.to(device, memo) for c in self.clients]
        public = None if self.public_x is None else move(self.public_x)
        return replace(self, clients=clients, public_x=public, **moved)

    def split_labels(self, split: str) -> tuple[np.ndarray, list[int]]:
        """Every client's ``split`` labels, concatenated in client order, and the per-client
        counts (one gather when the clients share their tensors)."""
        cs = self.clients
        first = cs[0] if cs else None
        if first is not None and all(
            c.is_indexed and c.source(split)[1] is first.source(split)[1] for c in cs
        ):
            parts = [c.indices(split) for c in cs]
            y = first.source(split)[1]
            flat = np.concatenate(parts) if parts else np.empty(0, dtype=np.int64)
            return y[torch.from_numpy(flat).to(y.device)].cpu().numpy(), [len(p) for p in parts]
        ys = [getattr(c, f"{split}_y") for c in cs]
        ys = [y if y is not None else torch.empty(0, dtype=torch.int64) for y in ys]
        labels = torch.cat([y.cpu() for y in ys]).numpy() if ys else np.empty(0, np.int64)
        return labels, [len(y) for y in ys]

    def class_table(self, split: str = "train") -> np.ndarray:
        """[num_clients, num_classes] sample counts of the local ``train``, ``test`` or ``val``
        splits."""
        if split == "val" and not self.has_val:
            raise PflkitError("this dataset has no validation split: set data.val_fraction > 0")
        if self.task != "classification":
            raise PflkitError(
                f"dataset '{self.name}' is a {self.task} task, whose samples have no class: "
                "class tables exist for classification datasets only"
            )
        labels, counts = self.split_labels(split)
        ends = np.cumsum(counts, dtype=np.int64)
        parts = [np.arange(e - n, e) for e, n in zip(ends, counts, strict=True)]
        return class_table(labels, parts, self.num_classes)


def partition_key(
    cfg: DataConfig, seed: int, num_train: int, fingerprint: str | None = None
) -> str:
    """The partition cache's key: a hash of every setting the split depends on, the source's
    ``fingerprint`` when it has one, and the version of the library that draws a delegated
    partition (``flwr``: flwr-datasets)."""
    spec = {
        "dataset": cfg.dataset,
        "options": cfg.options,
        "subset": cfg.subset,
        "num_clients": cfg.num_clients,
        "partition": cfg.partition,
        "test_fraction": cfg.test_fraction,
        "seed": seed,
        "num_train": num_train,
        "version": 1,
    }
    if cfg.val_fraction > 0:  # only then: every partition id without validation stays as it was
        spec["val_fraction"] = cfg.val_fraction
    if _local_test(cfg) is not None:  # test indices point into the official test set
        spec["local_test"] = "official test set"
    if _carves_public(cfg):  # the public samples were taken out before partitioning
        spec["public_carved"] = cfg.public.size
    if fingerprint is not None:
        spec["fingerprint"] = fingerprint
    if (library := delegated_version(cfg.partition["name"])) is not None:
        spec["partitioner_library"] = library
    text = json.dumps(spec, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _carves_public(cfg: DataConfig) -> bool:
    """Whether the public set comes out of the task's own training set."""
    return cfg.public is not None and cfg.public.dataset == cfg.dataset


def _local_test(cfg: DataConfig):
    """The partitioner's own local-test builder (None: split test sets off the clients)."""
    info = PARTITIONERS.get(cfg.partition["name"])
    return info.local_test if info else None


def _split_clients(
    cfg: DataConfig,
    labels: np.ndarray,
    groups: np.ndarray | None,
    seed: int,
    test_labels: np.ndarray | None = None,
    exclude: np.ndarray | None = None,
) -> tuple[list[np.ndarray], list[np.ndarray], list[np.ndarray] | None]:
    """Per client: train, test and (``val_fraction`` > 0, else None) validation indices. Test
    indices point into the official test set (``test_labels``) when the partitioner builds
    the local test sets, else into the training set. ``exclude``: training samples no client
    gets (the carved-out public set)."""
    rng = np.random.default_rng([seed, 1])
    keep = (
        np.arange(len(labels)) if exclude is None else np.setdiff1d(np.arange(len(labels)), exclude)
    )
    if cfg.subset is not None and cfg.subset < len(keep):
        keep = keep[np.sort(rng.choice(len(keep), cfg.subset, replace=False))]
    params = {k: v for k, v in cfg.partition.items() if k != "name"}
    if "groups" in params:  # partition() takes them from the source, as its own argument
        raise PflkitError(
            f"partitioner '{cfg.partition['name']}' takes its groups from the dataset's natural "
            "owners, not from its parameters: remove 'groups' from data.partition"
        )
    parts = partition(
        cfg.partition["name"],
        labels[keep],
        cfg.num_clients,
        seed,
        groups=None if groups is None else groups[keep],
        **params,
    )
    own_tests = None
    if (local_test := _local_test(cfg)) is not None:
        own_tests = local_test(labels[keep], parts, test_labels, **params)
    val = cfg.val_fraction > 0
    train_idx, test_idx, val_idx = [], [], []
    for cid, part in enumerate(parts):
        idx = keep[rng.permutation(part)]
        n_test = 0 if own_tests is not None else max(int(cfg.test_fraction * len(idx)), 1)
        n_val = max(int(cfg.val_fraction * len(idx)), 1) if val else 0
        if len(idx) - n_test - n_val < 1:
            split = "train/validation/test" if val else "train/test"
            raise PflkitError(
                f"client {cid} got {len(part)} sample(s) from partitioner "
                f"'{cfg.partition['name']}', too few for a {split} split: use fewer clients "
                f"or a milder partition"
                + (", or lower data.test_fraction and data.val_fraction" if val else "")
            )
        test_idx.append(own_tests[cid] if own_tests is not None else np.sort(idx[:n_test]))
        val_idx.append(np.sort(idx[n_test : n_test + n_val]))
        train_idx.append(np.sort(idx[n_test + n_val :]))
    return train_idx, test_idx, val_idx if val else None


def _valid_split(
    tr: list, te: list, va: list | None, num_clients: int, num_samples: int, num_test: int | None
) -> bool:
    """A cached split is used only if it has the configured client count, every client a
    train and a test part (and a validation part when ``va`` is given), integer indices in
    range, and no sample twice. ``num_test``: the test parts index the official test set of
    that size (else the training set, with the other parts)."""
    if va is not None and len(va) != num_clients:
        return False
    if len(tr) != num_clients or len(te) != num_clients:
        return False

    def distinct_in_range(parts: list, n: int) -> bool:
        if not parts:
            return True
        sizes = np.fromiter((len(p) for p in parts), dtype=np.int64, count=len(parts))
        if sizes.min() == 0 or any(p.dtype.kind not in "iu" for p in parts):
            return False
        flat = np.concatenate(parts)
        if flat.min() < 0 or flat.max() >= n:
            return False
        seen = np.bincount(flat.astype(np.int64), minlength=n)  # O(n), no sort
        return bool(seen.max() <= 1)

    if num_test is None:
        return distinct_in_range([*tr, *te, *(va or [])], num_samples)
    return distinct_in_range([*tr, *(va or [])], num_samples) and distinct_in_range(te, num_test)


def _digest(arrays: dict[str, np.ndarray]) -> str:
    """sha256 of a partition cache's arrays (names, dtypes, shapes and bytes, in name order)."""
    h = hashlib.sha256()
    for name in sorted(arrays):
        a = np.ascontiguousarray(arrays[name])
        h.update(f"{name}:{a.dtype.str}:{a.shape};".encode())
        h.update(a.tobytes())
    return h.hexdigest()


# Up to this many clients a cache file holds one array per client and split (``tr{i}``,
# ``te{i}``, ``va{i}``); above it, one concatenated array per split and the per-client sizes
# (``tr``/``tr_sizes``, ...): a zip member per client makes 100,000 clients' file take seconds
# to write and many more to read. Both layouts are read.
PER_CLIENT_CACHE_MAX = 1000


def _pack(parts: list[np.ndarray], prefix: str, flat: bool) -> dict[str, np.ndarray]:
    if not flat:
        return {f"{prefix}{i}": a for i, a in enumerate(parts)}
    sizes = np.array([len(a) for a in parts], dtype=np.int64)
    joined = np.concatenate(parts) if parts else np.empty(0, dtype=np.int64)
    return {prefix: joined, f"{prefix}_sizes": sizes}


def _unpack(arrays: dict[str, np.ndarray], prefix: str, n: int) -> list[np.ndarray]:
    if prefix in arrays:
        sizes = arrays[f"{prefix}_sizes"]
        if sizes.ndim != 1 or len(sizes) != n or sizes.sum() != len(arrays[prefix]):
            raise ValueError("sizes do not match the concatenated indices")
        return np.split(arrays[prefix], np.cumsum(sizes)[:-1]) if n else []
    return [arrays[f"{prefix}{i}"] for i in range(n)]


def _cached_split(
    cfg,
    labels,
    groups,
    seed,
    cache_dir: Path | None,
    test_labels=None,
    exclude=None,
    fingerprint: str | None = None,
):
    """(partition id, train, test, validation indices or None), from the cache when it holds
    a valid split (a file without validation arrays is no split with validation).
    ``test_labels``: the official test labels, given when the partitioner builds the local
    test sets (their indices then point into the test set)."""
    num_test = None if test_labels is None else len(test_labels)
    key = partition_key(cfg, seed, len(labels), fingerprint)
    path = cache_dir / f"{key}.npz" if cache_dir else None
    if path and path.exists():
        try:
            with np.load(path) as z:
                arrays = {k: z[k] for k in z.files if k != "sha256"}
                stored = str(z["sha256"])  # a cache from before checksums: rebuilt (KeyError)
            if stored != _digest(arrays):
                raise PflkitError(
                    f"partition cache '{path}' fails its checksum (its content changed after "
                    "pflkit wrote it): delete it and pflkit rebuilds it"
                )
            n = int(arrays["num_clients"])
            tr, te = _unpack(arrays, "tr", n), _unpack(arrays, "te", n)
            va = _unpack(arrays, "va", n) if cfg.val_fraction > 0 else None
            if _valid_split(tr, te, va, cfg.num_clients, len(labels), num_test):
                return key, tr, te, va
        except (OSError, KeyError, ValueError, EOFError, zipfile.BadZipFile):
            pass  # unreadable (truncated, say) or wrong cache entry: recompute and overwrite it
    train_idx, test_idx, val_idx = _split_clients(cfg, labels, groups, seed, test_labels, exclude)
    if path:
        flat = len(train_idx) > PER_CLIENT_CACHE_MAX
        arrays = {"num_clients": np.asarray(len(train_idx))}
        arrays |= _pack(train_idx, "tr", flat) | _pack(test_idx, "te", flat)
        if val_idx is not None:
            arrays |= _pack(val_idx, "va", flat)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".npz")
            with os.fdopen(fd, "wb") as f:
                np.savez(f, sha256=_digest(arrays), **arrays)
            os.replace(tmp, path)
        except OSError:
            pass  # caching is an optimisation; a read-only data dir must not fail the run
    return key, train_idx, test_idx, val_idx


def build_federated(cfg: DataConfig) -> FederatedDataset:
    """Load, partition and split ``cfg.dataset`` (deterministic in ``cfg``, seed included)."""
    seed = cfg.seed
    root = check_data_root(Path(cfg.root).expanduser()) if cfg.root else default_data_root()
    src = load_source(cfg.dataset, root, download=cfg.download, **cfg.options)
    task = get_task(src.task)
    task.check_partition(cfg.partition["name"], cfg.dataset)
    labels = task.partition_labels(src.train_y.numpy())
    official = _local_test(cfg) is not None
    if official and src.test_y is None:
        raise PflkitError(
            f"partitioner '{cfg.partition['name']}' draws each client's test set from the "
            f"official test set, which '{cfg.dataset}' does not have: use a dataset with one "
            "(e.g. fashion_mnist, mnist, cifar10)"
        )
    public_src, public_idx = None, None
    if cfg.public is not None:
        own = _carves_public(cfg)
        public_src = src if own else load_source(cfg.public.dataset, root, download=cfg.download)
        public_idx = _public_indices(cfg, public_src, src, seed)
    carved = public_idx if public_src is src else None
    available = len(labels) - (0 if carved is None else len(carved))
    if cfg.subset is not None and cfg.subset > available:
        after = "" if carved is None else f" left after the {len(carved)}-sample public set"
        raise PflkitError(
            f"data.subset {cfg.subset} exceeds the {available} training samples of "
            f"'{cfg.dataset}'{after}: set data.subset <= {available}, or remove it to use them all"
        )
    cache_dir = root / "partitions" if cfg.cache else None
    key, train_idx, test_idx, val_idx = _cached_split(
        cfg,
        labels,
        src.train_groups,
        seed,
        cache_dir,
        src.test_y.numpy() if official else None,
        public_idx if public_src is src else None,
        src.fingerprint,
    )

    clients, test_x, test_y = _clients(src, train_idx, test_idx, val_idx, official)
    return FederatedDataset(
        name=cfg.dataset,
        clients=clients,
        test_x=test_x,
        test_y=test_y,
        num_classes=src.num_classes,
        input_shape=tuple(src.train_x.shape[1:]),
        partition_id=key,
        train_indices=train_idx,
        test_indices=test_idx,
        public_x=None if public_src is None else public_src.train_x[public_idx],
        public_indices=public_idx,
        class_names=src.class_names,
        val_indices=val_idx,
        task=src.task,
    )


def _clients(src, train_idx, test_idx, val_idx, official: bool):
    """(clients, global test x, y): every client indexes the source's own tensors, with no
    copy (the source stays in memory anyway: :func:`~pflkit.data.sources.load_source` caches
    it in-process)."""
    x, y = src.train_x, src.train_y
    val_idx = val_idx if val_idx is not None else [None] * len(train_idx)
    tx, ty = (src.test_x, src.test_y) if official else (None, None)
    clients = [
        ClientData.indexed(x, y, tr, te, va, tx, ty)
        for tr, te, va in zip(train_idx, test_idx, val_idx, strict=True)
    ]
    if src.test_x is not None:
        return clients, src.test_x, src.test_y
    # no official test set: the union of the local test splits, in client order
    rows = torch.from_numpy(np.concatenate(test_idx).astype(np.int64))
    return clients, x[rows], y[rows]


def _public_indices(cfg: DataConfig, src, task, seed: int) -> np.ndarray:
    """The public set's sorted indices into ``src``'s training set, after checking ``src``
    against the ``task`` source (class count, input shape, size)."""
    pub = cfg.public
    assert pub is not None
    num_classes, shape = task.num_classes, tuple(task.train_x.shape[1:])
    if src.num_classes != num_classes and not pub.allow_other_classes:
        raise PflkitError(
            f"public set '{pub.dataset}' has {src.num_classes} classes but the task "
            f"'{cfg.dataset}' has {num_classes}: choose a public set with {num_classes} classes, "
            f"or set data.public.allow_other_classes: true if its labels are not used"
        )
    if tuple(src.train_x.shape[1:]) != shape:
        raise PflkitError(
            f"public set '{pub.dataset}' has inputs of shape {tuple(src.train_x.shape[1:])} but "
            f"'{cfg.dataset}' has {shape}: choose a public set with the same input shape"
        )
    if pub.size > len(src.train_x):
        raise PflkitError(
            f"public set size {pub.size} exceeds the {len(src.train_x)} samples of "
            f"'{pub.dataset}': set data.public.size <= {len(src.train_x)}"
        )
    idx = np.random.default_rng([seed, 2]).choice(len(src.train_x), pub.size, replace=False)
    return np.sort(idx)
