"""DomainNet, read from its official files and sampled as FL-bench prepares it: pFedSim's
Table 8 (Tan et al., "pFedSim: Similarity-Aware Model Aggregation Towards Personalized
Federated Learning", App. B.3; specs/pfedsim.md §4.3).

``domainnet``
    The official layout in ``<root>/domainnet/``: one folder per domain as the official zips
    unpack (``clipart/``, ``infograph/``, ``painting/``, ``quickdraw/``, ``real/``,
    ``sketch/``, each ``<domain>/<class>/<image>.jpg``; the zips FL-bench's
    ``data/download/domain.sh`` fetches from http://csr.bu.edu/ftp/visda/2019/multi-source/)
    and, for ``split: official``, the official split files ``<domain>_train.txt`` /
    ``<domain>_test.txt`` beside them (lines ``clipart/aircraft_carrier/clipart_001_000018.jpg
    0``; their label column is not read). pflkit does not download DomainNet (six large zips
    without published checksums).

    Sampling (FL-bench ``data/domain/preprocess.py``, identical at 9382b2c, the commit that
    added pFedSim, and at 06e658b; line numbers of 06e658b), with one ``random.Random(class_seed)``
    (the stream of ``random.seed(seed)``), in FL-bench's call order:

    1. the ``classes`` classes: ``sorted(rng.sample(sorted(folders), classes))`` over the class
       folders of the first domain (clipart by default, FL-bench's choice; lines 42-43); class
       ``c`` is the ``c``-th of them in name order (``class_names``);
    2. for each domain (in the official order above), for each class in order: its image names
       sorted, and with ``0 < fraction < 1``, ``rng.sample(names, int(len(names) * fraction))``
       kept in the order drawn (lines 55-63); the images are numbered in this order, across
       domains, as FL-bench's ``filename_list``;
    3. after each domain's images, that domain is split into ``clients_per_domain`` clients:
       ``clients_per_domain`` times ``rng.sample(rest, len(domain) // clients_per_domain)``
       with ``rest = list(set(rest) - set(drawn))`` after each draw, the residual appended to
       the domain's last client (lines 66-75).

    The client of each image is ``train_groups`` (group ``d * clients_per_domain + j`` is
    client ``j`` of the ``d``-th domain kept; ``group_names`` are ``"<domain>/<j>"``), so
    ``partition: {name: natural}`` with ``num_clients = len(domains) * clients_per_domain``
    gives FL-bench's clients in FL-bench's order, and client ``i``'s domain is
    ``group_names[i].split("/")[0]`` (docs/pfedsim.md shows per-domain accuracy from
    ``metrics.jsonl``). Each client is then split into local train/test by pflkit's
    ``data.test_fraction`` (FL-bench splits each client at random too, with its own draws).
    FL-bench lists every entry of a folder (``os.listdir``); pflkit takes the sub-folders as
    classes and the ``.jpg``/``.jpeg``/``.png`` files as images, the same on the official
    folders.

    ``split: pool`` (default, FL-bench's): every image of the class folders, no official test
    set (the global test set is the union of the clients' local test splits).
    ``split: official``: the training images are those listed in ``<domain>_train.txt`` and
    the test set those of ``<domain>_test.txt`` (all domains kept, the global test set);
    steps 2 and 3 run on the train lists, and each class's test list is sampled by the same
    rule right after its train list, so the test set keeps the same share. FL-bench has no
    such mode.

    Pixels: ``Image.open(path).convert("RGB")``, then resized to ``image_size x image_size``
    with Pillow's bilinear filter, then ``(x/255 - mean)/std`` with FL-bench's constants for
    "domain": mean (0.485, 0.456, 0.406), std (0.229, 0.224, 0.225)
    (``src/utils/constants.py`` lines 196 and 216; ``data/utils/constants.py`` lines 17 and 35
    at 9382b2c). FL-bench applies ``transforms.Resize((s, s))`` and ``ToTensor`` to the PIL
    image (``data/utils/datasets.py`` lines 613 and 626); torchvision's ``Resize`` of a PIL
    image calls Pillow's ``resize`` with the bilinear filter, so the pixels are the same up to
    differences between Pillow versions. The aspect ratio is not kept, as in FL-bench.

    Decoding tens of thousands of JPEGs takes minutes, so with ``cache: true`` (default) the
    resized uint8 pixels are kept in ``<root>/domainnet/cache/<part>-<size>px-<hash>.npz``
    (one file per selection of images; delete the folder to free the space), used only while
    every image's path, size and modification time match (as Tiny-ImageNet's cache).

Options (each checked, one sentence naming the value and the fix): ``classes`` (1..345,
default 20), ``class_seed`` (default 42, FL-bench's), ``fraction`` (share of each class's images
kept, in (0, 1]; default 1.0 as FL-bench; pFedSim's paper says 30%), ``image_size`` (default
64), ``domains`` (default all six), ``clients_per_domain`` (default 1, FL-bench's), ``split``
(``pool`` or ``official``), ``cache``.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pflkit.data.base import (
    Source,
    SourceInfo,
    _cached_pixels,
    _corrupt,
    _decode_images,
    _ImageFiles,
    _opt_bool,
    _opt_int,
    _pillow_reader,
    _rgb_to_tensor,
)
from pflkit.errors import PflkitError

__all__ = ["DOMAINNET_MEAN", "DOMAINNET_STD", "DOMAINS"]

DOMAINNET = "domainnet"
DOMAINS = ("clipart", "infograph", "painting", "quickdraw", "real", "sketch")
MAX_CLASSES = 345
DOMAINNET_MEAN = (0.485, 0.456, 0.406)  # FL-bench src/utils/constants.py:196 ("domain")
DOMAINNET_STD = (0.229, 0.224, 0.225)  # FL-bench src/utils/constants.py:216
SPLITS = ("pool", "official")
ZIPS_URL = "http://csr.bu.edu/ftp/visda/2019/multi-source/"
_IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png")
_CACHE_VERSION = 1


# --------------------------------------------------------------------------------------------
# Options
# --------------------------------------------------------------------------------------------


def _opt_classes(value: Any) -> int:
    ok = isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= MAX_CLASSES
    if not ok:
        raise PflkitError(
            f"option 'classes' of dataset '{DOMAINNET}' must be an integer in 1..{MAX_CLASSES} "
            f"(how many of DomainNet's classes to sample), got {value!r}"
        )
    return value


def _opt_fraction(value: Any) -> float:
    ok = isinstance(value, int | float) and not isinstance(value, bool) and 0 < value <= 1
    if not ok:
        raise PflkitError(
            f"option 'fraction' of dataset '{DOMAINNET}' must be a number in (0, 1] (the share "
            f"of each class's images kept; pFedSim's paper keeps 0.3), got {value!r}"
        )
    return float(value)


def _opt_domains(value: Any) -> tuple[str, ...]:
    names = (value,) if isinstance(value, str) else value
    ok = (
        isinstance(names, list | tuple)
        and len(names) > 0
        and all(isinstance(d, str) and d in DOMAINS for d in names)
        and len(set(names)) == len(names)
    )
    if not ok:
        shown = list(value) if isinstance(value, tuple) else value  # load_source's tuple
        raise PflkitError(
            f"option 'domains' of dataset '{DOMAINNET}' must be a list of distinct domains from "
            f"{', '.join(DOMAINS)}, got {shown!r}"
        )
    return tuple(d for d in DOMAINS if d in names)  # FL-bench's order, whatever the list's


def _opt_split(value: Any) -> str:
    if value not in SPLITS:
        raise PflkitError(
            f"option 'split' of dataset '{DOMAINNET}' must be 'pool' (FL-bench: every image, "
            f"split per client) or 'official' (the {{domain}}_train/test.txt files), got "
            f"{value!r}"
        )
    return value


# --------------------------------------------------------------------------------------------
# Files
# --------------------------------------------------------------------------------------------


def _subfolders(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.is_dir())


def _image_names(folder: Path, domain: str) -> list[str]:
    if not folder.is_dir():
        raise PflkitError(
            f"DomainNet folder {folder} is missing; every domain folder must hold the class "
            f"folders of the first domain (the official layout): unzip {domain}.zip again"
        )
    return [p.name for p in folder.iterdir() if p.suffix.lower() in _IMAGE_SUFFIXES]


def _split_file(home: Path, domain: str, part: str) -> dict[str, list[str]]:
    """Class -> image names listed in the official ``<domain>_<part>.txt``."""
    path = home / f"{domain}_{part}.txt"
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise PflkitError(
            f"DomainNet split file {path} is missing; put the official {domain}_train.txt and "
            f"{domain}_test.txt (from the DomainNet page, ai.bu.edu/M3SDA) in {home}, or use "
            "option split: pool"
        ) from None
    except UnicodeDecodeError as e:
        raise _corrupt(path, f"not a text file: {e}") from None
    except OSError as e:
        raise PflkitError(f"cannot read file {path} ({e.strerror}); check the path") from None
    listed: dict[str, list[str]] = {}
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        parts = line.split()[0].split("/")
        if len(line.split()) != 2 or len(parts) != 3 or parts[0] != domain:
            raise _corrupt(path, f"line {lineno} is not '{domain}/<class>/<image> <label>'")
        listed.setdefault(parts[1], []).append(parts[2])
    return listed


# --------------------------------------------------------------------------------------------
# FL-bench's sampling (data/domain/preprocess.py)
# --------------------------------------------------------------------------------------------


def _sample(rng: random.Random, names: Sequence[str], fraction: float) -> list[str]:
    """The names sorted, and a random ``fraction`` of them in drawn order (lines 57-59)."""
    names = sorted(names)
    if 0 < fraction < 1:
        names = rng.sample(names, int(len(names) * fraction))
    return names


def _split_domain(rng: random.Random, first: int, end: int, k: int) -> list[list[int]]:
    """Images ``first..end-1`` over ``k`` clients, FL-bench's draws (lines 67-75)."""
    rest = list(range(first, end))
    size = len(rest) // k
    clients = []
    for _ in range(k):
        drawn = rng.sample(rest, size)
        rest = list(set(rest) - set(drawn))
        clients.append(drawn)
    if rest:
        clients[-1].extend(rest)
    return clients


@dataclass
class _Selection:
    classes: list[str]
    train: list[tuple[str, str, str]] = field(default_factory=list)  # (domain, class, image)
    train_y: list[int] = field(default_factory=list)
    groups: list[int] = field(default_factory=list)
    test: list[tuple[str, str, str]] = field(default_factory=list)
    test_y: list[int] = field(default_factory=list)


def _select(
    all_classes: Sequence[str],
    domains: Sequence[str],
    listing: Callable[[str, str], tuple[list[str], list[str] | None]],
    *,
    classes: int,
    seed: int,
    fraction: float,
    clients_per_domain: int,
) -> _Selection:
    """FL-bench's sampling over ``listing(domain, class) -> (train names, test names or
    None)``; see the module docstring."""
    rng = random.Random(seed)
    sel = _Selection(sorted(rng.sample(sorted(all_classes), classes)))
    for d, domain in enumerate(domains):
        first = len(sel.train)
        for c, cls in enumerate(sel.classes):
            train_names, test_names = listing(domain, cls)
            for name in _sample(rng, train_names, fraction):
                sel.train.append((domain, cls, name))
                sel.train_y.append(c)
            if test_names is not None:
                for name in _sample(rng, test_names, fraction):
                    sel.test.append((domain, cls, name))
                    sel.test_y.append(c)
        n = len(sel.train) - first
        if n < clients_per_domain:
            raise PflkitError(
                f"DomainNet domain '{domain}' keeps too few images ({n}) for "
                f"{clients_per_domain} clients: lower option 'clients_per_domain' or raise "
                "'fraction' or 'classes'"
            )
        sel.groups += [-1] * n
        for j, members in enumerate(_split_domain(rng, first, len(sel.train), clients_per_domain)):
            for i in members:
                sel.groups[i] = d * clients_per_domain + j
    return sel


# --------------------------------------------------------------------------------------------
# Loader
# --------------------------------------------------------------------------------------------


def _pixels(
    home: Path, items: list[tuple[str, str, str]], y: list[int], side: int, part: str, cache: bool
) -> np.ndarray:
    files = [home / domain / cls / name for domain, cls, name in items]
    hint = "unzip its domain's zip again"
    images = _ImageFiles(home, files, np.asarray(y, dtype=np.int64), side, "DomainNet", hint)
    path = None
    if cache:  # one entry per selection of images: switching configs reuses each
        h = hashlib.sha256("\n".join("/".join(t) for t in items).encode()).hexdigest()
        path = home / "cache" / f"{part}-{side}px-{h[:16]}.npz"

    def decode(paths: Sequence[Path]) -> np.ndarray:
        read = _pillow_reader(DOMAINNET, side)
        return _decode_images(paths, read, side, "JPEG", "DomainNet", hint)

    return _cached_pixels(images, path, f"domainnet {side}px cache v{_CACHE_VERSION}", decode)


def _load_domainnet(
    root: Path,
    download: bool,
    *,
    classes: int = 20,
    class_seed: int = 42,
    fraction: float = 1.0,
    image_size: int = 64,
    domains: Sequence[str] = DOMAINS,
    clients_per_domain: int = 1,
    split: str = "pool",
    cache: bool = True,
) -> Source:
    del download  # pflkit never downloads DomainNet
    classes = _opt_classes(classes)
    seed = _opt_int(DOMAINNET, "class_seed", class_seed, 0)
    fraction = _opt_fraction(fraction)
    side = _opt_int(DOMAINNET, "image_size", image_size, 1)
    kept = _opt_domains(domains)
    k = _opt_int(DOMAINNET, "clients_per_domain", clients_per_domain, 1)
    split = _opt_split(split)
    use_cache = _opt_bool(DOMAINNET, "cache", cache)

    home = root / DOMAINNET
    if not home.is_dir() or not any((home / d).is_dir() for d in DOMAINS):
        raise PflkitError(
            f"DomainNet files not found in {home}; put the domain folders "
            f"({', '.join(f'{d}/' for d in DOMAINS)}, unzipped from {ZIPS_URL}<domain>.zip) "
            "there; pflkit does not download DomainNet"
        )
    for d in kept:
        if not (home / d).is_dir():
            raise PflkitError(
                f"DomainNet folder {home / d} is missing; unzip {ZIPS_URL}{d}.zip in {home}, "
                "or leave the domain out with option 'domains'"
            )
    all_classes = _subfolders(home / kept[0])
    if classes > len(all_classes):
        raise PflkitError(
            f"option 'classes' of dataset '{DOMAINNET}' is {classes} but {home / kept[0]} has "
            f"{len(all_classes)} class folders: set it to at most {len(all_classes)}"
        )

    lists = None
    if split == "official":
        lists = {d: (_split_file(home, d, "train"), _split_file(home, d, "test")) for d in kept}

    def listing(domain: str, cls: str) -> tuple[list[str], list[str] | None]:
        if lists is None:
            return _image_names(home / domain / cls, domain), None
        train, test = lists[domain]
        return train.get(cls, []), test.get(cls, [])

    sel = _select(
        all_classes, kept, listing, classes=classes, seed=seed, fraction=fraction,
        clients_per_domain=k,
    )  # fmt: skip
    train_x = _pixels(home, sel.train, sel.train_y, side, "train", use_cache)
    test_x = test_y = None
    if split == "official":
        test_x = _rgb_to_tensor(
            _pixels(home, sel.test, sel.test_y, side, "test", use_cache),
            DOMAINNET_MEAN,
            DOMAINNET_STD,
        )
        test_y = torch.tensor(sel.test_y, dtype=torch.int64)
    return Source(
        DOMAINNET,
        _rgb_to_tensor(train_x, DOMAINNET_MEAN, DOMAINNET_STD),
        torch.tensor(sel.train_y, dtype=torch.int64),
        test_x,
        test_y,
        classes,
        train_groups=np.asarray(sel.groups, dtype=np.int64),
        group_names=[f"{d}/{j}" for d in kept for j in range(k)],
        class_names=sel.classes,
        mean=DOMAINNET_MEAN,
        std=DOMAINNET_STD,
    )


ENTRIES: list[SourceInfo] = [
    SourceInfo(
        DOMAINNET,
        "DomainNet (local files only): 6 domains, `classes` of 345 sampled and split into "
        "`clients_per_domain` clients per domain as FL-bench (natural groups); image_size x "
        "image_size colour; options classes, class_seed, fraction, image_size, domains, "
        "clients_per_domain, split, cache",
        _load_domainnet,
    ),
]
