"""Tiny-ImageNet, read from its official files: GPFL's (Zhang et al., "GPFL: Simultaneously
Learning Global and Personalized Feature Information for Personalized Federated Learning",
ICCV 2023) "TINY"/"TINY*" columns (specs/gpfl.md §4.1-4.3, §9.6).

``tiny_imagenet``
    The official ``tiny-imagenet-200/`` folder (cs231n.stanford.edu/tiny-imagenet-200.zip):
    ``wnids.txt`` (one WordNet id per class), ``train/<wnid>/images/*.JPEG`` (500 per class,
    100,000 in all) and ``val/images/*.JPEG`` with their labels in ``val/val_annotations.txt``
    (tab-separated: file, wnid, bounding box). The official ``test/`` split has no labels and is
    not read (nor extracted from the archive).

    - Train = ``train/``; test = ``val/`` (10,000 images, 50 per class), labelled from
      ``val_annotations.txt``. Partitioners split the training set over clients and the
      per-client ``data.test_fraction`` split makes the clients' test sets, which is what
      current PFLlib (used by GPFL) does with ``train/`` alone; ``val/`` becomes the global test
      set. (The pre-2025 PFLlib script merged ``val/`` into the training pool with every val
      image labelled class 0; that bug is not reproduced: val labels come from
      ``val_annotations.txt``.)
    - Classes: the wnids of ``wnids.txt`` sorted by name, so class ``c`` is the ``c``-th folder
      of ``train/`` in name order, as torchvision's ``ImageFolder`` (PFLlib) numbers them.
      ``class_names`` are the wnids. ``num_classes`` is the number of wnids (200 officially).
    - Pixels: 64x64 RGB (the release's greyscale JPEGs are converted to RGB by replicating the
      grey channel, Pillow's ``convert("RGB")``), then ``(x/255 - 0.5)/0.5`` per channel,
      PFLlib's ``Normalize([0.5]*3, [0.5]*3)`` (``Source.mean``/``std`` = 0.5).
    - Decoding 110,000 JPEGs takes a while, so with ``cache: true`` (default) the decoded
      uint8 pixels are kept in ``<root>/tiny_imagenet/cache/{train,val}.npz``. A cache entry is
      used only if its key (SHA-256 of every image's relative path, size and modification
      time, the labels and the cache format version) matches the files on disk; a stale,
      truncated or unreadable entry is ignored and rewritten. ``cache: false`` neither reads
      nor writes it.
    - Download: the official zip, checked against its MD5 ``90528d7c...``, the digest quoted by
      many public loaders (e.g. Avalanche's ``TinyImagenet``, see :mod:`pflkit.data.download`);
      the zip is removed after extraction. Needs Pillow (installed with matplotlib).

Errors (missing or damaged files, wrong shapes, labels out of range) are one
:class:`~pflkit.errors.PflkitError` sentence naming the file and the fix.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from pflkit.data import download as dl
from pflkit.data.base import (
    Source,
    SourceInfo,
    _cached_pixels,
    _corrupt,
    _decode_images,
    _extract,
    _first_parts,
    _ImageFiles,
    _missing,
    _opt_bool,
    _opt_mirrors,
    _pillow_reader,
    _rgb_to_tensor,
)
from pflkit.errors import PflkitError

__all__ = ["TINY_MEAN", "TINY_STD"]

TINY = "tiny_imagenet"
TINY_FOLDER = "tiny-imagenet-200"
TINY_ZIP = "tiny-imagenet-200.zip"
TINY_SIDE = 64
TINY_MEAN = (0.5, 0.5, 0.5)  # PFLlib's transforms.Normalize([0.5]*3, [0.5]*3)
TINY_STD = (0.5, 0.5, 0.5)
_JPEG_SUFFIXES = (".jpeg", ".jpg")
_CACHE_VERSION = 1
_REEXTRACT = f"extract {TINY_ZIP} again"


def _tiny_base(home: Path) -> Path | None:
    """The folder holding the official layout: ``home/tiny-imagenet-200`` or ``home``."""
    for d in (home / TINY_FOLDER, home):
        if (d / "wnids.txt").is_file() or (d / "train").is_dir():
            return d
    return None


def _tiny_skip(name: str) -> bool:
    """Archive members not extracted: the unlabelled official test split."""
    return "test" in _first_parts(name)


def _read_text(path: Path, what: str) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise PflkitError(
            f"{what} file {path} is missing; it is part of the official {TINY_FOLDER} "
            f"layout: {_REEXTRACT}"
        ) from None
    except UnicodeDecodeError as e:
        raise _corrupt(path, f"not a text file: {e}") from None
    except OSError as e:
        raise PflkitError(f"cannot read file {path} ({e.strerror}); check the path") from None


def _read_wnids(base: Path) -> list[str]:
    path = base / "wnids.txt"
    wnids = _read_text(path, "Tiny-ImageNet").split()
    if not wnids:
        raise _corrupt(path, "it lists no class")
    if len(set(wnids)) != len(wnids):
        dup = next(w for w in wnids if wnids.count(w) > 1)
        raise _corrupt(path, f"class {dup!r} is listed twice")
    if len(wnids) < 2:
        raise _corrupt(path, "it lists a single class")
    return sorted(wnids)


def _tiny_train_files(base: Path, wnids: Sequence[str]) -> tuple[list[Path], np.ndarray]:
    files: list[Path] = []
    labels: list[int] = []
    for c, wnid in enumerate(wnids):
        d = base / "train" / wnid / "images"
        if not d.is_dir():
            raise PflkitError(
                f"Tiny-ImageNet folder {d} is missing; {base} must hold train/<wnid>/images/ "
                f"for every class in wnids.txt (the official {TINY_FOLDER} layout): "
                f"{_REEXTRACT}"
            )
        found = sorted(p for p in d.iterdir() if p.suffix.lower() in _JPEG_SUFFIXES)
        if not found:
            raise PflkitError(f"Tiny-ImageNet folder {d} holds no JPEG image; {_REEXTRACT}")
        files += found
        labels += [c] * len(found)
    return files, np.asarray(labels, dtype=np.int64)


def _tiny_val_files(base: Path, index: dict[str, int]) -> tuple[list[Path], np.ndarray]:
    """The val images and labels, in the order of ``val/val_annotations.txt``."""
    path = base / "val" / "val_annotations.txt"
    files: list[Path] = []
    labels: list[int] = []
    seen: set[str] = set()
    for lineno, line in enumerate(_read_text(path, "Tiny-ImageNet validation-label").splitlines()):
        if not line.strip():
            continue
        fields = line.split("\t") if "\t" in line else line.split()
        if len(fields) < 2:
            raise _corrupt(path, f"line {lineno + 1} is not '<file> <wnid> ...'")
        name, wnid = fields[0].strip(), fields[1].strip()
        if wnid not in index:
            raise _corrupt(path, f"line {lineno + 1} names class {wnid!r}, not in wnids.txt")
        if name in seen or "/" in name or "\\" in name:
            raise _corrupt(path, f"line {lineno + 1} names image {name!r} again or a path")
        seen.add(name)
        files.append(base / "val" / "images" / name)
        labels.append(index[wnid])
    if not files:
        raise _corrupt(path, "it labels no image")
    return files, np.asarray(labels, dtype=np.int64)


def _decode_jpegs(files: Sequence[Path]) -> np.ndarray:
    """uint8 [N, 3, 64, 64] from the JPEG files."""
    read = _pillow_reader(TINY)
    return _decode_images(files, read, TINY_SIDE, "JPEG", "Tiny-ImageNet", _REEXTRACT)


def _tiny_pixels(
    base: Path, files: Sequence[Path], labels: np.ndarray, cache: Path | None
) -> np.ndarray:
    images = _ImageFiles(base, files, labels, TINY_SIDE, "Tiny-ImageNet", _REEXTRACT)
    return _cached_pixels(images, cache, f"tiny_imagenet cache v{_CACHE_VERSION}", _decode_jpegs)


def _load_tiny_imagenet(
    root: Path, download: bool, *, mirrors: str | list[str] | None = None, cache: bool = True
) -> Source:
    mirrors_t = _opt_mirrors(TINY, mirrors)
    use_cache = _opt_bool(TINY, "cache", cache)
    home = root / TINY
    base = _tiny_base(home)
    if base is None:
        archive = home / TINY_ZIP
        downloaded = False
        if not archive.is_file():
            if not download:
                raise _missing(
                    "Tiny-ImageNet",
                    home,
                    [f"{TINY_FOLDER}/ (wnids.txt, train/, val/)"],
                    f" (or {TINY_ZIP} from http://cs231n.stanford.edu/)",
                )
            dl.fetch_files(TINY, [TINY_ZIP], home, mirrors=mirrors_t, what="Tiny-ImageNet")
            downloaded = True
        base = _extract(archive, home, TINY_FOLDER, "wnids.txt", _tiny_skip, "Tiny-ImageNet")
        if downloaded:
            archive.unlink()
    wnids = _read_wnids(base)
    index = {w: c for c, w in enumerate(wnids)}
    tr_files, tr_y = _tiny_train_files(base, wnids)
    te_files, te_y = _tiny_val_files(base, index)
    tr_cache = home / "cache" / "train.npz" if use_cache else None
    te_cache = home / "cache" / "val.npz" if use_cache else None
    tr_x = _tiny_pixels(base, tr_files, tr_y, tr_cache)
    te_x = _tiny_pixels(base, te_files, te_y, te_cache)
    return Source(
        TINY,
        _rgb_to_tensor(tr_x, TINY_MEAN, TINY_STD),
        torch.from_numpy(tr_y),
        _rgb_to_tensor(te_x, TINY_MEAN, TINY_STD),
        torch.from_numpy(te_y),
        len(wnids),
        class_names=list(wnids),
        mean=TINY_MEAN,
        std=TINY_STD,
    )


ENTRIES: list[SourceInfo] = [
    SourceInfo(
        "tiny_imagenet",
        "Tiny-ImageNet: 100k train / 10k val 64x64 colour images, 200 classes; val (labels "
        "from val_annotations.txt) is the test set; options cache, mirrors (downloaded)",
        _load_tiny_imagenet,
    ),
]
