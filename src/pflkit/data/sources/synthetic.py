"""FedProx's Synthetic(alpha, beta) data (Li et al., MLSys 2020), generated in-process.

``synthetic``
    60-dimensional float32 vectors (option ``dim``), 10 classes (``num_classes``), one natural
    group per user (``num_users``, 30); options ``alpha``, ``beta``, ``iid`` and ``seed``. The
    generative model is in :func:`_load_synthetic`'s docstring. No files, no test set.
"""

from __future__ import annotations

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
) -> Source:
    """FedProx's Synthetic(alpha, beta) (Li et al., MLSys 2020, `data/synthetic_*`).

    Per user k: u_k ~ N(0, alpha), B_k ~ N(0, beta); W_k ~ N(u_k, 1) of shape [dim, classes],
    b_k ~ N(u_k, 1); v_k ~ N(B_k, 1) per dimension; x ~ N(v_k, diag(j^-1.2)); y = argmax(x W_k
    + b_k). With ``iid`` (Synthetic-IID) every user shares W, b ~ N(0, 1) and v_k = 0, and alpha,
    beta are unused. Samples per user: floor(LogNormal(4, 2)) + 50. Drawn with NumPy's
    ``default_rng(seed)``, so the same seed gives the same data (not FedProx's exact numbers:
    its scripts use the unseeded global generator).
    """
    ds = "synthetic"
    alpha = _opt_float(ds, "alpha", alpha, 0.0)
    beta = _opt_float(ds, "beta", beta, 0.0)
    iid = _opt_bool(ds, "iid", iid)
    num_users = _opt_int(ds, "num_users", num_users, 1)
    dim = _opt_int(ds, "dim", dim, 1)
    num_classes = _opt_int(ds, "num_classes", num_classes, 2)
    seed = _opt_int(ds, "seed", seed, 0)

    rng = np.random.default_rng(seed)
    sizes = rng.lognormal(4, 2, num_users).astype(np.int64) + 50
    sd = np.arange(1, dim + 1, dtype=np.float64) ** -0.6  # sqrt of the covariance diagonal
    if iid:
        w_all = rng.normal(0.0, 1.0, (dim, num_classes))
        b_all = rng.normal(0.0, 1.0, num_classes)
        mean_x = np.zeros((num_users, dim))
    else:
        mean_w = rng.normal(0.0, alpha, num_users)
        big_b = rng.normal(0.0, beta, num_users)
        mean_x = rng.normal(big_b[:, None], 1.0, (num_users, dim))
    xs, ys = [], []
    for k in range(num_users):
        if iid:
            w, b = w_all, b_all
        else:
            w = rng.normal(mean_w[k], 1.0, (dim, num_classes))
            b = rng.normal(mean_w[k], 1.0, num_classes)
        x = mean_x[k] + rng.standard_normal((int(sizes[k]), dim)) * sd
        xs.append(x.astype(np.float32))
        ys.append(np.argmax(x @ w + b, axis=1).astype(np.int64))
    groups = np.repeat(np.arange(num_users, dtype=np.int64), sizes)
    return Source(
        ds,
        torch.from_numpy(np.concatenate(xs)),
        torch.from_numpy(np.concatenate(ys)),
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
        "user (generated; options alpha, beta, iid, num_users, seed)",
        _load_synthetic,
    ),
]
