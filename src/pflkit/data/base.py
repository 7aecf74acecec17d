"""What every source loader shares: the :class:`Source` it returns, the checks of its options,
and the helpers that read its files and turn them into tensors.

:mod:`pflkit.data.sources` (the registry and the image benchmarks), :mod:`pflkit.data.text` and
:mod:`pflkit.data.tiny_har` build on this module; it imports none of them.
"""

from __future__ import annotations

import gzip
import math
import os
import zlib
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
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
    train_x: torch.Tensor  # float32 [N, C, H, W] (images) or [N, D] (vectors)
    train_y: torch.Tensor  # int64 [N]
    test_x: torch.Tensor | None  # official test set; None when the source has none
    test_y: torch.Tensor | None
    num_classes: int
    train_groups: np.ndarray | None = None  # natural owner (writer/user index) per train sample
    group_names: list[str] | None = None  # name of each group index (LEAF user id, ...)
    class_names: list[str] | None = None
    mean: tuple[float, ...] | None = None  # per-channel normalisation applied to the pixels
    std: tuple[float, ...] | None = None

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
