"""Partitions of large populations (issue 53): ``dirichlet_clients`` (client-first label skew),
``quantity`` (quantity skew with IID labels), their sizes and mixes by value, the cases where
``dirichlet`` gives up, bad parameters, and ``pflkit partition``'s summary above 50 clients."""

from __future__ import annotations

import re

import numpy as np
import pytest
import yaml

from conftest import tiny_config
from pflkit.data import partition as partition_module
from pflkit.data.partition import PARTITIONERS, class_table, partition
from pflkit.errors import PflkitError

PRIOR = np.array([0.4, 0.3, 0.2, 0.1])


def skewed_labels(n: int, seed: int = 0) -> np.ndarray:
    """``n`` labels of 4 classes with shares exactly ``PRIOR``, shuffled."""
    counts = np.rint(PRIOR * n).astype(int)
    return np.random.default_rng(seed).permutation(np.repeat(np.arange(4), counts))


def largest_remainder(total: int, weights: np.ndarray) -> np.ndarray:
    """The documented rounding, written out independently: floors, then one more unit to each
    of the largest fractional parts (ties to the lower index)."""
    exact = weights / weights.sum() * total
    counts = np.floor(exact).astype(int)
    fractions = exact - counts
    for i in sorted(range(len(weights)), key=lambda i: (-fractions[i], i))[: total - counts.sum()]:
        counts[i] += 1
    return counts


def check_parts(parts, n_labels: int, min_size: int, whole: bool = True) -> np.ndarray:
    sizes = np.array([len(p) for p in parts])
    assert sizes.min() >= min_size
    flat = np.concatenate(parts)
    assert len(np.unique(flat)) == len(flat)  # no sample twice
    assert flat.min() >= 0 and flat.max() < n_labels
    assert all(p.dtype == np.int64 and np.all(np.diff(p) > 0) for p in parts)
    if whole:
        assert len(flat) == n_labels
    return sizes


def mixes(labels, parts) -> np.ndarray:
    table = class_table(labels, parts, 4)
    return table / table.sum(axis=1, keepdims=True)


# ---------------------------------------------------------------------------- dirichlet_clients


def test_registered_with_one_line_descriptions():
    for name in ("dirichlet_clients", "quantity"):
        assert PARTITIONERS[name].description and "\n" not in PARTITIONERS[name].description


def test_large_alpha_gives_every_client_the_prior_and_small_alpha_few_classes():
    labels = skewed_labels(200_000)
    near = partition("dirichlet_clients", labels, 100, 0, alpha=1e6, sigma=0.0)
    check_parts(near, len(labels), 2)
    m = mixes(labels, near)
    # 2,000 samples a client: multinomial noise alone is about 0.01 per class; the last
    # clients served take what the pools still hold, so only 95% are held to it
    deviation = np.abs(m - PRIOR).max(axis=1)
    assert np.quantile(deviation, 0.95) < 0.03 and np.median(deviation) < 0.02
    assert np.abs(m.mean(axis=0) - PRIOR).max() < 0.002
    skewed = mixes(labels, partition("dirichlet_clients", labels, 100, 0, alpha=0.05))
    assert np.abs(skewed - PRIOR).sum(axis=1).mean() > 0.8
    assert np.median(skewed.max(axis=1)) > 0.95  # most clients hold (nearly) one class
    # the prior, not uniform: the clients' average mix follows the class shares
    middle = mixes(labels, partition("dirichlet_clients", labels, 2000, 0, alpha=1.0))
    assert np.abs(middle.mean(axis=0) - PRIOR).max() < 0.03


def test_sizes_are_min_size_plus_a_log_normal_share():
    """By value: the sizes are min_size + the largest-remainder share of the first draw of
    default_rng(seed), LogNormal(0, sigma) per client; and their quantiles are log-normal."""
    labels = skewed_labels(300_000)
    n, sigma, seed = 2000, 0.8, 11
    parts = partition("dirichlet_clients", labels, n, seed, alpha=1.0, sigma=sigma, min_size=3)
    sizes = check_parts(parts, len(labels), 3)
    weights = np.random.default_rng(seed).lognormal(0.0, sigma, n)
    assert np.array_equal(sizes, 3 + largest_remainder(len(labels) - 3 * n, weights))
    above = (sizes - 3).astype(float)
    z90 = 1.2815515655446004  # standard normal 90% quantile
    q10, q50, q90 = np.quantile(above, [0.1, 0.5, 0.9])
    assert q90 / q50 == pytest.approx(np.exp(z90 * sigma), rel=0.1)
    assert q10 / q50 == pytest.approx(np.exp(-z90 * sigma), rel=0.1)
    assert sizes.mean() == len(labels) / n
    equal = partition("dirichlet_clients", labels, 7, 0, alpha=1.0, sigma=0.0)
    assert sorted(len(p) for p in equal) == [42857] * 6 + [42858]


def test_never_fails_where_dirichlet_gives_up(monkeypatch):
    labels = np.random.default_rng(0).permutation(np.repeat(np.arange(10), 6000))
    monkeypatch.setattr(partition_module, "MAX_TRIES", 20)
    with pytest.raises(PflkitError, match="no draw out of 20 gave every one of the 5000"):
        partition("dirichlet", labels, 5000, 0, alpha=0.3, min_size=2)
    for alpha in (0.01, 0.3, 100.0):
        parts = partition("dirichlet_clients", labels, 5000, 0, alpha=alpha)
        check_parts(parts, len(labels), 2)


@pytest.mark.parametrize("alpha", [0.001, 1.0])
def test_one_sample_a_client(alpha):
    """num_clients == N: every client exactly one sample, every sample used, even when the
    mixes ask for the same few classes (the renormalisation sends the rest elsewhere)."""
    labels = skewed_labels(3000, seed=2)
    parts = partition("dirichlet_clients", labels, 3000, 1, alpha=alpha, min_size=1)
    assert set(check_parts(parts, 3000, 1).tolist()) == {1}


def test_mean_size_uses_a_subset_and_pools_run_dry():
    labels = skewed_labels(10_000, seed=3)
    parts = partition("dirichlet_clients", labels, 1000, 0, alpha=0.1, mean_size=4.5)
    sizes = check_parts(parts, len(labels), 2, whole=False)
    assert sizes.sum() == 4500
    # class 3 has 1,000 samples; clients that want it get what there is and draw the rest
    # elsewhere, so the sizes hold even when a pool runs dry
    rare = np.zeros(4000, dtype=np.int64)
    rare[:40] = 1  # 1% of class 1, almost every client's mix asks for class 0
    parts = partition("dirichlet_clients", rare, 400, 0, alpha=1000.0, sigma=0.0)
    assert set(check_parts(parts, 4000, 2).tolist()) == {10}


def test_deterministic_in_the_seed():
    labels = skewed_labels(20_000)
    a = partition("dirichlet_clients", labels, 500, 4, alpha=0.3)
    b = partition("dirichlet_clients", labels, 500, 4, alpha=0.3)
    c = partition("dirichlet_clients", labels, 500, 5, alpha=0.3)
    assert all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))
    assert not all(np.array_equal(x, y) for x, y in zip(a, c, strict=True))


def test_a_hundred_thousand_clients():
    labels = np.random.default_rng(1).integers(0, 10, 400_000)
    parts = partition("dirichlet_clients", labels, 100_000, 0, alpha=0.3)
    check_parts(parts, len(labels), 2)


# ------------------------------------------------------------------------------------ quantity


@pytest.mark.parametrize(("key", "value"), [("beta", 0.5), ("sigma", 1.5)])
def test_quantity_sizes_by_value_and_iid_labels(key, value):
    labels = skewed_labels(100_000, seed=4)
    n, seed = 300, 8
    parts = partition("quantity", labels, n, seed, **{key: value}, min_size=5)
    sizes = check_parts(parts, len(labels), 5)
    rng = np.random.default_rng(seed)
    weights = rng.dirichlet(np.full(n, value)) if key == "beta" else rng.lognormal(0, value, n)
    assert np.array_equal(sizes, 5 + largest_remainder(len(labels) - 5 * n, weights))
    big = [p for p in parts if len(p) >= 2000]
    assert big and np.abs(mixes(labels, big) - PRIOR).max() < 0.05  # labels IID


def test_quantity_log_normal_quantiles_and_a_hundred_thousand_clients():
    labels = skewed_labels(400_000, seed=5)
    sizes = check_parts(partition("quantity", labels, 1000, 0, sigma=0.5), len(labels), 2)
    q50, q90 = np.quantile(sizes - 2.0, [0.5, 0.9])
    assert q90 / q50 == pytest.approx(np.exp(1.2815515655446004 * 0.5), rel=0.08)
    parts = partition("quantity", labels, 100_000, 0, beta=0.3)
    check_parts(parts, len(labels), 2)


# ------------------------------------------------------------------------------ bad parameters


@pytest.mark.parametrize(
    ("name", "params", "clients", "message"),
    [
        ("dirichlet_clients", {"alpha": 0}, 10, "alpha must be > 0 (got 0)"),
        ("dirichlet_clients", {"alpha": "x"}, 10, "alpha must be a number"),
        ("dirichlet_clients", {"alpha": 1, "sigma": -1}, 10, "sigma must be >= 0"),
        ("dirichlet_clients", {"alpha": 1, "min_size": 0}, 10, "min_size must be >= 1"),
        ("dirichlet_clients", {"alpha": 1, "min_size": 2}, 600, "min_size=2 for 600 clients "
         "needs 1200 samples but the dataset has 1000"),
        ("dirichlet_clients", {"alpha": 1, "mean_size": 200}, 10, "mean_size=200 for 10 "
         "clients needs 2000 samples but the dataset has 1000"),
        ("dirichlet_clients", {}, 10, "needs parameter 'alpha'"),
        ("quantity", {}, 10, "set exactly one of beta"),
        ("quantity", {"beta": 1, "sigma": 1}, 10, "set exactly one of beta"),
        ("quantity", {"beta": 0}, 10, "beta must be > 0"),
        ("quantity", {"sigma": -0.5}, 10, "sigma must be >= 0"),
        ("quantity", {"sigma": 1, "min_size": 1.5}, 10, "min_size must be an integer"),
        ("quantity", {"beta": 1, "min_size": 200}, 10, "min_size=200 for 10 clients"),
    ],
)  # fmt: skip
def test_bad_parameters_are_one_sentence(name, params, clients, message):
    labels = skewed_labels(1000)
    with pytest.raises(PflkitError) as err:
        partition(name, labels, clients, 0, **params)
    text = str(err.value)
    assert message in text
    assert "\n" not in text and not re.search(r"\.\s+[A-Z]", text)  # one sentence


def test_min_size_above_mean_size_names_the_subset():
    labels = skewed_labels(1000)
    with pytest.raises(PflkitError, match="needs 40 samples but mean_size=3 gives 30;"):
        partition("dirichlet_clients", labels, 10, 0, alpha=1, mean_size=3, min_size=4)


# ------------------------------------------------------------------------ pflkit partition CLI


def write_config(tmp_path, clients: int, partition_cfg: dict):
    cfg = tiny_config(data={"num_clients": clients, "partition": partition_cfg, "cache": False})
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def test_cli_summarises_a_large_population(cli, tmp_path):
    path = write_config(tmp_path, 400, {"name": "dirichlet_clients", "alpha": 0.5})
    r = cli("partition", str(path), "--out", "big.png", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert "400 clients, quantiles over clients" in out
    for row in ("train samples", "test samples", "classes held", "largest class share"):
        assert row in out
    assert "1797 samples (train + test) over 400 clients and 10 classes" in out
    assert "classes per client (clients):" in out and "per client (clients):" in out
    # the histograms count every client once
    lines = out.splitlines()
    start = lines.index("classes per client (clients):")
    counts = [int(line.rsplit(" ", 1)[1]) for line in lines[start + 1 : start + 11]]
    assert sum(counts) == 400
    assert len(lines) < 60  # a summary, not a row per client
    assert (tmp_path / "big.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_keeps_the_per_client_table_up_to_fifty_clients(cli, tmp_path):
    path = write_config(tmp_path, 50, {"name": "quantity", "sigma": 1.0})
    r = cli("partition", str(path), "--out", "small.png", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    rows = [line for line in r.stdout.splitlines() if line.startswith("│")]
    assert "quantiles" not in r.stdout and len(rows) == 50
    assert rows[-1].split("│")[1].strip() == "49"
