"""Arithmetic on weight dicts (``dict[str, Tensor]``): weighted sums and interpolations.

The helpers compute on the floating-point entries only. An integer entry (BatchNorm's
``num_batches_tracked``) is never averaged: the result holds a clone of it from one reference
dict, named in each helper's docstring. Every sum is taken term by term in the order given, so
a caller that passes its terms in its own order gets its own floating-point result.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import torch
from torch import Tensor

from pflkit.primitives.training import Weights


def weighted_sum(
    trees: Sequence[Mapping[str, Tensor]],
    weights: Sequence[float],
    like: Mapping[str, Tensor],
    keys: Iterable[str] | None = None,
    dtype: torch.dtype | None = None,
) -> Weights:
    """``sum_i weights[i] * trees[i][k]`` for every key ``k`` of ``keys`` (default: the keys
    of ``like``), in that order.

    A floating-point entry starts as zeros shaped like ``like[k]`` (of ``dtype``, default
    ``like[k]``'s); ``trees[i][k]`` (cast to ``dtype`` when one is given) is added to it in
    place with factor ``weights[i]``, for i = 0, 1, ... in turn; with ``dtype`` the sum is cast
    back to ``like[k]``'s dtype. An integer entry is a clone of ``like[k]``. Every term is
    added, zero weights included: leave a term out of both lists to skip it.
    """
    out: Weights = {}
    for k in like if keys is None else keys:
        v = like[k]
        if not v.is_floating_point():
            out[k] = v.clone()
            continue
        acc = torch.zeros_like(v, dtype=dtype)
        for tree, w in zip(trees, weights, strict=True):
            acc.add_(tree[k] if dtype is None else tree[k].to(dtype), alpha=w)
        out[k] = acc if dtype is None else acc.to(v.dtype)
    return out


def interpolate(a: Mapping[str, Tensor], b: Mapping[str, Tensor], t: float) -> Weights:
    """``a + t * (b - a)`` for every floating-point entry of ``b`` (keys in ``b``'s order);
    integer entries are clones of ``b``'s."""
    return {k: a[k] + t * (v - a[k]) if v.is_floating_point() else v.clone() for k, v in b.items()}


def convex_combination(a: Mapping[str, Tensor], b: Mapping[str, Tensor], t: float) -> Weights:
    """``(1 - t) * a + t * b`` for every floating-point entry of ``b`` (keys in ``b``'s
    order); integer entries are clones of ``b``'s. Not bit-identical to :func:`interpolate`
    (other rounding), so each caller keeps the form it was written with."""
    return {k: (1 - t) * a[k] + t * v if v.is_floating_point() else v.clone() for k, v in b.items()}
