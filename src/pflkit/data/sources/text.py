"""Text sources of GPFL (Zhang et al., ICCV 2023): AG News and the Amazon Review sentiment set.

Both are read from their official files; this module's ``ENTRIES`` register them in
:data:`pflkit.data.sources.SOURCES` as ``ag_news`` and ``amazon_review``.

**AG News** (Zhang, Zhao & LeCun, "Character-level convolutional networks for text
classification", NeurIPS 2015; the ``ag_news_csv`` release): ``train.csv`` (120,000 rows) and
``test.csv`` (7,600 rows), each row ``"class index","title","description"`` with class 1..4
(World, Sports, Business, Sci/Tech). Quoting is standard CSV (``""`` inside a quoted field is one
``"``); the release's readme says line breaks are escaped as a backslash + ``n``; these and the
other literal backslashes of the text are kept as they are, as torchtext's ``AG_NEWS`` keeps
them. Processing (GPFL's data came from PFLlib's 2023 ``dataset/generate_agnews.py``):

- text = title + ``" "`` + description (torchtext's ``AG_NEWS`` joins the columns so);
- tokens = :func:`basic_english` (torchtext's ``get_tokenizer("basic_english")``, rule for rule);
- vocabulary from the **training split only**: id 0 = padding, id 1 = unknown, then every token
  seen at least ``min_freq`` times in ``train.csv``, by descending count, ties in alphabetical
  (code-point) order, which is the order of torchtext's ``build_vocab_from_iterator``;
  ``max_vocab`` (total size, both special ids included) keeps only the most frequent ones;
- each text becomes its first ``max_len`` token ids, padded with 0 up to ``max_len`` (200, as
  PFLlib); a token missing from the vocabulary (e.g. seen only in ``test.csv``) becomes 1;
- labels 1..4 become 0..3.

Differences from PFLlib's 2023 script, which produced GPFL's AG News: it builds the
vocabulary from train + test together, with ``<unk>`` = id 0 = the padding id and no
separate padding id (GPFL's ``main.py`` hard-codes ``vocab_size = 98635`` for it); it merges the
two splits and partitions the merged set, splitting every client 75/25. pflkit keeps
``test.csv`` as the global test set (``Source.test_x``), partitions ``train.csv``, and lets
``data.test_fraction`` split every client (0.25 gives PFLlib's 75/25). Current PFLlib
(``utils/language_utils.tokenizer``) instead caps the vocabulary at 32,000 with four specials
and starts every text with a ``<cls>`` id; ``max_vocab: 32000`` gives the same cap here, not the
specials. The token ids travel in ``Source.train_x`` as **float32** (exact for every integer
below 2**24, which the loader checks) because every source in the pipeline is float32 and the
algorithms, codecs and device moves never need to know about text; the text models
(:mod:`pflkit.models.text`) cast them to int64 and refuse anything that is not an id of their
vocabulary. Download: ``train.csv`` and ``test.csv`` from the copy torchtext downloads, checked
against torchtext's MD5s (:mod:`pflkit.data.download`); the release archive
``ag_news_csv.tar.gz``, when present, is read instead.

**Amazon Review** (Blitzer et al.'s multi-domain sentiment data in the pre-processed form that
MDAN, Zhao et al. 2018, distributes and KD3A and PFLlib read): one ``amazon.npz`` with the keys (verified in
hanzhaoml/MDAN ``main_amazon.py``, FengHZ/KD3A ``datasets/AmazonReview.py`` and PFLlib
``dataset/generate_AmazonReview.py``, which read it the same way) ``xx_data``, ``xx_row``,
``xx_col``, ``xx_shape`` (a sparse matrix stored transposed: sample ``xx_col[k]``, feature
``xx_row[k]``, value ``xx_data[k]``, shape ``xx_shape[::-1]`` = samples x features, repeated
entries summed), ``yy`` (labels -1/+1) and ``offset`` (the first index of each domain and the
total: books, dvd, electronics, kitchen). Kept: the first ``num_features`` (5,000) feature
columns as dense float32, labels mapped to (y + 1) / 2, and the domain of every sample as its
natural group, so ``partition: {name: natural}`` with 4 clients gives one client per domain.
There is no official test set (``data.test_fraction`` splits each client; 0.25 = PFLlib's 75/25).
MDAN's log (``amazon.log``) of the same file reports 27,677 samples, 2,140,430 non-zeros in the
first 5,000 columns and 6,465 / 5,586 / 7,681 / 7,945 samples per domain. The dense matrix is
about 550 MB. It is **not downloaded**: the only published copies are behind Google Drive links
with no published checksum, so the loader asks for the file.
"""

from __future__ import annotations

import csv
import io
import re
import tarfile
import zipfile
import zlib
from collections import Counter
from collections.abc import Iterable, Sequence
from itertools import chain
from pathlib import Path

import numpy as np
import torch

from pflkit.data import download as dl
from pflkit.data.base import (
    Source,
    SourceInfo,
    _corrupt,
    _missing,
    _opt_int,
    _opt_mirrors,
    _read_maybe_gz,
)
from pflkit.errors import PflkitError

__all__ = [
    "AG_NEWS_CLASSES",
    "AMAZON_DOMAINS",
    "basic_english",
    "build_vocab",
    "encode",
    "texts_to_ids",
    "tokenize_all",
]

AG_NEWS_CLASSES = ["World", "Sports", "Business", "Sci/Tech"]  # the release's classes.txt
AMAZON_DOMAINS = ["books", "dvd", "electronics", "kitchen"]  # order of amazon.npz's offsets
AMAZON_KEYS = ("xx_data", "xx_row", "xx_col", "xx_shape", "yy", "offset")
PAD_ID, UNK_ID = 0, 1
FLOAT32_EXACT = 1 << 24  # every integer below this is exact in float32

# torchtext's basic_english rules, applied in this order to the lower-cased text; the last
# one only collapses whitespace before the final split on whitespace.
_BASIC_ENGLISH_RULES = [
    (re.compile(pattern), replacement)
    for pattern, replacement in (
        ("'", " '  "),  # an apostrophe becomes its own token
        ('"', ""),  # double quotes are dropped
        (r"\.", " . "),
        ("<br />", " "),  # an HTML line break is a space
        (",", " , "),
        (r"\(", " ( "),
        (r"\)", " ) "),
        ("!", " ! "),
        (r"\?", " ? "),
        (";", " "),  # semicolons and colons are dropped
        (":", " "),
        (r"\s+", " "),
    )
]


def basic_english(text: str) -> list[str]:
    """torchtext's ``basic_english`` tokenizer (the Python one ``get_tokenizer`` returns).

    Lower-case (Python's Unicode ``str.lower``; torchtext's C++ variant lowers ASCII only), put
    spaces around ``'`` ``.`` ``,`` ``(`` ``)`` ``!`` ``?``, drop ``"``, replace ``<br />``,
    ``;`` and ``:`` by a space, split on whitespace. Everything else (hyphens, ``$``, ``#``,
    backslashes, digits) stays inside its token: ``"Wall St.'s $5-bn (deal)"`` ->
    ``['wall', 'st', '.', "'", 's', '$5-bn', '(', 'deal', ')']``.
    """
    line = text.lower()
    for pattern, replacement in _BASIC_ENGLISH_RULES:
        line = pattern.sub(replacement, line)
    return line.split()


def tokenize_all(texts: Sequence[str]) -> list[list[str]]:
    """``[basic_english(t) for t in texts]``, several times faster on a large corpus.

    The texts are joined with newlines and every rule but the last runs once on the whole:
    no rule matches or writes a newline, so the lines stay the texts. The last rule (collapse
    whitespace) is left to ``str.split``, which splits on the same characters (both use
    Unicode's whitespace property). A text that holds a newline itself takes the slow path.
    """
    if any("\n" in t for t in texts):
        return [basic_english(t) for t in texts]
    blob = "\n".join(texts).lower()
    for pattern, replacement in _BASIC_ENGLISH_RULES[:-1]:
        blob = pattern.sub(replacement, blob)
    return [line.split() for line in blob.split("\n")] if texts else []


def build_vocab(
    token_lists: Iterable[Sequence[str]], min_freq: int = 1, max_size: int | None = None
) -> dict[str, int]:
    """token -> id, ids from 2 (0 = padding, 1 = unknown): the tokens seen at least
    ``min_freq`` times, by descending count, ties alphabetically; with ``max_size`` only the
    ``max_size - 2`` most frequent (the vocabulary, special ids included, has ``max_size``
    ids)."""
    counts = Counter(chain.from_iterable(token_lists))
    ranked = sorted((item for item in counts.items() if item[1] >= min_freq), key=_rank)
    if max_size is not None:
        ranked = ranked[: max(max_size - 2, 0)]
    return {token: i + 2 for i, (token, _) in enumerate(ranked)}


def _rank(item: tuple[str, int]) -> tuple[int, str]:
    return -item[1], item[0]


def encode(tokens: Sequence[str], vocab: dict[str, int], max_len: int) -> list[int]:
    """The ids of the first ``max_len`` tokens (unknown -> 1), padded with 0 to ``max_len``."""
    ids = [vocab.get(t, UNK_ID) for t in tokens[:max_len]]
    return ids + [PAD_ID] * (max_len - len(ids))


# --------------------------------------------------------------------------------------------
# AG News
# --------------------------------------------------------------------------------------------

_AG_FILES = ("train.csv", "test.csv")


def _ag_news_bytes(home: Path, download: bool, mirrors: tuple[str, ...] | None) -> list[tuple]:
    """(bytes, path) of train.csv and test.csv: from ``home`` or ``home/ag_news_csv``, else
    from the release archive ``home/ag_news_csv.tar.gz``, else downloaded into ``home``."""
    for directory in (home, home / "ag_news_csv"):
        if all((directory / f).is_file() for f in _AG_FILES):
            return [(_read_maybe_gz(directory / f), directory / f) for f in _AG_FILES]
    archive = home / "ag_news_csv.tar.gz"
    if archive.is_file():
        return _ag_news_from_tar(archive)
    hint = " (or the release archive ag_news_csv.tar.gz)"
    if not download:
        raise _missing("AG News", home, list(_AG_FILES), hint)
    missing = [f for f in _AG_FILES if not (home / f).is_file()]
    dl.fetch_files("ag_news", missing, home, mirrors=mirrors, what="AG News", hint=hint)
    return [(_read_maybe_gz(home / f), home / f) for f in _AG_FILES]


def _ag_news_from_tar(archive: Path) -> list[tuple]:
    found: dict[str, tuple] = {}
    try:
        with tarfile.open(archive, "r:*") as tar:
            for member in tar:
                base = Path(member.name).name
                if base in _AG_FILES and member.isfile() and base not in found:
                    fobj = tar.extractfile(member)
                    assert fobj is not None
                    found[base] = (fobj.read(), archive / member.name)
    except (tarfile.TarError, EOFError, zlib.error, OSError) as e:
        raise _corrupt(archive, f"{type(e).__name__}: {e}") from None
    lacking = [f for f in _AG_FILES if f not in found]
    if lacking:
        raise _corrupt(archive, f"it lacks {', '.join(lacking)}")
    return [found[f] for f in _AG_FILES]


def _read_ag_csv(data: bytes, path: Path) -> tuple[list[str], np.ndarray]:
    """Texts (title + " " + description) and labels 0..3 of one AG News CSV file."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise _corrupt(path, f"not UTF-8 text: {e}") from None
    reader = csv.reader(io.StringIO(text, newline=""), strict=True)
    texts: list[str] = []
    labels: list[int] = []
    try:
        for row in reader:
            if not row:
                continue  # a blank line
            cls = row[0].strip()
            if len(row) < 2 or cls not in ("1", "2", "3", "4"):
                raise _corrupt(
                    path,
                    f"line {reader.line_num} is {row[:3]!r}, expected "
                    '"class index","title","description" with class index 1..4',
                )
            labels.append(int(cls) - 1)
            texts.append(" ".join(row[1:]))
    except csv.Error as e:
        raise _corrupt(path, f"bad CSV near line {reader.line_num}: {e}") from None
    if not texts:
        raise _corrupt(path, "it holds no rows")
    return texts, np.asarray(labels, dtype=np.int64)


def _ids_tensor(docs: list[list[str]], vocab: dict[str, int], max_len: int) -> torch.Tensor:
    """``[encode(d, vocab, max_len) for d in docs]`` as a float32 tensor, filled row by row."""
    out = np.zeros((len(docs), max_len), dtype=np.float32)  # PAD_ID = 0
    get = vocab.get
    for i, tokens in enumerate(docs):
        ids = [get(t, UNK_ID) for t in tokens[:max_len]]
        out[i, : len(ids)] = ids
    return torch.from_numpy(out)


def texts_to_ids(
    what: str,
    train_texts: Sequence[str],
    test_texts: Sequence[str] | None,
    max_len: int,
    min_freq: int = 1,
    max_vocab: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Token ids ``[N, max_len]`` (float32) of the training and test texts: :func:`tokenize_all`,
    a vocabulary from the training texts only (:func:`build_vocab`), :func:`encode`. ``what``
    names the data set in the error for a vocabulary larger than float32 holds exactly."""
    train_tokens = tokenize_all(train_texts)
    vocab = build_vocab(train_tokens, min_freq, max_vocab)
    size = len(vocab) + 2
    if size > FLOAT32_EXACT:
        raise PflkitError(
            f"the {what} vocabulary has {size} ids, more than float32 holds exactly "
            f"({FLOAT32_EXACT}): set data.options.max_vocab or raise data.options.min_freq"
        )
    train_x = _ids_tensor(train_tokens, vocab, max_len)
    del train_tokens
    test_x = None if test_texts is None else _ids_tensor(tokenize_all(test_texts), vocab, max_len)
    return train_x, test_x


def _load_ag_news(
    root: Path,
    download: bool,
    *,
    max_len: int = 200,
    min_freq: int = 1,
    max_vocab: int | None = None,
    mirrors: str | list[str] | None = None,
) -> Source:
    """AG News: token ids ``[N, max_len]`` as float32, train-only vocabulary (module doc)."""
    ds = "ag_news"
    max_len = _opt_int(ds, "max_len", max_len, 1)
    min_freq = _opt_int(ds, "min_freq", min_freq, 1)
    if max_vocab is not None:
        max_vocab = _opt_int(ds, "max_vocab", max_vocab, 3)
    mirrors_t = _opt_mirrors(ds, mirrors)
    (train_raw, train_path), (test_raw, test_path) = _ag_news_bytes(root / ds, download, mirrors_t)
    train_texts, train_y = _read_ag_csv(train_raw, train_path)
    test_texts, test_y = _read_ag_csv(test_raw, test_path)
    train_x, test_x = texts_to_ids("AG News", train_texts, test_texts, max_len, min_freq, max_vocab)
    return Source(
        ds,
        train_x,
        torch.from_numpy(train_y),
        test_x,
        torch.from_numpy(test_y),
        4,
        class_names=list(AG_NEWS_CLASSES),
    )


# --------------------------------------------------------------------------------------------
# Amazon Review (MDAN / KD3A amazon.npz)
# --------------------------------------------------------------------------------------------

AMAZON_HOWTO = (
    "the MDAN/KD3A multi-domain sentiment file with keys xx_data, xx_row, xx_col, xx_shape, yy "
    "and offset, which PFLlib's dataset/generate_AmazonReview.py downloads from Google Drive; "
    "pflkit does not download it because no copy has a published checksum"
)


def _npz_arrays(path: Path) -> dict[str, np.ndarray]:
    try:
        archive = np.load(path, allow_pickle=False)
    except PermissionError as e:
        raise PflkitError(f"cannot read file {path} ({e.strerror}); check the path") from None
    except (zipfile.BadZipFile, EOFError, zlib.error, ValueError, OSError) as e:
        raise _corrupt(path, f"not a readable .npz archive: {type(e).__name__}: {e}") from None
    if not isinstance(archive, np.lib.npyio.NpzFile):
        raise _corrupt(path, "it is a single .npy array, not an .npz archive")
    with archive:
        lacking = [k for k in AMAZON_KEYS if k not in archive.files]
        if lacking:
            raise _corrupt(path, f"it lacks the keys {', '.join(lacking)}; expected {AMAZON_HOWTO}")
        try:
            return {k: np.asarray(archive[k]) for k in AMAZON_KEYS}
        except (zipfile.BadZipFile, EOFError, zlib.error, ValueError, OSError) as e:
            raise _corrupt(path, f"cannot read its arrays: {type(e).__name__}: {e}") from None


def _as_int_vector(a: np.ndarray, name: str, path: Path) -> np.ndarray:
    flat = a.ravel()
    if flat.size and not np.issubdtype(flat.dtype, np.integer):
        if not np.issubdtype(flat.dtype, np.floating) or not np.all(flat == np.round(flat)):
            raise _corrupt(path, f"'{name}' holds non-integer values ({flat.dtype})")
    return flat.astype(np.int64)


def _load_amazon_review(root: Path, download: bool, *, num_features: int = 5000) -> Source:
    """Amazon Review (``amazon.npz``): bag-of-words float32 ``[N, num_features]``, 2 classes,
    grouped by domain (module doc)."""
    from scipy.sparse import coo_matrix

    ds = "amazon_review"
    num_features = _opt_int(ds, "num_features", num_features, 1)
    home = root / ds
    path = home / "amazon.npz"
    if not path.is_file():
        raise PflkitError(
            f"Amazon Review file not found: put amazon.npz ({AMAZON_HOWTO}) in {home}"
        )
    z = _npz_arrays(path)
    shape = _as_int_vector(z["xx_shape"], "xx_shape", path)
    if shape.size != 2 or shape.min() < 1:
        raise _corrupt(path, f"'xx_shape' is {shape.tolist()}, expected [features, samples]")
    n_feat, n = int(shape[0]), int(shape[1])  # stored transposed
    rows = _as_int_vector(z["xx_row"], "xx_row", path)  # feature index
    cols = _as_int_vector(z["xx_col"], "xx_col", path)  # sample index
    values = z["xx_data"].ravel()
    if not (len(values) == len(rows) == len(cols)):
        raise _corrupt(
            path,
            f"'xx_data', 'xx_row', 'xx_col' have {len(values)}, {len(rows)}, {len(cols)} "
            "entries, expected the same number",
        )
    if len(rows) and (rows.min() < 0 or rows.max() >= n_feat or cols.min() < 0 or cols.max() >= n):
        raise _corrupt(path, f"sparse indices fall outside xx_shape {[n_feat, n]}")
    if num_features > n_feat:
        raise PflkitError(
            f"option 'num_features' of dataset '{ds}' is {num_features} but {path} has only "
            f"{n_feat} features: set it to at most {n_feat}"
        )
    yy = z["yy"].ravel()
    if len(yy) != n or not np.isin(yy, (-1, 1)).all():
        raise _corrupt(path, f"'yy' must hold {n} labels in {{-1, 1}}, got {len(yy)} values")
    offset = _as_int_vector(z["offset"], "offset", path)
    ok = len(offset) >= 5 and offset[0] == 0 and offset[4] == n
    if not ok or np.any(np.diff(offset[:5]) < 0):
        raise _corrupt(
            path,
            f"'offset' is {offset[:6].tolist()}, expected the 4 domain starts then {n}, "
            "non-decreasing from 0",
        )
    # KD3A/MDAN: coo_matrix((data, (col, row)), shape=xx_shape[::-1]) then the first columns
    matrix = coo_matrix((values, (cols, rows)), shape=(n, n_feat)).tocsc()[:, :num_features]
    x = matrix.astype(np.float32).toarray()
    y = ((yy.astype(np.int64) + 1) // 2).astype(np.int64)
    groups = np.repeat(np.arange(4, dtype=np.int64), np.diff(offset[:5]))
    return Source(
        ds,
        torch.from_numpy(x),
        torch.from_numpy(y),
        None,
        None,
        2,
        train_groups=groups,
        group_names=list(AMAZON_DOMAINS),
        class_names=["negative", "positive"],
    )


ENTRIES: list[SourceInfo] = [
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
]
