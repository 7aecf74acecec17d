"""Sim-pFD and TopK-pFD (pflkit.algorithms.simpfd): the similarity weights and the teachers
they mix on the server."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from distill_helpers import hetero_cfg, setup, soft
from pflkit.algorithms.blocks.distill import cosine_matrix
from pflkit.algorithms.context import ServerContext
from pflkit.algorithms.simpfd import similarity_weights, topk_weights

pytestmark = pytest.mark.usefixtures("one_thread")


def test_sim_pfd_weights_are_the_cosine_similarities():
    s = soft(3, 5, 4, seed=5)
    flat = s.reshape(3, -1).numpy()
    cos = np.array([[a @ b / np.linalg.norm(a) / np.linalg.norm(b) for b in flat] for a in flat])
    np.testing.assert_allclose(cosine_matrix(s).numpy(), cos, atol=1e-12)
    np.testing.assert_allclose(similarity_weights(s).numpy(), cos / cos.sum(0), atol=1e-12)
    shifted = cos - cos.min(0)  # the authors' code: least similar client gets 0
    np.testing.assert_allclose(
        similarity_weights(s, "code").numpy(), shifted / shifted.sum(0), atol=1e-12
    )


def test_topk_pfd_averages_the_k_most_similar_clients_including_itself():
    s = soft(5, 6, 4, seed=6)
    cos = cosine_matrix(s)
    w = topk_weights(s, 3)
    for n in range(5):
        chosen = set(torch.nonzero(w[:, n]).flatten().tolist())
        others = sorted((m for m in range(5) if m != n), key=lambda m: -float(cos[m, n]))
        assert chosen == {n, *others[:2]}
        assert torch.allclose(w[list(chosen), n], torch.full((3,), 1 / 3, dtype=torch.float64))
    assert torch.allclose(topk_weights(s, 10).sum(0), torch.ones(5, dtype=torch.float64))


def test_simpfd_and_topkpfd_teachers_through_the_server_by_hand(digits_with_public):
    """The share phase's teachers, S_hat_n = sum_m w[m, n] S_m: Sim-pFD's w[:, n] the cosine
    similarities of the flattened soft predictions to S_n, normalised over m; TopK-pFD's
    (k = 2) 1/2 on the student and on its most similar other client."""
    s = soft(4, 64, 10, seed=12).float()
    flat = s.double().reshape(4, -1).numpy()
    cos = np.array([[a @ b / np.linalg.norm(a) / np.linalg.norm(b) for b in flat] for a in flat])
    share = {c: {"soft": s[c], "num_samples": 10 * (c + 1)} for c in range(4)}
    algo, senv, _ = setup(hetero_cfg({"name": "simpfd"}), digits_with_public)
    teachers = algo.aggregate(senv, algo.server_init(senv), share, ServerContext(1, "share"))[
        "teachers"
    ]
    w = cos / cos.sum(0)
    for n in range(4):
        expected = sum(float(w[m, n]) * s[m] for m in range(4))
        assert torch.allclose(teachers[n], expected, atol=1e-6)
    algo, senv, _ = setup(hetero_cfg({"name": "topkpfd", "k": 2}), digits_with_public)
    teachers = algo.aggregate(senv, algo.server_init(senv), share, ServerContext(1, "share"))[
        "teachers"
    ]
    for n in range(4):
        nearest = max((m for m in range(4) if m != n), key=lambda m: cos[m, n])
        assert torch.allclose(teachers[n], (s[n] + s[nearest]) / 2, atol=1e-6)
