"""GPFL's text data and models: AG News (official CSVs) and Amazon Review (MDAN/KD3A npz),
fastText and AmazonMLP. Every file is written tiny in tmp_path in the official format; every
expected id, count and parameter number is worked out by hand in the comments."""

from __future__ import annotations

import hashlib
import io
import re
import tarfile
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from pflkit.config import DataConfig
from pflkit.data import download as dl
from pflkit.data.federated import build_federated
from pflkit.data.sources import SOURCES, clear_cache, load_source, text
from pflkit.data.sources.text import basic_english, build_vocab, encode, tokenize_all
from pflkit.engine.runner import run_experiment
from pflkit.errors import PflkitError
from pflkit.models import MODELS, build_model

pytestmark = pytest.mark.usefixtures("one_thread", "fresh_source_cache")


# ------------------------------------------------------------------------------------------
# tokenizer and vocabulary
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "sentence, tokens",
    [
        ("Hello, World!", ["hello", ",", "world", "!"]),
        ("Wall St.'s $5-bn (deal)?", ["wall", "st", ".", "'", "s", "$5-bn", "(", "deal", ")", "?"]),
        ('He said "no"; then: <br />left', ["he", "said", "no", "then", "left"]),
        ("dwindling\\band  \t of  #39;", ["dwindling\\band", "of", "#39"]),
        ("", []),
        ("ÉCOLE Über", ["école", "über"]),  # Python's Unicode lower()
    ],
)
def test_basic_english_by_hand(sentence, tokens):
    assert basic_english(sentence) == tokens


def _regex_oracle(line: str) -> list[str]:
    """torchtext's rules written out again, one regex at a time, as an independent check."""
    rules = [("'", " '  "), ('"', ""), (r"\.", " . "), (r"<br \/>", " "), (",", " , ")]
    rules += [(r"\(", " ( "), (r"\)", " ) "), (r"\!", " ! "), (r"\?", " ? "), (r"\;", " ")]
    rules += [(r"\:", " "), (r"\s+", " ")]
    line = line.lower()
    for pattern, replacement in rules:
        line = re.sub(pattern, replacement, line)
    return line.split()


TRICKY = [
    "ΟΔΥΣΣΕΥΣ wins",  # Greek final sigma depends on the next character
    "a\xa0b\x1cc\u2028d",  # no-break space, file separator, line separator
    'x<br "/>y',  # dropping the quote makes a <br /> that the next rule removes
    "Fed's rate: 2.5%; (up)!?",
    "",
    "trailing space ",
]


def test_batched_tokenizer_equals_the_one_text_tokenizer():
    expected = [_regex_oracle(t) for t in TRICKY]
    assert [basic_english(t) for t in TRICKY] == expected
    assert tokenize_all(TRICKY) == expected
    assert tokenize_all([*TRICKY, "two\nlines"]) == [*expected, ["two", "lines"]]
    assert tokenize_all([]) == []
    assert expected[2] == ["x", "y"]


def test_vocabulary_order_min_freq_and_cap():
    docs = [["b", "a", "c"], ["c", "b", "d"], ["c"]]  # c: 3, b: 2, a: 1, d: 1
    assert build_vocab(docs) == {"c": 2, "b": 3, "a": 4, "d": 5}  # ties alphabetically
    assert build_vocab(docs, min_freq=2) == {"c": 2, "b": 3}
    assert build_vocab(docs, max_size=4) == {"c": 2, "b": 3}  # 4 ids: pad, unk, c, b
    vocab = {"c": 2, "b": 3}
    assert encode(["b", "zz", "c"], vocab, 5) == [3, 1, 2, 0, 0]  # unknown 1, padding 0
    assert encode(["b", "zz", "c"], vocab, 2) == [3, 1]  # truncated to the first max_len


# ------------------------------------------------------------------------------------------
# AG News
# ------------------------------------------------------------------------------------------

# Official layout: "class index","title","description"; "" is a quote inside a quoted field;
# the release keeps backslashes literally (\b here is a backslash and a b, not an escape).
TRAIN_CSV = (
    '"3","Stocks up, bonds down","Traders say ""buy"" now\\band later"\n'
    '"4","Stocks fall","Chip maker\'s stocks fall."\n'
    '"1","Peace (talks)","Up!"\n'
)
TEST_CSV = '"2","Goal! Stocks","New coach"\n'
# train tokens:
#   stocks up , bonds down traders say buy now\band later
#   stocks fall chip maker ' s stocks fall .
#   peace ( talks ) up !
# counts: stocks 3, fall 2, up 2, the rest 1 -> ids by count, ties by code point:
VOCAB = {"stocks": 2, "fall": 3, "up": 4, "!": 5, "'": 6, "(": 7, ")": 8, ",": 9, ".": 10}
VOCAB |= {"bonds": 11, "buy": 12, "chip": 13, "down": 14, "later": 15, "maker": 16}
VOCAB |= {"now\\band": 17, "peace": 18, "s": 19, "say": 20, "talks": 21, "traders": 22}
TRAIN_IDS = [
    [2, 4, 9, 11, 14, 22, 20, 12, 17, 15, 0, 0],
    [2, 3, 13, 16, 6, 19, 2, 3, 10, 0, 0, 0],
    [18, 7, 21, 8, 4, 5, 0, 0, 0, 0, 0, 0],
]
TEST_IDS = [[1, 5, 2, 1, 1, 0, 0, 0, 0, 0, 0, 0]]  # goal, new, coach: only in test.csv -> 1


def write_ag(directory: Path, train: str = TRAIN_CSV, test: str = TEST_CSV) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "train.csv").write_bytes(train.encode())
    (directory / "test.csv").write_bytes(test.encode())


def test_vocabulary_of_the_tiny_train_csv_by_hand():
    rows = [r.split('","', 1)[1] for r in TRAIN_CSV.splitlines()]
    texts = [r.rstrip('"').replace('","', " ").replace('""', '"') for r in rows]
    assert build_vocab([basic_english(t) for t in texts]) == VOCAB


def test_ag_news_ids_labels_and_test_only_words(tmp_path):
    write_ag(tmp_path / "ag_news")
    src = load_source("ag_news", root=tmp_path, download=False, max_len=12)
    assert src.name == "ag_news" and src.num_classes == 4
    assert src.class_names == ["World", "Sports", "Business", "Sci/Tech"]
    assert src.train_x.dtype == torch.float32 and src.input_shape == (12,)
    assert src.train_x.tolist() == TRAIN_IDS
    assert src.test_x.tolist() == TEST_IDS
    assert src.train_y.tolist() == [2, 3, 0] and src.test_y.tolist() == [1]  # 1..4 -> 0..3
    assert src.train_y.dtype == torch.int64 and src.train_groups is None


def test_ag_news_truncation_min_freq_and_max_vocab(tmp_path):
    write_ag(tmp_path / "ag_news")
    short = load_source("ag_news", root=tmp_path, download=False, max_len=4)
    assert short.train_x.tolist() == [row[:4] for row in TRAIN_IDS]
    # min_freq 2 keeps stocks (2), fall (3), up (4)
    frequent = load_source("ag_news", root=tmp_path, download=False, max_len=6, min_freq=2)
    assert frequent.train_x.tolist()[2] == [1, 1, 1, 1, 4, 1]
    # 4 ids in all: padding, unknown, stocks, fall; 'up' becomes unknown
    capped = load_source("ag_news", root=tmp_path, download=False, max_len=3, max_vocab=4)
    assert capped.train_x.tolist() == [[2, 1, 1], [2, 3, 1], [1, 1, 1]]
    assert SOURCES["ag_news"].options == {
        "max_len": 200,
        "min_freq": 1,
        "max_vocab": None,
        "mirrors": None,
    }


def test_ag_news_from_the_release_archive_and_subfolder(tmp_path):
    home = tmp_path / "a" / "ag_news"
    home.mkdir(parents=True)
    with tarfile.open(home / "ag_news_csv.tar.gz", "w:gz") as tar:
        for name, body in (("train.csv", TRAIN_CSV), ("test.csv", TEST_CSV), ("classes.txt", "")):
            info = tarfile.TarInfo(f"ag_news_csv/{name}")
            info.size = len(body.encode())
            tar.addfile(info, io.BytesIO(body.encode()))
    src = load_source("ag_news", root=tmp_path / "a", download=False, max_len=12)
    assert src.train_x.tolist() == TRAIN_IDS
    write_ag(tmp_path / "b" / "ag_news" / "ag_news_csv")  # the extracted release folder
    src = load_source("ag_news", root=tmp_path / "b", download=False, max_len=12)
    assert src.test_x.tolist() == TEST_IDS


def test_ag_news_missing_and_corrupt_files(tmp_path):
    home = tmp_path / "ag_news"
    with pytest.raises(PflkitError, match=f"AG News files not found in {home}; put train.csv"):
        load_source("ag_news", root=tmp_path, download=False)
    bad_rows = {
        '"5","title","text"\n': "line 4 .*class index 1..4",
        '"1"\n': "line 4 .*expected",
        '"1","open quote\n': "bad CSV",
        "": "holds no rows",
    }
    for body, match in bad_rows.items():
        clear_cache()
        write_ag(home, train=TRAIN_CSV + body if body else "")
        with pytest.raises(PflkitError, match=f"{home / 'train.csv'} is corrupt.*{match}"):
            load_source("ag_news", root=tmp_path, download=False)
    clear_cache()
    (home / "train.csv").write_bytes(b'"1","caf\xe9","latin-1"\n')
    with pytest.raises(PflkitError, match="train.csv is corrupt.*not UTF-8.*delete it"):
        load_source("ag_news", root=tmp_path, download=False)
    with pytest.raises(PflkitError, match="option 'max_len' of dataset 'ag_news'.*>= 1"):
        load_source("ag_news", root=tmp_path, download=False, max_len=0)
    with pytest.raises(PflkitError, match="option 'max_vocab' of dataset 'ag_news'.*>= 3"):
        load_source("ag_news", root=tmp_path, download=False, max_vocab=2)


def test_ag_news_vocabulary_must_fit_float32(tmp_path, monkeypatch):
    write_ag(tmp_path / "ag_news")
    monkeypatch.setattr(text, "FLOAT32_EXACT", 20)  # the tiny vocabulary has 23 ids
    with pytest.raises(PflkitError, match="23 ids, more than float32 holds exactly"):
        load_source("ag_news", root=tmp_path, download=False)


def test_ag_news_download_from_file_mirror(tmp_path, monkeypatch):
    mirror = tmp_path / "mirror"
    write_ag(mirror)
    table = {
        f: ("md5", hashlib.md5((mirror / f).read_bytes()).hexdigest())
        for f in ("train.csv", "test.csv")
    }
    real = dict(dl.CHECKSUMS["ag_news"])
    assert real == {  # torchtext AG_NEWS.MD5
        "train.csv": ("md5", "b1a00f826fdfbd249f79597b59e1dc12"),
        "test.csv": ("md5", "d52ea96a97a2d943681189a97654912d"),
    }
    with pytest.raises(PflkitError, match="train.csv .*md5 .* but b1a00f826fdf"):
        load_source("ag_news", root=tmp_path / "r0", mirrors=mirror.as_uri())
    monkeypatch.setitem(dl.CHECKSUMS, "ag_news", table)
    src = load_source("ag_news", root=tmp_path / "r", mirrors=mirror.as_uri(), max_len=12)
    assert src.train_x.tolist() == TRAIN_IDS
    assert sorted(p.name for p in (tmp_path / "r" / "ag_news").iterdir()) == [
        "test.csv",
        "train.csv",
    ]


# ------------------------------------------------------------------------------------------
# Amazon Review
# ------------------------------------------------------------------------------------------

# 10 samples x 7 features, stored as MDAN does: transposed (row = feature, col = sample).
# (sample, feature, value); sample 4 has feature 1 twice (summed: 3 + 2 = 5).
ENTRIES = [(0, 0, 1.0), (0, 4, 2.0), (1, 6, 9.0), (2, 2, 1.0), (3, 1, 4.0), (4, 1, 3.0)]
ENTRIES += [(4, 1, 2.0), (5, 5, 7.0), (6, 3, 1.0), (7, 0, 2.0), (8, 4, 1.0), (9, 2, 6.0)]
YY = [1, -1, 1, -1, -1, 1, 1, -1, 1, -1]
OFFSET = [0, 3, 5, 8, 10]  # books 0-2, dvd 3-4, electronics 5-7, kitchen 8-9


def write_amazon(directory: Path, **override) -> Path:
    s, f, v = (np.array(c) for c in zip(*ENTRIES, strict=True))
    arrays = {
        "xx_data": v,
        "xx_row": f,
        "xx_col": s,
        "xx_shape": np.array([7, 10]),
        "yy": np.array(YY).reshape(-1, 1),
        "offset": np.array(OFFSET).reshape(-1, 1),
    }
    arrays.update(override)
    arrays = {k: a for k, a in arrays.items() if a is not None}
    directory.mkdir(parents=True, exist_ok=True)
    np.savez(directory / "amazon.npz", **arrays)
    return directory / "amazon.npz"


def test_amazon_features_labels_and_domains(tmp_path):
    write_amazon(tmp_path / "amazon_review")
    src = load_source("amazon_review", root=tmp_path, download=False, num_features=5)
    expected = np.zeros((10, 5), dtype=np.float32)  # features 5 and 6 are cut
    expected[0, 0], expected[0, 4], expected[2, 2], expected[3, 1] = 1, 2, 1, 4
    expected[4, 1], expected[6, 3], expected[7, 0], expected[8, 4], expected[9, 2] = 5, 1, 2, 1, 6
    assert src.train_x.dtype == torch.float32
    np.testing.assert_array_equal(src.train_x.numpy(), expected)
    assert src.train_y.tolist() == [1, 0, 1, 0, 0, 1, 1, 0, 1, 0]  # -1 -> 0, 1 -> 1
    assert src.train_groups.tolist() == [0, 0, 0, 1, 1, 2, 2, 2, 3, 3]
    assert src.group_names == ["books", "dvd", "electronics", "kitchen"]
    assert src.test_x is None and src.num_classes == 2
    full = load_source("amazon_review", root=tmp_path, download=False, num_features=7)
    assert full.train_x[1, 6] == 9.0 and full.train_x[5, 5] == 7.0
    assert SOURCES["amazon_review"].options == {"num_features": 5000}


def test_amazon_natural_partition_gives_one_client_per_domain(tmp_path):
    write_amazon(tmp_path / "amazon_review")
    cfg = DataConfig(
        dataset="amazon_review",
        root=str(tmp_path),
        options={"num_features": 5},
        num_clients=4,
        partition={"name": "natural"},
        test_fraction=0.25,
        cache=False,
    )
    fed = build_federated(cfg)
    domains = [range(a, b) for a, b in zip(OFFSET, OFFSET[1:], strict=False)]
    for tr, te, dom in zip(fed.train_indices, fed.test_indices, domains, strict=True):
        assert sorted([*tr, *te]) == list(dom) and len(te) == 1  # max(int(0.25 n), 1)
    assert fed.test_x.shape == (4, 5)  # no official test set: the clients' test parts


def test_amazon_missing_and_corrupt_files(tmp_path):
    home = tmp_path / "amazon_review"
    with pytest.raises(PflkitError, match=f"put amazon.npz .*in {home}$"):
        load_source("amazon_review", root=tmp_path)
    cases = [
        ({"yy": None}, "lacks the keys yy"),
        ({"offset": np.array([0, 3, 5, 8])}, "'offset' is \\[0, 3, 5, 8\\]"),
        ({"offset": np.array([0, 5, 3, 8, 10])}, "non-decreasing"),
        ({"yy": np.array([0] * 10)}, "'yy' must hold 10 labels in"),
        ({"xx_shape": np.array([7, 9])}, "outside xx_shape"),
        ({"xx_row": np.array([0] * 11)}, "12, 11, 12 entries"),
        ({"xx_col": np.arange(12) * 0.5}, "non-integer"),
    ]
    for override, match in cases:
        clear_cache()
        path = write_amazon(home, **override)
        with pytest.raises(PflkitError, match=f"{path} is corrupt.*{match}"):
            load_source("amazon_review", root=tmp_path, num_features=5)
    clear_cache()
    path.write_bytes(b"not a zip")
    with pytest.raises(PflkitError, match="amazon.npz is corrupt.*not a readable .npz"):
        load_source("amazon_review", root=tmp_path, num_features=5)
    clear_cache()
    write_amazon(home)
    with pytest.raises(PflkitError, match="'num_features' .* is 8 but .* has only 7 features"):
        load_source("amazon_review", root=tmp_path, num_features=8)


# ------------------------------------------------------------------------------------------
# models
# ------------------------------------------------------------------------------------------


def _count(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def test_model_shapes_and_parameter_counts():
    # fastText, GPFL's sizes: embedding 98,635 x 32 = 3,156,320; Linear 32x32 + 32 = 1,056
    m = build_model("fasttext", (200,), 4)
    assert m.feature_dim == 32
    assert _count(m.body) == 3_156_320 + 1_056 and _count(m.head) == 32 * 4 + 4
    assert m.body[0].embedding.padding_idx == 0
    x = torch.randint(0, 98_635, (3, 200)).float()
    assert m(x).shape == (3, 4) and m.features(x).shape == (3, 32)
    assert torch.equal(m(x), m.head(m.features(x)))
    # PFLlib's hidden 512, vocab 1,000: 512,000 + 512 x 512 + 512 in the body; 512 x 4 + 4 head
    p = build_model("fasttext", (200,), 4, vocab_size=1_000, hidden=512, variant="pfllib")
    assert _count(p.body) == 512_000 + 262_656 and _count(p.head) == 2_052
    feats = p.features(torch.zeros(2, 200))
    torch.testing.assert_close(feats.exp().sum(1), torch.ones(2))  # log-probabilities
    # AmazonMLP: 5000x1000+1000 + 1000x500+500 + 500x100+100 = 5,551,600; head 100x2+2
    a = build_model("amazon_mlp", (5000,), 2)
    assert a.feature_dim == 100 and _count(a.body) == 5_551_600 and _count(a.head) == 202
    assert a(torch.randn(3, 5000)).shape == (3, 2)
    assert [type(layer).__name__ for layer in a.body][1:] == ["Linear", "ReLU"] * 3
    assert {"fasttext", "amazon_mlp"} <= set(MODELS)


def test_fasttext_mean_counts_padding_positions():
    torch.manual_seed(0)
    m = build_model("fasttext", (4,), 3, vocab_size=6, hidden=2)
    assert torch.equal(m.body[0].embedding.weight[0], torch.zeros(2))  # the padding row
    with torch.no_grad():
        m.body[0].embedding.weight[5] = torch.tensor([4.0, 8.0])
        m.body[0].embedding.weight[3] = torch.tensor([2.0, -2.0])
        m.body[1].weight.copy_(torch.eye(2))
        m.body[1].bias.zero_()
    x = torch.tensor([[5, 0, 0, 0], [5, 5, 0, 0], [5, 3, 0, 0], [5, 5, 5, 5], [3, 3, 0, 0]])
    # sums over the 4 positions divided by 4, padding included; no activation after the
    # hidden Linear, so the last row's feature stays negative
    expected = torch.tensor([[1.0, 2.0], [2.0, 4.0], [1.5, 1.5], [4.0, 8.0], [1.0, -1.0]])
    torch.testing.assert_close(m.features(x.float()), expected)
    nn.functional.cross_entropy(m(x.float()), torch.tensor([0, 1, 2, 0, 1])).backward()
    grad = m.body[0].embedding.weight.grad
    assert torch.equal(grad[0], torch.zeros(2)) and grad[5].abs().sum() > 0


def test_fasttext_refuses_ids_outside_its_vocabulary_and_non_text_input():
    m = build_model("fasttext", (3,), 2, vocab_size=10, hidden=4)
    assert m(torch.tensor([[9, 0, 0]])).shape == (1, 2)  # int64 input works too
    with pytest.raises(PflkitError, match="token id 10 but has vocab_size 10.*max_vocab: 10"):
        m(torch.tensor([[1.0, 10.0, 0.0]]))
    with pytest.raises(PflkitError, match="takes token ids.*from -0.5 to 1"):
        m(torch.tensor([[0.5, -0.5, 1.0]]))
    with pytest.raises(PflkitError, match="needs token-id input \\[max_len\\]"):
        build_model("fasttext", (1, 28, 28), 10)
    with pytest.raises(PflkitError, match="option 'variant' must be one of gpfl, pfllib"):
        build_model("fasttext", (8,), 2, variant="torch")
    with pytest.raises(PflkitError, match="option 'vocab_size' must be at least 2"):
        build_model("fasttext", (8,), 2, vocab_size=1)


# ------------------------------------------------------------------------------------------
# end to end
# ------------------------------------------------------------------------------------------

WORDS = [["war", "summit", "minister"], ["goal", "match", "coach"]]
WORDS += [["stocks", "profit", "bank"], ["software", "space", "chip"]]


def _topic_csv(n: int, seed: int) -> str:
    rng = np.random.default_rng(seed)
    lines = []
    for i in range(n):
        c = i % 4
        words = [*rng.choice(WORDS[c], 2), *rng.choice(["the", "a", "of", "news"], 3)]
        lines.append(f'"{c + 1}","{" ".join(words[:3])}","{" ".join(words[3:])}."')
    return "\n".join(lines) + "\n"


def test_fasttext_learns_a_tiny_ag_news_in_a_federated_run(tmp_path, tiny):
    write_ag(tmp_path / "ag_news", _topic_csv(160, 1), _topic_csv(40, 2))
    cfg = tiny(
        data={
            "dataset": "ag_news",
            "root": str(tmp_path),
            "download": False,
            "options": {"max_len": 6},
            "partition": {"name": "iid"},
        },
        model={"name": "fasttext", "options": {"vocab_size": 32, "hidden": 8}},
        train={"rounds": 4, "lr": 1.0, "batch_size": 8, "local_epochs": 3},
    )
    result = run_experiment(cfg, out=tmp_path / "run")
    assert result.rows[-1]["global_acc"] >= 0.9  # 4 balanced classes: chance is 0.25
