"""Tiny-ImageNet and UCI HAR, read from their official files: GPFL's (Zhang et al., "GPFL:
Simultaneously Learning Global and Personalized Feature Information for Personalized Federated
Learning", ICCV 2023) "TINY"/"TINY*" and "HAR" columns (specs/gpfl.md §4.1-4.3, §9.6).

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

``har``
    UCI "Human Activity Recognition Using Smartphones" (Anguita et al., ESANN 2013), the
    official ``UCI HAR Dataset/`` folder: for split s in train/test,
    ``s/Inertial Signals/{body_acc,body_gyro,total_acc}_{x,y,z}_s.txt`` (one 128-step window
    per line, whitespace-separated floats), ``s/y_s.txt`` (activity 1..6, mapped to 0..5 in
    the order of ``activity_labels.txt``: walking, walking upstairs, walking downstairs,
    sitting, standing, laying) and ``s/subject_s.txt`` (volunteer 1..30). Values are the raw
    signals (g and rad/s), not normalised, as PFLlib leaves them.

    - Windows are ``[N, 9, 1, 128]`` float32 (HAR-CNN's 9x1x128 input), channels in PFLlib's
      order: body_acc x, y, z, body_gyro x, y, z, total_acc x, y, z.
    - ``layout: channels`` (default): ``x[n, c, 0, t]`` = signal ``c`` at time ``t``, i.e. each
      of the 9 input channels is one sensor axis, the reading of HAR-CNN's (Zeng et al. 2014)
      9 x 1 x 128 input (the GPFL paper does not describe the layout). ``layout: pfllib``: the
      exact tensors of PFLlib's ``generate_HAR.py`` (its ``HAR_utils.py`` is taken from
      jindongwang/Deep-learning-activity-recognition), which build a ``[128, 9]`` time-major
      window and then ``reshape`` (not transpose) it to ``[9, 1, 128]``, so its "channel" ``k``
      position ``j`` holds time step ``(128k + j) // 9`` of axis ``(128k + j) % 9``: the axes
      interleaved. GPFL's data come from PFLlib's scripts (specs/gpfl.md §9.6), so its HAR
      numbers were obtained on that layout.
    - GPFL's protocol (default): the official train (7,352 windows, 21 volunteers) and test
      (2,947, 9 volunteers) sets are merged (10,299 windows) and grouped by volunteer: 30
      natural groups (``train_groups`` = index of the volunteer in ``group_names``, the
      volunteer ids "1".."30" in ascending order), so ``partition: {name: natural}`` with 30
      clients gives one client per volunteer, whose local train/test split is
      ``data.test_fraction`` (PFLlib: 75/25). No global test set (``test_x`` is None: the
      union of the clients' local test splits is used). ``official_test: true`` keeps the
      official split instead: train = the 21 training volunteers (21 groups), test = the
      official test set.
    - Download: the official ``UCI HAR Dataset.zip`` from the UCI archive (URL folder
      ``00240``), checked against SHA-256 ``2045e435...`` (quoted by two independent public
      loaders, see :mod:`pflkit.data.download`); removed after extraction.

Errors (missing or damaged files, wrong shapes, labels out of range) are one
:class:`~pflkit.errors.PflkitError` sentence naming the file and the fix.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import sys
import zipfile
import zlib
from collections.abc import Callable, Sequence
from pathlib import Path, PurePosixPath
from typing import Any

import numpy as np
import torch

from pflkit.data import download as dl
from pflkit.data.base import (
    Source,
    _corrupt,
    _decode_images,
    _missing,
    _opt_bool,
    _opt_mirrors,
    _rgb_to_tensor,
)
from pflkit.errors import PflkitError

__all__ = ["HAR_CLASSES", "HAR_SIGNALS", "TINY_MEAN", "TINY_STD"]


# --------------------------------------------------------------------------------------------
# Archive extraction (shared)
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


# --------------------------------------------------------------------------------------------
# Tiny-ImageNet
# --------------------------------------------------------------------------------------------

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


def _jpeg_reader() -> Callable[[Path], np.ndarray]:
    try:
        from PIL import Image
    except ImportError:
        raise PflkitError(
            "dataset 'tiny_imagenet' needs Pillow to read its JPEG files, which is not "
            "installed; run `pip install pillow`"
        ) from None

    def read(path: Path) -> np.ndarray:
        with Image.open(path) as im:
            return np.asarray(im.convert("RGB"))  # greyscale / CMYK JPEGs become RGB

    return read


def _decode_jpegs(files: Sequence[Path]) -> np.ndarray:
    """uint8 [N, 3, 64, 64] from the JPEG files."""
    return _decode_images(files, _jpeg_reader(), TINY_SIDE, "JPEG", "Tiny-ImageNet", _REEXTRACT)


def _cache_key(base: Path, files: Sequence[Path], labels: np.ndarray) -> str:
    """SHA-256 of every file's relative path, size and mtime, the labels and the format."""
    h = hashlib.sha256(f"pflkit tiny_imagenet cache v{_CACHE_VERSION}\n".encode())
    h.update(np.ascontiguousarray(labels, dtype=np.int64).tobytes())
    for path in files:
        try:
            st = path.stat()
        except FileNotFoundError:
            raise PflkitError(f"Tiny-ImageNet image {path} is missing; {_REEXTRACT}") from None
        h.update(f"{path.relative_to(base).as_posix()}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return h.hexdigest()


def _read_cache(path: Path, key: str, n: int) -> np.ndarray | None:
    """The cached pixels if ``path`` is a readable entry for ``key`` with ``n`` images."""
    try:
        with np.load(path, allow_pickle=False) as z:
            if str(z["key"]) != key:
                return None
            x = z["x"]
    except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile, zlib.error):
        return None  # absent, truncated or damaged: decode again
    if x.dtype != np.uint8 or x.shape != (n, 3, TINY_SIDE, TINY_SIDE):
        return None
    return x


def _write_cache(path: Path, key: str, x: np.ndarray) -> None:
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


def _tiny_pixels(
    base: Path, files: Sequence[Path], labels: np.ndarray, cache: Path | None
) -> np.ndarray:
    key = _cache_key(base, files, labels) if cache is not None else ""
    if cache is not None:
        x = _read_cache(cache, key, len(files))
        if x is not None:
            return x
    if len(files) > 5000:
        where = f"; cached in {cache}" if cache is not None else ""
        print(f"decoding {len(files)} Tiny-ImageNet images in {base}{where}", file=sys.stderr)
    x = _decode_jpegs(files)
    if cache is not None:
        _write_cache(cache, key, x)
    return x


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


# --------------------------------------------------------------------------------------------
# UCI HAR
# --------------------------------------------------------------------------------------------

HAR = "har"
HAR_FOLDER = "UCI HAR Dataset"
HAR_ZIP = "UCI HAR Dataset.zip"  # the name a user's own copy has
HAR_ZIP_URL_NAME = "UCI%20HAR%20Dataset.zip"  # the name in the archive's URL (and on disk)
HAR_SIGNALS = (
    "body_acc_x",
    "body_acc_y",
    "body_acc_z",
    "body_gyro_x",
    "body_gyro_y",
    "body_gyro_z",
    "total_acc_x",
    "total_acc_y",
    "total_acc_z",
)
HAR_CLASSES = [
    "WALKING",
    "WALKING_UPSTAIRS",
    "WALKING_DOWNSTAIRS",
    "SITTING",
    "STANDING",
    "LAYING",
]
HAR_WINDOW = 128
HAR_LAYOUTS = ("channels", "pfllib")
_HAR_REEXTRACT = f"extract {HAR_ZIP} again"


def _har_files(split: str) -> list[str]:
    """The official files of ``split`` (train/test), relative to the dataset folder."""
    signals = [f"{split}/Inertial Signals/{s}_{split}.txt" for s in HAR_SIGNALS]
    return [*signals, f"{split}/y_{split}.txt", f"{split}/subject_{split}.txt"]


def _har_skip(name: str) -> bool:
    """Archive members not extracted: the macOS resource forks next to the dataset folder."""
    return _first_parts(name, 1) == ("__MACOSX",)


def _har_base(home: Path) -> Path | None:
    for d in (home / HAR_FOLDER, home):
        if (d / "train").is_dir() or (d / "test").is_dir():
            return d
    return None


def _har_check(base: Path) -> None:
    for rel in _har_files("train") + _har_files("test"):
        if not (base / rel).is_file():
            raise PflkitError(
                f"UCI HAR file {base / rel} is missing; {base} must hold the official "
                f"'{HAR_FOLDER}' layout (train/ and test/ with their 'Inertial Signals'): "
                f"{_HAR_REEXTRACT}"
            )


def _loadtxt(path: Path, dtype: Any, ndmin: int) -> np.ndarray:
    try:
        return np.loadtxt(path, dtype=dtype, ndmin=ndmin)
    except ValueError as e:
        raise _corrupt(path, str(e).split(";")[0]) from None
    except UnicodeDecodeError as e:
        raise _corrupt(path, f"not a text file: {e}") from None
    except OSError as e:
        raise PflkitError(f"cannot read file {path} ({e}); check the path") from None


def _read_windows(path: Path) -> np.ndarray:
    """float32 [N, 128]: one whitespace-separated window per line."""
    a = _loadtxt(path, np.float32, 2)
    if a.shape[0] == 0:
        raise _corrupt(path, "it holds no window")
    if a.shape[1] != HAR_WINDOW:
        raise _corrupt(path, f"its lines hold {a.shape[1]} values, expected {HAR_WINDOW}")
    if not np.isfinite(a).all():
        raise _corrupt(path, "it holds non-finite values")
    return a


def _read_ints(path: Path, n: int, low: int, high: int | None, ref: str) -> np.ndarray:
    """int64 [n]: one integer per line, each in low..high."""
    a = _loadtxt(path, np.int64, 1)
    if a.ndim != 1:
        raise _corrupt(path, "expected one integer per line")
    if len(a) != n:
        raise _corrupt(path, f"it has {len(a)} lines but {ref} has {n} windows")
    if n and (a.min() < low or (high is not None and a.max() > high)):
        want = f"{low}..{high}" if high is not None else f">= {low}"
        raise _corrupt(path, f"values range {a.min()}..{a.max()}, expected {want}")
    return a


def _har_split(base: Path, split: str, layout: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(windows [N, 9, 1, 128] float32, labels 0..5, volunteer ids) of one official split."""
    paths = [base / rel for rel in _har_files(split)]
    signals = [_read_windows(p) for p in paths[:9]]
    n = len(signals[0])
    for p, s in zip(paths[1:9], signals[1:], strict=True):
        if len(s) != n:
            raise _corrupt(p, f"it has {len(s)} windows but {paths[0].name} has {n}")
    y = _read_ints(paths[9], n, 1, len(HAR_CLASSES), paths[0].name) - 1
    subjects = _read_ints(paths[10], n, 1, None, paths[0].name)
    stacked = np.stack(signals, axis=1)  # [N, 9, 128]: x[n, c, t] = signal c at time t
    if layout == "channels":
        x = stacked[:, :, None, :]
    else:  # PFLlib: a [128, 9] time-major window reshaped (not transposed) to [9, 1, 128]
        x = stacked.transpose(0, 2, 1).reshape(n, len(HAR_SIGNALS), 1, HAR_WINDOW)
    return np.ascontiguousarray(x, dtype=np.float32), y, subjects


def _load_har(
    root: Path,
    download: bool,
    *,
    layout: str = "channels",
    official_test: bool = False,
    mirrors: str | list[str] | None = None,
) -> Source:
    if layout not in HAR_LAYOUTS:
        raise PflkitError(
            f"option 'layout' of dataset 'har' must be 'channels' or 'pfllib', got {layout!r}"
        )
    official_test = _opt_bool(HAR, "official_test", official_test)
    mirrors_t = _opt_mirrors(HAR, mirrors)
    home = root / HAR
    base = _har_base(home)
    if base is None:
        own = home / HAR_ZIP
        archive = own if own.is_file() else home / HAR_ZIP_URL_NAME
        downloaded = False
        if not archive.is_file():
            if not download:
                raise _missing(
                    "UCI HAR", home, [f"{HAR_FOLDER}/ (train/, test/)"], f" (or {HAR_ZIP})"
                )
            dl.fetch_files(HAR, [HAR_ZIP_URL_NAME], home, mirrors=mirrors_t, what="UCI HAR")
            downloaded = True
        base = _extract(archive, home, HAR_FOLDER, "train/Inertial Signals", _har_skip, "UCI HAR")
        if downloaded:
            archive.unlink()
    _har_check(base)
    tr_x, tr_y, tr_s = _har_split(base, "train", layout)
    te_x, te_y, te_s = _har_split(base, "test", layout)
    if official_test:
        x, y, subjects = tr_x, tr_y, tr_s
        test_x, test_y = torch.from_numpy(te_x), torch.from_numpy(te_y)
    else:  # GPFL / PFLlib: merge, then one group per volunteer
        x = np.concatenate([tr_x, te_x])
        y = np.concatenate([tr_y, te_y])
        subjects = np.concatenate([tr_s, te_s])
        test_x = test_y = None
    ids = np.unique(subjects)
    groups = np.searchsorted(ids, subjects).astype(np.int64)
    return Source(
        HAR,
        torch.from_numpy(x),
        torch.from_numpy(y),
        test_x,
        test_y,
        len(HAR_CLASSES),
        train_groups=groups,
        group_names=[str(int(i)) for i in ids],
        class_names=list(HAR_CLASSES),
    )
