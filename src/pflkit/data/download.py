"""Downloads of the official dataset files, verified by checksum.

Every file pflkit downloads is listed in :data:`CHECKSUMS` with a digest published by the
dataset's authors or by a widely used loader that quotes them; nothing here is invented.
Where only an MD5 is published we verify MD5 (it guards against truncated or swapped files, not
against an attacker; every mirror below is the dataset's official one).

Digest sources:

- Fashion-MNIST: MD5s of the four ``.gz`` files from the "Get the Data" table of the official
  README (github.com/zalandoresearch/fashion-mnist), identical to torchvision's
  ``FashionMNIST.resources``. The Debian package ``dataset-fashion-mnist`` re-compresses the
  files, so its ``.gz`` bytes differ; their *decompressed* contents match the published raw
  MD5s, and :data:`FASHION_MNIST_RAW_SHA256` records the SHA-256 of that content.
- MNIST: torchvision ``MNIST.resources`` (MD5 of the ``.gz`` files).
- EMNIST: torchvision ``EMNIST.md5`` (MD5 of NIST's ``gzip.zip``).
- CIFAR-10 / CIFAR-100: torchvision ``CIFAR10.tgz_md5`` / ``CIFAR100.tgz_md5``.
- CINIC-10: MD5 of ``CINIC-10.tar.gz`` as quoted by many independent CINIC-10 loaders
  (the Edinburgh DataShare record lists bitstream MD5s; not re-checked here).
- Tiny-ImageNet: MD5 of ``tiny-imagenet-200.zip`` as quoted by many independent loaders
  (e.g. ContinualAI/avalanche ``benchmarks/datasets/tiny_imagenet/tiny_imagenet.py``); no
  digest is published next to the file. The archive is 248,100,043 bytes.
- UCI HAR: SHA-256 of the UCI archive's ``UCI HAR Dataset.zip`` (folder ``00240``) as pinned by
  two independent public loaders (a UCI-datasets loader by N. Lay, NIH, 2021, and a fetch
  script that checks the same zip inside UCI's newer ``static/public/240`` download); UCI
  publishes no digest. The file name keeps the URL's ``%20`` escapes (so does the name on
  disk), because a mirror URL is the base URL plus the file name.
- AG News: torchtext ``AG_NEWS``'s MD5s of ``train.csv`` and ``test.csv`` (also quoted by
  DAI-Lab/fibber); the release archive ``ag_news_csv.tar.gz`` has no published digest and is
  only read when placed by hand. Amazon Review (``amazon.npz``) has none and is not downloaded.

Mirrors: the ``mirrors=`` option of :func:`pflkit.data.sources.load_source` (base URLs that
hold the files directly) replaces the official list; otherwise the environment variable
``PFLKIT_MIRROR`` (a base URL laid out like the data directory, i.e.
``$PFLKIT_MIRROR/<dataset>/<file>``) replaces it; otherwise the official mirrors are tried in
order. ``file://`` URLs work too.
"""

from __future__ import annotations

import hashlib
import http.client
import os
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from pflkit.errors import PflkitError

MIRROR_ENV = "PFLKIT_MIRROR"
TIMEOUT_S = 30.0
_CHUNK = 1 << 20

# dataset -> file name -> (algorithm, hex digest). Tests may monkeypatch entries.
CHECKSUMS: dict[str, dict[str, tuple[str, str]]] = {
    "fashion_mnist": {
        "train-images-idx3-ubyte.gz": ("md5", "8d4fb7e6c68d591d4c3dfef9ec88bf0d"),
        "train-labels-idx1-ubyte.gz": ("md5", "25c81989df183df01b3e8a0aad5dffbe"),
        "t10k-images-idx3-ubyte.gz": ("md5", "bef4ecab320f06d8554ea6380940ec79"),
        "t10k-labels-idx1-ubyte.gz": ("md5", "bb300cfdad3c16e7a12a480ee83cd310"),
    },
    "mnist": {
        "train-images-idx3-ubyte.gz": ("md5", "f68b3c2dcbeaaa9fbdd348bbdeb94873"),
        "train-labels-idx1-ubyte.gz": ("md5", "d53e105ee54ea40749a09fcbcd1e9432"),
        "t10k-images-idx3-ubyte.gz": ("md5", "9fb629c4189551a2d022fa330f9573f3"),
        "t10k-labels-idx1-ubyte.gz": ("md5", "ec29112dd5afa0611ce80d1b7f02629c"),
    },
    "emnist": {
        "gzip.zip": ("md5", "58c8d27c78d21e728a6bc7b3cc06412e"),
    },
    "cifar10": {
        "cifar-10-python.tar.gz": ("md5", "c58f30108f718f92721af3b95e74349a"),
    },
    "cifar100": {
        "cifar-100-python.tar.gz": ("md5", "eb9058c3a382ffc7106e4002c42a8d85"),
    },
    "cinic10": {
        "CINIC-10.tar.gz": ("md5", "6ee4d0c996905fe93221de577967a372"),
    },
    "tiny_imagenet": {
        "tiny-imagenet-200.zip": ("md5", "90528d7ca1a48142e341f4ef8d21d0de"),
    },
    "har": {
        "UCI%20HAR%20Dataset.zip": (
            "sha256",
            "2045e435c955214b38145fb5fa00776c72814f01b203fec405152dac7d5bfeb0",
        ),
    },
    "ag_news": {  # torchtext AG_NEWS.MD5 (pytorch/text, torchtext/datasets/ag_news.py)
        "train.csv": ("md5", "b1a00f826fdfbd249f79597b59e1dc12"),
        "test.csv": ("md5", "d52ea96a97a2d943681189a97654912d"),
    },
}

# SHA-256 of the decompressed official Fashion-MNIST IDX files, computed from the Debian
# package's files, whose decompressed MD5s equal the published raw MD5s
# (f4a8712d..., 9018921c..., 8181f547..., 15d48437...).
FASHION_MNIST_RAW_SHA256: dict[str, str] = {
    "train-images-idx3-ubyte": "c59f468a2f672dc815687fe0f83887768d799fd8a3f3276145d20f83aa44d888",
    "train-labels-idx1-ubyte": "bad3541b69d912435c50bb6ba87bec294ff4f6a2e1246121d8633921760443d9",
    "t10k-images-idx3-ubyte": "5b4141f0afbad91edebe8549f8fcffe087ea10ca49f1dbef5c9a5cd8815ce37b",
    "t10k-labels-idx1-ubyte": "0402a96d92fd2663957122ceb108a494c5af83dab82d92729df917d7dec38c34",
}

# Official mirrors (base URLs), tried in order.
MIRRORS: dict[str, tuple[str, ...]] = {
    "fashion_mnist": (
        "http://fashion-mnist.s3-website.eu-central-1.amazonaws.com/",
        "https://raw.githubusercontent.com/zalandoresearch/fashion-mnist/master/data/fashion/",
    ),
    "mnist": (
        "https://ossci-datasets.s3.amazonaws.com/mnist/",
        "http://yann.lecun.com/exdb/mnist/",
    ),
    "emnist": (
        "https://biometrics.nist.gov/cs_links/EMNIST/",
        "https://www.itl.nist.gov/iaui/vip/cs_links/EMNIST/",
    ),
    "cifar10": ("https://www.cs.toronto.edu/~kriz/",),
    "cifar100": ("https://www.cs.toronto.edu/~kriz/",),
    "cinic10": ("https://datashare.ed.ac.uk/bitstream/handle/10283/3192/",),
    "tiny_imagenet": ("http://cs231n.stanford.edu/",),
    "har": ("https://archive.ics.uci.edu/ml/machine-learning-databases/00240/",),
    # the copy of the ag_news_csv release that torchtext's AG_NEWS downloads
    "ag_news": (
        "https://raw.githubusercontent.com/mhjabreel/CharCnn_Keras/master/data/ag_news_csv/",
    ),
}


class DownloadFailed(Exception):
    """A network-level failure (internal; callers turn it into a PflkitError)."""


@dataclass(frozen=True)
class Failure:
    url: str
    reason: str


def resolve_mirrors(dataset: str, mirrors: str | Sequence[str] | None = None) -> list[str]:
    """Base URLs to try for ``dataset``: the option, else $PFLKIT_MIRROR, else the official."""
    if mirrors is not None:
        if isinstance(mirrors, str):
            mirrors = [mirrors]
        return [str(m) for m in mirrors]
    env = os.environ.get(MIRROR_ENV, "").strip()
    if env:
        return [_join(base, dataset) for base in env.split()]
    return list(MIRRORS.get(dataset, ()))


def _join(base: str, name: str) -> str:
    return base.rstrip("/") + "/" + name


def expected_checksum(dataset: str, filename: str) -> tuple[str, str]:
    try:
        return CHECKSUMS[dataset][filename]
    except KeyError:  # programming error: every downloadable file must have a digest
        raise RuntimeError(f"no checksum recorded for {dataset}/{filename}") from None


#: no "downloading ..." (nor "decoding ...") lines on stderr: the command line's -q sets it
QUIET = False


def notice(text: str, end: str = "\n") -> None:
    """A line about data being fetched or prepared, on stderr (nothing with :data:`QUIET`)."""
    if not QUIET:
        print(text, end=end, file=sys.stderr, flush=True)


def _progress_line(url: str, done: int, total: int | None) -> str:
    mb = done / 1e6
    if total:
        return f"\rdownloading {url}: {mb:.1f}/{total / 1e6:.1f} MB ({100 * done / total:.0f}%)"
    return f"\rdownloading {url}: {mb:.1f} MB"


def download_file(
    url: str, dest: Path, checksum: tuple[str, str], *, timeout: float = TIMEOUT_S
) -> None:
    """Download ``url`` to ``dest`` atomically and verify ``checksum`` = (algorithm, hexdigest).

    The bytes go to a temporary file next to ``dest`` that is renamed only after the digest
    matches, so no half-written file is ever left under the final name. Raises
    :class:`DownloadFailed` for network errors and :class:`PflkitError` for a digest mismatch
    (after deleting the downloaded bytes).
    """
    algorithm, expected = checksum
    tmp = dest.with_name(f".{dest.name}.part-{os.getpid()}")
    h = hashlib.new(algorithm)
    show = sys.stderr.isatty()
    try:
        try:
            req = urllib.request.Request(url, headers={"User-Agent": "pflkit"})
            with urllib.request.urlopen(req, timeout=timeout) as resp:
                dest.parent.mkdir(parents=True, exist_ok=True)
                with open(tmp, "wb") as out:
                    length = resp.headers.get("Content-Length")
                    total = int(length) if length and length.isdigit() else None
                    big = total is None or total > 5_000_000
                    if not show or not big:
                        notice(f"downloading {url}")
                    done, last = 0, 0.0
                    while chunk := resp.read(_CHUNK):
                        out.write(chunk)
                        h.update(chunk)
                        done += len(chunk)
                        if show and big and time.monotonic() - last > 0.5:
                            last = time.monotonic()
                            notice(_progress_line(url, done, total), end="")
                    if show and big:
                        notice(_progress_line(url, done, total))
            if total is not None and done != total:
                raise DownloadFailed(f"connection closed after {done} of {total} bytes")
        except urllib.error.HTTPError as e:
            raise DownloadFailed(f"HTTP {e.code} {e.reason}") from None
        except urllib.error.URLError as e:
            raise DownloadFailed(str(e.reason)) from None
        except (OSError, http.client.HTTPException, ValueError) as e:
            raise DownloadFailed(f"{type(e).__name__}: {e}") from None
        actual = h.hexdigest()
        if actual != expected:
            raise PflkitError(
                f"downloaded file {dest} from {url} has {algorithm} {actual} but {expected} "
                "was expected, so it was deleted; the mirror may be serving a different or "
                "damaged file: retry, or place the official file there yourself"
            )
        os.replace(tmp, dest)
    finally:
        tmp.unlink(missing_ok=True)


def fetch_files(
    dataset: str,
    filenames: Sequence[str],
    dest_dir: Path,
    *,
    mirrors: str | Sequence[str] | None = None,
    what: str,
    hint: str = "",
) -> None:
    """Download every file in ``filenames`` missing from ``dest_dir``, trying each mirror.

    ``what`` names the data set in errors ("Fashion-MNIST"); ``hint`` is appended to the fix.
    On total failure raises a PflkitError naming ``dest_dir``, the URL, the reason and the fix.
    """
    bases = resolve_mirrors(dataset, mirrors)
    for name in filenames:
        dest = dest_dir / name
        if dest.exists():
            continue
        checksum = expected_checksum(dataset, name)
        failures: list[Failure] = []
        for base in bases:
            url = _join(base, name)
            try:
                download_file(url, dest, checksum)
                break
            except DownloadFailed as e:
                failures.append(Failure(url, str(e)))
        else:
            tried = "; ".join(f"{f.url}: {f.reason}" for f in failures) or "no mirror configured"
            files = ", ".join(filenames)
            raise PflkitError(
                f"{what} files not found in {dest_dir} and the download failed ({tried}); "
                f"put {files} in {dest_dir}{hint}, or set {MIRROR_ENV} to a reachable mirror"
            )
