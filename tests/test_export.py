"""`pflkit export`: each format read back as its consumer reads it (PFLlib's load expression,
torchvision's IDX files plus FL-bench's partition.pkl, plain NumPy) and compared with
build_federated sample for sample and index for index; bad input is one sentence, exit 2,
nothing written."""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import pickle
import struct
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from conftest import tiny_config
from pflkit import export_partition
from pflkit.data.download import FASHION_MNIST_RAW_SHA256
from pflkit.data.federated import build_federated
from pflkit.data.sources import load_source
from pflkit.errors import PflkitError
from pflkit.experiment import validate

pytestmark = pytest.mark.usefixtures("one_thread")


def listing(folder: Path) -> list[str]:
    """Every path under ``folder``, hidden ones included."""
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*")) if folder.exists() else []


# --------------------------------------------------------------------------------------------
# readers, as the reference libraries read the files
# --------------------------------------------------------------------------------------------


def pfllib_read(folder: Path, idx: int, is_train: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """PFLlib's read_data + process_image, on an export folder instead of ../dataset/NAME."""
    file = folder / ("train" if is_train else "test") / f"{idx}.npz"
    with open(file, "rb") as f:
        data = np.load(f, allow_pickle=True)["data"].tolist()
    return torch.Tensor(data["x"]).type(torch.float32), torch.Tensor(data["y"]).type(torch.int64)


def idx_read(path: Path) -> np.ndarray:
    """An IDX file as torchvision's read_sn3_pascalvincent_tensor reads it (uint8 only)."""
    raw = path.read_bytes()
    magic = int.from_bytes(raw[0:4], "big")
    nd, ty = magic % 256, magic // 256
    assert 1 <= nd <= 3 and ty == 8, (nd, ty)
    dims = [int.from_bytes(raw[4 * (i + 1) : 4 * (i + 2)], "big") for i in range(nd)]
    return np.frombuffer(raw, dtype=np.uint8, offset=4 * (nd + 1)).reshape(dims)


def flbench_dataset(folder: Path, tv_class: str) -> tuple[torch.Tensor, torch.Tensor]:
    """FL-bench's MNIST / FashionMNIST class: torchvision's raw train then test files,
    concatenated, [N, 1, 28, 28] (before FL-bench's float(), /255 and Normalize)."""
    raw = folder / tv_class / "raw"
    parts = [
        (idx_read(raw / f"{p}-images-idx3-ubyte"), idx_read(raw / f"{p}-labels-idx1-ubyte"))
        for p in ("train", "t10k")
    ]
    x = torch.cat([torch.from_numpy(im.copy()).unsqueeze(1) for im, _ in parts])
    y = torch.cat([torch.from_numpy(lab.copy()).long() for _, lab in parts])
    return x, y  # x stays uint8 here (70,000 images); FL-bench's .float() is applied per use


def pflkit_pixels(x255: torch.Tensor) -> torch.Tensor:
    """pflkit's mapping of 0..255 grey levels (pflkit.data.base._gray_to_tensor), for the comparison."""
    return x255.mul(2.0 / 255.0).sub(1.0)


# --------------------------------------------------------------------------------------------
# npz
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("val", [0.0, 0.1])
def test_npz_round_trip(tiny, tmp_path, val):
    cfg = tiny(data={"val_fraction": val})
    folder = export_partition(cfg, "npz", tmp_path / "ex")
    data = build_federated(cfg.data)
    src = load_source("digits")
    assert folder == tmp_path / "ex" / f"digits-{data.partition_id}-npz"
    assert listing(tmp_path / "ex") == [
        folder.name,
        *(f"{folder.name}/{p}" for p in ["clients", *[f"clients/{i}.npz" for i in range(4)]]),
        f"{folder.name}/global_test.npz",
        f"{folder.name}/partition.json",
    ]
    for i, c in enumerate(data.clients):
        with np.load(folder / "clients" / f"{i}.npz") as z:
            assert sorted(z.files) == sorted(
                f"{s}_{k}" for s in ("train", "val", "test") for k in ("x", "y", "idx")
            )
            for s in ("train", "test", "val"):
                x, y = getattr(c, f"{s}_x"), getattr(c, f"{s}_y")
                if s == "val" and not val:
                    assert z["val_x"].shape == (0, 1, 8, 8) and len(z["val_y"]) == 0
                    assert len(z["val_idx"]) == 0
                    continue
                assert z[f"{s}_x"].dtype == np.float32 and z[f"{s}_y"].dtype == np.int64
                assert np.array_equal(z[f"{s}_x"], x.numpy())
                assert np.array_equal(z[f"{s}_y"], y.numpy())
                indices = getattr(data, f"{s}_indices")[i]
                assert np.array_equal(z[f"{s}_idx"], indices)
                # the indices point into the source's training set: they give the samples
                assert np.array_equal(src.train_x[z[f"{s}_idx"]].numpy(), z[f"{s}_x"])
                assert np.array_equal(src.train_y[z[f"{s}_idx"]].numpy(), z[f"{s}_y"])
    with np.load(folder / "global_test.npz") as z:
        # digits has no official test set: the global one is the clients' local tests
        assert np.array_equal(z["x"], data.test_x.numpy())
        assert np.array_equal(z["y"], data.test_y.numpy())
        assert np.array_equal(z["idx"], np.concatenate(data.test_indices))
    info = json.loads((folder / "partition.json").read_text())
    assert info["partition_id"] == data.partition_id and info["dataset"] == "digits"
    assert info["num_clients"] == 4 and info["num_classes"] == 10
    assert info["class_names"] == list("0123456789") and info["has_val"] == bool(val)
    assert info["input_shape"] == [1, 8, 8]
    splits = ["train", "test"] + (["val"] if val else [])
    assert sorted(info["class_tables"]) == sorted(splits)
    for s in splits:
        assert info["class_tables"][s] == data.class_table(s).tolist()
        assert info["num_samples"][s] == [len(getattr(c, f"{s}_y")) for c in data.clients]
    assert set(info["indices"]) == {"train_idx", "val_idx", "test_idx"}
    assert all("training set" in v for v in info["indices"].values())
    assert "no official test set" in info["global_test"]["idx"] and info["public"] is None
    assert info["pflkit_data"] == cfg.data.model_dump(mode="json")


def test_npz_public_set(tiny, tmp_path):
    cfg = tiny(data={"public": {"dataset": "digits", "size": 100}})
    folder = export_partition(cfg, "npz", tmp_path, name="pub")
    data = build_federated(cfg.data)
    with np.load(folder / "public.npz") as z:
        assert np.array_equal(z["x"], data.public_x.numpy())
        assert np.array_equal(z["idx"], data.public_indices)
    info = json.loads((folder / "partition.json").read_text())
    assert info["public"]["size"] == 100 and info["public"]["dataset"] == "digits"


# --------------------------------------------------------------------------------------------
# pfllib
# --------------------------------------------------------------------------------------------


def test_pfllib_round_trip_leaves_validation_out(tiny, tmp_path):
    cfg = tiny(data={"val_fraction": 0.1})
    folder = export_partition(cfg, "pfllib", tmp_path)
    data = build_federated(cfg.data)
    assert folder.name == f"digits-{data.partition_id}-pfllib"
    assert sorted(p.name for p in folder.iterdir()) == ["config.json", "test", "train"]
    for split in ("train", "test"):
        assert sorted(p.name for p in (folder / split).iterdir()) == [f"{i}.npz" for i in range(4)]
    for i, c in enumerate(data.clients):
        for is_train, (x, y) in ((True, (c.train_x, c.train_y)), (False, (c.test_x, c.test_y))):
            px, py = pfllib_read(folder, i, is_train)
            assert px.dtype == torch.float32 and py.dtype == torch.int64
            assert torch.equal(px, x) and torch.equal(py, y)  # the very floats pflkit trains on
    config = json.loads((folder / "config.json").read_text())
    assert config["num_clients"] == 4 and config["num_classes"] == 10
    assert config["non_iid"] is True and config["partition"] == "dir" and config["alpha"] == 0.5
    assert config["balance"] is False and config["batch_size"] == 16
    table = data.class_table("train") + data.class_table("test")
    assert config["Size of samples for labels in clients"] == [
        [[k, int(n)] for k, n in enumerate(row) if n] for row in table
    ]
    assert config["partition_id"] == data.partition_id
    assert config["pflkit_data"] == cfg.data.model_dump(mode="json")
    assert config["num_samples"]["train"] == [len(c.train_y) for c in data.clients]
    n_val = sum(len(c.val_y) for c in data.clients)
    assert config["validation"].startswith("left out") and f" {n_val} " in config["validation"]


def test_pfllib_config_of_an_iid_partition(tiny, tmp_path):
    cfg = tiny(data={"partition": {"name": "iid"}})
    config = json.loads((export_partition(cfg, "pfllib", tmp_path) / "config.json").read_text())
    assert config["non_iid"] is False and config["balance"] is True
    assert config["partition"] is None and config["alpha"] is None
    assert config["validation"].startswith("none")


# --------------------------------------------------------------------------------------------
# flbench
# --------------------------------------------------------------------------------------------


def fmnist(**data):
    return validate(
        tiny_config(data={"dataset": "fashion_mnist", "subset": 600, "num_clients": 4} | data)
    )


def check_flbench(folder: Path, cfg, tv_class: str, official_local_test: bool) -> None:
    """FL-bench's view of the export (its dataset class and partition.pkl) is pflkit's split."""
    data = build_federated(cfg.data)
    src = load_source(cfg.data.dataset, cfg.data.root, **cfg.data.options)
    x, y = flbench_dataset(folder, tv_class)
    assert len(y) == src.num_train + src.num_test
    with open(folder / "partition.pkl", "rb") as f:
        partition = pickle.load(f)
    assert set(partition) == {"separation", "data_indices"}
    k = data.num_clients
    assert partition["separation"] == {
        "train": list(range(k)),
        "val": list(range(k)),
        "test": list(range(k)),
        "total": k,
    }
    assert len(partition["data_indices"]) == k
    offset = src.num_train if official_local_test else 0
    for i, c in enumerate(data.clients):
        entry = partition["data_indices"][i]
        assert set(entry) == {"train", "val", "test"}
        expected = {
            "train": data.train_indices[i],
            "val": data.val_indices[i] if data.has_val else np.zeros(0, dtype=np.int64),
            "test": data.test_indices[i] + offset,
        }
        for s, idx in entry.items():
            assert isinstance(idx, np.ndarray) and idx.dtype == np.int64
            assert np.array_equal(idx, expected[s])
            want_x, want_y = getattr(c, f"{s}_x"), getattr(c, f"{s}_y")
            if want_y is None:
                assert len(idx) == 0
                continue
            assert torch.equal(y[idx], want_y)
            assert torch.equal(pflkit_pixels(x[idx].float()), want_x)  # the same images
    args = json.loads((folder / "args.json").read_text())
    assert args["client_num"] == k and args["split"] == "sample"
    assert args["val_ratio"] == cfg.data.val_fraction and args["seed"] == cfg.data.seed
    assert args["pflkit_partition_id"] == data.partition_id
    stats = json.loads((folder / "all_stats.json").read_text())
    for i, entry in enumerate(partition["data_indices"]):
        ys = y[np.concatenate(list(entry.values()))]
        assert stats[str(i)]["x"] == len(ys)
        labels, counts = np.unique(ys.numpy(), return_counts=True)
        assert stats[str(i)]["y"] == {str(a): int(b) for a, b in zip(labels, counts, strict=True)}
    sizes = np.array([stats[str(i)]["x"] for i in range(k)])
    assert stats["samples_per_client"] == pytest.approx(
        {"mean": sizes.mean(), "stddev": sizes.std()}
    )
    info = json.loads((folder / "pflkit.json").read_text())
    assert info["partition_id"] == data.partition_id
    assert info["global_test"]["flbench_indices"] == [src.num_train, src.num_train + src.num_test]


def test_flbench_fashion_mnist_round_trip(tmp_path):
    cfg = fmnist(val_fraction=0.1)
    folder = export_partition(cfg, "flbench", tmp_path)
    assert folder == tmp_path / "fmnist"
    assert sorted(p.name for p in folder.iterdir()) == [
        "FashionMNIST", "all_stats.json", "args.json", "partition.pkl", "pflkit.json",
    ]  # fmt: skip
    raw = folder / "FashionMNIST" / "raw"
    for name, digest in FASHION_MNIST_RAW_SHA256.items():  # the official files, byte for byte
        assert hashlib.sha256((raw / name).read_bytes()).hexdigest() == digest
    check_flbench(folder, cfg, "FashionMNIST", official_local_test=False)
    args = json.loads((folder / "args.json").read_text())
    assert args["alpha"] == 0.5 and args["test_ratio"] == 0.25 and args["IID_ratio"] == 0.0


def test_flbench_local_tests_from_the_official_test_set(tmp_path):
    part = {"name": "nway_kshot", "n": 3, "k": 5, "train_shots_max": 10, "test_shots": 5}
    cfg = fmnist(subset=None, partition=part)
    folder = export_partition(cfg, "flbench", tmp_path, name="fmnist-nway")
    check_flbench(folder, cfg, "FashionMNIST", official_local_test=True)
    with open(folder / "partition.pkl", "rb") as f:
        tests = [e["test"] for e in pickle.load(f)["data_indices"]]
    assert all(len(t) and t.min() >= 60_000 for t in tests)


def write_idx(path: Path, array: np.ndarray) -> None:
    header = bytes([0, 0, 8, array.ndim]) + struct.pack(f">{array.ndim}I", *array.shape)
    with gzip.open(path, "wb") as f:
        f.write(header + array.astype(np.uint8).tobytes())


def test_flbench_mnist(tmp_path):
    rng = np.random.default_rng(0)
    root = tmp_path / "data"
    (root / "mnist").mkdir(parents=True)
    arrays = {
        "train-images-idx3-ubyte": rng.integers(0, 256, (48, 28, 28)),
        "train-labels-idx1-ubyte": np.arange(48) % 10,
        "t10k-images-idx3-ubyte": rng.integers(0, 256, (20, 28, 28)),
        "t10k-labels-idx1-ubyte": np.arange(20) % 10,
    }
    for name, array in arrays.items():
        write_idx(root / "mnist" / f"{name}.gz", array)
    cfg = validate(
        tiny_config(
            data={
                "dataset": "mnist",
                "root": str(root),
                "download": False,
                "options": {"verify": False},
                "num_clients": 3,
                "partition": {"name": "iid"},
            }
        )
    )
    folder = export_partition(cfg, "flbench", tmp_path / "ex")
    assert folder == tmp_path / "ex" / "mnist"
    for name, array in arrays.items():
        assert np.array_equal(idx_read(folder / "MNIST" / "raw" / name), array)
    check_flbench(folder, cfg, "MNIST", official_local_test=False)


# --------------------------------------------------------------------------------------------
# the command line, bad input, atomic writes
# --------------------------------------------------------------------------------------------


@pytest.fixture
def cfg_file(tmp_path):
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(tiny_config()))
    return path


def test_cli_export(cli, cfg_file, tmp_path):
    r = cli("export", str(cfg_file), "--format", "npz", "--out", "ex", "--name", "t", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "wrote ex/t (npz, 4 clients)" in r.stdout
    cfg = validate(tiny_config())
    with np.load(tmp_path / "ex" / "t" / "clients" / "3.npz") as z:
        assert np.array_equal(z["train_x"], build_federated(cfg.data).clients[3].train_x.numpy())
    r = cli(
        "export", str(cfg_file), "--format", "pfllib", "--out", "ex",
        "--set", "data.num_clients=3", cwd=tmp_path,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert "-data digits-" in r.stdout and "-nc 3 -ncl 10" in r.stdout
    pid = build_federated(validate(tiny_config(data={"num_clients": 3})).data).partition_id
    assert len(list((tmp_path / "ex" / f"digits-{pid}-pfllib" / "train").iterdir())) == 3


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--format", "csv"], "unknown export format 'csv': use one of pfllib, flbench, npz"),
        (
            ["--format", "flbench"],
            "the flbench format supports the datasets fashion_mnist and mnist (FL-bench reads "
            "their raw files), not 'digits': use --format pfllib or --format npz for it",
        ),
        (["--format", "npz", "--name", "a/b"], "invalid --name 'a/b'"),
        (["--format", "npz", "--name", ".hidden"], "invalid --name '.hidden'"),
        (["--format", "pfllib", "--name", "AGNews"], "contains 'News'"),
        (["--format", "npz", "--out", "afile"], "--out 'afile' is a file, not a folder"),
        (["--format", "npz", "--out", "afile/sub"], "lies under 'afile', which is a file"),
        (["--format", "npz", "--name", "taken"], "'ex/taken' already exists and is not empty"),
        (["--format", "npz", "--name", "tfile"], "'ex/tfile' exists and is not a folder"),
        (["--format", "npz", "--set", "data.num_clients=5000"], "5000"),
        ([], "pflkit export needs --format"),
        (["--format", "npz", "--out", None], "pflkit export needs --out DIR"),
    ],
)
def test_bad_input_is_one_sentence_and_exit_2(cli, cfg_file, tmp_path, args, message):
    (tmp_path / "afile").write_text("x")
    (tmp_path / "ex" / "taken").mkdir(parents=True)
    (tmp_path / "ex" / "taken" / "keep.txt").write_text("mine")
    (tmp_path / "ex" / "tfile").write_text("mine")
    before = listing(tmp_path)
    if None in args:
        args = args[: args.index("--out")]
    elif "--out" not in args:
        args = [*args, "--out", "ex"]
    r = cli("export", str(cfg_file), *args, cwd=tmp_path)
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert message in r.stderr
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert listing(tmp_path) == before  # nothing written


def test_unwritable_out_is_refused(cli, cfg_file, tmp_path, monkeypatch):
    # root may write anywhere, so the permission check is simulated
    (tmp_path / "ro").mkdir()
    real = os.access
    monkeypatch.setattr(os, "access", lambda p, m: False if Path(p).name == "ro" else real(p, m))
    r = cli("export", str(cfg_file), "--format", "npz", "--out", "ro/new", cwd=tmp_path)
    assert r.returncode == 2
    assert "--out 'ro/new' is not writable (no permission to write in 'ro')" in r.stderr
    assert listing(tmp_path / "ro") == []


def test_missing_config_is_refused(cli, tmp_path):
    r = cli("export", "--format", "npz", "--out", "ex", cwd=tmp_path)
    assert r.returncode == 2 and "pflkit export needs a CONFIG file" in r.stderr


def test_force_replaces_only_a_complete_export(tiny, tmp_path, monkeypatch):
    from pflkit.data import export

    first = export_partition(tiny(), "npz", tmp_path, name="e")
    marker = first / "partition.json"
    old = marker.read_text()
    with pytest.raises(PflkitError, match="already exists and is not empty"):
        export_partition(tiny(), "npz", tmp_path, name="e")

    calls = []

    def failing(*args, **kwargs):  # the disk fills up after the first client file
        calls.append(args)
        if len(calls) > 1:
            raise OSError(28, "No space left on device")
        return real(*args, **kwargs)

    real = np.savez_compressed
    monkeypatch.setattr(export.np, "savez_compressed", failing)
    cfg = tiny(data={"seed": 1})
    with pytest.raises(
        PflkitError, match=r"writing the export into .* \(No space left on device\)"
    ):
        export_partition(cfg, "npz", tmp_path, name="e", force=True)
    assert marker.read_text() == old
    assert sorted(p.name for p in tmp_path.iterdir()) == ["e"]  # no temporary folder left
    monkeypatch.setattr(export.np, "savez_compressed", real)

    export_partition(cfg, "npz", tmp_path, name="e", force=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["e"]
    info = json.loads(marker.read_text())
    assert (
        info["partition_id"]
        == build_federated(cfg.data).partition_id
        != json.loads(old)["partition_id"]
    )


def test_failed_export_into_a_new_folder_leaves_nothing(tiny, tmp_path, monkeypatch):
    from pflkit.data import export

    def broken(*args, **kwargs):
        raise KeyboardInterrupt  # an interrupt mid-write

    monkeypatch.setattr(export.np, "savez_compressed", broken)
    with pytest.raises(KeyboardInterrupt):
        export_partition(tiny(), "pfllib", tmp_path / "new" / "out")
    assert listing(tmp_path) == []  # every folder it made is gone


def test_api_rejects_a_non_config(tmp_path):
    with pytest.raises(PflkitError, match="needs an ExperimentConfig or DataConfig"):
        export_partition({"data": {}}, "npz", tmp_path)
