"""Helpers of the knowledge-distillation tests (tests/algorithms/test_ktpfl.py, test_fedmd.py,
test_feddf.py, test_simpfd.py, blocks/test_distill.py): heterogeneous client models on the tiny
digits config, the algorithm and its environments without the engine, soft predictions, and
hand-written logits, KL and simplex projection. Their federation with a public set is the
``digits_with_public`` fixture (tests/conftest.py)."""

from __future__ import annotations

import numpy as np
import torch

from conftest import tiny_config
from pflkit.algorithms import build_algorithm
from pflkit.algorithms.context import RoundContext
from pflkit.engine.envs import make_envs
from pflkit.experiment import validate
from pflkit.primitives.training import get_weights, set_weights

# digits are 1x8x8: four distinct architectures that accept that input (ShuffleNetV2 would
# reach 1x1 before its last BatchNorm, which a 1-sample last batch cannot train)
ZOO = [
    {"name": "mlp", "options": {"hidden": [32]}},
    {"name": "resnet8", "options": {"width": 4}},
    {"name": "mlp", "options": {"hidden": [16, 16]}},
    {"name": "mlp", "options": {"hidden": []}},
]


def hetero_cfg(algorithm: dict, rounds: int = 2, **train):
    raw = tiny_config(
        model={"name": "mlp", "options": {"hidden": [32]}, "per_client": ZOO},
        algorithm=algorithm,
        train={"rounds": rounds, "batch_size": 16, "lr": 0.05, "local_epochs": 1, **train},
    )
    return validate(raw)


def setup(cfg, data):
    """The algorithm, server environment and client environments of ``cfg`` (no engine)."""
    senv, envs = make_envs(cfg, data)
    return build_algorithm(cfg.algorithm), senv, envs


def soft(a: int, b: int, c: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.softmax(torch.randn(a, b, c, generator=g, dtype=torch.float64) * 2, dim=-1)


def logits_of(env, weights, x, slot="ref") -> torch.Tensor:
    """Eval-mode logits of ``weights`` (the client's architecture) on ``x``, by hand."""
    m = env.model(slot)
    set_weights(m, weights)
    m.eval()
    with torch.no_grad():
        return m(x)


def kl_rows(p: torch.Tensor, logq: torch.Tensor) -> float:
    """mean_x KL(p(x) || q(x)) with ``logq`` = log q."""
    return float((p * (p.clamp_min(1e-30).log() - logq)).sum(1).mean())


def np_project(v: np.ndarray) -> np.ndarray:
    """Independent simplex projection (per column), for checking."""
    out = np.empty_like(v)
    for j in range(v.shape[1]):
        u = np.sort(v[:, j])[::-1]
        css = np.cumsum(u) - 1
        r = np.nonzero(u - css / np.arange(1, len(u) + 1) > 0)[0][-1]
        out[:, j] = np.maximum(v[:, j] - css[r] / (r + 1), 0)
    return out


def trained_by_hand(env, weights, seed, **overrides):
    """``weights`` after the client's private training, batches drawn after seeding ``seed``."""
    m = env.model("ref")
    set_weights(m, weights)
    torch.manual_seed(seed)
    env.train(m, RoundContext(1), **overrides)
    return get_weights(m)
