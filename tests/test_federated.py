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
    np.savez(path, **arrays)
    b = build_federated(digits(root=str(tmp_path)))
    assert all(np.array_equal(x, y) for x, y in zip(a.train_indices, b.train_indices, strict=True))
    assert all(np.array_equal(x, y) for x, y in zip(a.test_indices, b.test_indices, strict=True))
    with np.load(path) as z:  # and the entry was rewritten
        assert int(z["num_clients"]) == 5 and np.array_equal(z["tr1"], a.train_indices[1])
