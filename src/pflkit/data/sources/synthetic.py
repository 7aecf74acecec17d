"""FedProx's Synthetic(alpha, beta) data (Li et al., MLSys 2020), generated in-process.

``synthetic``
    60-dimensional float32 vectors (option ``dim``), 10 classes (``num_classes``), one natural
    group per user (``num_users``, 30); options ``alpha``, ``beta``, ``iid``, ``seed`` and the
    samples-per-user law ``size_mu``, ``size_sigma``, ``size_min``. The
    generative model is in :func:`_load_synthetic`'s docstring. No files, no test set.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch

from pflkit.data.base import (
    Source,
    SourceInfo,
    _opt_bool,
    _opt_float,
    _opt_int,
)

CHUNK = 1 << 23  # standard-normal draws per chunk of users (64 MiB of float64)


def _load_synthetic(
    root: Path,
    download: bool,
    *,
    alpha: float = 1.0,
    beta: float = 1.0,
    iid: bool = False,
    num_users: int = 30,
    dim: int = 60,
    num_classes: int = 10,
    seed: int = 0,
    size_mu: float = 4.0,
    size_sigma: float = 2.0,
    size_min: int = 50,
) -> Source:
    """FedProx's Synthetic(alpha, beta) (Li et al., MLSys 2020, `data/synthetic_*`).

    Per user k: u_k ~ N(0, alpha), B_k ~ N(0, beta); W_k ~ N(u_k, 1) of shape [dim, classes],
    b_k ~ N(u_k, 1); v_k ~ N(B_k, 1) per dimension; x ~ N(v_k, diag(j^-1.2)); y = argmax(x W_k
    + b_k). With ``iid`` (Synthetic-IID) every user shares W, b ~ N(0, 1) and v_k = 0, and alpha,
    beta are unused. Samples per user: floor(LogNormal(size_mu, size_sigma)) + size_min,
    FedProx's floor(LogNormal(4, 2)) + 50 by default (about 450 a user on average, so 100,000
    users make some 45 M samples, 11 GB of float32; smaller ``size_*`` options make large user
    counts cheap). Drawn with NumPy's ``default_rng(seed)``, so the same seed gives the same
    data (not FedProx's exact numbers: its scripts use the unseeded global generator).
    Generation is bound by its standard-normal draws (dim per sample, about 1.5 s per 50 M):
    the per-user draws come from one call per chunk of users (the same numbers as one call per
    user) and fill preallocated arrays, so the peak memory holds the data once, not twice.
    """
    ds = "synthetic"
    alpha = _opt_float(ds, "alpha", alpha, 0.0)
    beta = _opt_float(ds, "beta", beta, 0.0)
    iid = _opt_bool(ds, "iid", iid)
    num_users = _opt_int(ds, "num_users", num_users, 1)
    dim = _opt_int(ds, "dim", dim, 1)
    num_classes = _opt_int(ds, "num_classes", num_classes, 2)
    seed = _opt_int(ds, "seed", seed, 0)
    size_mu = _opt_float(ds, "size_mu", size_mu, -math.inf)
    size_sigma = _opt_float(ds, "size_sigma", size_sigma, 0.0)
    size_min = _opt_int(ds, "size_min", size_min, 1)

    rng = np.random.default_rng(seed)
    sizes = rng.lognormal(size_mu, size_sigma, num_users).astype(np.int64) + size_min
    sd = np.arange(1, dim + 1, dtype=np.float64) ** -0.6  # sqrt of the covariance diagonal
    if iid:
        w_all = rng.normal(0.0, 1.0, (dim, num_classes))
        b_all = rng.normal(0.0, 1.0, num_classes)
        mean_x = np.zeros((num_users, dim))
    else:
        mean_w = rng.normal(0.0, alpha, num_users)
        big_b = rng.normal(0.0, beta, num_users)
        mean_x = rng.normal(big_b[:, None], 1.0, (num_users, dim))
    # Every per-user draw (W_k, b_k, then the user's x noise; only the noise with ``iid``) is
    # loc + a standard normal from one stream, so one call for a chunk of users, sliced per
    # user, gives the numbers one call per user gives, with one generator call per chunk.
    params = 0 if iid else dim * num_classes + num_classes  # W_k and b_k draws per user
    draws = params + sizes * dim
    x_all = np.empty((int(sizes.sum()), dim), dtype=np.float32)
    y_all = np.empty(len(x_all), dtype=np.int64)
    row, first = 0, 0
    while first < num_users:
        last = first + max(1, int(np.searchsorted(np.cumsum(draws[first:]), CHUNK, "right")))
        flat, at = rng.standard_normal(int(draws[first:last].sum())), 0
        for k in range(first, last):
            n = int(sizes[k])
            if iid:
                w, b = w_all, b_all
            else:
                w = mean_w[k] + flat[at : at + dim * num_classes].reshape(dim, num_classes)
                b = mean_w[k] + flat[at + dim * num_classes : at + params]
            x = mean_x[k] + flat[at + params : at + params + n * dim].reshape(n, dim) * sd
            x_all[row : row + n] = x
            y_all[row : row + n] = np.argmax(x @ w + b, axis=1)
            at, row = at + params + n * dim, row + n
        first = last
    groups = np.repeat(np.arange(num_users, dtype=np.int64), sizes)
    return Source(
        ds,
        torch.from_numpy(x_all),
        torch.from_numpy(y_all),
        None,
        None,
        num_classes,
        train_groups=groups,
        group_names=[f"f_{k:05d}" for k in range(num_users)],
    )


ENTRIES: list[SourceInfo] = [
    SourceInfo(
        "synthetic",
        "synthetic: FedProx Synthetic(alpha, beta) 60-dim vectors, 10 classes, grouped by "
        "user (generated; options alpha, beta, iid, num_users, seed, size_mu/sigma/min)",
        _load_synthetic,
    ),
]
