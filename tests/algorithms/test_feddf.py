"""FedDF and pFedDF (pflkit.algorithms.feddf): the ensemble teacher, the server's distillation
(one epoch of SGD, or Adam with cosine annealing and early stopping on held-out public samples),
the sample-weighted group average and pFedDF's fine-tuning, by value.

Expected values are computed here by hand (numpy, or torch formulas and autograd on a copy of
the model), never with the modules' own helpers."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from distill_helpers import hetero_cfg, kl_rows, logits_of, setup, trained_by_hand
from pflkit.algorithms.context import RoundContext, ServerContext
from pflkit.algorithms.feddf import ensemble_distill
from pflkit.primitives.training import get_weights, set_weights
from pflkit.testing import personal_weights
from split_helpers import assert_close, hand_sgd, mlp_logits

pytestmark = pytest.mark.usefixtures("one_thread")


def feddf_round(algorithm: dict, data):
    """FedDF's uploads of round 1 (every client trained from its prototype) and the server
    state after aggregating them."""
    algo, senv, envs = setup(hetero_cfg(algorithm), data)
    server = algo.server_init(senv)
    uploads = {}
    for c in range(4):
        torch.manual_seed(c)
        payload = algo.configure(senv, server, c, ServerContext(1, "train"))
        uploads[c] = algo.client_update(envs[c], payload, {}, RoundContext(1)).upload
    torch.manual_seed(99)
    return (
        algo,
        senv,
        envs,
        uploads,
        algo.aggregate(senv, server, uploads, ServerContext(1, "train")),
    )


def ensemble_by_hand(envs, uploads, x, t):
    """softmax(mean over ALL clients of their logits / T)."""
    logits = [logits_of(envs[c], uploads[c]["weights"], x, "t") for c in range(4)]
    return torch.softmax(torch.stack(logits).mean(0) / t, 1)


def test_feddf_one_epoch_distils_the_all_client_ensemble_into_each_group_by_value(
    digits_with_public,
):
    t = 3.0
    algo, senv, envs, uploads, server = feddf_round(
        {"name": "feddf", "server_distill": "one_epoch", "temperature": t,
         "distill_batch_size": 64},
        digits_with_public,
    )  # fmt: skip
    x = digits_with_public.public_x
    teacher = ensemble_by_hand(envs, uploads, x, t)
    np.testing.assert_allclose(algo.ensemble_teacher(senv, uploads).numpy(), teacher, atol=1e-5)
    for c in range(4):  # one client per architecture: its group average is its upload
        env, w = envs[c], uploads[c]["weights"]
        m = env.model("ref")
        set_weights(m, w)
        m.train()
        logq = torch.log_softmax(m(x) / t, dim=1)
        loss = (teacher * (teacher.log() - logq)).sum(1).mean()
        grads = dict(zip([k for k, _ in m.named_parameters()],
                         torch.autograd.grad(loss, list(m.parameters())), strict=True))  # fmt: skip
        expected = {**get_weights(m), **{k: w[k] - 0.05 * g for k, g in grads.items()}}
        proto = server["protos"][env.arch]
        for k in expected:  # parameters one SGD step on, BatchNorm buffers after the batch
            assert torch.allclose(proto[k].double(), expected[k].double(), atol=1e-5), (c, k)
    assert server["fusion"] == {}


def test_feddf_default_fusion_keeps_the_best_student_on_the_held_out_public_samples(
    digits_with_public,
):
    t = 3.0
    algo, senv, envs, uploads, server = feddf_round(
        {"name": "feddf", "temperature": t, "server_steps": 30, "eval_every": 10},
        digits_with_public,
    )
    x = digits_with_public.public_x
    teacher = ensemble_by_hand(envs, uploads, x, t)
    cut = 64 - 7  # the last ceil(0.1 * 64) public samples are held out
    for c in range(4):
        env = envs[c]
        info = server["fusion"][env.arch]
        assert info["steps"] == 30 and info["best_step"] in (10, 20, 30)
        proto = server["protos"][env.arch]
        logq = torch.log_softmax(logits_of(env, proto, x) / t, 1)
        assert info["heldout_kl"] == pytest.approx(kl_rows(teacher[cut:], logq[cut:]), rel=1e-4)
        # distillation lowered KL(teacher || student) on the public samples it trained on
        start = torch.log_softmax(logits_of(env, uploads[c]["weights"], x) / t, 1)
        assert kl_rows(teacher[:cut], logq[:cut]) < kl_rows(teacher[:cut], start[:cut]), c


def test_feddf_server_step_is_adam_with_cosine_annealing_by_value():
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 4)
    x = torch.randn(20, 3)
    teacher = torch.softmax(torch.randn(20, 4), 1)
    p0 = {k: v.detach().clone() for k, v in model.named_parameters()}
    lr, t, b1, b2, eps = 0.01, 2.0, 0.9, 0.999, 1e-8

    def grad_at(params):
        z = x @ params["weight"].T + params["bias"]
        logq = torch.log_softmax(z / t, 1)
        loss = (teacher * (teacher.log() - logq)).sum(1).mean()
        return dict(zip(params, torch.autograd.grad(loss, list(params.values())), strict=True))

    p = {k: v.clone().requires_grad_(True) for k, v in p0.items()}
    m = {k: torch.zeros_like(v) for k, v in p0.items()}
    v = {k: torch.zeros_like(v) for k, v in p0.items()}
    for step, step_lr in ((1, lr), (2, lr * (1 + math.cos(math.pi / 2)) / 2)):
        g = grad_at(p)
        with torch.no_grad():
            for k in p:
                m[k] = b1 * m[k] + (1 - b1) * g[k]
                v[k] = b2 * v[k] + (1 - b2) * g[k] ** 2
                mhat, vhat = m[k] / (1 - b1**step), v[k] / (1 - b2**step)
                p[k] -= step_lr * mhat / (vhat.sqrt() + eps)
    info = ensemble_distill(
        model, x, teacher, x[:5], teacher[:5], steps=2, batch_size=32, lr=lr, temperature=t
    )
    assert info["steps"] == 2 and info["best_step"] == 2
    for k, w in model.named_parameters():
        assert torch.allclose(w, p[k], atol=1e-6), k


def test_feddf_stops_early_when_the_held_out_kl_stops_improving():
    torch.manual_seed(0)
    x = torch.ones(8, 3)  # one input, so the held-out KL moves monotonically
    towards_0 = torch.tensor([[0.95, 0.05]]).expand(8, 2)
    towards_1 = torch.tensor([[0.05, 0.95]]).expand(8, 2)

    def run(patience):
        model = torch.nn.Linear(3, 2)
        torch.nn.init.zeros_(model.weight)
        torch.nn.init.zeros_(model.bias)
        info = ensemble_distill(
            model, x, towards_0, x, towards_1, steps=60, batch_size=8, lr=2e-3, temperature=1.0,
            eval_every=10, patience=patience,
        )  # fmt: skip
        logq = torch.log_softmax(model(x).detach(), 1)
        return info, kl_rows(towards_1, logq)

    info, kept = run(patience=30)
    # held-out KL rises from the first check on: best at 10, no better at 20, 30, 40: stop
    assert (info["steps"], info["best_step"]) == (40, 10)
    assert kept == pytest.approx(info["heldout_kl"], rel=1e-5)  # the step-10 student is kept
    info, _ = run(patience=1000)
    assert (info["steps"], info["best_step"]) == (60, 10)


def test_pfeddf_fine_tunes_the_prototype_for_ft_epochs_by_value(digits_with_public):
    algo, senv, envs, _, server = feddf_round(
        {"name": "pfeddf", "ft_epochs": 2, "server_steps": 5}, digits_with_public
    )
    env = envs[1]
    proto = server["protos"][env.arch]
    torch.manual_seed(21)
    personal = personal_weights(
        algo, env, algo.eval_view(senv, server, 1, ServerContext(1)), {}, RoundContext(1)
    )
    expected = trained_by_hand(env, proto, 21, epochs=2)  # train.local_epochs is 1
    for k in expected:
        assert torch.allclose(personal[k], expected[k], atol=1e-6), k


def test_feddf_group_average_is_sample_weighted_before_distillation_by_hand(
    tiny, digits_with_public
):
    """One architecture, four uploads with n_k = 10, 20, 30, 40: the server starts from
    sum_k (n_k / n) w_k, forms the teacher softmax(mean_k f_k(x) / T) (the clients' logits
    averaged) and takes one full-batch SGD step (server_distill one_epoch, 64 public samples,
    distill_batch_size 64, lr = train.lr) on KL(teacher || softmax(f(x) / T))."""
    t = 2.0
    algo_cfg = {"name": "feddf", "server_distill": "one_epoch", "temperature": t,
                "distill_batch_size": 64}  # fmt: skip
    algo, senv, _ = setup(tiny(algorithm=algo_cfg), digits_with_public)
    base = algo.server_init(senv)["protos"][senv.arch()]
    gen = torch.Generator().manual_seed(1)
    uploads = {
        c: {"weights": {k: v + 0.3 * torch.randn(v.shape, generator=gen) for k, v in base.items()},
            "num_samples": 10 * (c + 1)}
        for c in range(4)
    }  # fmt: skip
    server = algo.aggregate(senv, algo.server_init(senv), uploads, ServerContext(1, "train"))
    x = digits_with_public.public_x
    avg = {k: sum(u["weights"][k] * u["num_samples"] for u in uploads.values()) / 100 for k in base}
    with torch.no_grad():
        z = torch.stack([mlp_logits(u["weights"], x) for u in uploads.values()]).mean(0)
        teacher = torch.softmax(z / t, 1)
    p = {k: v.clone().requires_grad_(True) for k, v in avg.items()}
    logq = torch.log_softmax(mlp_logits(p, x) / t, 1)
    loss = (teacher * (teacher.log() - logq)).sum(1).mean()
    grads = torch.autograd.grad(loss, list(p.values()))
    expected = {k: avg[k] - 0.05 * g for k, g in zip(p, grads, strict=True)}
    assert_close(server["protos"][senv.arch()], expected)


def test_pfeddf_fine_tunes_the_prototype_by_hand(tiny, digits_with_public):
    """pFedDF's personalized model: the architecture's prototype after ft_epochs = 2 epochs of
    SGD at train.lr on the client's data (train.local_epochs is 1)."""
    algo, senv, envs = setup(tiny(algorithm={"name": "pfeddf", "ft_epochs": 2}), digits_with_public)
    torch.manual_seed(0)
    proto = {k: v + 0.1 * torch.randn_like(v) for k, v in senv.init_weights().items()}
    d = digits_with_public.clients[2]
    torch.manual_seed(6)
    got = personal_weights(algo, envs[2], {"proto": proto}, {}, RoundContext(1))
    torch.manual_seed(6)
    assert_close(got, hand_sgd(proto, d.train_x, d.train_y, lr=0.05, epochs=2))
