"""Hugging Face datasets: any image or text classification dataset, read from a folder written
by ``save_to_disk`` or from the local ``datasets`` cache (source name ``hf``).

Options (``data.options``), exactly one of ``path`` and ``dataset``:

``path``
    A folder written by ``Dataset.save_to_disk`` or ``DatasetDict.save_to_disk``, read with
    ``datasets.load_from_disk``.
``dataset`` (with ``config``, ``cache_dir``)
    A Hub name such as ``uoft-cs/cifar10``, read with ``datasets.load_dataset(dataset, config,
    cache_dir=cache_dir)``: from the cache when it holds the dataset (set
    ``HF_DATASETS_OFFLINE=1`` to never touch the network), else downloaded into it
    (``data.download`` and ``data.root`` do not apply: the ``datasets`` library and its
    cache do the finding and the downloading).
``split``, ``test_split``
    The training split (default ``train``) and the official test split (default ``test``;
    ``null`` for none). A test split the dataset does not have is no error: the source then
    has no official test set, as a single saved ``Dataset`` has none.
``label_column``, ``image_column``, ``text_column``
    Inferred from the features when not given: the label is the one ``ClassLabel`` column (or
    an integer column named ``label`` or ``labels``); the input is the one ``Image`` column,
    else the one string column. A dataset with no such label column is not a classification
    dataset and is refused in one sentence that names its columns.
``image_size``
    Resize every image to ``image_size x image_size`` (Pillow's bilinear filter); needed when
    the images differ in size.
``max_len``, ``min_freq``, ``max_vocab``
    Text only: as AG News (:mod:`pflkit.data.sources.text`): ``basic_english`` tokens, a
    vocabulary from the training split only (0 = padding, 1 = unknown), the first ``max_len``
    ids of each text, as float32.

Labels are the label column's integers; the class count is the ``ClassLabel``'s (its names are
the class names), or the largest integer label + 1. Images: greyscale ones (every image in
mode ``L``) become ``[N, 1, H, W]`` mapped with ``(x/255 - 0.5)/0.5``, as pflkit's other
greyscale sources; any other mode is converted to RGB, ``[N, 3, H, W]``, normalised per channel
with the training split's own mean and std (recorded in ``Source.mean``/``Source.std``; on
CIFAR-10 they are the usual published constants). ``Source.fingerprint`` is a hash of the
training labels, so a partition cached for one dataset is never used for another.

Needs ``pip install 'pflkit[hf]'`` (``datasets``, Pillow).
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pflkit.data.base import Source, SourceInfo, _gray_to_tensor, _opt_int
from pflkit.data.sources.text import texts_to_ids
from pflkit.errors import PflkitError

DS = "hf"
LABEL_NAMES = ("label", "labels")  # integer columns taken as the label without a ClassLabel


def require_datasets() -> Any:
    """The ``datasets`` module, or one sentence saying how to install it."""
    try:
        import datasets
    except ImportError:
        raise PflkitError(
            "dataset 'hf' needs the Hugging Face datasets package, which is not installed; "
            "run `pip install 'pflkit[hf]'`"
        ) from None
    return datasets


def _load_hf(
    root: Path,
    download: bool,
    *,
    path: str | None = None,
    dataset: str | None = None,
    config: str | None = None,
    cache_dir: str | None = None,
    split: str = "train",
    test_split: str | None = "test",
    label_column: str | None = None,
    image_column: str | None = None,
    text_column: str | None = None,
    image_size: int | None = None,
    max_len: int = 200,
    min_freq: int = 1,
    max_vocab: int | None = None,
) -> Source:
    datasets = require_datasets()
    if (path is None) == (dataset is None):
        raise PflkitError(
            "dataset 'hf' needs exactly one of the options 'path' (a folder written by "
            "save_to_disk) and 'dataset' (a Hugging Face dataset name in the local cache)"
        )
    what = f"'{path}'" if path is not None else f"'{dataset}'"
    splits = _open(datasets, path, dataset, config, cache_dir, what)
    if split not in splits:
        raise PflkitError(
            f"the Hugging Face dataset {what} has no split '{split}'; it has "
            f"{', '.join(splits)}: set data.options.split to one of them"
        )
    train = splits[split]
    test = splits.get(test_split) if test_split is not None else None
    features = train.features
    label = _label_column(features, label_column, what)
    kind, column = _input_column(features, image_column, text_column, label, what)
    train_y, num_classes, names = _labels(train, label, what)
    test_y = None if test is None else _labels(test, label, what, num_classes)[0]

    if kind == "image":
        if image_size is not None:
            image_size = _opt_int(DS, "image_size", image_size, 1)
        train_x, test_x, mean, std = _images(datasets, train, test, column, image_size, what)
    else:
        max_len = _opt_int(DS, "max_len", max_len, 1)
        min_freq = _opt_int(DS, "min_freq", min_freq, 1)
        if max_vocab is not None:
            max_vocab = _opt_int(DS, "max_vocab", max_vocab, 3)
        train_texts = _texts(train, column, what)
        test_texts = None if test is None else _texts(test, column, what)
        name = f"Hugging Face dataset {what}"
        train_x, test_x = texts_to_ids(name, train_texts, test_texts, max_len, min_freq, max_vocab)
        mean = std = None
    return Source(
        DS,
        train_x,
        torch.from_numpy(train_y),
        test_x,
        None if test_y is None else torch.from_numpy(test_y),
        num_classes,
        class_names=names,
        mean=mean,
        std=std,
        fingerprint=hashlib.sha256(train_y.tobytes()).hexdigest()[:16],
    )


def _open(datasets: Any, path: str | None, name: str | None, config, cache_dir, what: str) -> dict:
    """Split name -> ``datasets.Dataset`` (a single saved Dataset is the split ``train``)."""
    try:
        if path is not None:
            found = Path(path).expanduser()
            if not found.is_dir():
                raise PflkitError(
                    f"data.options.path '{path}' is not a folder; give the folder that "
                    "save_to_disk wrote"
                )
            loaded = datasets.load_from_disk(str(found))
        else:
            loaded = datasets.load_dataset(name, config, cache_dir=cache_dir)
    except PflkitError:
        raise
    except Exception as err:  # datasets raises many types: missing files, offline, bad name
        detail = str(err).splitlines()[0] if str(err) else type(err).__name__
        hint = (
            "check that the folder was written by save_to_disk"
            if path is not None
            else "check the name, or download it once with network access (it is then read "
            "from the cache, also with HF_DATASETS_OFFLINE=1)"
        )
        raise PflkitError(
            f"cannot load the Hugging Face dataset {what} ({detail}): {hint}"
        ) from None
    if isinstance(loaded, datasets.Dataset):
        return {"train": loaded}
    if isinstance(loaded, datasets.DatasetDict):
        return dict(loaded)
    raise PflkitError(
        f"the Hugging Face dataset {what} is a {type(loaded).__name__}, not a Dataset or a "
        "DatasetDict (streaming datasets are not read): save it with save_to_disk first"
    )


def _columns(features: Any) -> str:
    return ", ".join(f"{k} ({_kind(v)})" for k, v in features.items())


def _kind(feature: Any) -> str:
    name = type(feature).__name__
    return feature.dtype if name == "Value" else name


def _label_column(features: Any, given: str | None, what: str) -> str:
    if given is not None:
        if given not in features:
            raise PflkitError(
                f"data.options.label_column '{given}' is not a column of {what}; its columns "
                f"are {_columns(features)}"
            )
        if not _is_label(features[given], any_name=True):
            raise PflkitError(
                f"column '{given}' of {what} is {_kind(features[given])}, not class labels "
                "(ClassLabel or integers): choose another data.options.label_column"
            )
        return given
    labels = [k for k, f in features.items() if type(f).__name__ == "ClassLabel"]
    if not labels:
        labels = [k for k in LABEL_NAMES if k in features and _is_label(features[k], True)]
    if len(labels) == 1:
        return labels[0]
    if not labels:
        raise PflkitError(
            f"the Hugging Face dataset {what} is not a classification dataset: none of its "
            f"columns, {_columns(features)}, is a ClassLabel or an integer 'label' column "
            "(set data.options.label_column if one holds class indices)"
        )
    raise PflkitError(
        f"the Hugging Face dataset {what} has several label columns ({', '.join(labels)}): "
        "choose one with data.options.label_column"
    )


def _is_label(feature: Any, any_name: bool) -> bool:
    name = type(feature).__name__
    return name == "ClassLabel" or (
        any_name and name == "Value" and str(feature.dtype).startswith(("int", "uint"))
    )


def _input_column(
    features: Any, image: str | None, text: str | None, label: str, what: str
) -> tuple[str, str]:
    """("image" or "text", column name)."""
    if image is not None and text is not None:
        raise PflkitError(
            "give at most one of data.options.image_column and data.options.text_column"
        )
    for kind, given, test in (("image", image, _is_image), ("text", text, _is_text)):
        if given is None:
            continue
        if given not in features or not test(features[given]):
            raise PflkitError(
                f"data.options.{kind}_column '{given}' is not an {kind} column of {what}; its "
                f"columns are {_columns(features)}"
            )
        return kind, given
    others = {k: f for k, f in features.items() if k != label}
    for kind, test in (("image", _is_image), ("text", _is_text)):
        found = [k for k, f in others.items() if test(f)]
        if len(found) == 1:
            return kind, found[0]
        if len(found) > 1:
            raise PflkitError(
                f"the Hugging Face dataset {what} has several {kind} columns "
                f"({', '.join(found)}): choose one with data.options.{kind}_column"
            )
    raise PflkitError(
        f"the Hugging Face dataset {what} has no image or text column to classify (columns: "
        f"{_columns(features)}); pflkit reads image and text classification datasets"
    )


def _is_image(feature: Any) -> bool:
    return type(feature).__name__ == "Image"


def _is_text(feature: Any) -> bool:
    return type(feature).__name__ == "Value" and feature.dtype in ("string", "large_string")


def _labels(
    split: Any, column: str, what: str, num_classes: int | None = None
) -> tuple[np.ndarray, int, list[str] | None]:
    """(int64 labels, class count, class names or None) of one split."""
    y = np.asarray(split.with_format("numpy")[column], dtype=np.int64)
    feature = split.features[column]
    names = list(feature.names) if type(feature).__name__ == "ClassLabel" else None
    if num_classes is None:
        num_classes = len(names) if names is not None else int(y.max(initial=-1)) + 1
    if y.size and (y.min() < 0 or y.max() >= num_classes):
        raise PflkitError(
            f"labels of {what} (column '{column}') range over {y.min()}..{y.max()}, outside "
            f"0..{num_classes - 1}: remove unlabelled rows (-1) or relabel them"
        )
    if num_classes < 2:
        raise PflkitError(
            f"column '{column}' of {what} holds {num_classes} class(es); classification needs "
            "at least 2"
        )
    return y, num_classes, names


def _texts(split: Any, column: str, what: str) -> list[str]:
    texts = split[column]
    if any(t is None for t in texts):
        raise PflkitError(f"column '{column}' of {what} has empty (None) texts: fill or drop them")
    return texts


def _images(
    datasets: Any, train: Any, test: Any, column: str, size: int | None, what: str
) -> tuple[torch.Tensor, torch.Tensor | None, tuple | None, tuple | None]:
    """(train x, test x, mean, std): see the module docstring."""
    train_u8, train_gray = _pixels(datasets, train, column, size, what)
    test_u8, test_gray = (
        (None, True) if test is None else _pixels(datasets, test, column, size, what)
    )
    if train_gray and test_gray:
        to = lambda u8: _gray_to_tensor(u8[:, 0])  # noqa: E731
        return to(train_u8), None if test_u8 is None else to(test_u8), (0.5,), (0.5,)
    train_u8, test_u8 = (_rgb(a) for a in (train_u8, test_u8))
    scaled = train_u8.astype(np.float64) / 255.0
    mean = tuple(float(m) for m in scaled.mean(axis=(0, 2, 3)))
    std = tuple(float(s) for s in scaled.std(axis=(0, 2, 3)))
    del scaled
    if min(std) == 0:
        raise PflkitError(f"the images of {what} are constant in a channel: nothing to learn")

    def to(u8: np.ndarray) -> torch.Tensor:
        x = torch.from_numpy(u8).to(torch.float32).div_(255.0)
        m = torch.tensor(mean, dtype=torch.float32).view(1, -1, 1, 1)
        s = torch.tensor(std, dtype=torch.float32).view(1, -1, 1, 1)
        return x.sub_(m).div_(s)

    return to(train_u8), None if test_u8 is None else to(test_u8), mean, std


def _rgb(u8: np.ndarray | None) -> np.ndarray | None:
    return u8 if u8 is None or u8.shape[1] == 3 else np.repeat(u8, 3, axis=1)


def _pixels(
    datasets: Any, split: Any, column: str, size: int | None, what: str
) -> tuple[np.ndarray, bool]:
    """(uint8 [N, C, H, W] with C = 1 when every image is greyscale, else 3; whether grey)."""
    try:
        from PIL import Image
    except ImportError:
        raise PflkitError(
            "dataset 'hf' needs Pillow to decode images, which is not installed; run "
            "`pip install 'pflkit[hf]'`"
        ) from None
    images = split.cast_column(column, datasets.Image(decode=True))[column]
    grey = all(im.mode == "L" for im in images)
    arrays = []
    for i, im in enumerate(images):
        im = im.convert("L" if grey else "RGB")
        if size is not None and im.size != (size, size):
            im = im.resize((size, size), Image.Resampling.BILINEAR)
        a = np.asarray(im, dtype=np.uint8)
        if arrays and a.shape != arrays[0].shape:
            raise PflkitError(
                f"images of {what} differ in size ({arrays[0].shape[1]}x{arrays[0].shape[0]} "
                f"and, at row {i}, {a.shape[1]}x{a.shape[0]}): set data.options.image_size "
                "to resize them all"
            )
        arrays.append(a)
    if not arrays:
        raise PflkitError(f"a split of {what} has no rows: choose a split with data")
    stacked = np.stack(arrays)
    return (stacked[:, None] if grey else stacked.transpose(0, 3, 1, 2)), grey


ENTRIES: list[SourceInfo] = [
    SourceInfo(
        "hf",
        "Hugging Face: any image or text classification dataset from a save_to_disk folder "
        "(option path) or the local cache (option dataset); pip install 'pflkit[hf]'",
        _load_hf,
    ),
]
