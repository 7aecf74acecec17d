"""``partition: {name: flwr, ...}`` (pflkit.data.flwr_partition): the clients get the indices
flwr-datasets' own partitioners give for the same labels, arguments and seed, computed here
through flwr-datasets directly; a FederatedDataset split runs in pflkit row for row; bad
input is one sentence, exit 2."""

from __future__ import annotations

import numpy as np
import pytest
import yaml

from conftest import tiny_config
from pflkit.data.partition import delegated_version, partition
from pflkit.errors import PflkitError

datasets = pytest.importorskip("datasets")
fp = pytest.importorskip("flwr_datasets.partitioner")
flwr_datasets = pytest.importorskip("flwr_datasets")


@pytest.fixture(scope="module")
def labels() -> np.ndarray:
    return np.random.default_rng(11).integers(0, 10, size=1200)


def flower_indices(labels: np.ndarray, partitioner, num_partitions: int) -> list[np.ndarray]:
    """What flwr-datasets gives: each partition's rows, read from a column of row numbers."""
    partitioner.dataset = datasets.Dataset.from_dict({"label": labels, "row": range(len(labels))})
    return [np.sort(partitioner.load_partition(i)["row"]) for i in range(num_partitions)]


CASES = [
    ("DirichletPartitioner", {"alpha": 0.3}, True),
    ("DirichletPartitioner", {"alpha": 1.0, "min_partition_size": 5, "self_balancing": True}, True),
    ("IidPartitioner", {}, False),
    ("PathologicalPartitioner", {"num_classes_per_partition": 2}, True),
    ("ShardPartitioner", {"num_shards_per_partition": 3}, True),
]


@pytest.mark.parametrize(("name", "arguments", "seeded"), CASES)
@pytest.mark.parametrize("seed", [0, 42])
def test_clients_get_flwr_datasets_own_indices(labels, name, arguments, seeded, seed):
    k = 8
    ours = partition("flwr", labels, k, seed, partitioner=name, **arguments)
    flower_arguments = dict(arguments)
    if seeded:
        flower_arguments |= {"partition_by": "label", "seed": seed}
    theirs = flower_indices(labels, getattr(fp, name)(num_partitions=k, **flower_arguments), k)
    assert len(ours) == k
    for a, b in zip(ours, theirs, strict=True):
        assert a.dtype == np.int64
        np.testing.assert_array_equal(a, b)


def test_a_natural_partition_by_group(labels):
    groups = np.random.default_rng(2).integers(0, 6, size=len(labels))
    parts = partition(
        "flwr",
        labels,
        6,
        0,
        groups=groups,
        partitioner="NaturalIdPartitioner",
        partition_by="group",
    )
    assert [set(groups[p]) for p in parts] == [{g} for g in range(6)]
    assert sum(map(len, parts)) == len(labels)


def test_a_federated_dataset_split_runs_row_for_row(tmp_path, monkeypatch):
    """FederatedDataset shuffles the split (seed 7 here) before partitioning; with
    federated_dataset_seed 7 and data.seed as the partitioner's seed, each pflkit client holds
    exactly the rows of FederatedDataset.load_partition(i)."""
    from flwr_datasets import FederatedDataset

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    folder = tmp_path / "rows"
    folder.mkdir()
    n, k = 400, 5
    y = np.random.default_rng(5).integers(0, 4, size=n)
    text = [f"row {i} word{i % 7}" for i in range(n)]
    datasets.Dataset.from_dict(
        {"text": text, "label": y.tolist(), "id": list(range(n))}
    ).to_parquet(str(folder / "train.parquet"))
    flower = FederatedDataset(
        dataset=str(folder),
        partitioners={
            "train": fp.DirichletPartitioner(
                num_partitions=k, partition_by="label", alpha=0.5, min_partition_size=5, seed=3
            )
        },
        seed=7,
        cache_dir=str(tmp_path / "cache"),
    )
    theirs = [np.sort(flower.load_partition(i)["id"]) for i in range(k)]

    from pflkit.data.federated import build_federated
    from pflkit.experiment import validate

    cfg = tiny_config(
        data={
            "dataset": "hf",
            "options": {"dataset": str(folder), "cache_dir": str(tmp_path / "cache2")},
            "num_clients": k,
            "seed": 3,
            "partition": {
                "name": "flwr",
                "partitioner": "DirichletPartitioner",
                "alpha": 0.5,
                "min_partition_size": 5,
                "federated_dataset_seed": 7,
            },
        }
    )
    fed = build_federated(validate(cfg).data)
    ours = [
        np.sort(np.concatenate([tr, te]))
        for tr, te in zip(fed.train_indices, fed.test_indices, strict=True)
    ]
    for a, b in zip(ours, theirs, strict=True):
        np.testing.assert_array_equal(a, b)  # row i of the parquet file has id i


def test_the_cache_key_names_the_flwr_datasets_version():
    assert delegated_version("flwr") == f"flwr-datasets {flwr_datasets.__version__}"
    assert delegated_version("dirichlet") is None


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({}, "partition 'flwr' needs 'partitioner'.*DirichletPartitioner"),
        ({"partitioner": "Dirichlet"}, "did you mean 'DirichletPartitioner'"),
        (
            {"partitioner": "DirichletPartitioner", "alpha": 0.5, "beta": 1},
            "has no argument 'beta'; it takes: partition_by, alpha",
        ),
        (
            {"partitioner": "DirichletPartitioner", "alpha": 0.5, "seed": 1},
            "'flwr' takes its seed from data.seed, not from its parameters: remove 'seed'",
        ),
        (
            {"partitioner": "IidPartitioner", "num_partitions": 3},
            "'num_partitions' from data.num_clients",
        ),
        (
            {"partitioner": "DirichletPartitioner", "alpha": -1},
            "DirichletPartitioner refused its arguments",
        ),
        (
            {"partitioner": "SizePartitioner", "partition_sizes": [10, 20]},
            "makes 2 partitions but data.num_clients is 4",
        ),
        (
            {"partitioner": "NaturalIdPartitioner", "partition_by": "group"},
            "partition_by: group needs a dataset with natural owners",
        ),
    ],
)
def test_bad_arguments_are_one_sentence(labels, arguments, message):
    with pytest.raises(PflkitError, match=message):
        partition("flwr", labels, 4, 0, **arguments)


def test_an_unknown_partitioner_through_the_cli_lists_the_known_ones(tmp_path, cli):
    cfg = tiny_config(data={"partition": {"name": "flwr", "partitioner": "Quux"}})
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cfg))
    r = cli("run", "c.yaml", "--out", "never", cwd=tmp_path)
    assert r.returncode == 2
    known = ", ".join(
        n
        for n in sorted(fp.__all__)
        if n not in ("Partitioner", "IdToSizeFncPartitioner") and not n.startswith("Vertical")
    )
    assert r.stderr.strip() == (
        f"error: unknown flwr-datasets partitioner 'Quux': the known ones are {known}"
    )
    assert "DirichletPartitioner, DistributionPartitioner" in known
    assert not (tmp_path / "never").exists()


def test_list_shows_both_with_their_install_hint_unmangled(cli, tmp_path):
    """Descriptions are printed as text: rich would eat ``[hf]`` as a markup tag."""
    r = cli("list", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    for name in ("hf", "flwr"):
        line = next(x for x in r.stdout.splitlines() if x.split()[:1] == [name])
        assert line.endswith("pip install 'pflkit[hf]'"), line
