"""FederatedDataset: local splits, global test set, public set, partition cache."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pflkit.config import DataConfig
from pflkit.data.federated import build_federated
from pflkit.errors import PflkitError


def digits(**kw) -> DataConfig:
    base = {"dataset": "digits", "num_clients": 5, "partition": {"name": "iid"}}
    return DataConfig.model_validate(base | kw)


def test_local_splits_cover_each_client_without_overlap():
    fd = build_federated(digits(test_fraction=0.2))
    all_idx = np.concatenate(fd.train_indices + fd.test_indices)
    assert len(all_idx) == len(np.unique(all_idx)) == 1797  # nothing lost or duplicated
    for tr, te, c in zip(fd.train_indices, fd.test_indices, fd.clients, strict=True):
        assert len(te) == max(int(0.2 * (len(tr) + len(te))), 1)
        assert len(c.train_y) == len(tr) and len(c.test_y) == len(te)
    # digits has no official test set: the global test set is the union of local test splits
    assert len(fd.test_y) == sum(len(te) for te in fd.test_indices)


def test_partition_is_cached_and_keyed_by_its_parameters(tmp_path):
    a = build_federated(digits(root=str(tmp_path)))
    files = list((tmp_path / "partitions").glob("*.npz"))
    assert [f.stem for f in files] == [a.partition_id]
    b = build_federated(digits(root=str(tmp_path)))  # read back from the cache
    assert all(np.array_equal(x, y) for x, y in zip(a.train_indices, b.train_indices, strict=True))
    assert build_federated(digits(root=str(tmp_path), seed=1)).partition_id != a.partition_id
    c = build_federated(digits(root=str(tmp_path), partition={"name": "dirichlet", "alpha": 0.5}))
    assert c.partition_id != a.partition_id


def test_subset_and_official_test_set_kept_whole():
    fd = build_federated(
        DataConfig.model_validate(
            {
                "dataset": "fashion_mnist",
                "subset": 1000,
                "num_clients": 4,
                "partition": {"name": "iid"},
            }
        )
    )
    assert sum(len(c.train_y) + len(c.test_y) for c in fd.clients) == 1000
    assert len(fd.test_y) == 10000


def test_public_set_is_drawn_and_checked():
    fd = build_federated(
        DataConfig.model_validate(
            {
                "dataset": "fashion_mnist",
                "subset": 500,
                "num_clients": 2,
                "partition": {"name": "iid"},
                "public": {"dataset": "mnist5k", "size": 300},
            }
        )
    )
    assert fd.public_x.shape == (300, 1, 28, 28) and fd.public_x.dtype == torch.float32
    with pytest.raises(PflkitError, match="inputs of shape"):
        build_federated(digits(public={"dataset": "mnist5k", "size": 10}))
    with pytest.raises(PflkitError, match="exceeds the 5000 samples"):
        build_federated(
            DataConfig.model_validate(
                {"dataset": "fashion_mnist", "subset": 500, "num_clients": 2,
                 "partition": {"name": "iid"}, "public": {"dataset": "mnist5k", "size": 6000}}
            )
        )  # fmt: skip


def public_cfg(**public) -> DataConfig:
    return DataConfig.model_validate(
        {"dataset": "fashion_mnist", "subset": 500, "num_clients": 2, "partition": {"name": "iid"},
         "public": {"dataset": "mnist5k", "size": 100, **public}}
    )  # fmt: skip


def test_public_set_with_other_class_count_is_refused_unless_allowed(mnist5k_with_26_classes):
    with pytest.raises(PflkitError, match="has 26 classes but the task"):
        build_federated(public_cfg())
    assert build_federated(public_cfg(allow_other_classes=True)).public_x.shape[0] == 100


def signed(arrays: dict) -> dict:
    """``arrays`` with the sha256 pflkit would have written for them (the check of a cache's
    content, not of its checksum)."""
    from pflkit.data.federated import _digest

    plain = {k: v for k, v in arrays.items() if k != "sha256"}
    return plain | {"sha256": np.asarray(_digest(plain))}


@pytest.mark.parametrize(
    "tamper",
    ["duplicate", "two_clients", "out_of_range", "float", "empty"],
)
def test_a_wrong_cache_entry_is_recomputed_not_used(tmp_path, tamper):
    a = build_federated(digits(root=str(tmp_path)))
    path = tmp_path / "partitions" / f"{a.partition_id}.npz"
    with np.load(path) as z:
        arrays = {k: z[k] for k in z.files}
    if tamper == "duplicate":  # client 1 also gets client 0's first training sample
        arrays["tr1"] = np.append(arrays["tr1"], arrays["tr0"][0])
    elif tamper == "two_clients":
        arrays = {
            "num_clients": np.array(2),
            **{k: arrays[k] for k in ("tr0", "te0", "tr1", "te1")},
        }
    elif tamper == "out_of_range":
        arrays["te2"] = arrays["te2"] + 10_000
    elif tamper == "float":
        arrays["tr3"] = arrays["tr3"].astype(float)
    else:
        arrays["te4"] = arrays["te4"][:0]
    np.savez(path, **signed(arrays))  # a wrong entry that pflkit wrote: its checksum holds
    b = build_federated(digits(root=str(tmp_path)))
    assert all(np.array_equal(x, y) for x, y in zip(a.train_indices, b.train_indices, strict=True))
    assert all(np.array_equal(x, y) for x, y in zip(a.test_indices, b.test_indices, strict=True))
    with np.load(path) as z:  # and the entry was rewritten
        assert int(z["num_clients"]) == 5 and np.array_equal(z["tr1"], a.train_indices[1])


# ---------------------------------------------------------------- nway_kshot's local test sets


def test_nway_kshot_test_blocks_by_hand():
    from pflkit.data.partition import nway_kshot_test

    train = np.array([0, 0, 1, 1, 2, 2])
    parts = [np.array([0, 4]), np.array([2, 5])]  # client 0 holds classes {0, 2}, client 1 {1, 2}
    test = np.array([2, 0, 1, 0, 2, 1, 0, 2, 1])
    # class 0 sits at test positions 1, 3, 6; class 1 at 2, 5, 8; class 2 at 0, 4, 7.
    # test_shots=1: client 0 takes position 0 of its classes, client 1 position 1 of its.
    got = nway_kshot_test(train, parts, test, test_shots=1, n=2, k=1)
    assert [g.tolist() for g in got] == [[0, 1], [4, 5]]
    got = nway_kshot_test(train, parts[:1], test, test_shots=2)
    assert [g.tolist() for g in got] == [[0, 1, 3, 4]]  # class 0: 1, 3; class 2: 0, 4
    with pytest.raises(PflkitError, match="class 1 has 3 test samples but client 1 needs"):
        nway_kshot_test(train, parts, test, test_shots=2)


def nway_cfg(**kw) -> DataConfig:
    part = {"name": "nway_kshot", "n": 3, "k": 20, "stdev": 1, "train_shots_max": 25,
            "test_shots": 10}  # fmt: skip
    return DataConfig.model_validate(
        {"dataset": "fashion_mnist", "num_clients": 6, "partition": part} | kw
    )


def test_nway_kshot_tests_each_client_on_its_own_classes_from_the_official_test_set(tmp_path):
    from pflkit.data.sources import load_source

    fd = build_federated(nway_cfg())
    src = load_source("fashion_mnist", tmp_path)
    test_y = src.test_y.numpy()
    seen = np.concatenate(fd.test_indices)
    assert len(np.unique(seen)) == len(seen)  # disjoint across clients
    for cid, (c, te) in enumerate(zip(fd.clients, fd.test_indices, strict=True)):
        classes = np.unique(c.train_y.numpy())
        assert 2 <= len(classes) <= 4
        # exactly its classes, test_shots each, the block at offset cid * test_shots
        counts = np.bincount(c.test_y.numpy(), minlength=10)
        assert counts[classes].tolist() == [10] * len(classes) and counts.sum() == 10 * len(classes)
        for cl in classes:
            block = np.flatnonzero(test_y == cl)[cid * 10 : (cid + 1) * 10]
            assert np.array_equal(np.sort(te[test_y[te] == cl]), block)
        assert torch.equal(c.test_x, src.test_x[te])  # official test images, not training ones
        assert len(c.train_y) == len(fd.train_indices[cid])  # nothing split off for testing
    assert len(fd.test_y) == 10000  # the global test set is still the whole official one
    again = build_federated(nway_cfg())  # from the cache: same split
    assert all(
        np.array_equal(a, b) for a, b in zip(fd.test_indices, again.test_indices, strict=True)
    )
    # a validation split comes out of the training samples only
    val = build_federated(nway_cfg(val_fraction=0.2))
    for c, base in zip(val.clients, fd.clients, strict=True):
        assert len(c.train_y) + len(c.val_y) == len(base.train_y)
        assert torch.equal(c.test_y, base.test_y)


def test_nway_kshot_needs_an_official_test_set():
    part = {"name": "nway_kshot", "n": 3, "k": 5, "stdev": 1, "train_shots_max": 6}
    with pytest.raises(PflkitError, match="'digits' does not have: use a dataset with one"):
        build_federated(digits(partition=part, num_clients=3))


def test_a_public_set_from_the_task_dataset_is_carved_out_before_partitioning(tmp_path):
    from pflkit.data.sources import load_source

    base = {"dataset": "fashion_mnist", "subset": 1000, "num_clients": 4,
            "partition": {"name": "iid"}}  # fmt: skip
    own = build_federated(
        DataConfig.model_validate(base | {"public": {"dataset": "fashion_mnist", "size": 3000}})
    )
    used = np.concatenate(own.train_indices + own.test_indices)
    assert len(own.public_indices) == 3000
    assert np.intersect1d(used, own.public_indices).size == 0  # disjoint by construction
    src = load_source("fashion_mnist", tmp_path)
    assert torch.equal(own.public_x, src.train_x[own.public_indices])
    assert sum(len(c.train_y) + len(c.test_y) for c in own.clients) == 1000
    plain = build_federated(DataConfig.model_validate(base))
    assert own.partition_id != plain.partition_id
    # a public set from another dataset leaves the partition as it was
    other = build_federated(
        DataConfig.model_validate(base | {"public": {"dataset": "mnist5k", "size": 100}})
    )
    assert other.partition_id == plain.partition_id
    assert all(
        np.array_equal(a, b) for a, b in zip(other.train_indices, plain.train_indices, strict=True)
    )
