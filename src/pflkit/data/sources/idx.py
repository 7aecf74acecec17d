"""MNIST-format IDX sources: Fashion-MNIST, MNIST and EMNIST, read from their official files.

``fashion_mnist``
    The four IDX files of zalandoresearch/fashion-mnist (``train-images-idx3-ubyte``,
    ``train-labels-idx1-ubyte``, ``t10k-images-idx3-ubyte``, ``t10k-labels-idx1-ubyte``, raw or
    ``.gz``) in ``<root>/fashion_mnist/``, else where Debian's ``dataset-fashion-mnist`` package
    installs them (:data:`SYSTEM_DIRS`); the ``.gz`` files are downloaded when missing. With
    ``verify`` (default) each file's decompressed content is checked against the SHA-256 of
    the official content (the Debian package re-compresses the ``.gz``).
``mnist``
    The same four files of MNIST in ``<root>/mnist/``, downloaded when missing; with ``verify``
    the ``.gz`` files are checked against their MD5, and a Fashion-MNIST file found where
    MNIST's is expected is named as such.
``emnist``
    NIST's EMNIST files ``emnist-<split>-{train,test}-{images-idx3,labels-idx1}-ubyte`` (raw or
    ``.gz``) in ``<root>/emnist/`` or its ``gzip/``, else extracted from the release's
    ``gzip.zip`` (downloaded when missing, and then removed after extraction). Option
    ``split``: byclass (62 classes), bymerge/balanced (47), letters (26; labels 1..26 become
    0..25), digits (10, default), mnist (10). The images are stored transposed and are
    transposed back.

Every IDX file's header (magic number, element type, dimensions, size) is checked; pixels become
float32 ``[N, 1, 28, 28]`` mapped with ``(x/255 - 0.5)/0.5`` to [-1, 1].
"""

from __future__ import annotations

import hashlib
import math
import os
import shutil
import string
import struct
import zipfile
import zlib
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from pflkit.data import download as dl
from pflkit.data.base import (
    _FEMNIST_CLASSES,
    DIGIT_CLASSES,
    Source,
    SourceInfo,
    _corrupt,
    _gray_to_tensor,
    _labels,
    _missing,
    _opt_bool,
    _opt_mirrors,
    _read_maybe_gz,
)
from pflkit.errors import PflkitError

# Other places a source's files may already be installed (checked after <root>/<name>/).
SYSTEM_DIRS: dict[str, list[Path]] = {
    "fashion_mnist": [Path("/usr/share/datasets/fashion-mnist")],
}

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
_EMNIST_MERGED = list(string.digits + string.ascii_uppercase + "abdefghnqrt")
EMNIST_SPLITS: dict[str, list[str]] = {
    "byclass": _FEMNIST_CLASSES,
    "bymerge": _EMNIST_MERGED,
    "balanced": _EMNIST_MERGED,
    "letters": list(string.ascii_lowercase),  # official labels 1..26, shifted to 0..25
    "digits": DIGIT_CLASSES,
    "mnist": DIGIT_CLASSES,
}


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


# --------------------------------------------------------------------------------------------
# Loaders
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


ENTRIES: list[SourceInfo] = [
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
]
