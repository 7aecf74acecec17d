"""What every source loader shares: the :class:`Source` it returns, the :class:`SourceInfo`
that registers it, the checks of its options, the class-name tables and the helpers that read
its files (archives included) and turn them into tensors.

:mod:`pflkit.data.sources` (the registry, :func:`~pflkit.data.sources.load_source`) and its
family modules (:mod:`~pflkit.data.sources.idx`, :mod:`~pflkit.data.sources.cifar`, ...) build
on this module; it imports none of them.
"""

from __future__ import annotations

import gzip
import hashlib
import inspect
import math
import os
import shutil
import string
import zipfile
import zlib
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

import numpy as np
import torch

from pflkit.errors import PflkitError

# --------------------------------------------------------------------------------------------
# Public types
# --------------------------------------------------------------------------------------------


@dataclass
class Source:
    """A whole data set, preprocessed and ready to partition.

    Tensors are shared with the in-process cache: do not modify them in place.
    """

    name: str
    train_x: torch.Tensor  # float32 [N, C, H, W] (images) or [N, D] (vectors), [N, L] tokens
    train_y: torch.Tensor  # int64 [N] classes; [N, L] next tokens (task next_token)
    test_x: torch.Tensor | None  # official test set; None when the source has none
    test_y: torch.Tensor | None
    num_classes: int  # classes; for next_token the vocabulary size
    train_groups: np.ndarray | None = None  # natural owner (writer/user index) per train sample
    group_names: list[str] | None = None  # name of each group index (LEAF user id, ...)
    class_names: list[str] | None = None
    mean: tuple[float, ...] | None = None  # per-channel normalisation applied to the pixels
    std: tuple[float, ...] | None = None
    # what identifies the data when the name and options do not (a local folder whose content
    # may change: the hf source hashes its labels); part of the partition cache's key
    fingerprint: str | None = None
    # what the targets are and how predictions are scored: a name in pflkit.eval.tasks.TASKS
    # (classification, next_token)
    task: str = "classification"

    @property
    def input_shape(self) -> tuple[int, ...]:
        """Shape of one sample, e.g. (1, 28, 28) or (60,)."""
        return tuple(self.train_x.shape[1:])

    @property
    def num_train(self) -> int:
        return int(self.train_x.shape[0])

    @property
    def num_test(self) -> int:
        return 0 if self.test_x is None else int(self.test_x.shape[0])


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


# Class names shared by several families (digits: MNIST, EMNIST, mnist5k, digits; the 62
# characters: FEMNIST and EMNIST's byclass split).
DIGIT_CLASSES = list(string.digits)
_FEMNIST_CLASSES = list(string.digits + string.ascii_uppercase + string.ascii_lowercase)


# --------------------------------------------------------------------------------------------
# Option checks
# --------------------------------------------------------------------------------------------


def _opt_int(ds: str, key: str, value: Any, minimum: int) -> int:
    ok = isinstance(value, int | np.integer) and not isinstance(value, bool)
    if not ok and isinstance(value, float) and value.is_integer():
        value, ok = int(value), True
    if not ok or value < minimum:
        raise PflkitError(
            f"option '{key}' of dataset '{ds}' must be an integer >= {minimum}, got {value!r}"
        )
    return int(value)


def _opt_float(ds: str, key: str, value: Any, minimum: float) -> float:
    ok = isinstance(value, int | float | np.integer | np.floating) and not isinstance(value, bool)
    if not ok or not math.isfinite(float(value)) or float(value) < minimum:
        raise PflkitError(
            f"option '{key}' of dataset '{ds}' must be a number >= {minimum}, got {value!r}"
        )
    return float(value)


def _opt_bool(ds: str, key: str, value: Any) -> bool:
    if not isinstance(value, bool | np.bool_):
        raise PflkitError(f"option '{key}' of dataset '{ds}' must be true or false, got {value!r}")
    return bool(value)


def _opt_mirrors(ds: str, value: Any) -> tuple[str, ...] | None:
    if value is None:
        return None
    if isinstance(value, str):
        value = (value,)
    if not isinstance(value, Sequence) or not all(isinstance(v, str) and v for v in value):
        raise PflkitError(
            f"option 'mirrors' of dataset '{ds}' must be a URL or a list of URLs, got {value!r}"
        )
    return tuple(value)


# --------------------------------------------------------------------------------------------
# File helpers
# --------------------------------------------------------------------------------------------


def _corrupt(path: Path, reason: str) -> PflkitError:
    return PflkitError(
        f"file {path} is corrupt or truncated ({reason}); delete it and download or copy it again"
    )


def _read_maybe_gz(path: Path) -> bytes:
    """The bytes of ``path``, gunzipped when it ends in .gz."""
    try:
        if path.suffix == ".gz":
            with gzip.open(path, "rb") as f:
                return f.read()
        return path.read_bytes()
    except (PermissionError, IsADirectoryError, FileNotFoundError) as e:
        raise PflkitError(f"cannot read file {path} ({e.strerror}); check the path") from None
    except (OSError, EOFError, zlib.error) as e:
        raise _corrupt(path, f"{type(e).__name__}: {e}") from None


def _missing(what: str, directory: Path, files: Sequence[str], hint: str = "") -> PflkitError:
    return PflkitError(
        f"{what} files not found in {directory}; put {', '.join(files)} there{hint}, "
        "or allow downloads (download=True)"
    )


def _labels(values: np.ndarray | Sequence[int], path: Path, num_classes: int) -> torch.Tensor:
    y = np.asarray(values, dtype=np.int64)
    if y.size and (y.min() < 0 or y.max() >= num_classes):
        raise _corrupt(path, f"labels range {y.min()}..{y.max()}, expected 0..{num_classes - 1}")
    return torch.from_numpy(y)


def _decode_images(
    files: Sequence[Path],
    read: Callable[[Path], np.ndarray],
    side: int,
    kind: str,
    what: str,
    missing_hint: str,
) -> np.ndarray:
    """uint8 ``[N, 3, side, side]`` from the ``kind`` (PNG, JPEG) image files, each read by
    ``read`` (path -> uint8 ``[H, W, 3]``) in a thread pool (Pillow decodes without the GIL).
    A missing file, an undecodable one or one of another size is one clear error."""
    out = np.empty((len(files), side, side, 3), dtype=np.uint8)

    def one(i: int) -> None:
        path = files[i]
        try:
            a = read(path)
        except FileNotFoundError:
            raise PflkitError(f"{what} image {path} is missing; {missing_hint}") from None
        except Exception as e:  # any decoder error means a bad file
            raise _corrupt(path, f"cannot decode {kind}: {type(e).__name__}: {e}") from None
        if a.shape != (side, side, 3):
            raise _corrupt(path, f"image is {a.shape[1]}x{a.shape[0]}, expected {side}x{side}")
        out[i] = a

    with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
        for _ in pool.map(one, range(len(files)), chunksize=256):
            pass
    return np.ascontiguousarray(out.transpose(0, 3, 1, 2))


def _gray_to_tensor(images: np.ndarray, scale: float = 255.0) -> torch.Tensor:
    """uint8/float [N, H, W] -> float32 [N, 1, H, W] mapped by (x/scale - 0.5)/0.5."""
    x = torch.from_numpy(np.ascontiguousarray(images, dtype=np.float32)).unsqueeze(1)
    return x.mul_(2.0 / scale).sub_(1.0)


def _rgb_to_tensor(images: np.ndarray, mean: Sequence[float], std: Sequence[float]) -> torch.Tensor:
    """uint8 [N, 3, H, W] -> float32 normalised per channel: (x/255 - mean)/std."""
    x = torch.from_numpy(np.ascontiguousarray(images, dtype=np.float32)).div_(255.0)
    m = torch.tensor(mean, dtype=torch.float32).view(1, -1, 1, 1)
    s = torch.tensor(std, dtype=torch.float32).view(1, -1, 1, 1)
    return x.sub_(m).div_(s)


# --------------------------------------------------------------------------------------------
# Image files read with Pillow, and their decoded-pixel cache (Tiny-ImageNet, DomainNet)
# --------------------------------------------------------------------------------------------


def _pillow_reader(ds: str, side: int | None = None) -> Callable[[Path], np.ndarray]:
    """``path -> uint8 [H, W, 3]`` read with Pillow: any mode becomes RGB (``convert("RGB")``:
    greyscale replicated), then, with ``side``, the image is scaled to ``side x side`` with
    Pillow's bilinear filter, which is what torchvision's ``Resize`` does to a PIL image."""
    try:
        from PIL import Image
    except ImportError:
        raise PflkitError(
            f"dataset '{ds}' needs Pillow to read its JPEG files, which is not installed; run "
            "`pip install pillow`"
        ) from None

    def read(path: Path) -> np.ndarray:
        with Image.open(path) as im:
            rgb = im.convert("RGB")
        if side is not None:
            rgb = rgb.resize((side, side), Image.Resampling.BILINEAR)
        return np.asarray(rgb)

    return read


def _pixel_cache_key(
    tag: str, base: Path, files: Sequence[Path], labels: np.ndarray, what: str, hint: str
) -> str:
    """SHA-256 of ``tag`` (the source and the cache format), the labels and every file's path
    relative to ``base``, size and modification time."""
    h = hashlib.sha256(f"pflkit {tag}\n".encode())
    h.update(np.ascontiguousarray(labels, dtype=np.int64).tobytes())
    for path in files:
        try:
            st = path.stat()
        except FileNotFoundError:
            raise PflkitError(f"{what} image {path} is missing; {hint}") from None
        h.update(f"{path.relative_to(base).as_posix()}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return h.hexdigest()


def _read_pixel_cache(path: Path, key: str, shape: tuple[int, ...]) -> np.ndarray | None:
    """The cached uint8 pixels if ``path`` is a readable entry for ``key`` of ``shape``."""
    try:
        with np.load(path, allow_pickle=False) as z:
            if str(z["key"]) != key:
                return None
            x = z["x"]
    except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile, zlib.error):
        return None  # absent, truncated or damaged: decode again
    if x.dtype != np.uint8 or x.shape != shape:
        return None
    return x


def _write_pixel_cache(path: Path, key: str, x: np.ndarray) -> None:
    tmp = path.with_name(f".{path.name}.part-{os.getpid()}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(tmp, "wb") as f:
            np.savez(f, x=x, key=np.array(key))
        os.replace(tmp, path)
    except OSError:
        pass  # the cache is an optimisation: a read-only or full disk must not fail the load
    finally:
        tmp.unlink(missing_ok=True)


@dataclass(frozen=True)
class _ImageFiles:
    """Image files to decode into uint8 ``[N, 3, side, side]``, and how to name them in
    messages: ``what`` (e.g. "Tiny-ImageNet") and ``hint`` (the fix for a missing file)."""

    base: Path  # the folder the files' cache-key paths are relative to
    files: Sequence[Path]
    labels: np.ndarray
    side: int
    what: str
    hint: str


def _cached_pixels(
    images: _ImageFiles,
    cache: Path | None,
    tag: str,
    decode: Callable[[Sequence[Path]], np.ndarray],
) -> np.ndarray:
    """``decode(images.files)``, kept in the ``.npz`` file ``cache`` (``None``: no cache).

    A cache entry is used only if its key (:func:`_pixel_cache_key` of ``tag``, the labels and
    every file's relative path, size and modification time) matches the files on disk; a
    stale, truncated or unreadable entry is decoded again and rewritten."""
    shape = (len(images.files), 3, images.side, images.side)
    key = ""
    if cache is not None:
        key = _pixel_cache_key(
            tag, images.base, images.files, images.labels, images.what, images.hint
        )
        x = _read_pixel_cache(cache, key, shape)
        if x is not None:
            return x
    if len(images.files) > 5000:
        where = f"; cached in {cache}" if cache is not None else ""
        from pflkit.data.download import notice

        notice(f"decoding {len(images.files)} {images.what} images in {images.base}{where}")
    x = decode(images.files)
    if cache is not None:
        _write_pixel_cache(cache, key, x)
    return x


# --------------------------------------------------------------------------------------------
# Archive extraction (Tiny-ImageNet, UCI HAR)
# --------------------------------------------------------------------------------------------


def _extract(
    archive: Path, home: Path, folder: str, marker: str, skip: Callable[[str], bool], what: str
) -> Path:
    """Extract ``archive`` (a zip) so that ``home/folder`` holds the folder of the archive that
    contains ``marker``; members for which ``skip(name)`` is true are left out. The folder is
    moved into place only once complete. Returns ``home/folder``."""
    target = home / folder
    if target.exists():
        raise PflkitError(
            f"{what} folder {target} exists but is incomplete (it has no {marker}); delete it "
            f"so that {archive.name} can be extracted there"
        )
    tmp = home / f".extract-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        try:
            with zipfile.ZipFile(archive) as z:
                for info in z.infolist():
                    if not skip(info.filename):
                        z.extract(info, tmp)  # zipfile drops absolute paths and '..' parts
        except (zipfile.BadZipFile, EOFError, zlib.error) as e:
            raise _corrupt(archive, f"{type(e).__name__}: {e}") from None
        except OSError as e:
            raise PflkitError(
                f"cannot extract {archive} into {home} ({e}); check free disk space and "
                "write permission"
            ) from None
        dirs = [tmp, *sorted(p for p in tmp.iterdir() if p.is_dir())]
        found = next((d for d in dirs if (d / marker).exists()), None)
        if found is None:
            raise _corrupt(archive, f"it has no {marker}")
        try:
            os.replace(found, target)
        except OSError as e:
            if not (target / marker).exists():  # not another process extracting it meanwhile
                msg = f"cannot move the extracted {what} files to {target} ({e}); check the path"
                raise PflkitError(msg) from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _first_parts(name: str, n: int = 2) -> tuple[str, ...]:
    return PurePosixPath(name).parts[:n]
