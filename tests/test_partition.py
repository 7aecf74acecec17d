"""Tests for pflkit.data.partition."""

from __future__ import annotations

import numpy as np
import pytest

from pflkit.data import partition as partition_module
from pflkit.data.partition import PARTITIONERS, class_table, partition
from pflkit.errors import PflkitError

C = 10
PER_CLASS = 300


@pytest.fixture(scope="module")
def labels() -> np.ndarray:
    """10 classes x 300 samples, in a shuffled (fixed) order."""
    return np.random.default_rng(123).permutation(np.repeat(np.arange(C), PER_CLASS))


@pytest.fixture(scope="module")
def groups() -> np.ndarray:
    """25 writers of different sizes (writer g owns 72 + 4*g samples, 3,000 in all)."""
    rng = np.random.default_rng(7)
    g = np.repeat(np.arange(25), np.arange(25) * 4 + 72)
    assert len(g) == C * PER_CLASS
    return rng.permutation(g)


# name, params, num_clients, uses the whole set
CASES = [
    ("iid", {}, 20, True),
    ("dirichlet", {"alpha": 0.3}, 20, True),
    ("pathological", {"classes_per_client": 2}, 20, True),
    ("pathological", {"classes_per_client": 3, "balance": False}, 17, True),
    ("incomplete", {}, 20, True),
    ("nway_kshot", {"n": 3, "k": 10, "stdev": 2, "train_shots_max": 15}, 10, False),
    ("natural", {"select": "random"}, 12, False),
    ("dirichlet_clients", {"alpha": 0.3}, 20, True),
    ("quantity", {"beta": 0.5}, 20, True),
    ("flwr", {"partitioner": "DirichletPartitioner", "alpha": 0.3}, 20, True),
    ("flwr", {"partitioner": "ShardPartitioner", "num_shards_per_partition": 2}, 20, True),
]


def _run(name, labels, groups, num_clients, seed, params):
    g = groups if name in ("natural", "flwr") else None
    return partition(name, labels, num_clients, seed, groups=g, **params)


def _classes(labels, part):
    return set(np.unique(labels[part]).tolist())


def test_every_partitioner_has_a_case():
    assert {c[0] for c in CASES} == set(PARTITIONERS)
    for info in PARTITIONERS.values():
        assert info.description and "\n" not in info.description


@pytest.mark.parametrize(("name", "params", "num_clients", "whole"), CASES)
def test_no_duplicates_no_loss_sorted(labels, groups, name, params, num_clients, whole):
    parts = _run(name, labels, groups, num_clients, 0, params)
    assert len(parts) == num_clients
    for p in parts:
        assert p.dtype == np.int64
        assert len(p) > 0
        assert np.all(np.diff(p) > 0)  # sorted, no duplicate within a client
        assert p.min() >= 0 and p.max() < len(labels)
    flat = np.concatenate(parts)
    assert len(np.unique(flat)) == len(flat)  # no duplicate across clients
    if whole:
        assert len(flat) == len(labels)
    else:
        assert len(flat) < len(labels)


@pytest.mark.parametrize(("name", "params", "num_clients", "whole"), CASES)
def test_deterministic(labels, groups, name, params, num_clients, whole):
    a = _run(name, labels, groups, num_clients, 5, params)
    b = _run(name, labels, groups, num_clients, 5, params)
    c = _run(name, labels, groups, num_clients, 6, params)
    assert all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))
    assert not all(np.array_equal(x, y) for x, y in zip(a, c, strict=True))


def test_no_global_rng_use(labels):
    np.random.seed(0)
    before = np.random.random()
    np.random.seed(0)
    partition("dirichlet", labels, 10, 1, alpha=0.5)
    partition("incomplete", labels, 10, 1)
    assert np.random.random() == before


def test_iid_even_sizes(labels):
    parts = partition("iid", labels, 7, 0)
    sizes = [len(p) for p in parts]
    assert max(sizes) - min(sizes) <= 1


# ---------------------------------------------------------------------------- dirichlet


def _classes_for_90pct(table: np.ndarray) -> float:
    """Mean over clients of the number of classes needed to cover 90% of the client's data."""
    out = []
    for row in table:
        frac = np.cumsum(np.sort(row)[::-1]) / row.sum()
        out.append(int(np.searchsorted(frac, 0.9) + 1))
    return float(np.mean(out))


def test_dirichlet_smaller_alpha_more_skew(labels):
    skew = {}
    for alpha in (0.05, 1.0, 100.0):
        vals = []
        for seed in range(3):
            parts = partition("dirichlet", labels, 10, seed, alpha=alpha)
            vals.append(_classes_for_90pct(class_table(labels, parts, C)))
        skew[alpha] = np.mean(vals)
    assert skew[0.05] < skew[1.0] < skew[100.0]
    assert skew[0.05] < 3.5
    assert skew[100.0] >= 8.5  # nearly IID: almost all classes needed


def test_dirichlet_min_size(labels):
    parts = partition("dirichlet", labels, 20, 3, alpha=0.1, min_size=40)
    assert min(len(p) for p in parts) >= 40
    # the first draw for this seed violates min_size=40, so the redraw loop was exercised
    first = partition("dirichlet", labels, 20, 3, alpha=0.1, min_size=1)
    assert min(len(p) for p in first) < 40


def test_dirichlet_min_size_impossible(labels):
    with pytest.raises(PflkitError, match="min_size=200 for 20 clients needs 4000"):
        partition("dirichlet", labels, 20, 0, alpha=0.5, min_size=200)


def test_dirichlet_min_size_unreachable_in_bounded_tries(labels, monkeypatch):
    with pytest.raises(PflkitError, match="no draw out of 1000 .* min_size=40"):
        partition("dirichlet", labels, 30, 3, alpha=0.1, min_size=40)
    # the bound is what stops the loop: with one try, a draw that needed a redraw now fails
    monkeypatch.setattr(partition_module, "MAX_TRIES", 1)
    with pytest.raises(PflkitError, match="no draw out of 1 "):
        partition("dirichlet", labels, 20, 3, alpha=0.1, min_size=40)


@pytest.mark.parametrize("alpha", [0, -1, -0.5])
def test_dirichlet_bad_alpha(labels, alpha):
    with pytest.raises(PflkitError, match=r"alpha must be > 0 \(got "):
        partition("dirichlet", labels, 10, 0, alpha=alpha)
    try:
        partition("dirichlet", labels, 10, 0, alpha=-1)
    except PflkitError as e:
        assert "(got -1)" in str(e)


def test_dirichlet_requires_alpha(labels):
    with pytest.raises(PflkitError, match="needs parameter 'alpha'"):
        partition("dirichlet", labels, 10, 0)


# ---------------------------------------------------------------------------- pathological


@pytest.mark.parametrize(("k", "num_clients"), [(1, 10), (2, 20), (3, 17), (10, 4), (4, 3)])
@pytest.mark.parametrize("balance", [True, False])
def test_pathological_exactly_k_classes(labels, k, num_clients, balance):
    parts = partition("pathological", labels, num_clients, 1, classes_per_client=k, balance=balance)
    table = class_table(labels, parts, C)
    assert np.all((table > 0).sum(axis=1) == k)
    assert np.all(table.sum(axis=0) == PER_CLASS)  # every class used, fully
    holders = (table > 0).sum(axis=0)
    assert holders.max() - holders.min() <= 1  # classes shared as evenly as possible
    if balance:
        for c in range(C):
            col = table[:, c][table[:, c] > 0]
            assert col.max() - col.min() <= 1


def test_pathological_unbalanced_varies(labels):
    parts = partition("pathological", labels, 20, 0, classes_per_client=2, balance=False)
    table = class_table(labels, parts, C)
    col = table[:, 0][table[:, 0] > 0]
    assert col.max() - col.min() > 5


def test_pathological_k_too_large(labels):
    with pytest.raises(PflkitError, match=r"classes_per_client=11 .* classes, 10"):
        partition("pathological", labels, 10, 0, classes_per_client=11)
    with pytest.raises(PflkitError, match=r"classes_per_client=0 .* classes, 10"):
        partition("pathological", labels, 10, 0, classes_per_client=0)


def test_pathological_cannot_cover_all_classes(labels):
    with pytest.raises(PflkitError, match="cannot cover all 10 classes"):
        partition("pathological", labels, 3, 0, classes_per_client=2)


# ---------------------------------------------------------------------------- incomplete


@pytest.mark.parametrize("min_classes", [2, 5])
def test_incomplete_class_counts(labels, min_classes):
    seen = set()
    for seed in range(3):
        parts = partition("incomplete", labels, 30, seed, min_classes=min_classes)
        table = class_table(labels, parts, C)
        n_cls = (table > 0).sum(axis=1)
        assert n_cls.min() >= min_classes and n_cls.max() <= C
        assert np.all(table.sum(axis=0) == PER_CLASS)  # union covers all, nothing lost
        assert min(len(p) for p in parts) >= 5
        seen.update(n_cls.tolist())
    assert len(seen) >= 4  # the number of classes really varies between clients


def test_incomplete_within_client_roughly_balanced_and_contiguous(labels):
    parts = partition("incomplete", labels, 20, 0, sigma=0.0, min_classes=C)
    table = class_table(labels, parts, C)
    # every client holds all classes, each with 300/20 = 15 samples (sigma 0: no skew)
    assert np.all(table == 15)
    # contiguous slices of each class's index list in dataset order, clients in order
    for c in range(C):
        idx_c = np.flatnonzero(labels == c)
        for i, p in enumerate(parts):
            assert np.array_equal(p[labels[p] == c], idx_c[15 * i : 15 * (i + 1)])


def test_incomplete_quantity_skew_grows_with_sigma(labels):
    def spread(sigma):
        sizes = [len(p) for p in partition("incomplete", labels, 20, 0, sigma=sigma)]
        return np.std(sizes) / np.mean(sizes)

    assert spread(1.0) > spread(0.3) > 0


def test_incomplete_too_small():
    lab = np.repeat(np.arange(3), 4)
    with pytest.raises(PflkitError, match="incomplete"):
        partition("incomplete", lab, 3, 0)


def test_incomplete_unreachable_in_bounded_tries():
    # with min_classes = C = 2 every client must get a sample of class 1, which has only one
    lab = np.array([0] * 100 + [1])
    with pytest.raises(PflkitError, match="no draw out of 1000"):
        partition("incomplete", lab, 3, 0)


def test_incomplete_bad_min_classes(labels):
    with pytest.raises(PflkitError, match="min_classes=11"):
        partition("incomplete", labels, 10, 0, min_classes=11)


# ---------------------------------------------------------------------------- nway_kshot


def test_nway_kshot_ways_and_shots(labels):
    n, k, s, tsm = 4, 10, 2, 15
    parts = partition("nway_kshot", labels, 12, 3, n=n, k=k, stdev=s, train_shots_max=tsm)
    table = class_table(labels, parts, C)
    ways = (table > 0).sum(axis=1)
    assert ways.min() >= max(2, n - s) and ways.max() <= min(C - 1, n + s)
    assert len(set(ways.tolist())) > 1  # noise on n
    for i, row in enumerate(table):
        shots = set(row[row > 0].tolist())
        assert len(shots) == 1  # same k_i for all of a client's classes
        assert k - s + 1 <= shots.pop() <= k + s
        # samples come from the block at offset i * train_shots_max of each class
        for c in np.flatnonzero(row):
            idx_c = np.flatnonzero(labels == c)
            got = parts[i][labels[parts[i]] == c]
            assert np.array_equal(got, idx_c[i * tsm : i * tsm + row[c]])


def test_nway_kshot_explicit_shot_range(labels):
    parts = partition(
        "nway_kshot", labels, 10, 0, n=3, k=20, stdev=1, shots_min=20, shots_max=20,
        train_shots_max=25,
    )  # fmt: skip
    table = class_table(labels, parts, C)
    assert set(table[table > 0].tolist()) == {20}


def test_nway_kshot_not_enough_samples(labels):
    with pytest.raises(PflkitError, match=r"class \d+ has 300 samples"):
        partition("nway_kshot", labels, 20, 0, n=3, k=100, stdev=2)


def test_nway_kshot_shots_exceed_block(labels):
    with pytest.raises(PflkitError, match="train_shots_max"):
        partition("nway_kshot", labels, 2, 0, n=3, k=20, stdev=2, train_shots_max=15)


# ---------------------------------------------------------------------------- natural


def test_natural_all_groups(labels, groups):
    n_groups = len(np.unique(groups))
    parts = partition("natural", labels, n_groups, 0, groups=groups)
    assert len(np.concatenate(parts)) == len(labels)
    for i, p in enumerate(parts):
        assert np.all(groups[p] == i)  # one client per group, ascending ids


def test_natural_largest(labels, groups):
    parts = partition("natural", labels, 5, 0, groups=groups)
    ids, sizes = np.unique(groups, return_counts=True)
    largest = set(ids[np.argsort(-sizes, kind="stable")[:5]].tolist())
    got = [int(np.unique(groups[p])[0]) for p in parts]
    assert set(got) == largest and got == sorted(got)


def test_natural_errors(labels, groups):
    with pytest.raises(PflkitError, match="only 25 groups"):
        partition("natural", labels, 26, 0, groups=groups)
    with pytest.raises(PflkitError, match="group ids"):
        partition("natural", labels, 5, 0)
    with pytest.raises(PflkitError, match="did you mean 'random'"):
        partition("natural", labels, 5, 0, groups=groups, select="randm")


# ---------------------------------------------------------------------------- validation


def test_unknown_partitioner_suggests(labels):
    with pytest.raises(
        PflkitError, match="unknown partitioner 'dirichet': did you mean 'dirichlet'"
    ):
        partition("dirichet", labels, 10, 0, alpha=0.5)


def test_unknown_param(labels):
    with pytest.raises(PflkitError) as e:
        partition("dirichlet", labels, 10, 0, beta=0.5)
    assert str(e.value) == (
        "partitioner 'dirichlet' has no parameter 'beta'; it takes: alpha, min_size"
    )
    with pytest.raises(PflkitError, match="'iid' has no parameter 'alpha'"):
        partition("iid", labels, 10, 0, alpha=0.5)


@pytest.mark.parametrize("num_clients", [0, -3])
def test_too_few_clients(labels, num_clients):
    with pytest.raises(PflkitError, match="num_clients must be >= 1"):
        partition("iid", labels, num_clients, 0)


def test_more_clients_than_samples():
    with pytest.raises(PflkitError, match="num_clients=11 is more than the 10"):
        partition("iid", np.arange(10) % 2, 11, 0)


def test_bad_labels():
    with pytest.raises(PflkitError, match="1-D integer"):
        partition("iid", np.zeros(10), 2, 0)


def test_bad_param_type(labels):
    with pytest.raises(PflkitError, match="classes_per_client must be an integer"):
        partition("pathological", labels, 10, 0, classes_per_client=2.5)


def test_class_table(labels):
    parts = partition("iid", labels, 4, 0)
    table = class_table(labels, parts, C)
    assert table.shape == (4, C)
    assert np.array_equal(table.sum(axis=0), np.full(C, PER_CLASS))
    assert np.array_equal(table.sum(axis=1), [len(p) for p in parts])
    assert table[2, 3] == np.sum(labels[parts[2]] == 3)
    with pytest.raises(PflkitError, match="num_classes"):
        class_table(labels, parts, 5)
