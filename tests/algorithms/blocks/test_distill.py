"""pflkit.algorithms.blocks.distill: the simplex projection, the distillation loss and the
distill phase that KT-pFL, FedMD and Sim-pFD share."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from distill_helpers import hetero_cfg, kl_rows, logits_of, np_project, setup
from pflkit.algorithms.blocks.distill import kd_loss, project_simplex
from pflkit.algorithms.context import RoundContext

pytestmark = pytest.mark.usefixtures("one_thread")


def test_simplex_projection():
    v = torch.tensor([[0.5, 2.0, -1.0], [0.5, 0.0, -1.0], [0.2, -3.0, -1.0]], dtype=torch.float64)
    got = project_simplex(v)
    np.testing.assert_allclose(got.numpy(), np_project(v.numpy()), atol=1e-12)
    assert torch.allclose(got[:, 1], torch.tensor([1.0, 0.0, 0.0], dtype=torch.float64))
    assert torch.allclose(got[:, 2], torch.full((3,), 1 / 3, dtype=torch.float64))
    on = torch.tensor([[0.2], [0.3], [0.5]], dtype=torch.float64)
    assert torch.allclose(project_simplex(on), on)  # already on the simplex: unchanged


def test_kd_loss_is_kl_teacher_student_and_its_t2_form():
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 4)
    x, t = torch.randn(5, 3), 4.0
    teacher = torch.softmax(torch.randn(5, 4), 1)
    q = torch.softmax(model(x) / t, 1)
    kl = (teacher * (teacher.log() - q.log())).sum(1).mean()
    assert kd_loss(t)(model, x, teacher).item() == pytest.approx(kl.item(), rel=1e-5)
    assert kd_loss(t, "kl_t2")(model, x, teacher).item() == pytest.approx(
        t * t * kl.item(), rel=1e-5
    )
    assert kd_loss(t, "kl_mean")(model, x, teacher).item() == pytest.approx(kl.item() / 4, rel=1e-5)
    # the gradient on the logits: (q - p) / (T B) for kl, T (q - p) / B with the T^2 factor
    z = model(x).detach().requires_grad_(True)
    logit_model = lambda _: z  # noqa: E731
    (g,) = torch.autograd.grad(kd_loss(t, "kl_t2")(logit_model, x, teacher), z)
    assert torch.allclose(g, t * (q.detach() - teacher) / 5, atol=1e-6)


@pytest.mark.parametrize("name", ["ktpfl", "fedmd", "simpfd"])
def test_distillation_lowers_kl_to_the_teacher_on_the_public_set(name, digits_with_public):
    cfg = hetero_cfg(
        {"name": name, "distill_epochs": 8, "distill_batch_size": 16, "order": "train_then_distill"}
    )
    algo, _, envs = setup(cfg, digits_with_public)
    x = digits_with_public.public_x
    teacher = torch.softmax(logits_of(envs[2], envs[2].init_weights(), x, "t") * 10, 1)
    for env in envs[:2]:  # an MLP and the ResNet
        w = algo.client_init(env)["weights"]
        before = kl_rows(teacher, torch.log_softmax(logits_of(env, w, x), 1))
        out = algo.client_update(
            env, {"teacher": teacher}, {"weights": w}, RoundContext(1, "distill")
        )
        after = kl_rows(teacher, torch.log_softmax(logits_of(env, out.state["weights"], x), 1))
        assert after < 0.8 * before, (before, after)
