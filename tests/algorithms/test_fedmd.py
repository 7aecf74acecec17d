"""FedMD (pflkit.algorithms.fedmd): the consensus teacher. Its client round (upload, digest,
revisit) is checked beside KT-pFL's in test_ktpfl.py; its distillation step in
blocks/test_distill.py."""

from __future__ import annotations

import pytest
import torch

from distill_helpers import hetero_cfg, setup, soft
from pflkit.algorithms.context import ServerContext

pytestmark = pytest.mark.usefixtures("one_thread")


def test_fedmd_teacher_is_the_plain_mean(digits_with_public):
    algo, senv, _ = setup(hetero_cfg({"name": "fedmd"}), digits_with_public)
    s = soft(4, 64, 10, seed=9).float()
    counts = (5, 10, 20, 40)  # the consensus ignores D_n
    server = algo.aggregate(senv, algo.server_init(senv), {c: {"soft": s[c], "num_samples": counts[c]} for c in range(4)}, ServerContext(1, "share"))  # fmt: skip
    for n in range(4):
        assert torch.allclose(server["teachers"][n], (s[0] + s[1] + s[2] + s[3]) / 4, atol=1e-6)
    assert algo.order == "distill_then_train"  # FedMD: digest, then revisit
