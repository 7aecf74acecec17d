"""The ``hf`` source (pflkit.data.sources.hf) on small datasets the tests write in the Hugging
Face format: images (greyscale, colour) and text, from a save_to_disk folder and from the
datasets cache offline; its refusals through the command line."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import yaml

from conftest import tiny_config
from pflkit.data.sources import load_source
from pflkit.data.sources.text import basic_english, build_vocab, encode
from pflkit.errors import PflkitError

datasets = pytest.importorskip("datasets")
Image = pytest.importorskip("PIL.Image")

pytestmark = pytest.mark.usefixtures("fresh_source_cache")
NAMES = ["cat", "dog", "fox"]


def _images(rng, n: int, mode: str, side: int = 6) -> tuple[list, np.ndarray]:
    shape = (n, side, side) if mode == "L" else (n, side, side, 3)
    pixels = rng.integers(0, 256, size=shape, dtype=np.uint8)
    return [Image.fromarray(a, mode=mode) for a in pixels], pixels


def _image_dict(tmp_path, mode: str, n_train: int = 30, n_test: int = 12):
    """A DatasetDict (train, test) of random images and ClassLabel labels, saved to disk;
    returns its folder and the pixels and labels written."""
    rng = np.random.default_rng(0)
    features = datasets.Features(
        {"img": datasets.Image(), "label": datasets.ClassLabel(names=NAMES)}
    )
    written = {}
    splits = {}
    for split, n in (("train", n_train), ("test", n_test)):
        images, pixels = _images(rng, n, mode)
        y = rng.integers(0, 3, size=n)
        splits[split] = datasets.Dataset.from_dict(
            {"img": images, "label": y.tolist()}, features=features
        )
        written[split] = (pixels, y)
    folder = tmp_path / f"images-{mode}"
    datasets.DatasetDict(splits).save_to_disk(str(folder))
    return folder, written


def test_greyscale_images_are_mapped_as_pflkits_other_greyscale_sources(tmp_path):
    folder, written = _image_dict(tmp_path, "L")
    src = load_source("hf", path=str(folder))
    pixels, y = written["train"]
    expected = (pixels.astype(np.float64) / 255 - 0.5) / 0.5
    assert src.train_x.shape == (30, 1, 6, 6) and src.train_x.dtype == torch.float32
    np.testing.assert_allclose(src.train_x[:, 0].numpy(), expected, atol=1e-6)
    assert src.train_y.tolist() == y.tolist() and src.train_y.dtype == torch.int64
    test_pixels, test_y = written["test"]
    np.testing.assert_allclose(src.test_x[:, 0].numpy(), (test_pixels / 255 - 0.5) / 0.5, atol=1e-6)
    assert src.test_y.tolist() == test_y.tolist()
    assert src.num_classes == 3 and src.class_names == NAMES
    assert src.mean == (0.5,) and src.std == (0.5,)


def test_colour_images_are_normalised_with_the_training_splits_own_statistics(tmp_path):
    folder, written = _image_dict(tmp_path, "RGB")
    src = load_source("hf", path=str(folder))
    pixels = written["train"][0].astype(np.float64) / 255  # [N, H, W, 3]
    mean, std = pixels.mean(axis=(0, 1, 2)), pixels.std(axis=(0, 1, 2))
    np.testing.assert_allclose(src.mean, mean, rtol=1e-9)
    np.testing.assert_allclose(src.std, std, rtol=1e-9)
    expected = ((pixels - mean) / std).transpose(0, 3, 1, 2)
    np.testing.assert_allclose(src.train_x.numpy(), expected, atol=1e-5)
    test = written["test"][0].astype(np.float64) / 255
    np.testing.assert_allclose(
        src.test_x.numpy(), ((test - mean) / std).transpose(0, 3, 1, 2), atol=1e-5
    )


def test_images_of_different_sizes_need_image_size(tmp_path):
    rng = np.random.default_rng(1)
    images = [_images(rng, 1, "L", side)[0][0] for side in (6, 6, 8)]
    folder = tmp_path / "mixed"
    datasets.Dataset.from_dict(
        {"image": images, "label": [0, 1, 0]},
        features=datasets.Features(
            {"image": datasets.Image(), "label": datasets.ClassLabel(num_classes=2)}
        ),
    ).save_to_disk(str(folder))
    with pytest.raises(PflkitError, match=r"differ in size \(6x6 and, at row 2, 8x8\).*image_size"):
        load_source("hf", path=str(folder))
    src = load_source("hf", path=str(folder), image_size=4)
    assert src.train_x.shape == (3, 1, 4, 4)
    assert src.test_x is None  # a single saved Dataset has no test split


def test_text_is_tokenised_with_a_training_vocabulary(tmp_path):
    train = ["The cat sat.", "A dog, a fox!", "cat and dog", "fox (red)"]
    test = ["a new cat", "unseen words here"]
    folder = tmp_path / "text"
    features = datasets.Features(
        {"text": datasets.Value("string"), "label": datasets.ClassLabel(names=NAMES)}
    )
    datasets.DatasetDict(
        {
            "train": datasets.Dataset.from_dict(
                {"text": train, "label": [0, 1, 0, 2]}, features=features
            ),
            "test": datasets.Dataset.from_dict({"text": test, "label": [0, 2]}, features=features),
        }
    ).save_to_disk(str(folder))
    src = load_source("hf", path=str(folder), max_len=5)
    vocab = build_vocab([basic_english(t) for t in train])
    assert src.train_x.tolist() == [encode(basic_english(t), vocab, 5) for t in train]
    assert src.test_x.tolist() == [encode(basic_english(t), vocab, 5) for t in test]
    assert src.test_x[1].tolist() == [1, 1, 1, 0, 0]  # unknown words: 1, padding: 0
    assert src.train_y.tolist() == [0, 1, 0, 2] and src.num_classes == 3


def test_a_cached_dataset_is_read_offline(tmp_path, monkeypatch):
    """``dataset``: load_dataset with a cache folder. A local folder of parquet files stands in
    for a Hub name (load_dataset reads both through its cache), read with the network off."""
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    data = tmp_path / "mydata"
    data.mkdir()
    rng = np.random.default_rng(3)
    for split, n in (("train", 20), ("test", 8)):
        table = datasets.Dataset.from_dict(
            {
                "text": [f"word{i % 4} other" for i in range(n)],
                "label": rng.integers(0, 4, n).tolist(),
            }
        )
        table.to_parquet(str(data / f"{split}.parquet"))
    cache = tmp_path / "cache"
    src = load_source("hf", dataset=str(data), cache_dir=str(cache))
    assert src.num_train == 20 and src.num_test == 8
    assert src.num_classes == 4  # an integer 'label' column: the largest label + 1
    assert src.class_names is None
    assert any(cache.iterdir())  # went through the cache


def test_the_fingerprint_tells_two_datasets_at_one_path_apart(tmp_path):
    folder, _ = _image_dict(tmp_path, "L")
    first = load_source("hf", path=str(folder)).fingerprint
    from pflkit.data.sources import clear_cache

    clear_cache()
    features = datasets.Features(
        {"img": datasets.Image(), "label": datasets.ClassLabel(names=NAMES)}
    )
    rng = np.random.default_rng(9)
    images, _ = _images(rng, 30, "L")
    datasets.Dataset.from_dict(
        {"img": images, "label": [2] * 15 + [1] * 15}, features=features
    ).save_to_disk(str(folder))
    assert load_source("hf", path=str(folder)).fingerprint != first


def test_a_changed_dataset_at_one_path_gets_its_own_partition(tmp_path):
    """The partition cache's key holds the source's fingerprint: the same config on other
    labels at the same path is partitioned anew, not read from the first one's cache."""
    from pflkit.data.federated import build_federated
    from pflkit.data.sources import clear_cache
    from pflkit.experiment import validate

    folder, _ = _image_dict(tmp_path, "L", 40, 8)
    cfg = validate(
        tiny_config(data={"dataset": "hf", "options": {"path": str(folder)}, "num_clients": 2})
    ).data
    first = build_federated(cfg)
    clear_cache()
    features = datasets.Features(
        {"img": datasets.Image(), "label": datasets.ClassLabel(names=NAMES)}
    )
    images, _ = _images(np.random.default_rng(4), 40, "L")
    datasets.Dataset.from_dict(
        {"img": images, "label": [0] * 20 + [1] * 20}, features=features
    ).save_to_disk(str(folder))
    second = build_federated(cfg)
    assert second.partition_id != first.partition_id


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({}, "needs exactly one of the options 'path'"),
        ({"path": "x", "dataset": "y"}, "needs exactly one of the options 'path'"),
        ({"path": "/nonexistent/folder"}, "'/nonexistent/folder' is not a folder"),
        ({"split": "validation"}, "has no split 'validation'; it has train, test"),
        (
            {"label_column": "nope"},
            "'nope' is not a column of .*img \\(Image\\), label \\(ClassLabel\\)",
        ),
        ({"label_column": "img"}, "column 'img' of .* is Image, not class labels"),
        ({"text_column": "img"}, "'img' is not an text column"),
    ],
)
def test_bad_options_are_one_sentence(tmp_path, options, message):
    folder, _ = _image_dict(tmp_path, "L", 4, 2)
    if options and "path" not in options and "dataset" not in options:
        options = {"path": str(folder), **options}  # the folder, with the bad option
    with pytest.raises(PflkitError, match=message):
        load_source("hf", **options)


def test_a_dataset_that_is_not_classification_is_refused_through_the_cli(tmp_path, cli):
    folder = tmp_path / "regression"
    datasets.Dataset.from_dict({"text": ["a", "b", "c"], "score": [0.5, 1.5, 2.0]}).save_to_disk(
        str(folder)
    )
    cfg = tiny_config(data={"dataset": "hf", "options": {"path": str(folder)}})
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cfg))
    r = cli("run", "c.yaml", "--out", "never", cwd=tmp_path)
    assert r.returncode == 2
    assert r.stderr.strip() == (
        f"error: the Hugging Face dataset '{folder}' is not a classification dataset: none of "
        "its columns, text (string), score (float64), is a ClassLabel or an integer 'label' "
        "column (set data.options.label_column if one holds class indices)"
    )
    assert not (tmp_path / "never").exists()
