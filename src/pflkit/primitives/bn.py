"""BatchNorm bookkeeping shared by FedBN, f-FedAP and pFedSim: which state-dict entries belong
to normalisation layers or are buffers, and how to split and merge weight dicts by them.

Entries are found by module type (``nn.modules.batchnorm._NormBase``: BatchNorm1d/2d/3d and
their running statistics), never by substring of the key.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from torch import Tensor, nn

from pflkit.primitives.training import Weights


def bn_modules(model: nn.Module) -> list[tuple[str, nn.modules.batchnorm._NormBase]]:
    """The model's BatchNorm modules with their qualified names, in forward-definition order."""
    return [
        (n, m) for n, m in model.named_modules() if isinstance(m, nn.modules.batchnorm._NormBase)
    ]


def bn_keys(model: nn.Module) -> list[str]:
    """State-dict keys of every BatchNorm layer: affine weight and bias, running mean and
    variance, batch counter."""
    keys: list[str] = []
    for name, m in bn_modules(model):
        keys += [f"{name}.{k}" for k in m.state_dict()]
    return keys


def buffer_keys(model: nn.Module) -> list[str]:
    """State-dict keys that are buffers (BatchNorm running statistics and counters)."""
    return [k for k, _ in model.named_buffers()]


def without(weights: Mapping[str, Tensor], keys: Iterable[str]) -> Weights:
    """``weights`` minus ``keys``."""
    drop = set(keys)
    return {k: v for k, v in weights.items() if k not in drop}


def only(weights: Mapping[str, Tensor], keys: Iterable[str]) -> Weights:
    """The entries of ``weights`` named in ``keys``."""
    return {k: weights[k] for k in keys}


def merged(model: nn.Module, *parts: Mapping[str, Tensor]) -> Weights:
    """One full weight dict in the model's key order from ``parts`` (later parts win)."""
    out: dict[str, Tensor] = {}
    for p in parts:
        out.update(p)
    return {k: out[k] for k in model.state_dict()}
