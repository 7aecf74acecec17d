"""MAP family: restricted softmax, the inherited private model, KD/MMD, MAP's two stages."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from pflkit.algorithms.base import parse_params
from pflkit.algorithms.blocks.hpm import (
    hpm_momentum,
    hpm_update,
    kd_loss,
    mmd_loss,
    personalize,
)
from pflkit.algorithms.blocks.rs import class_counts, rs_loss, rs_scale
from pflkit.algorithms.blocks.training import get_weights, set_weights
from pflkit.algorithms.context import RoundContext
from pflkit.engine import Simulation, run_experiment
from pflkit.engine.simulation import seed_torch
from pflkit.errors import PflkitError
from split_helpers import assert_close, hand_sgd, mlp_logits


class Head(torch.nn.Module):
    """features = x, logits = W x (bias-free, as MAP's models)."""

    def __init__(self, d=3, c=4):
        super().__init__()
        self.head = torch.nn.Linear(d, c, bias=False)

    def features(self, x):
        return x

    def forward(self, x):
        return self.head(x)


# -- restricted softmax --------------------------------------------------------------------------
def test_rs_scales_exactly_the_missing_classes_logits():
    counts = torch.tensor([5.0, 0.0, 2.0, 0.0])
    scale = rs_scale(counts, alpha=0.3)
    assert scale.tolist() == pytest.approx([1.0, 0.3, 1.0, 0.3])
    torch.manual_seed(0)
    logits = torch.randn(6, 4)
    scaled = logits * scale
    assert torch.equal(scaled[:, [0, 2]], logits[:, [0, 2]])  # observed: unchanged
    assert torch.allclose(scaled[:, [1, 3]], 0.3 * logits[:, [1, 3]])  # missing: alpha times
    assert rs_scale(counts, 0.3, min_samples=3).tolist() == pytest.approx([1.0, 0.3, 0.3, 0.3])


def test_rs_with_alpha_one_is_plain_softmax():
    torch.manual_seed(0)
    model, x, y = Head(), torch.randn(8, 3), torch.tensor([0, 2] * 4)
    scale = rs_scale(class_counts(y, 4), alpha=1.0)
    assert torch.equal(rs_loss(scale)(model, x, y), F.cross_entropy(model(x), y))


def test_rs_with_alpha_zero_gives_missing_proxies_no_gradient():
    torch.manual_seed(0)
    model, x, y = Head(), torch.randn(8, 3), torch.tensor([0, 2] * 4)
    rs_loss(rs_scale(class_counts(y, 4), alpha=0.0))(model, x, y).backward()
    g = model.head.weight.grad
    assert torch.count_nonzero(g[[1, 3]]) == 0  # missing classes 1 and 3
    assert torch.count_nonzero(g[[0, 2]]) > 0
    # with alpha = 0.5 the missing proxies' gradient is damped, not zero
    model.zero_grad()
    rs_loss(rs_scale(class_counts(y, 4), alpha=0.5))(model, x, y).backward()
    assert torch.count_nonzero(model.head.weight.grad[[1, 3]]) > 0


def test_rs_soft_and_complete_modes():
    counts = torch.tensor([10.0, 0.0, 5.0])
    assert rs_scale(counts, 0.2, "soft").tolist() == pytest.approx([1.0, 0.2, 0.2 + 0.8 * 0.5])
    assert rs_scale(counts, 0.2, "complete").tolist() == pytest.approx([10 / 15, 0.0, 5 / 15])


# -- inherited private model -----------------------------------------------------------------------
def test_hpm_momentum_schedules():
    # paper: mu * z / (Q T), z includes this selection, clipped to [0, 1]
    assert hpm_momentum(1, 0.2, 150) == pytest.approx(0.9 / 30)
    assert hpm_momentum(15, 0.2, 150) == pytest.approx(0.45)
    assert hpm_momentum(40, 0.2, 150) == 1.0
    # code: previous selections only, int(Q T), clipped to [0, 0.9]
    assert hpm_momentum(1, 0.2, 150, schedule="code") == 0.0
    assert hpm_momentum(16, 0.2, 150, schedule="code") == pytest.approx(0.45)
    assert hpm_momentum(40, 0.2, 150, schedule="code") == 0.9


def test_hpm_update_is_the_moving_average():
    old = {"w": torch.tensor([1.0, 2.0]), "n": torch.tensor(3)}
    new = {"w": torch.tensor([5.0, -2.0]), "n": torch.tensor(7)}
    out = hpm_update(old, new, 0.25)
    assert torch.allclose(out["w"], 0.75 * new["w"] + 0.25 * old["w"])
    assert out["n"].item() == 7


def test_personalize_folds_the_fine_tuned_model_into_the_hpm(tiny):
    sim = Simulation(
        tiny(algorithm={"name": "fedphp"}, train={"rounds": 10, "client_fraction": 0.5})
    )
    env, p = sim.envs[0], sim.algo.params
    model = env.model()
    set_weights(model, sim.server["weights"])
    first = RoundContext(1)
    state, _ = personalize(env, model, {}, p, first)  # first selection: HPM := fine-tuned model
    assert state["selected"] == 1
    assert all(torch.equal(state["hpm"][k], v) for k, v in get_weights(model).items())
    old = {k: v + 0.1 for k, v in state["hpm"].items()}
    state, _ = personalize(env, model, {"hpm": old, "selected": 1}, p, RoundContext(2))
    mu = 0.9 * 2 / (0.5 * 10)
    for k, v in get_weights(model).items():
        assert torch.allclose(state["hpm"][k], (1 - mu) * v + mu * old[k], atol=1e-6)


def test_kd_loss_matches_hand_computation():
    s = torch.tensor([[1.0, 2.0, 0.5]])
    t = torch.tensor([[0.2, 3.0, -1.0]])
    tau = 4.0
    ps = np.exp(s.numpy()[0] / tau) / np.exp(s.numpy()[0] / tau).sum()
    pt = np.exp(t.numpy()[0] / tau) / np.exp(t.numpy()[0] / tau).sum()
    kl = float((pt * np.log(pt / ps)).sum())
    assert kd_loss(s, t, tau).item() == pytest.approx(tau**2 * kl, rel=1e-5)
    ce = -float((pt * np.log(np.exp(s.numpy()[0]) / np.exp(s.numpy()[0]).sum())).sum())
    assert kd_loss(s, t, tau, form="code").item() == pytest.approx(ce, rel=1e-5)


def test_mmd_matches_the_kernel_formula():
    torch.manual_seed(0)
    h, hp = torch.randn(4, 3), torch.randn(4, 3) + 1.0
    assert mmd_loss(h, h).item() == pytest.approx(0.0, abs=1e-6)
    z = torch.cat([h, hp]).numpy()
    d2 = ((z[:, None] - z[None]) ** 2).sum(-1)
    base = d2.sum() / (64 - 8) / 4
    k = sum(np.exp(-d2 / (base * 2**i)) for i in range(5))
    expect = k[:4, :4].mean() + k[4:, 4:].mean() - 2 * k[:4, 4:].mean()
    assert mmd_loss(h, hp).item() == pytest.approx(expect, rel=1e-4)


# -- MAP ---------------------------------------------------------------------------------------------
def incomplete(tiny, **algo):
    return tiny(
        algorithm={"name": "map", **algo},
        data={"num_clients": 6, "partition": {"name": "incomplete", "min_classes": 2}},
        train={"rounds": 4, "local_epochs": 2, "client_fraction": 0.5},
        eval={"selected_clients": True},
    )


def test_map_stage_lengths(tiny):
    sim = Simulation(incomplete(tiny))
    n = len(sim.data.clients[0].train_y)
    total = 2 * math.ceil(n / 16)
    ctx = RoundContext(1)
    assert sim.algo.stage_steps(sim.envs[0], ctx) == (total - total // 2, total // 2)  # E/2 + E/2
    sim = Simulation(incomplete(tiny, stage_b_fraction=0.1, stage_b_lr_scale=0.2))
    assert sim.algo.stage_steps(sim.envs[0], ctx) == (total, max(int(0.1 * total), 5))  # code


def test_map_uploads_the_stage_a_rs_model_and_keeps_stage_b_private(tiny):
    sim = Simulation(incomplete(tiny, alpha=0.0))
    env, algo = sim.envs[1], sim.algo
    payload = {"weights": sim.server["weights"]}
    seed_torch(9)
    ctx = RoundContext(1)
    up = algo.client_update(env, payload, {}, ctx)
    # stage A alone, same seed: RS loss for steps_A steps
    model = env.model(slot="check")
    set_weights(model, sim.server["weights"])
    seed_torch(9)
    y = sim.data.clients[1].train_y
    loss_fn = rs_loss(rs_scale(class_counts(y, 10), 0.0))
    env.train(model, ctx, loss_fn=loss_fn, steps=algo.stage_steps(env, ctx)[0])
    for k, v in get_weights(model).items():
        assert torch.equal(up.upload["weights"][k], v)
    # the HPM (stage B result) differs from the upload and is the personalized model
    hpm = up.state["hpm"]
    assert any(not torch.equal(hpm[k], up.upload["weights"][k]) for k in hpm)
    assert algo.personal_weights(env, {}, up.state, RoundContext(1)) is hpm


def test_map_trains_on_incomplete_classes(tiny, tmp_path):
    res = run_experiment(incomplete(tiny), out=tmp_path / "map")
    final = res.summary["final"]
    assert final["pers_acc_mean"] > 0.5 and final["global_acc"] > 0.3  # chance: 0.1
    assert "pers_acc_selected" in final
    res_mmd = run_experiment(incomplete(tiny, lam=0.1, kt="mmd"), out=tmp_path / "mmd")
    assert res_mmd.summary["final"]["pers_acc_mean"] > 0.5


@pytest.mark.parametrize("name", ["fedrs", "fedphp"])
def test_fedrs_and_fedphp_train(tiny, tmp_path, name):
    cfg = incomplete(tiny).model_copy(update={"algorithm": {"name": name}})
    res = run_experiment(cfg, out=tmp_path / name)
    assert res.summary["final"]["pers_acc_mean"] > 0.5


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"alpha": 1.5}, "map.alpha"),
        ({"alpha": -0.1}, "map.alpha"),
        ({"lam": 1.2}, "map.lam"),
        ({"lam": -0.5}, "map.lam"),
        ({"kt": "cosine"}, "map.kt"),
        ({"tau": 0}, "map.tau"),
    ],
)
def test_bad_map_parameters(params, message):
    with pytest.raises(PflkitError, match=message):
        parse_params({"name": "map", **params})


def test_scamap_stage_a_is_scaffold_on_the_rs_loss(tiny, tmp_path):
    from pflkit.algorithms.scaffold import scaffold_local_steps

    sim = Simulation(incomplete(tiny).model_copy(update={"algorithm": {"name": "scamap"}}))
    env, algo = sim.envs[2], sim.algo
    payload = algo.configure(sim.senv, sim.server, 2, 1, "train")
    payload["control"] = {k: torch.full_like(v, 0.01) for k, v in payload["control"].items()}
    seed_torch(5)
    ctx = RoundContext(1)
    up = algo.client_update(env, payload, {}, ctx)
    seed_torch(5)
    y = sim.data.clients[2].train_y
    ref = scaffold_local_steps(
        env, payload["weights"], payload["control"], None, ctx,
        loss_fn=rs_loss(rs_scale(class_counts(y, 10), 0.9)), steps=algo.stage_steps(env, ctx)[0],
    )  # fmt: skip
    for k in ref.delta_y:
        assert torch.equal(up.upload["delta_y"][k], ref.delta_y[k])
    assert all(torch.equal(up.state["control"][k], ref.control[k]) for k in ref.control)
    assert "hpm" in up.state
    res = run_experiment(
        incomplete(tiny).model_copy(update={"algorithm": {"name": "scamap"}}), out=tmp_path / "s"
    )
    assert res.summary["final"]["pers_acc_mean"] > 0.5


def test_scamap_defaults_to_the_code_stage_split_and_stage_b_never_reaches_the_server(tiny):
    cfg = incomplete(tiny)
    sim = Simulation(cfg.model_copy(update={"algorithm": {"name": "scamap"}}))
    total = cfg.train.local_epochs * -(-len(sim.data.clients[0].train_y) // cfg.train.batch_size)
    assert sim.algo.stage_steps(sim.envs[0], RoundContext(1)) == (total, max(int(0.2 * total), 5))
    assert sim.algo.params.stage_b_lr_scale == 0.5
    assert sim.algo.params.control_scale == "code"
    servers = []
    for lr_scale in (0.5, 2.0):  # stage B at another lr: the same global model and controls
        algo = {"name": "scamap", "stage_b_lr_scale": lr_scale}
        s = Simulation(cfg.model_copy(update={"algorithm": algo}))
        s.run_round(1)
        s.run_round(2)
        servers.append(s.server)
    for part in ("weights", "control"):
        for k, v in servers[0][part].items():
            assert torch.equal(v, servers[1][part][k])


# -- the defining math, by value against hand computations (issue 10) ---------------------------
def _softmax(z):
    e = np.exp(z - z.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def _two_heads():
    """A student and a teacher Head with fixed weights, a batch of 3 and its labels."""
    student, teacher = Head(), Head()
    with torch.no_grad():
        student.head.weight.copy_(torch.tensor([[1.0, 0, 0], [0, 1, 0], [0, 0, 1], [1, 1, 0]]))
        teacher.head.weight.copy_(torch.tensor([[0.5, 0, 1], [2, 0, 0], [0, -1, 0], [0, 0, 0]]))
    x = torch.tensor([[1.0, 2.0, 0.0], [0.0, -1.0, 3.0], [2.0, 0.5, 1.0]])
    return student, teacher, x, torch.tensor([0, 2, 2])


def test_rs_loss_by_value_for_a_fractional_alpha():
    # MAP Eq. 8 with alpha = 0.5 on a client that observes classes 0 and 2: logits z = W x,
    # missing classes 1 and 3 scaled by 0.5, then cross-entropy averaged over the batch
    model, _, x, y = _two_heads()
    z = np.array([[1, 2, 0, 3], [0, -1, 3, -1], [2, 0.5, 1, 2.5]])  # W x by hand
    a = np.array([1, 0.5, 1, 0.5])
    p = _softmax(z * a)
    expect = -np.mean(np.log(p[[0, 1, 2], [0, 2, 2]]))
    scale = rs_scale(class_counts(y, 4), alpha=0.5)
    assert rs_loss(scale)(model, x, y).item() == pytest.approx(expect, rel=1e-6)


def test_kd_loss_averages_over_the_batch():
    # Eq. 11 for a batch of 3: tau^2 times the mean (not the sum) of the per-sample KL terms
    s = torch.tensor([[1.0, 2.0, 0.5], [0.0, 0.0, 3.0], [-1.0, 1.0, 0.0]])
    t = torch.tensor([[0.2, 3.0, -1.0], [1.0, 1.0, 1.0], [2.0, 0.0, 0.0]])
    ps, pt = _softmax(s.numpy() / 4), _softmax(t.numpy() / 4)
    per_sample = (pt * np.log(pt / ps)).sum(1)
    assert kd_loss(s, t, 4.0).item() == pytest.approx(16 * per_sample.mean(), rel=1e-5)
    ce = -(pt * np.log(_softmax(s.numpy()))).sum(1).mean()  # the code's form, batch mean too
    assert kd_loss(s, t, 4.0, form="code").item() == pytest.approx(ce, rel=1e-5)


@pytest.mark.parametrize("kt", ["kd", "mmd"])
def test_eq13_weights_ce_by_one_minus_lambda_and_kt_by_lambda(kt):
    from pflkit.algorithms.blocks.hpm import HPMParams, kt_loss

    student, teacher, x, y = _two_heads()
    lam = 0.2  # asymmetric, so swapping lambda and 1 - lambda changes the value
    g = (x @ student.head.weight.T).detach().numpy()
    gp = (x @ teacher.head.weight.T).detach().numpy()
    ce = -np.mean(np.log(_softmax(g)[[0, 1, 2], y.numpy()]))
    if kt == "kd":
        ps, pt = _softmax(g / 4), _softmax(gp / 4)
        ktv = 16 * (pt * np.log(pt / ps)).sum(1).mean()
    else:  # features are x for both (Head.features): MMD between a batch and itself is 0
        ktv = 0.0
    loss = kt_loss(teacher, HPMParams(lam=lam, kt=kt))(student, x, y)
    assert loss.item() == pytest.approx((1 - lam) * ce + lam * ktv, rel=1e-5)


def test_mmd_of_identical_batches_is_zero_not_nan():
    z = torch.zeros(4, 3)
    assert mmd_loss(z, z).item() == 0.0  # the bandwidth epsilon (1e-8) of the authors' code


def test_stage_b_distils_from_the_hpm(tiny):
    # the same start, seed and data with two different HPMs: the fine-tuned model must differ
    # (if the teacher were the student itself, KT would do nothing and both would be equal)
    sim = Simulation(
        tiny(algorithm={"name": "fedphp", "lam": 0.5}, train={"rounds": 10, "client_fraction": 0.5})
    )
    env, p = sim.envs[0], sim.algo.params
    w0 = sim.server["weights"]
    trained = []
    for shift in (0.0, 0.5):
        hpm = {k: v + shift * torch.sign(v) for k, v in w0.items()}
        model = env.model()
        set_weights(model, w0)
        seed_torch(3)
        personalize(env, model, {"hpm": hpm, "selected": 1}, p, RoundContext(2))
        trained.append(get_weights(model))
    assert any(not torch.allclose(trained[0][k], trained[1][k]) for k in w0)


def test_incomplete_partition_balances_a_clients_classes_with_quantity_skew():
    # MAP §4.2 with fixed draws: n_k = (2, 3, 2), classes {0,1}, {0,1,2}, {1,2}, skew
    # s = (1, 2, 0.5); rows d_k = s_k / n_k on the drawn classes; each class column is shared
    # in proportion to d_k: class 0: 0.5 : 2/3 (3/7, 4/7 of 60 -> 26, 34), class 1:
    # 0.5 : 2/3 : 0.25 (6/17, 8/17, 3/17 -> 21, 28, 11), class 2: 2/3 : 0.25 (8/11, 3/11 -> 44, 16);
    # cumulative rounding of the slice ends
    from pflkit.data.partition import incomplete as incomplete_partition

    class Draws:
        def __init__(self):
            self.sets = [np.array([0, 1]), np.array([0, 1, 2]), np.array([1, 2])]

        def integers(self, lo, hi, size):
            return np.array([2, 3, 2])

        def choice(self, n, size, replace):
            return self.sets.pop(0)

        def lognormal(self, mean, sigma, size):
            return np.array([1.0, 2.0, 0.5])

        def permutation(self, x):
            return np.random.default_rng(0).permutation(x)

        def shuffle(self, x):
            np.random.default_rng(0).shuffle(x)

    labels = np.repeat(np.arange(3), 60)
    parts = incomplete_partition(labels, 3, Draws(), min_classes=2, sigma=0.3)
    counts = np.array([np.bincount(labels[p], minlength=3) for p in parts])
    assert counts.tolist() == [[26, 21, 0], [34, 28, 44], [0, 11, 16]]
    assert sorted(np.concatenate(parts).tolist()) == list(range(180))  # every sample, once


def test_selected_client_protocol_scores_the_hpm_of_the_selected_clients(tiny):
    # MAP's personalization accuracy: the round's selected clients only, each with its HPM
    # right after local training, on its local test split, unweighted mean (specs/map.md §4.4)
    sim = Simulation(incomplete(tiny))
    row = sim.run_round(1)
    selected = row["clients"]
    assert 0 < len(selected) < sim.data.num_clients

    def acc(cid, weights):
        model = sim.envs[cid].model(slot="check")
        set_weights(model, weights)
        model.eval()
        with torch.no_grad():
            pred = model(sim.data.clients[cid].test_x).argmax(1)
        return int((pred == sim.data.clients[cid].test_y).sum()) / len(pred)

    hpm = [acc(c, sim.clients[c]["hpm"]) for c in selected]
    assert row["pers_acc_selected"] == pytest.approx(np.mean(hpm), abs=1e-12)
    # the alternatives the protocol must not compute are different numbers here
    every = [acc(c, sim.clients[c].get("hpm", sim.server["weights"])) for c in range(6)]
    assert np.mean(every) != pytest.approx(np.mean(hpm), abs=1e-6)


def test_map_stage_b_runs_at_the_scaled_learning_rate(tiny, monkeypatch):
    sim = Simulation(incomplete(tiny, stage_b_lr_scale=0.25))
    env, calls = sim.envs[0], []
    real = type(env).train

    def spy(self, model, ctx, **kw):
        calls.append(kw)
        return real(self, model, ctx, **kw)

    monkeypatch.setattr(type(env), "train", spy)
    state = {"hpm": sim.server["weights"], "selected": 1}
    sim.algo.client_update(env, {"weights": sim.server["weights"]}, state, RoundContext(2))
    steps_a, steps_b = sim.algo.stage_steps(env, RoundContext(2))
    assert [c.get("steps") for c in calls] == [steps_a, steps_b]
    assert "lr" not in calls[0] or calls[0]["lr"] == 0.05  # stage A: train.lr
    assert calls[1]["lr"] == pytest.approx(0.05 * 0.25)  # stage B: 0.25 x train.lr


def test_fedphp_uploads_the_fine_tuned_model_and_folds_it_into_the_hpm(tiny):
    # FedPHP: the upload is the model fine-tuned from the download; the HPM becomes
    # (1 - mu_k) upload + mu_k old HPM with mu_k = 0.9 z / (Q T) = 0.9 * 3 / (0.5 * 10) = 0.54
    sim = Simulation(
        tiny(algorithm={"name": "fedphp"}, train={"rounds": 10, "client_fraction": 0.5})
    )
    env, w0 = sim.envs[1], sim.server["weights"]
    old = {k: v + 0.3 for k, v in w0.items()}
    up = sim.algo.client_update(env, {"weights": w0}, {"hpm": old, "selected": 2}, RoundContext(3))
    new, sent = up.state["hpm"], up.upload["weights"]
    assert up.state["selected"] == 3
    for k in w0:
        assert torch.allclose(new[k], 0.46 * sent[k] + 0.54 * old[k], atol=1e-6)
    assert any(not torch.allclose(sent[k], new[k]) for k in w0)


# -- FedRS, FedPHP and ScaMAP client and server steps, by hand ----------------------------------
def rs_ce(train_y, alpha, num_classes=10):
    """MAP Eq. 8 written out: CE of the logits scaled by 1 (classes the client has at least
    one sample of) or alpha."""
    have = torch.zeros(num_classes, dtype=torch.bool)
    have[train_y.unique()] = True
    a = torch.where(have, 1.0, alpha)
    return lambda w, x, y: F.cross_entropy(mlp_logits(w, x) * a, y)


def kt_ce(hpm, lam, tau=4.0):
    """MAP Eq. 13 with KD (Eq. 11) written out: (1 - lam) CE + lam tau^2 KL(p_hpm || p) at
    temperature tau, the KL summed over classes and averaged over the batch."""

    def loss(w, x, y):
        z = mlp_logits(w, x)
        pt = torch.softmax(mlp_logits(hpm, x) / tau, 1)
        kl = (pt * (pt.log() - torch.log_softmax(z / tau, 1))).sum(1).mean()
        return (1 - lam) * F.cross_entropy(z, y) + lam * tau**2 * kl

    return loss


def test_fedrs_client_step_is_sgd_on_the_rs_loss_by_hand(tiny):
    alpha = 0.3
    cfg = tiny(
        algorithm={"name": "fedrs", "alpha": alpha},
        data={"partition": {"name": "pathological", "classes_per_client": 3}},
    )
    sim = Simulation(cfg)
    env, d, w = sim.envs[0], sim.data.clients[0], sim.server["weights"]
    assert len(d.train_y.unique()) < 10
    torch.manual_seed(2)
    up = sim.algo.client_update(env, {"weights": w}, {}, RoundContext(1)).upload
    torch.manual_seed(2)
    assert_close(up["weights"], hand_sgd(w, d.train_x, d.train_y, rs_ce(d.train_y, alpha), lr=0.05))


def test_fedphp_client_step_distils_from_the_hpm_by_hand(tiny):
    """FedPHP with an HPM: the upload is E epochs of SGD from the download on Eq. 13 (KD from
    the frozen HPM, lambda = 0.3, tau = 4); the HPM becomes (1 - mu_k) upload + mu_k HPM with
    mu_k = 0.9 z / (Q T) = 0.9 * 2 / (0.5 * 10) = 0.36 (second selection)."""
    lam = 0.3
    cfg = tiny(
        algorithm={"name": "fedphp", "lam": lam}, train={"rounds": 10, "client_fraction": 0.5}
    )
    sim = Simulation(cfg)
    env, d, w = sim.envs[2], sim.data.clients[2], sim.server["weights"]
    torch.manual_seed(0)
    hpm = {k: v + 0.3 * torch.randn_like(v) for k, v in w.items()}
    torch.manual_seed(5)
    up = sim.algo.client_update(env, {"weights": w}, {"hpm": hpm, "selected": 1}, RoundContext(4))
    torch.manual_seed(5)
    sent = hand_sgd(w, d.train_x, d.train_y, kt_ce(hpm, lam), lr=0.05)
    assert_close(up.upload["weights"], sent)
    assert_close(up.state["hpm"], {k: 0.64 * sent[k] + 0.36 * hpm[k] for k in w})
    assert up.state["selected"] == 2


def scamap(tiny):
    return incomplete(tiny).model_copy(update={"algorithm": {"name": "scamap"}})


def test_scamap_client_update_by_hand(tiny):
    """ScaMAP's client with the defaults (authors' code), E = 2, K = 2 ceil(n / B):

    - stage A: K SCAFFOLD steps y <- y - lr (grad RS(y) + c - c_i) from x (RS: alpha = 0.9 on
      the classes the client lacks); upload Delta y = y - x, Delta c = c_i+ - c_i with
      c_i+ = c_i - c + (x - y) / (K lr), keep c_i+;
    - stage B: max(floor(0.2 K), 5) steps at 0.5 lr from y on Eq. 13 (KD from the HPM,
      lambda = 0.01, tau = 4); HPM <- (1 - mu_k) result + mu_k HPM, mu_k = 0.9 * 2 / (0.5 * 4).
    """
    sim = Simulation(scamap(tiny))
    cid = 4
    env, d, x = sim.envs[cid], sim.data.clients[cid], sim.server["weights"]
    assert len(d.train_y.unique()) < 10
    torch.manual_seed(1)
    c = {k: 0.3 * torch.randn_like(v) for k, v in x.items()}
    ci = {k: 0.3 * torch.randn_like(v) for k, v in x.items()}
    hpm = {k: v + 0.3 * torch.randn_like(v) for k, v in x.items()}
    state = {"control": ci, "hpm": hpm, "selected": 1}
    torch.manual_seed(3)
    update = sim.algo.client_update(env, {"weights": x, "control": c}, state, RoundContext(2))
    k_steps = 2 * math.ceil(len(d.train_y) / 16)
    torch.manual_seed(3)
    shift = {k: c[k] - ci[k] for k in x}
    y = hand_sgd(x, d.train_x, d.train_y, rs_ce(d.train_y, 0.9), lr=0.05, steps=k_steps,
                 shift=shift)  # fmt: skip
    b = hand_sgd(y, d.train_x, d.train_y, kt_ce(hpm, 0.01), lr=0.025,
                 steps=max(int(0.2 * k_steps), 5))  # fmt: skip
    new_ci = {k: ci[k] - c[k] + (x[k] - y[k]) / (k_steps * 0.05) for k in x}
    assert_close(update.upload["delta_y"], {k: y[k] - x[k] for k in x})
    assert_close(update.upload["delta_c"], {k: new_ci[k] - ci[k] for k in x})
    assert_close(update.state["control"], new_ci)
    mu = 0.9 * 2 / (0.5 * 4)
    assert_close(update.state["hpm"], {k: (1 - mu) * b[k] + mu * hpm[k] for k in x})


def test_scamap_server_update_by_hand(tiny):
    """ScaMAP's server (defaults): x <- x + 1.0 * mean_S(Delta y), c <- c + mean_S(Delta c)
    (the authors' code: no |S| / N factor; here |S| = 3 of N = 6)."""
    sim = Simulation(scamap(tiny))
    x, c = sim.server["weights"], sim.server["control"]
    gen = torch.Generator().manual_seed(0)
    ups = {
        cid: {
            "delta_y": {k: torch.randn(v.shape, generator=gen) for k, v in x.items()},
            "delta_c": {k: torch.randn(v.shape, generator=gen) for k, v in c.items()},
            "num_samples": 10 * (cid + 1),
        }
        for cid in (0, 2, 5)
    }
    new = sim.algo.aggregate(sim.senv, sim.server, ups, 1, "train")
    mean_dy = {k: sum(u["delta_y"][k] for u in ups.values()) / 3 for k in x}
    mean_dc = {k: sum(u["delta_c"][k] for u in ups.values()) / 3 for k in c}
    assert_close(new["weights"], {k: x[k] + mean_dy[k] for k in x}, atol=1e-6)
    assert_close(new["control"], {k: c[k] + mean_dc[k] for k in c}, atol=1e-6)
