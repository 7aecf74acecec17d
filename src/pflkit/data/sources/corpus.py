"""A bundled text corpus for next-token prediction (task ``next_token``): ``python_docs``.

Every Python installation ships the texts of ``help()``'s topics (the language reference's
sections, ``pydoc_data.topics.topics``: 79 topics and about 465,000 characters in Python 3.11),
so the source needs no download and no extra package. The text differs between Python
versions; its SHA-256 is the source's ``fingerprint`` (part of the partition cache's key).

Processing:

- each topic's text, its newlines turned into spaces, is tokenized by
  :func:`~pflkit.data.sources.text.basic_english`;
- vocabulary over all topics (:func:`~pflkit.data.sources.text.build_vocab`: id 0 padding,
  never used here, 1 unknown, then by descending count), capped at ``max_vocab`` ids
  (default 2,000), tokens seen fewer than ``min_freq`` times are unknown (there is no
  official test set, so the vocabulary sees the clients' local test text too);
- each topic's id stream is cut into non-overlapping windows of ``seq_len`` + 1 tokens (the
  remainder of a topic is dropped, as are topics shorter than one window): the input is the
  first ``seq_len`` ids (float32, exact, like the other text sources), the target the last
  ``seq_len`` (int64 ``[N, seq_len]``): the next token at each position;
- the natural group of a window is its topic, so ``partition: {name: natural}`` gives one
  client per topic (the largest topics first); ``iid`` spreads the windows evenly.

``num_classes`` is the vocabulary size; the task is ``next_token`` (:mod:`pflkit.eval.tasks`).
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import torch

from pflkit.data.base import Source, SourceInfo, _opt_int
from pflkit.data.sources.text import FLOAT32_EXACT, UNK_ID, build_vocab, tokenize_all


def topics() -> dict[str, str]:
    """The help topics' texts of this Python (``pydoc_data.topics.topics``)."""
    from pydoc_data.topics import topics as texts

    return dict(sorted(texts.items()))


def windows(ids: list[int], seq_len: int) -> np.ndarray:
    """Non-overlapping ``[K, seq_len + 1]`` windows of ``ids`` (the remainder dropped)."""
    k = len(ids) // (seq_len + 1)
    return np.asarray(ids[: k * (seq_len + 1)], dtype=np.int64).reshape(k, seq_len + 1)


def _load_python_docs(
    root: Path, download: bool, *, seq_len: int = 32, max_vocab: int = 2000, min_freq: int = 1
) -> Source:
    ds = "python_docs"
    seq_len = _opt_int(ds, "seq_len", seq_len, 1)
    max_vocab = _opt_int(ds, "max_vocab", max_vocab, 3)
    min_freq = _opt_int(ds, "min_freq", min_freq, 1)
    texts = topics()
    names = list(texts)
    tokens = tokenize_all([t.replace("\n", " ") for t in texts.values()])
    vocab = build_vocab(tokens, min_freq, max_vocab)
    size = len(vocab) + 2
    assert size < FLOAT32_EXACT
    parts, groups = [], []
    for g, toks in enumerate(tokens):
        w = windows([vocab.get(t, UNK_ID) for t in toks], seq_len)
        parts.append(w)
        groups.append(np.full(len(w), g, dtype=np.int64))
    seqs = np.concatenate(parts)
    digest = hashlib.sha256("\0".join(f"{k}\0{v}" for k, v in texts.items()).encode())
    return Source(
        ds,
        torch.from_numpy(seqs[:, :-1].astype(np.float32)),
        torch.from_numpy(np.ascontiguousarray(seqs[:, 1:])),
        None,
        None,
        size,
        train_groups=np.concatenate(groups),
        group_names=names,
        fingerprint=digest.hexdigest()[:16],
        task="next_token",
    )


ENTRIES: list[SourceInfo] = [
    SourceInfo(
        "python_docs",
        "Python's bundled help-topic texts (pydoc_data, offline) for next-token prediction: "
        "windows of seq_len token ids, vocabulary max_vocab, grouped by topic (79)",
        _load_python_docs,
    ),
]
