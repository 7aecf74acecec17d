"""Partitioners: split a labelled training set over federated clients.

Every partitioner is a function ``fn(labels, num_clients, rng, **params)`` that returns one
sorted ``int64`` array of sample indices per client. Use them through :func:`partition`, which
validates the name, the parameters and the client count, seeds ``np.random.default_rng(seed)``
(no global RNG anywhere) and checks the result. A function that declares a ``groups`` or a
``seed`` parameter receives the per-sample owners or the seed itself; one with ``**kwargs``
takes any other parameter (``flwr``, which hands them to flwr-datasets:
:mod:`pflkit.data.flwr_partition`).

Guarantees, for every partitioner:

- deterministic given ``(params, seed)``;
- no sample is given to two clients, and every client gets at least one sample;
- the whole set is used (no sample lost) by ``iid``, ``dirichlet``, ``pathological``,
  ``incomplete``, ``quantity`` and ``dirichlet_clients`` (the latter unless ``mean_size`` asks
  for fewer samples). By design ``nway_kshot`` uses only a subset (FedProto's n-way k-shot
  tasks use about 6k-10k of MNIST's 60k images), and ``natural`` uses only the selected groups
  when ``num_clients`` is below the number of groups; the unused samples are returned nowhere;
  ``flwr`` uses what its flwr-datasets partitioner gives out (every sample, for most);
- ``dirichlet_clients`` and ``quantity`` never fail for a client count up to N / min_size
  (they are the ones for large populations: 100,000 clients in about a second), while
  ``dirichlet`` and ``incomplete`` redraw until every client is large enough and give up.

Classes are the distinct values of ``labels``; their count ``C`` is ``len(np.unique(labels))``.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from pflkit.data import flwr_partition
from pflkit.errors import PflkitError, unknown_name
from pflkit.registry import Registry

# Bound on whole-partition redraws (dirichlet min_size, incomplete coverage/min size).
MAX_TRIES = 1000


@dataclass(frozen=True)
class PartitionerInfo:
    """A registered partitioner."""

    name: str
    description: str  # one line for `pflkit list`
    fn: Callable[..., list[np.ndarray]]
    # builds each client's local test set from the official test set instead of the client's
    # own samples: (train labels, parts, test labels, **params) -> indices into the test set
    local_test: Callable[..., list[np.ndarray]] | None = None
    # for a partitioner that delegates to a library: () -> "<library> <version>", part of the
    # partition cache's key (another version of the library may draw other indices)
    library: Callable[[], str] | None = None


# --------------------------------------------------------------------------------------------
# helpers


def _check_int(name: str, value: Any, low: int | None = None, partitioner: str = "") -> int:
    where = f"partitioner '{partitioner}': " if partitioner else ""
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        raise PflkitError(f"{where}{name} must be an integer (got {value!r}); pass a whole number.")
    value = int(value)
    if low is not None and value < low:
        raise PflkitError(f"{where}{name} must be >= {low} (got {value}); pass a larger value.")
    return value


def _check_float(name: str, value: Any, partitioner: str = "") -> float:
    where = f"partitioner '{partitioner}': " if partitioner else ""
    if isinstance(value, bool) or not isinstance(value, int | float | np.integer | np.floating):
        raise PflkitError(f"{where}{name} must be a number (got {value!r}); pass a number.")
    value = float(value)
    if not np.isfinite(value):
        raise PflkitError(f"{where}{name} must be finite (got {value}); pass a finite number.")
    return value


def _class_indices(labels: np.ndarray) -> tuple[np.ndarray, list[np.ndarray]]:
    """Distinct classes and, per class, its sample indices in dataset order."""
    classes, inverse = np.unique(labels, return_inverse=True)
    order = np.argsort(inverse, kind="stable")
    bounds = np.cumsum(np.bincount(inverse, minlength=len(classes)))[:-1]
    return classes, np.split(order, bounds)


def _finish(parts: list[list[np.ndarray]] | list[np.ndarray]) -> list[np.ndarray]:
    out = []
    for p in parts:
        if isinstance(p, list):
            p = np.concatenate(p) if p else np.empty(0, dtype=np.int64)
        out.append(np.sort(np.asarray(p, dtype=np.int64)))
    return out


def _apportion(total: int, weights: np.ndarray) -> np.ndarray:
    """Split ``total`` into integer counts proportional to ``weights`` (largest remainders:
    every count is the floor of its exact share, and the leftover units go one each to the
    largest fractional parts, ties to the lower index). Equal shares when the weights are not
    usable (all zero, say, after an underflow)."""
    w = np.asarray(weights, dtype=np.float64)
    w = np.isposinf(w).astype(np.float64) if np.isposinf(w).any() else w  # overflowed draws
    w = np.clip(np.nan_to_num(w, nan=0.0), 0.0, None)
    if w.sum() <= 0:
        w = np.ones(len(w))
    exact = w / w.sum() * total
    counts = np.floor(exact).astype(np.int64)
    short = int(total - counts.sum())
    if short > 0:
        counts[np.argsort(counts - exact, kind="stable")[:short]] += 1
    return counts


def _split_by_owner(owner: np.ndarray, samples: np.ndarray, num_clients: int) -> list[np.ndarray]:
    """One sorted int64 array per client from (owner, sample index) pairs, in one sort."""
    samples = np.asarray(samples, dtype=np.int64)
    order = np.lexsort((samples, owner))
    counts = np.bincount(owner, minlength=num_clients)
    return np.split(samples[order], np.cumsum(counts)[:-1])


def _check_min_size(
    name: str, min_size: Any, num_clients: int, available: int, source: str = ""
) -> int:
    """``min_size`` as an int, checked against the ``available`` samples (``source`` names
    them when they are not the whole dataset)."""
    min_size = _check_int("min_size", min_size, 1, name)
    if min_size * num_clients > available:
        has = source or f"the dataset has {available}"
        raise PflkitError(
            f"{name}: min_size={min_size} for {num_clients} clients needs "
            f"{min_size * num_clients} samples but {has}; lower min_size or use fewer clients."
        )
    return min_size


def _even_counts(total: int, m: int) -> np.ndarray:
    """Split ``total`` into ``m`` counts that differ by at most one."""
    counts = np.full(m, total // m, dtype=np.int64)
    counts[: total % m] += 1
    return counts


# --------------------------------------------------------------------------------------------
# partitioners


def iid(labels: np.ndarray, num_clients: int, rng: np.random.Generator) -> list[np.ndarray]:
    """Shuffle all samples and split them evenly (client sizes differ by at most one)."""
    perm = rng.permutation(len(labels))
    return _finish(np.array_split(perm, num_clients))


def dirichlet(
    labels: np.ndarray,
    num_clients: int,
    rng: np.random.Generator,
    alpha: float,
    min_size: int = 10,
) -> list[np.ndarray]:
    """Label skew: for every class, client shares ~ Dir(alpha).

    Follows PFLlib's ``separate_data(partition="dir")`` variant (itself from MOON / IBM's PFNM
    ``experiment.py``, the same as FL-bench's 2023 partitioner, see specs/pfedsim.md §4.2): for
    each class, shuffle its samples, draw p ~ Dir(alpha * 1_n) over the clients, zero the share
    of every client that already holds >= N/n samples, renormalise, and cut the shuffled class
    at ``floor(cumsum(p) * N_c)``. The whole draw is repeated until every client holds at least
    ``min_size`` samples (at most ``MAX_TRIES`` draws, then a clear error). Differences from
    PFLlib: ``min_size`` defaults to 10 (PFLlib's ``least_samples`` is 1, 40 or
    min(40, N/n/2) depending on the version) and the random stream is ``default_rng(seed)``.
    If a draw leaves a class with no eligible share (possible for tiny alpha, where Dir draws
    underflow to zero) the class goes whole to one random eligible client.
    Uses every sample.
    """
    alpha = _check_float("alpha", alpha, "dirichlet")
    if alpha <= 0:
        raise PflkitError(
            f"alpha must be > 0 (got {alpha:g}); use e.g. alpha=0.1 for strong label skew "
            "or alpha=100 for nearly IID."
        )
    min_size = _check_int("min_size", min_size, 1, "dirichlet")
    n_total = len(labels)
    if min_size * num_clients > n_total:
        raise PflkitError(
            f"dirichlet: min_size={min_size} for {num_clients} clients needs "
            f"{min_size * num_clients} samples but the dataset has {n_total}; lower min_size "
            "or use fewer clients."
        )
    _, class_idx = _class_indices(labels)
    cap = n_total / num_clients

    for _ in range(MAX_TRIES):
        sizes = np.zeros(num_clients, dtype=np.int64)
        cuts: list[tuple[np.ndarray, np.ndarray]] = []
        for idx in class_idx:
            idx = rng.permutation(idx)
            p = rng.dirichlet(np.full(num_clients, alpha))
            p = np.nan_to_num(p, nan=0.0) * (sizes < cap)
            if p.sum() <= 0:
                eligible = np.flatnonzero(sizes < cap)
                p = np.zeros(num_clients)
                p[rng.choice(eligible) if len(eligible) else rng.integers(num_clients)] = 1.0
            p = p / p.sum()
            bounds = (np.cumsum(p) * len(idx)).astype(np.int64)[:-1]
            bounds = np.clip(bounds, 0, len(idx))
            counts = np.diff(np.concatenate(([0], bounds, [len(idx)])))
            sizes += counts
            cuts.append((idx, bounds))
        if sizes.min() >= min_size:
            parts: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
            for idx, bounds in cuts:
                for client, piece in enumerate(np.split(idx, bounds)):
                    parts[client].append(piece)
            return _finish(parts)
    raise PflkitError(
        f"dirichlet: no draw out of {MAX_TRIES} gave every one of the {num_clients} clients "
        f"at least min_size={min_size} samples with alpha={alpha:g}; lower min_size, raise "
        "alpha or use fewer clients."
    )


def dirichlet_clients(
    labels: np.ndarray,
    num_clients: int,
    rng: np.random.Generator,
    alpha: float,
    sigma: float = 1.0,
    min_size: int = 2,
    mean_size: float | None = None,
) -> list[np.ndarray]:
    """Client-first label skew for any population: each client draws its own label mix and
    size, then samples its labels from per-class pools. Never fails up to one sample a client.

    Let N be the number of samples, N_c those of class c and q_c = N_c / N the class prior.

    1. Sizes (quantity skew with log-normal sizes, as FedProx's and LEAF's synthetic
       populations have): s_k ~ LogNormal(0, sigma), and client k gets
       n_k = min_size + its share, proportional to s_k, of the T - num_clients * min_size
       samples above the minimum (largest-remainder rounding, so the n_k sum to T exactly).
       T = N by default; with ``mean_size`` T = round(mean_size * num_clients), which must be
       at most N. So the sizes average T / num_clients, and n_k - min_size is log-normal up to
       one common scale (``sigma=0``: equal sizes).
    2. Label mix (Hsu et al. 2019, "Measuring the effects of non-identical data distribution
       for federated visual classification"): p_k ~ Dir(alpha * q). alpha is the total
       concentration: large alpha puts every client's mix near the prior q, small alpha gives
       each client few classes. (It is not on the per-class ``dirichlet``'s scale: Dir(alpha*q)
       with 10 balanced classes has per-class parameters alpha / 10.)
    3. Labels, without replacement: every class's samples are shuffled into a pool, and the
       clients are served in a random order, in passes. In each pass every client still short
       of n_k draws its missing count from Multinomial(missing, p_k renormalised over the
       classes whose pools still have samples at the start of the pass; if p_k has no mass
       there, the pools' remaining sizes are the weights), and per class the draws are filled
       in serving order while the pool lasts; what a client did not get it draws again in the
       next pass. Each pass fills at least one sample, and T <= N, so every client ends with
       exactly n_k samples. Clients served late bend towards what is left, little when alpha
       draws match the prior on average (they do: E[p_k] = q).
    4. Client k's samples are the next positions of the class pools (pools consumed in client
       id order).

    Uses every sample with the default ``mean_size`` (T = N); with ``mean_size`` it uses a
    random subset of T samples (whatever the pools still hold is returned nowhere). Every
    client has at least ``min_size`` samples (default 2: one for local training, one for the
    local test split); num_clients * min_size > T is an error. Vectorised: about a second for
    100,000 clients.
    """
    name = "dirichlet_clients"
    alpha = _check_float("alpha", alpha, name)
    if alpha <= 0:
        raise PflkitError(
            f"{name}: alpha must be > 0 (got {alpha:g}); use e.g. alpha=0.3 for strong label "
            "skew or alpha=1000 for label mixes near the class shares."
        )
    sigma = _check_float("sigma", sigma, name)
    if sigma < 0:
        raise PflkitError(f"{name}: sigma must be >= 0 (got {sigma:g}); 0 gives equal sizes.")
    n_total = len(labels)
    total = n_total
    if mean_size is not None:
        mean_size = _check_float("mean_size", mean_size, name)
        total = int(round(mean_size * num_clients))
        if not 0 < total <= n_total:
            raise PflkitError(
                f"{name}: mean_size={mean_size:g} for {num_clients} clients needs {total} "
                f"samples but the dataset has {n_total}; use a mean_size between "
                f"{1 / num_clients:.3g} and {n_total / num_clients:.3g}, or leave it out to "
                "use every sample."
            )
    source = "" if mean_size is None else f"mean_size={mean_size:g} gives {total}"
    min_size = _check_min_size(name, min_size, num_clients, total, source)

    _, class_idx = _class_indices(labels)
    left = np.array([len(i) for i in class_idx], dtype=np.int64)
    prior = left / n_total
    sizes = min_size + _apportion(
        total - num_clients * min_size, rng.lognormal(0.0, sigma, num_clients)
    )
    mix = np.nan_to_num(rng.dirichlet(alpha * prior, size=num_clients), nan=0.0)
    serve = rng.permutation(num_clients)
    pools = [rng.permutation(idx) for idx in class_idx]

    counts = np.zeros((num_clients, len(left)), dtype=np.int64)
    waiting = serve  # clients short of their size, in serving order
    missing = sizes[serve]
    while len(waiting):
        weights = mix[waiting] * (left > 0)
        empty = weights.sum(axis=1) <= 0
        weights[empty] = left
        weights /= weights.sum(axis=1, keepdims=True)
        draws = rng.multinomial(missing, weights)
        before = np.cumsum(draws, axis=0) - draws  # drawn by clients served earlier
        got = np.clip(left - before, 0, draws)
        assert got.sum() > 0, "dirichlet_clients: a pass filled nothing"
        counts[waiting] += got
        left -= got.sum(axis=0)
        missing = missing - got.sum(axis=1)
        waiting, missing = waiting[missing > 0], missing[missing > 0]

    owners, samples = [], []
    for c, pool in enumerate(pools):
        owners.append(np.repeat(np.arange(num_clients), counts[:, c]))
        samples.append(pool[: len(owners[-1])])
    return _split_by_owner(np.concatenate(owners), np.concatenate(samples), num_clients)


def quantity(
    labels: np.ndarray,
    num_clients: int,
    rng: np.random.Generator,
    beta: float | None = None,
    sigma: float | None = None,
    min_size: int = 2,
) -> list[np.ndarray]:
    """Quantity skew with IID labels (Li et al., ICDE 2022, "Federated Learning on Non-IID Data
    Silos: An Experimental Study", quantity skew): only the client sizes differ.

    Set exactly one of ``beta`` or ``sigma``. Weights w ~ Dir(beta * 1_n) (the paper's
    q ~ Dir_N(beta)) or w_k ~ LogNormal(0, sigma); client k gets n_k = min_size plus its
    share, proportional to w_k, of the N - num_clients * min_size samples above the minimum
    (largest-remainder rounding, so the sizes sum to N). Then all samples are shuffled and
    cut into consecutive blocks of n_1, n_2, ... samples, so every client's labels are an IID
    draw of its size. Difference from the paper's code (NIID-Bench), which redraws the whole
    Dirichlet until every party has 10 samples (hopeless for large populations): the minimum
    is added instead, so it never fails when num_clients * min_size <= N.
    Uses every sample; every client has at least ``min_size`` (default 2) samples.
    """
    name = "quantity"
    if (beta is None) == (sigma is None):
        raise PflkitError(
            f"{name}: set exactly one of beta (Dirichlet sizes, e.g. beta=0.5) or sigma "
            "(log-normal sizes, e.g. sigma=1.0)."
        )
    if beta is not None:
        beta = _check_float("beta", beta, name)
        if beta <= 0:
            raise PflkitError(
                f"{name}: beta must be > 0 (got {beta:g}); smaller beta gives more unequal sizes."
            )
    else:
        sigma = _check_float("sigma", sigma, name)
        if sigma < 0:
            raise PflkitError(f"{name}: sigma must be >= 0 (got {sigma:g}); 0 gives equal sizes.")
    n_total = len(labels)
    min_size = _check_min_size(name, min_size, num_clients, n_total)
    if beta is not None:
        weights = rng.dirichlet(np.full(num_clients, beta))
    else:
        weights = rng.lognormal(0.0, sigma, num_clients)
    sizes = min_size + _apportion(n_total - num_clients * min_size, weights)
    owner = np.repeat(np.arange(num_clients), sizes)
    return _split_by_owner(owner, rng.permutation(n_total), num_clients)


def pathological(
    labels: np.ndarray,
    num_clients: int,
    rng: np.random.Generator,
    classes_per_client: int,
    balance: bool = True,
) -> list[np.ndarray]:
    """Shards: every client gets exactly ``classes_per_client`` (k) distinct classes.

    Follows PFLlib's ``separate_data(partition="pat")``: each class is shared by about
    N*k/C clients, its (shuffled) samples are cut into one contiguous shard per sharing client;
    with ``balance=True`` the shards differ by at most one sample, with ``balance=False`` every
    sharing client but the last gets a uniform random count in [max(num_per/10, 1), num_per)
    (num_per = class size / sharing clients) and the last gets the remainder, as in PFLlib.
    Class assignment differs from PFLlib so that every client gets exactly k classes and every
    class is used: the classes are put in a random order and dealt cyclically, client i taking
    positions i*k .. i*k+k-1 (mod C); each class is then shared by floor(N*k/C) or ceil(N*k/C)
    clients. (PFLlib gives each class to the first ceil(N*k/C) clients with free slots, which
    leaves classes unused or clients short when N*k/C is not a whole number.)
    Uses every sample; needs num_clients * k >= C.
    """
    k = _check_int("classes_per_client", classes_per_client, None, "pathological")
    classes, class_idx = _class_indices(labels)
    n_classes = len(classes)
    if k < 1 or k > n_classes:
        raise PflkitError(
            f"pathological: classes_per_client={k} must be between 1 and the number of "
            f"classes, {n_classes}; pass a value in that range."
        )
    if num_clients * k < n_classes:
        raise PflkitError(
            f"pathological: {num_clients} clients x {k} classes each = {num_clients * k} class "
            f"slots cannot cover all {n_classes} classes (samples would be lost); use more "
            "clients or a larger classes_per_client."
        )
    if not isinstance(balance, bool | np.bool_):
        raise PflkitError(f"pathological: balance must be true or false (got {balance!r}).")

    order = rng.permutation(n_classes)
    holders: list[list[int]] = [[] for _ in range(n_classes)]
    for client in range(num_clients):
        for j in range(k):
            holders[order[(client * k + j) % n_classes]].append(client)

    parts: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
    for c in range(n_classes):
        idx = rng.permutation(class_idx[c])
        m = len(holders[c])
        if len(idx) < m:
            raise PflkitError(
                f"pathological: class {classes[c]} has {len(idx)} samples but {m} clients "
                "must share it; use fewer clients or a smaller classes_per_client."
            )
        if balance or m == 1:
            counts = _even_counts(len(idx), m)
        else:
            num_per = len(idx) / m
            low, high = max(int(num_per / 10), 1), int(num_per)
            if low >= high:
                counts = _even_counts(len(idx), m)
            else:
                head = rng.integers(low, high, size=m - 1)
                counts = np.append(head, len(idx) - head.sum())
        for client, piece in zip(holders[c], np.split(idx, np.cumsum(counts)[:-1]), strict=True):
            parts[client].append(piece)
    return _finish(parts)


def incomplete(
    labels: np.ndarray,
    num_clients: int,
    rng: np.random.Generator,
    min_classes: int = 2,
    sigma: float = 0.3,
    min_size: int = 5,
) -> list[np.ndarray]:
    """MAP's incomplete-classes partition (specs/map.md §4.2, ``split="map"``).

    1. Client k draws n_k ~ UniformInt{min_classes..C} and a uniform random n_k-subset of the
       classes; d_k = 1/n_k on those classes.
    2. Quantity skew: each row is scaled by s_k ~ LogNormal(0, sigma).
    3. Each class column is normalised over the clients; client k's share of class c times the
       class size N_c gives its count.
    4. Client k gets a contiguous slice of class c's index list, in dataset order, clients in
       order 0..n-1.

    Differences from MAP's code, so that no sample is lost and ``num_clients`` is kept:
    counts are rounded through the cumulative shares (slice ends = round(cumsum(share) * N_c)),
    so they sum to N_c exactly and each differs from MAP's round(share * N_c) by at most one;
    and where MAP drops clients with fewer than 5 samples, the whole draw is repeated instead
    (at most ``MAX_TRIES`` times, then a clear error) until every client has >= ``min_size``
    samples, every class is held by some client, and every class a client drew gets at least
    one sample (so each client really holds between min_classes and C classes).
    Uses every sample.
    """
    classes, class_idx = _class_indices(labels)
    n_classes = len(classes)
    min_classes = _check_int("min_classes", min_classes, None, "incomplete")
    if not 1 <= min_classes <= n_classes:
        raise PflkitError(
            f"incomplete: min_classes={min_classes} must be between 1 and the number of "
            f"classes, {n_classes}; pass a value in that range."
        )
    sigma = _check_float("sigma", sigma, "incomplete")
    if sigma < 0:
        raise PflkitError(f"incomplete: sigma must be >= 0 (got {sigma:g}); MAP uses 0.3.")
    min_size = _check_int("min_size", min_size, 1, "incomplete")
    if min_size * num_clients > len(labels):
        raise PflkitError(
            f"incomplete: min_size={min_size} for {num_clients} clients needs "
            f"{min_size * num_clients} samples but the dataset has {len(labels)}; lower "
            "min_size or use fewer clients."
        )
    class_sizes = np.array([len(i) for i in class_idx])

    for _ in range(MAX_TRIES):
        n_k = rng.integers(min_classes, n_classes + 1, size=num_clients)
        d = np.zeros((num_clients, n_classes))
        for client in range(num_clients):
            chosen = rng.choice(n_classes, size=n_k[client], replace=False)
            d[client, chosen] = 1.0 / n_k[client]
        d *= rng.lognormal(0.0, sigma, size=num_clients)[:, None]
        col = d.sum(axis=0)
        if np.any(col <= 0):
            continue  # some class drawn by nobody: redraw
        share = d / col
        ends = np.rint(np.cumsum(share, axis=0) * class_sizes).astype(np.int64)
        ends[-1] = class_sizes
        starts = np.vstack([np.zeros((1, n_classes), dtype=np.int64), ends[:-1]])
        counts = ends - starts
        assert not np.any(counts[d == 0]), "incomplete: count for a class not drawn"
        if np.any(counts[d > 0] < 1) or counts.sum(axis=1).min() < min_size:
            continue
        parts: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
        for client in range(num_clients):
            for c in np.flatnonzero(counts[client]):
                parts[client].append(class_idx[c][starts[client, c] : ends[client, c]])
        return _finish(parts)
    raise PflkitError(
        f"incomplete: no draw out of {MAX_TRIES} gave all {num_clients} clients at least "
        f"min_size={min_size} samples and a sample of every class they drew; the dataset "
        f"({len(labels)} samples, {n_classes} classes) is too small for this many clients, "
        "use fewer clients."
    )


def nway_kshot(
    labels: np.ndarray,
    num_clients: int,
    rng: np.random.Generator,
    n: int,
    k: int,
    stdev: int = 2,
    shots_min: int | None = None,
    shots_max: int | None = None,
    train_shots_max: int = 110,
    test_shots: int = 40,
) -> list[np.ndarray]:
    """FedProto / pFedPM n-way k-shot label skew (specs/pfedpm.md §4.2). Uses a SUBSET.

    Client i draws n_i ~ UniformInt[max(2, n - stdev), min(C - 1, n + stdev)] ways and
    k_i ~ UniformInt[shots_min, shots_max] shots (both inclusive), then a uniform random
    n_i-subset of the classes. For each of its classes it takes k_i samples from a contiguous
    block of the label-sorted training set (dataset order within a class) starting at offset
    i * train_shots_max, so clients get disjoint samples. ``stdev`` is FedProto's name; it is a
    half-width, not a standard deviation. Shot range defaults to FedProto's FEMNIST/CIFAR-10
    form [k - stdev + 1, k + stdev]; FedProto's MNIST form is shots_max = k + stdev - 2.
    Only num_clients * train_shots_max samples per class at most are used; the rest of the set
    is returned nowhere. Every class must have at least (num_clients - 1) * train_shots_max +
    k_i samples for each client i holding it. Each client's local test set comes from the
    official *test* set (:func:`nway_kshot_test`, ``test_shots`` per class; FedProto's code:
    40 for MNIST, 15 for FEMNIST and CIFAR-10), not from its own samples.
    """
    classes, class_idx = _class_indices(labels)
    n_classes = len(classes)
    n = _check_int("n", n, 1, "nway_kshot")
    k = _check_int("k", k, 1, "nway_kshot")
    stdev = _check_int("stdev", stdev, 0, "nway_kshot")
    train_shots_max = _check_int("train_shots_max", train_shots_max, 1, "nway_kshot")
    _check_int("test_shots", test_shots, 1, "nway_kshot")
    lo_n, hi_n = max(2, n - stdev), min(n_classes - 1, n + stdev)
    if lo_n > hi_n:
        raise PflkitError(
            f"nway_kshot: n={n}, stdev={stdev} gives no valid way count in "
            f"[max(2, n-stdev), min(C-1, n+stdev)] = [{lo_n}, {hi_n}] for C={n_classes} "
            "classes; choose n between 2 and C-1."
        )
    lo_k = k - stdev + 1 if shots_min is None else shots_min
    hi_k = k + stdev if shots_max is None else shots_max
    lo_k = _check_int("shots_min", lo_k, 1, "nway_kshot")
    hi_k = _check_int("shots_max", hi_k, None, "nway_kshot")
    if hi_k < lo_k:
        raise PflkitError(
            f"nway_kshot: shot range [{lo_k}, {hi_k}] is empty; make shots_max >= shots_min."
        )
    if hi_k > train_shots_max:
        raise PflkitError(
            f"nway_kshot: up to {hi_k} shots per class exceed train_shots_max="
            f"{train_shots_max}, so clients would share samples; raise train_shots_max."
        )

    ways = rng.integers(lo_n, hi_n + 1, size=num_clients)
    shots = rng.integers(lo_k, hi_k + 1, size=num_clients)
    parts: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
    for client in range(num_clients):
        offset = client * train_shots_max
        for c in np.sort(rng.choice(n_classes, size=ways[client], replace=False)):
            need = offset + shots[client]
            if len(class_idx[c]) < need:
                raise PflkitError(
                    f"nway_kshot: class {classes[c]} has {len(class_idx[c])} samples but client "
                    f"{client} needs samples up to position {need} "
                    f"(offset {client} x train_shots_max {train_shots_max} + {shots[client]} "
                    "shots); use fewer clients, fewer shots or a smaller train_shots_max."
                )
            parts[client].append(class_idx[c][offset:need])
    return _finish(parts)


def nway_kshot_test(
    train_labels: np.ndarray,
    parts: list[np.ndarray],
    test_labels: np.ndarray,
    test_shots: int = 40,
    **_train_params: Any,
) -> list[np.ndarray]:
    """FedProto's per-client local test sets for :func:`nway_kshot` (specs/pfedpm.md §4.2
    item 5): for client i and each class it holds in ``parts[i]``, the ``test_shots`` samples
    at positions [i * test_shots, (i + 1) * test_shots) of that class in the official test set
    (dataset order within a class). So every client is tested on exactly its own classes and
    the clients' test sets are disjoint. Returns indices into the *test* set."""
    test_shots = _check_int("test_shots", test_shots, 1, "nway_kshot")
    train_labels, test_labels = np.asarray(train_labels), np.asarray(test_labels)
    out = []
    for client, part in enumerate(parts):
        begin, end = client * test_shots, (client + 1) * test_shots
        blocks = []
        for c in np.unique(train_labels[part]):
            idx = np.flatnonzero(test_labels == c)
            if len(idx) < end:
                raise PflkitError(
                    f"nway_kshot: class {c} has {len(idx)} test samples but client {client} "
                    f"needs positions {begin}..{end - 1} (test_shots={test_shots}); lower "
                    "test_shots or use fewer clients."
                )
            blocks.append(idx[begin:end])
        out.append(np.sort(np.concatenate(blocks)).astype(np.int64))
    return out


def natural(
    labels: np.ndarray,
    num_clients: int,
    rng: np.random.Generator,
    groups: np.ndarray | None = None,
    select: str = "largest",
) -> list[np.ndarray]:
    """One client per natural owner (writer, subject, domain) given by ``groups``.

    With G groups, num_clients must be <= G. If it is smaller, ``select`` picks the groups:
    ``"largest"`` (default, deterministic; the num_clients groups with most samples, ties by
    group id), ``"first"`` (lowest group ids) or ``"random"`` (uniform, from the seed). Clients
    are ordered by ascending group id. Samples of unselected groups are returned nowhere; with
    num_clients == G every sample is used.
    """
    if groups is None:
        raise PflkitError(
            "partitioner 'natural' needs per-sample group ids; use a dataset with a natural "
            "split (e.g. FEMNIST writers) or another partitioner."
        )
    groups = np.asarray(groups)
    if groups.ndim != 1 or len(groups) != len(labels):
        raise PflkitError(
            f"natural: groups must be one id per sample ({len(labels)}), got shape "
            f"{groups.shape}; pass a 1-D array aligned with labels."
        )
    if len(groups) and np.all(groups[1:] >= groups[:-1]):  # already grouped (generated data)
        starts = np.flatnonzero(np.r_[True, groups[1:] != groups[:-1]])
        sizes = np.diff(np.r_[starts, len(groups)])
        order = np.arange(len(groups), dtype=np.int64)
    else:
        _, inverse, sizes = np.unique(groups, return_inverse=True, return_counts=True)
        order = np.argsort(inverse, kind="stable")  # ascending sample index within a group
    n_groups = len(sizes)
    if num_clients > n_groups:
        raise PflkitError(
            f"natural: {num_clients} clients requested but the data has only {n_groups} "
            f"groups; set num_clients <= {n_groups}."
        )
    if select == "largest":
        chosen = np.argsort(-sizes, kind="stable")[:num_clients]
    elif select == "first":
        chosen = np.arange(num_clients)
    elif select == "random":
        chosen = rng.choice(n_groups, size=num_clients, replace=False)
    else:
        raise unknown_name("natural group selection", select, ["largest", "first", "random"])
    per_group = np.split(order, np.cumsum(sizes)[:-1])
    return [per_group[g] for g in np.sort(chosen)]


PARTITIONERS: Registry[PartitionerInfo] = Registry(
    "partitioner",
    PartitionerInfo,
    [
        PartitionerInfo("iid", "shuffle and split evenly", iid),
        PartitionerInfo(
            "dirichlet",
            "label skew: per-class client shares ~ Dir(alpha) (PFLlib/MOON 'dir')",
            dirichlet,
        ),
        PartitionerInfo(
            "dirichlet_clients",
            "label skew for large populations: per-client mix ~ Dir(alpha*prior), log-normal "
            "sizes (sigma); never fails",
            dirichlet_clients,
        ),
        PartitionerInfo(
            "quantity",
            "quantity skew: IID labels, sizes ~ Dir(beta) or log-normal(sigma)",
            quantity,
        ),
        PartitionerInfo(
            "pathological",
            "shards: exactly classes_per_client classes per client (PFLlib 'pat')",
            pathological,
        ),
        PartitionerInfo(
            "incomplete",
            "MAP: random class subsets of size min_classes..C, log-normal quantity skew",
            incomplete,
        ),
        PartitionerInfo(
            "nway_kshot",
            "FedProto/pFedPM n-way k-shot tasks (a subset; local tests from the test set)",
            nway_kshot,
            nway_kshot_test,
        ),
        PartitionerInfo("natural", "one client per natural group (writer, subject)", natural),
        PartitionerInfo(
            "flwr",
            "Flower Datasets' partitioners (partitioner: DirichletPartitioner, ...; their "
            "arguments beside it), same indices as flwr-datasets; pip install 'pflkit[hf]'",
            flwr_partition.flwr,
            library=flwr_partition.library_version,
        ),
    ],
)


def delegated_version(name: str) -> str | None:
    """``"<library> <version>"`` for a partitioner that delegates to a library (``flwr``),
    else None."""
    info = PARTITIONERS.get(name)
    return info.library() if info is not None and info.library is not None else None


# parameters a partitioner function declares to receive them from partition(), not the user
_GIVEN = ("groups", "seed")


def _param_names(fn: Callable[..., Any]) -> tuple[list[str], list[str], bool]:
    """(all user parameters, required ones, whether it takes any other keyword: **kwargs) of
    a partitioner function."""
    params = list(inspect.signature(fn).parameters.values())[3:]  # skip labels, clients, rng
    var = inspect.Parameter.VAR_KEYWORD
    named = [p for p in params if p.name not in _GIVEN and p.kind is not var]
    names = [p.name for p in named]
    required = [p.name for p in named if p.default is inspect.Parameter.empty]
    return names, required, any(p.kind is var for p in params)


def partition(
    name: str,
    labels: np.ndarray,
    num_clients: int,
    seed: int,
    /,
    groups: np.ndarray | None = None,
    **params: Any,
) -> list[np.ndarray]:
    """Split ``labels`` (the training labels, length N) over ``num_clients`` clients.

    Returns one sorted int64 index array per client. ``groups`` (per-sample owner ids) is used
    only by the partitioners that take it (``natural``, ``flwr``). Raises :class:`PflkitError` for an unknown partitioner or parameter, a
    missing required parameter, an invalid client count or invalid parameter values.
    """
    fn = PARTITIONERS.lookup(name).fn
    names, required, any_keyword = _param_names(fn)
    for key in _GIVEN:
        if key in params:
            source = "data.seed" if key == "seed" else "the dataset's natural owners"
            raise PflkitError(
                f"partitioner '{name}' takes its {key} from {source}, not from its parameters: "
                f"remove '{key}' from data.partition"
            )
    for key in params:
        if key not in names and (not any_keyword or key in _GIVEN):
            takes = ", ".join(names) if names else "no parameters"
            raise PflkitError(f"partitioner '{name}' has no parameter '{key}'; it takes: {takes}")
    missing = [r for r in required if r not in params]
    if missing:
        raise PflkitError(
            f"partitioner '{name}' needs parameter '{missing[0]}'; "
            f"set it (it takes: {', '.join(names)})."
        )

    labels = np.asarray(labels)
    if labels.ndim != 1 or not np.issubdtype(labels.dtype, np.integer):
        raise PflkitError(
            f"labels must be a 1-D integer array (got shape {labels.shape}, dtype "
            f"{labels.dtype}); pass the class index of each training sample."
        )
    num_clients = _check_int("num_clients", num_clients)
    if num_clients < 1:
        raise PflkitError(f"num_clients must be >= 1 (got {num_clients}); use at least one.")
    if num_clients > len(labels):
        raise PflkitError(
            f"num_clients={num_clients} is more than the {len(labels)} training samples; "
            "use fewer clients."
        )
    seed = _check_int("seed", seed)

    rng = np.random.default_rng(seed)
    given = inspect.signature(fn).parameters
    params |= {k: v for k, v in (("groups", groups), ("seed", seed)) if k in given}
    parts = fn(labels, num_clients, rng, **params)

    # Internal invariants (bugs, not user errors).
    assert len(parts) == num_clients, f"{name} returned {len(parts)} clients"
    flat = np.concatenate(parts)
    assert np.bincount(flat, minlength=1).max(initial=0) <= 1, f"{name} duplicated samples"
    assert all(len(p) > 0 for p in parts), f"{name} left a client empty"
    return parts


def class_table(labels: np.ndarray, parts: list[np.ndarray], num_classes: int) -> np.ndarray:
    """Per-client class counts, shape [num_clients, num_classes]."""
    labels = np.asarray(labels)
    if len(labels) and (labels.min() < 0 or labels.max() >= num_classes):
        raise PflkitError(
            f"class_table: labels range over [{labels.min()}, {labels.max()}] but "
            f"num_classes={num_classes}; pass num_classes > the largest label."
        )
    sizes = np.array([len(p) for p in parts], dtype=np.int64)
    if not len(parts) or not sizes.sum():
        return np.zeros((len(parts), num_classes), dtype=np.int64)
    owner = np.repeat(np.arange(len(parts)), sizes)
    cells = owner * num_classes + labels[np.concatenate(parts)]
    return np.bincount(cells, minlength=len(parts) * num_classes).reshape(len(parts), -1)
