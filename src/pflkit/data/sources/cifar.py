"""CIFAR-10, CIFAR-100 and CINIC-10, read from their official files.

``cifar10`` / ``cifar100``
    The python versions of the releases: ``cifar-10-python.tar.gz`` (``data_batch_1``..``5``,
    ``test_batch``) and ``cifar-100-python.tar.gz`` (``train``, ``test``; the 100 fine labels),
    read from the extracted ``cifar-10-batches-py/`` / ``cifar-100-python/`` folder (or the
    batches in ``<root>/<name>/`` itself), else straight from the tarball (downloaded when
    missing). The pickled batches are read with an unpickler that builds only NumPy arrays and
    plain containers.
``cinic10``
    The ``train/`` and ``test/`` folders of ``CINIC-10.tar.gz`` (one folder of PNG files per
    CIFAR-10 class; ``valid/`` is extracted but unused), extracted from the archive when missing
    (the archive is downloaded when missing, and then removed after extraction). PNGs are
    decoded with Pillow, or matplotlib when Pillow is missing.

Pixels become float32 ``[N, 3, 32, 32]`` normalised per channel with the training set's mean and
std (CINIC-10: from the CINIC-10 README), recorded in ``Source.mean``/``Source.std``.
"""

from __future__ import annotations

import importlib.util
import io
import os
import pickle
import shutil
import tarfile
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
    SourceInfo,
    _corrupt,
    _decode_images,
    _labels,
    _missing,
    _opt_mirrors,
    _read_maybe_gz,
    _rgb_to_tensor,
)
from pflkit.errors import PflkitError

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


ENTRIES: list[SourceInfo] = [
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
]
