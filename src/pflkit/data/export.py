"""Write a config's exact federated split to disk for other libraries (``pflkit export``).

:func:`export_partition` builds the split with :func:`~pflkit.data.federated.build_federated`
(the one source of truth: the same partition id, clients, samples and tensors a run trains on)
and writes it in one of three layouts under ``<out>/<name>/``:

``pfllib``
    PFLlib's dataset folder: ``train/<i>.npz`` and ``test/<i>.npz``, each holding one pickled
    dict ``{"x": float32 [N, ...], "y": int64 [N]}`` under the key ``data`` (what PFLlib's
    ``read_data`` loads), and ``config.json`` with PFLlib's keys plus pflkit's. ``x`` is the
    tensor pflkit trains on, value for value. PFLlib has no local validation split: a client's
    validation samples (``data.val_fraction`` > 0) are left out, and ``config.json`` says so.
``flbench``
    FL-bench's dataset folder (``data/<dataset>/`` of an FL-bench checkout): the dataset's raw
    files as torchvision reads them (IDX, uint8, official train set then official test set,
    which FL-bench concatenates), ``partition.pkl`` with each client's ``train`` / ``val`` /
    ``test`` index arrays into that concatenation, ``args.json`` and ``all_stats.json`` as
    FL-bench's ``generate_data.py`` writes them, and ``pflkit.json`` (partition id, index
    mapping, normalisation). Fashion-MNIST and MNIST only.
``npz``
    A plain layout: ``clients/<i>.npz`` (``train_x``, ``train_y``, ``train_idx``, ``val_*``,
    ``test_*``), ``global_test.npz`` (``x``, ``y``, ``idx``), ``public.npz`` (``x``, ``idx``;
    with ``data.public``) and ``partition.json`` (what every array and index means).

The folder is written under a temporary sibling name and renamed at the end, so a failed or
interrupted export leaves nothing half-written; an existing non-empty ``<out>/<name>`` is
refused unless ``force`` is given. docs/guide.md ("Exporting a partition") documents every
file.
"""

from __future__ import annotations

import json
import os
import pickle
import re
import shutil
import struct
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pflkit.config import DataConfig, ExperimentConfig
from pflkit.data.base import Source, _gray_to_tensor
from pflkit.data.federated import FederatedDataset, build_federated
from pflkit.data.partition import PARTITIONERS
from pflkit.data.sources import default_data_root, load_source
from pflkit.errors import PflkitError

__all__ = ["FLBENCH_DATASETS", "FORMATS", "export_partition"]

FORMATS = ("pfllib", "flbench", "npz")

# pflkit dataset -> (FL-bench's dataset name, the torchvision class folder its class reads)
FLBENCH_DATASETS: dict[str, tuple[str, str]] = {
    "fashion_mnist": ("fmnist", "FashionMNIST"),
    "mnist": ("mnist", "MNIST"),
}
# the four files torchvision's MNIST-style classes read from <root>/<Class>/raw/
_IDX_FILES = {
    "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}
# PFLlib parses a dataset whose name contains one of these as text (token, length) pairs
_PFLLIB_TEXT_NAMES = ("News", "Shakespeare")
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+=-]*")

_VALIDATION_LEFT_OUT = (
    "left out: PFLlib has no local validation split, so the {n} validation samples of "
    "data.val_fraction = {f} are in no file (train and test are exactly pflkit's)"
)


def export_partition(
    cfg: ExperimentConfig | DataConfig,
    fmt: str,
    out: str | Path,
    name: str | None = None,
    force: bool = False,
) -> Path:
    """Write ``cfg``'s federated split in format ``fmt`` (``pfllib``, ``flbench`` or ``npz``)
    into ``<out>/<name>/`` and return that folder.

    ``name`` defaults to ``<dataset>-<partition id>-<fmt>`` (``pfllib``, ``npz``) or
    FL-bench's name of the dataset (``flbench``: ``fmnist``, ``mnist``; FL-bench reads
    ``data/<that name>/``).
    An existing non-empty ``<out>/<name>`` is refused unless ``force`` (then it is replaced,
    only once the new folder is complete). Every mistake (unknown format, unsupported
    dataset, bad name or folder) raises :class:`PflkitError` before anything is written.
    """
    data_cfg = cfg.data if isinstance(cfg, ExperimentConfig) else cfg
    if not isinstance(data_cfg, DataConfig):
        raise PflkitError(
            f"export_partition needs an ExperimentConfig or DataConfig, got "
            f"{type(cfg).__name__}: load one with pflkit.load_config(path)"
        )
    if fmt not in FORMATS:
        raise PflkitError(f"unknown export format {fmt!r}: use one of {', '.join(FORMATS)}")
    if fmt == "flbench" and data_cfg.dataset not in FLBENCH_DATASETS:
        raise PflkitError(
            f"the flbench format supports the datasets {' and '.join(FLBENCH_DATASETS)} "
            f"(FL-bench reads their raw files), not '{data_cfg.dataset}': use --format pfllib "
            "or --format npz for it"
        )
    if name is not None:
        _check_name(name, fmt)
    elif fmt == "flbench":
        name = FLBENCH_DATASETS[data_cfg.dataset][0]
    out = Path(out)
    _check_out(out)
    if name is not None:
        _check_target(out / name, force)

    data = build_federated(data_cfg)
    if name is None:  # named by the partition id, known now
        name = f"{data_cfg.dataset}-{data.partition_id}-{fmt}"
        _check_target(out / name, force)
    src = _source(data_cfg)
    writer: Callable[..., None] = {
        "pfllib": _write_pfllib,
        "flbench": _write_flbench,
        "npz": _write_npz,
    }[fmt]
    return _write_folder(out, name, force, lambda d: writer(d, data, src, cfg, data_cfg))


# --------------------------------------------------------------------------------------------
# checks and the atomic folder
# --------------------------------------------------------------------------------------------


def _check_name(name: str, fmt: str) -> None:
    if not _NAME.fullmatch(name):
        shown = name if name.isprintable() else repr(name)[1:-1]
        raise PflkitError(
            f"invalid --name '{shown}': give one folder name of letters, digits and . _ + = - "
            "(not starting with a dot), e.g. fmnist-dir01"
        )
    if fmt == "pfllib" and any(w in name for w in _PFLLIB_TEXT_NAMES):
        raise PflkitError(
            f"--name '{name}' contains '{next(w for w in _PFLLIB_TEXT_NAMES if w in name)}', "
            "which makes PFLlib parse the files as text token pairs: choose a name without "
            f"{' or '.join(_PFLLIB_TEXT_NAMES)}"
        )


def _check_out(out: Path) -> None:
    """``out`` is a writable folder, or can be created (checked before any work)."""
    probe = out
    try:
        while not probe.exists():
            if probe.parent == probe:
                break
            probe = probe.parent
        is_dir = probe.is_dir()
    except OSError as err:  # e.g. a name longer than the file system allows
        raise PflkitError(
            f"--out '{out}' is not a usable path ({err.strerror}): choose another --out"
        ) from None
    if not is_dir:
        where = f"'{out}'" if probe == out else f"'{out}' lies under '{probe}', which"
        raise PflkitError(f"--out {where} is a file, not a folder: choose another --out")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise PflkitError(
            f"--out '{out}' is not writable (no permission to write in '{probe}'): choose "
            "another --out"
        )


def _check_target(target: Path, force: bool) -> None:
    if target.is_symlink() or (target.exists() and not target.is_dir()):
        raise PflkitError(
            f"'{target}' exists and is not a folder: remove it, or choose another --name or --out"
        )
    if target.is_dir() and any(target.iterdir()) and not force:
        raise PflkitError(
            f"'{target}' already exists and is not empty: choose another --name or --out, or "
            "replace it with --force"
        )


def _write_folder(out: Path, name: str, force: bool, fill: Callable[[Path], None]) -> Path:
    """Fill a temporary sibling of ``out/name`` and rename it into place: a failure or an
    interrupt removes the temporary folder and leaves ``out/name`` as it was."""
    target = out / name
    created = None  # the topmost folder this export creates (removed again on failure)
    for folder in (out, *out.parents):
        if folder.exists():
            break
        created = folder
    try:
        out.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{name}.tmp-", dir=out))
        umask = os.umask(0)
        os.umask(umask)
        tmp.chmod(0o777 & ~umask)  # mkdtemp makes it private; the export is a normal folder
    except OSError as err:
        if created is not None:
            shutil.rmtree(created, ignore_errors=True)
        raise PflkitError(
            f"cannot write into --out '{out}' ({err.strerror or err}): choose another --out"
        ) from None
    old: Path | None = None
    try:
        fill(tmp)
        if target.is_dir() and any(target.iterdir()):  # --force (checked before)
            old = Path(tempfile.mkdtemp(prefix=f".{name}.old-", dir=out))
            os.replace(target, old)
        elif target.is_dir():
            target.rmdir()
        os.replace(tmp, target)
    except BaseException as err:
        if old is not None and not target.exists():
            os.replace(old, target)
            old = None
        shutil.rmtree(tmp, ignore_errors=True)
        if created is not None:
            shutil.rmtree(created, ignore_errors=True)
        if isinstance(err, OSError):
            raise PflkitError(
                f"writing the export into '{out}' failed ({err.strerror or err}): free some "
                "space or choose another --out"
            ) from None
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    return target


# --------------------------------------------------------------------------------------------
# shared facts
# --------------------------------------------------------------------------------------------


def _source(cfg: DataConfig) -> Source:
    """The source ``build_federated`` split (in-process cached: the same tensors)."""
    root = Path(cfg.root) if cfg.root else default_data_root()
    return load_source(cfg.dataset, root, download=cfg.download, **cfg.options)


def _official_local_test(cfg: DataConfig) -> bool:
    """Whether the clients' test indices point into the official test set (``nway_kshot``)."""
    info = PARTITIONERS.get(cfg.partition["name"])
    return bool(info and info.local_test is not None)


def _index_meaning(cfg: DataConfig) -> dict[str, str]:
    train = (
        "the source's training set, as loaded (data.subset and a carved-out data.public do not "
        "renumber it)"
    )
    test = "the official test set" if _official_local_test(cfg) else train
    return {"train_idx": train, "val_idx": train, "test_idx": test}


def _numpy(t: torch.Tensor | None) -> np.ndarray:
    assert t is not None
    return np.ascontiguousarray(t.detach().cpu().numpy())


def _partition_params(cfg: DataConfig) -> dict[str, Any]:
    return {k: v for k, v in cfg.partition.items() if k != "name"}


def _json(path: Path, obj: Any) -> None:
    path.write_text(_dumps(obj) + "\n")


def _dumps(obj: Any, level: int = 0) -> str:
    """JSON, indented by level, with every list of plain values on one line (class tables
    stay one row per client)."""
    pad, inner = "  " * level, "  " * (level + 1)
    if isinstance(obj, dict) and obj:
        items = (f"{inner}{json.dumps(str(k))}: {_dumps(v, level + 1)}" for k, v in obj.items())
        return "{\n" + ",\n".join(items) + f"\n{pad}}}"
    if isinstance(obj, list | tuple) and any(isinstance(v, dict | list | tuple) for v in obj):
        return "[\n" + ",\n".join(f"{inner}{_dumps(v, level + 1)}" for v in obj) + f"\n{pad}]"
    return json.dumps(obj)


def _version() -> str:
    from pflkit import __version__

    return __version__


def _val_count(data: FederatedDataset) -> int:
    return sum(len(c.val_y) for c in data.clients if c.val_y is not None)


# --------------------------------------------------------------------------------------------
# pfllib
# --------------------------------------------------------------------------------------------


def _write_pfllib(
    folder: Path, data: FederatedDataset, src: Source, cfg: Any, data_cfg: DataConfig
) -> None:
    for split in ("train", "test"):
        (folder / split).mkdir()
        for i, c in enumerate(data.clients):
            x, y = getattr(c, f"{split}_x"), getattr(c, f"{split}_y")
            payload = {"x": _numpy(x).astype(np.float32, copy=False), "y": _numpy(y)}
            with open(folder / split / f"{i}.npz", "wb") as f:
                np.savez_compressed(f, data=payload)

    part = data_cfg.partition["name"]
    sizes = [len(c.train_y) + len(c.test_y) for c in data.clients]
    table = data.class_table("train") + data.class_table("test")
    labels = [[[int(k), int(n)] for k, n in enumerate(row) if n > 0] for row in table.tolist()]
    config = {
        "num_clients": data.num_clients,
        "num_classes": data.num_classes,
        "non_iid": part != "iid",
        "balance": max(sizes) - min(sizes) <= 1,
        "partition": {"iid": None, "dirichlet": "dir", "pathological": "pat"}.get(part, part),
        "Size of samples for labels in clients": labels,
        "alpha": data_cfg.partition.get("alpha") if part == "dirichlet" else None,
        "batch_size": cfg.train.batch_size if isinstance(cfg, ExperimentConfig) else None,
        # pflkit's own keys
        "partition_id": data.partition_id,
        "pflkit_version": _version(),
        "pflkit_data": data_cfg.model_dump(mode="json"),
        "pflkit_partition": {"name": part, **_partition_params(data_cfg)},
        "num_samples": {
            "train": [len(c.train_y) for c in data.clients],
            "test": [len(c.test_y) for c in data.clients],
        },
        "test_samples": (
            "each client's test file holds its local test split from the official test set "
            "(the partitioner's own)"
            if _official_local_test(data_cfg)
            else f"each client's test file holds its local test split (data.test_fraction = "
            f"{data_cfg.test_fraction} of its samples)"
        ),
        "validation": (
            _VALIDATION_LEFT_OUT.format(n=_val_count(data), f=data_cfg.val_fraction)
            if data.has_val
            else "none (data.val_fraction = 0)"
        ),
        "global_test": "not exported: PFLlib evaluates on the union of the clients' test files",
        "inputs": "x is the float32 tensor pflkit trains on, unchanged (pflkit's normalisation)",
    }
    _json(folder / "config.json", config)


# --------------------------------------------------------------------------------------------
# flbench
# --------------------------------------------------------------------------------------------


def _idx_bytes(array: np.ndarray) -> bytes:
    """An IDX file of unsigned bytes (magic 0x0000 08 <ndim>, big-endian dimensions)."""
    header = bytes([0, 0, 0x08, array.ndim]) + struct.pack(f">{array.ndim}I", *array.shape)
    return header + np.ascontiguousarray(array, dtype=np.uint8).tobytes()


def _to_uint8(x: torch.Tensor, dataset: str, split: str) -> np.ndarray:
    """The uint8 [N, H, W] pixels pflkit mapped to ``x`` with (p/255 - 0.5)/0.5, checked to
    give back ``x`` exactly."""
    if x.ndim != 4 or x.shape[1] != 1:
        raise PflkitError(
            f"the {split} images of '{dataset}' have shape {tuple(x.shape[1:])}, not one "
            "grey channel: the flbench format cannot write them; use --format npz"
        )
    pixels = np.rint((_numpy(x)[:, 0].astype(np.float64) + 1.0) * 127.5)
    u8 = np.clip(pixels, 0, 255).astype(np.uint8)
    if not torch.equal(_gray_to_tensor(u8), x.cpu()):
        raise PflkitError(
            f"the {split} images of '{dataset}' are not 8-bit pixels mapped by pflkit's "
            "(p/255 - 0.5)/0.5, so they cannot be written as IDX bytes: use --format npz"
        )
    return u8


def _write_flbench(
    folder: Path, data: FederatedDataset, src: Source, cfg: Any, data_cfg: DataConfig
) -> None:
    fl_name, tv_class = FLBENCH_DATASETS[data_cfg.dataset]
    assert src.test_x is not None and src.test_y is not None
    n_train = src.num_train
    raw = folder / tv_class / "raw"
    raw.mkdir(parents=True)
    pixels = []
    for split, (x, y) in {
        "train": (src.train_x, src.train_y),
        "test": (src.test_x, src.test_y),
    }.items():
        images, labels = _IDX_FILES[split]
        pixels.append(_to_uint8(x, data_cfg.dataset, split))
        (raw / images).write_bytes(_idx_bytes(pixels[-1]))
        (raw / labels).write_bytes(_idx_bytes(_numpy(y).astype(np.uint8)))

    # FL-bench's dataset is train + test concatenated: official test sample j is n_train + j
    test_offset = n_train if _official_local_test(data_cfg) else 0
    all_x = np.concatenate(pixels)
    all_y = np.concatenate([_numpy(src.train_y), _numpy(src.test_y)])
    empty = np.zeros(0, dtype=np.int64)
    indices = []
    for i, c in enumerate(data.clients):
        entry = {
            "train": np.asarray(data.train_indices[i], dtype=np.int64),
            "val": np.asarray(data.val_indices[i], dtype=np.int64) if data.has_val else empty,
            "test": np.asarray(data.test_indices[i], dtype=np.int64) + test_offset,
        }
        for split, idx in entry.items():  # what FL-bench will read is what pflkit trains on
            x, y = getattr(c, f"{split}_x"), getattr(c, f"{split}_y")
            same_y = np.array_equal(all_y[idx], empty if y is None else _numpy(y))
            same_x = len(idx) == 0 or torch.equal(_gray_to_tensor(all_x[idx]), x.cpu())
            if not (same_x and same_y):
                raise RuntimeError(
                    f"internal error: FL-bench's {split} samples of client {i} differ"
                )
        indices.append(entry)
    k = data.num_clients
    partition = {
        "separation": {
            "train": list(range(k)),
            "val": list(range(k)),
            "test": list(range(k)),
            "total": k,
        },
        "data_indices": indices,
    }
    with open(folder / "partition.pkl", "wb") as f:
        pickle.dump(partition, f)

    stats: dict[str, Any] = {}
    for i, entry in enumerate(indices):
        ys = all_y[np.concatenate(list(entry.values()))]
        labels, counts = np.unique(ys, return_counts=True)
        stats[str(i)] = {
            "x": int(len(ys)),
            "y": {str(int(a)): int(b) for a, b in zip(labels, counts, strict=True)},
        }
    sizes = np.array([s["x"] for s in stats.values()], dtype=np.float64)
    stats["samples_per_client"] = {"mean": float(sizes.mean()), "stddev": float(sizes.std())}
    _json(folder / "all_stats.json", stats)

    part = data_cfg.partition["name"]
    params = _partition_params(data_cfg)
    args: dict[str, Any] = {
        "client_num": k,
        "test_ratio": None if _official_local_test(data_cfg) else data_cfg.test_fraction,
        "val_ratio": data_cfg.val_fraction,
        "seed": data_cfg.seed,
        "split": "sample",
        "IID_ratio": 1.0 if part == "iid" else 0.0,
    }
    suffix = f"{fl_name}-{k}clients-{int(args['IID_ratio'] * 100)}%IID"
    if part == "dirichlet":
        args["alpha"] = params.get("alpha")
        args["min_samples_per_client"] = params.get("min_size", 10)
        suffix += f"-Dir({params.get('alpha')})"
    elif part == "pathological":
        args["classes_per_client"] = params.get("classes_per_client")
        suffix += f"-{params.get('classes_per_client')}classes"
    elif part != "iid":
        suffix += f"-pflkit-{part}"
    args["monitor_window_name_suffix"] = f"{suffix}-seed{data_cfg.seed}"
    args["pflkit_partition_id"] = data.partition_id
    _json(folder / "args.json", args)

    _json(
        folder / "pflkit.json",
        {
            "partition_id": data.partition_id,
            "pflkit_version": _version(),
            "dataset": data_cfg.dataset,
            "flbench_dataset": fl_name,
            "num_clients": k,
            "num_classes": data.num_classes,
            "class_names": data.class_names,
            "pflkit_data": data_cfg.model_dump(mode="json"),
            "raw_files": f"{tv_class}/raw/: the official train set ({n_train} images) and test "
            f"set ({src.num_test}) as uint8 IDX, the pixels pflkit read",
            "indices": "partition.pkl's lists index FL-bench's concatenation of the train and "
            f"test files: pflkit's training-set index i is i, official test index j is "
            f"{n_train} + j",
            "global_test": {
                "pflkit": "the official test set",
                "flbench_indices": [n_train, n_train + src.num_test],
                "note": "FL-bench's server-side test pools the clients' test lists instead",
            },
            "validation": "FL-bench's 'val' lists hold pflkit's local validation splits"
            if data.has_val
            else "none: every 'val' list is empty (data.val_fraction = 0)",
            "normalisation": {
                "pflkit": "(p/255 - 0.5)/0.5",
                "flbench": "p/255, then its DATA_MEAN/DATA_STD for the dataset",
            },
        },
    )


# --------------------------------------------------------------------------------------------
# npz
# --------------------------------------------------------------------------------------------


def _write_npz(
    folder: Path, data: FederatedDataset, src: Source, cfg: Any, data_cfg: DataConfig
) -> None:
    clients = folder / "clients"
    clients.mkdir()
    shape = tuple(data.input_shape)
    for i, c in enumerate(data.clients):
        arrays = {
            "train_x": _numpy(c.train_x),
            "train_y": _numpy(c.train_y),
            "train_idx": np.asarray(data.train_indices[i], dtype=np.int64),
            "test_x": _numpy(c.test_x),
            "test_y": _numpy(c.test_y),
            "test_idx": np.asarray(data.test_indices[i], dtype=np.int64),
        }
        if data.has_val and data.val_indices is not None:
            arrays |= {
                "val_x": _numpy(c.val_x),
                "val_y": _numpy(c.val_y),
                "val_idx": np.asarray(data.val_indices[i], dtype=np.int64),
            }
        else:
            arrays |= {
                "val_x": np.zeros((0, *shape), dtype=arrays["train_x"].dtype),
                "val_y": np.zeros(0, dtype=arrays["train_y"].dtype),
                "val_idx": np.zeros(0, dtype=np.int64),
            }
        np.savez_compressed(clients / f"{i}.npz", **arrays)

    official = src.test_y is not None
    if official:
        test_idx = np.arange(len(data.test_y), dtype=np.int64)
        test_from = "the official test set (all of it)"
    else:  # the union of the clients' local test splits, in client order
        test_idx = np.concatenate(data.test_indices).astype(np.int64)
        test_from = (
            "the source's training set: the source has no official test set, so the global "
            "test set is the union of the clients' local test splits, in client order"
        )
    np.savez_compressed(
        folder / "global_test.npz", x=_numpy(data.test_x), y=_numpy(data.test_y), idx=test_idx
    )
    public = None
    if data.public_x is not None and data.public_indices is not None and data_cfg.public:
        np.savez_compressed(
            folder / "public.npz",
            x=_numpy(data.public_x),
            idx=np.asarray(data.public_indices, dtype=np.int64),
        )
        public = {
            "file": "public.npz",
            "dataset": data_cfg.public.dataset,
            "size": len(data.public_indices),
            "idx": f"into the training set of '{data_cfg.public.dataset}'",
        }

    splits = ["train", "test"] + (["val"] if data.has_val else [])
    info = {
        "format": "pflkit npz export",
        "pflkit_version": _version(),
        "partition_id": data.partition_id,
        "dataset": data_cfg.dataset,
        "num_clients": data.num_clients,
        "num_classes": data.num_classes,
        "class_names": data.class_names,
        "input_shape": list(shape),
        "x_dtype": str(_numpy(data.test_x).dtype),
        "has_val": data.has_val,
        "num_samples": {s: [len(getattr(c, f"{s}_y")) for c in data.clients] for s in splits},
        "class_tables": {s: data.class_table(s).tolist() for s in splits},
        "indices": _index_meaning(data_cfg),
        "global_test": {"file": "global_test.npz", "size": len(data.test_y), "idx": test_from},
        "public": public,
        "files": {
            "clients/<i>.npz": "train_x, train_y, train_idx, val_x, val_y, val_idx, test_x, "
            "test_y, test_idx (val_* empty without data.val_fraction)",
            "global_test.npz": "x, y, idx",
            "public.npz": "x, idx (only with data.public)",
        },
        "normalisation": _normalisation(src),
        "pflkit_data": data_cfg.model_dump(mode="json"),
    }
    _json(folder / "partition.json", info)


def _normalisation(src: Source) -> str:
    if src.mean is None or src.std is None:
        return "x is the float32 tensor pflkit trains on (see the dataset's loader)"
    return (
        f"x is the float32 tensor pflkit trains on: each pixel scaled to [0, 1], then per "
        f"channel (v - mean) / std with mean {list(src.mean)}, std {list(src.std)}"
    )
