"""Sample-level DP-SGD in local training through Opacus (``privacy.sample_dp``;
src/pflkit/privacy/dpsgd.py, docs/dp-sgd.md): per-sample clipping and the noise by value, the
non-per-sample terms of a local objective applied after the noise, every client's own
accountant against Opacus's and dp-accounting's, the step count through checkpoints and worker
processes, determinism, and the refusals."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
import yaml
from torch import nn

pytest.importorskip("opacus")
pytest.importorskip("dp_accounting")

from conftest import tiny_config  # noqa: E402
from pflkit.algorithms.base import ALGORITHMS  # noqa: E402
from pflkit.algorithms.context import ServerContext
from pflkit.config import SampleDPConfig  # noqa: E402
from pflkit.engine.clients import InProcess, ProcessPool, round_context, train_client  # noqa: E402
from pflkit.engine.simulation import Simulation  # noqa: E402
from pflkit.errors import PflkitError  # noqa: E402
from pflkit.experiment import validate  # noqa: E402
from pflkit.primitives.training import get_weights, proximal_loss  # noqa: E402
from pflkit.privacy import dpsgd  # noqa: E402
from pflkit.privacy.dpsgd import HISTORY, accounting, dp_sgd  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")


def dp_config(algorithm="fedavg", sample_dp=None, **sections) -> dict:
    sample_dp = {"noise_multiplier": 1.0, "max_grad_norm": 1.0, **(sample_dp or {})}
    return tiny_config(
        algorithm=algorithm if isinstance(algorithm, dict) else {"name": algorithm},
        privacy={"sample_dp": sample_dp},
        **sections,
    )


def simulation(raw: dict, runner=None) -> Simulation:
    return Simulation(validate(raw), runner=runner if runner is not None else InProcess())


def rows_without_time(rows):
    return [{k: v for k, v in r.items() if not k.startswith("seconds_")} for r in rows]


# -- the mechanism by value ----------------------------------------------------------------------


def half_squared_error(model, x, y):
    return 0.5 * (model(x).squeeze(1) - y).pow(2).mean()


def test_per_sample_gradients_are_clipped_before_they_are_summed():
    """w = (1, -1), loss (w.x - y)^2 / 2: the per-sample gradients (w.x_i - y_i) x_i are
    (1, 0), (0, -4), (-6, -8), norms 1, 4, 10; clipped to C = 2 they are (1, 0), (0, -2),
    (-1.2, -1.6), sum (-0.2, -3.6). One step with all three samples (batch 3 of 3: q = 1), no
    noise, lr 0.5: w - 0.5 * sum / 3 = (1 + 0.2/6, -1 + 3.6/6) = (1.0333.., -0.4)."""
    model = nn.Linear(2, 1, bias=False)
    with torch.no_grad():
        model.weight.copy_(torch.tensor([[1.0, -1.0]]))
    x = torch.tensor([[1.0, 0.0], [0.0, 2.0], [3.0, 4.0]])
    y = torch.tensor([0.0, 0.0, 1.0])
    dp = SampleDPConfig(max_grad_norm=2.0, noise_multiplier=0.0)
    with accounting() as tally:
        dp_sgd(model, x, y, dp, epochs=1, batch_size=3, lr=0.5, loss_fn=half_squared_error)
    want = torch.tensor([[1.0 + 0.2 / 6, -1.0 + 3.6 / 6]])
    # Opacus divides by norm + 1e-6: 1e-6 relative at most
    assert torch.allclose(model.weight.detach(), want, atol=1e-5), model.weight
    assert tally.history == [[0.0, 1.0, 1]]
    assert not hasattr(model.weight, "grad_sample")  # Opacus's hooks are gone afterwards


def test_noise_std_is_noise_multiplier_times_clip_over_expected_batch():
    """Zero per-sample gradients (zero inputs, no bias): one step moves every weight by
    -lr * N(0, (z C / B)^2), B = q n the expected batch size. 10,000 draws: the empirical std
    is within 3% (4 standard errors) of z C / B * lr, the mean within 4 standard errors of 0."""
    torch.manual_seed(0)
    model = nn.Linear(100, 100, bias=False)
    before = model.weight.detach().clone()
    x = torch.zeros(8, 100)
    y = torch.randint(0, 100, (8,))
    dp = SampleDPConfig(max_grad_norm=0.7, noise_multiplier=1.3)
    with accounting():
        dp_sgd(model, x, y, dp, epochs=1, batch_size=2, lr=1.0, steps=1)  # q = 2 / 8
    step = (model.weight.detach() - before).flatten()
    std = 1.3 * 0.7 / 2
    assert step.std().item() == pytest.approx(std, rel=0.03)
    assert abs(step.mean().item()) < 4 * std / math.sqrt(step.numel())


def test_noise_comes_from_the_seeded_global_rng():
    """Every sample in the batch (q = 1) and zero gradients: the step is the noise alone. The
    same torch seed gives the same noise, another seed other noise."""

    def noise(seed: int) -> torch.Tensor:
        model = nn.Linear(5, 3, bias=False)
        with torch.no_grad():
            model.weight.zero_()
        torch.manual_seed(seed)
        with accounting():
            dp_sgd(model, torch.zeros(6, 5), torch.zeros(6, dtype=torch.long), SampleDPConfig(),
                   epochs=1, batch_size=6, lr=1.0)  # fmt: skip
        return model.weight.detach().clone()

    assert torch.equal(noise(1), noise(1))
    assert not torch.equal(noise(1), noise(2))
    assert noise(1).abs().min() > 0


def test_a_step_equals_opacus_own_gradsamplemodule_and_dpoptimizer():
    """A small conv net, every sample in the batch (q = 1), no noise: pflkit's DP-SGD step
    gives the weights Opacus's own GradSampleModule + DPOptimizer step gives."""
    from opacus import GradSampleModule
    from opacus.optimizers import DPOptimizer

    def net() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Conv2d(1, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6 * 6, 3))

    x, y = torch.randn(12, 1, 8, 8), torch.randint(0, 3, (12,))
    ours = net()
    with accounting():
        dp_sgd(ours, x, y, SampleDPConfig(max_grad_norm=0.3, noise_multiplier=0.0),
               epochs=1, batch_size=12, lr=0.5, momentum=0.9, steps=2)  # fmt: skip
    theirs = GradSampleModule(net())
    opt = DPOptimizer(
        torch.optim.SGD(theirs.parameters(), lr=0.5, momentum=0.9),
        noise_multiplier=0.0, max_grad_norm=0.3, expected_batch_size=12,
    )  # fmt: skip
    for _ in range(2):
        opt.zero_grad()
        F.cross_entropy(theirs(x), y).backward()
        opt.step()
    for a, b in zip(ours.parameters(), theirs._module.parameters(), strict=True):
        assert torch.allclose(a, b, atol=1e-6)


def per_sample_clipped_mean(model, x, y, clip: float) -> dict[str, torch.Tensor]:
    """sum_i clip(grad CE(model(x_i), y_i)) / n, one backward pass per sample (by hand)."""
    names = [k for k, _ in model.named_parameters()]
    total = {k: torch.zeros_like(p) for k, p in model.named_parameters()}
    for i in range(len(y)):
        model.zero_grad(set_to_none=True)
        F.cross_entropy(model(x[i : i + 1]), y[i : i + 1]).backward()
        g = {k: p.grad.detach().clone() for k, p in model.named_parameters()}
        norm = torch.sqrt(sum(g[k].pow(2).sum() for k in names))
        factor = min(1.0, clip / (float(norm) + 1e-6))
        for k in names:
            total[k] += factor * g[k]
    return {k: v / len(y) for k, v in total.items()}


def test_fedprox_proximal_term_is_applied_after_the_noise_by_value():
    """FedProx's client step under DP-SGD without noise, every sample in every batch (batch
    size above n: q = 1), two local steps: w1 = w0 - lr * clipped mean gradient at w0, then
    w2 = w1 - lr * (clipped mean gradient at w1 + mu (w1 - w_g)). The proximal term has no
    per-sample gradient in Opacus; dropping it (or clipping it with the samples) changes w2."""
    lr, mu, clip = 0.2, 2.0, 0.05
    raw = dp_config(
        {"name": "fedprox", "mu": mu},
        {"noise_multiplier": 0.0, "max_grad_norm": clip},
        train={"batch_size": 10_000, "local_epochs": 2, "lr": lr, "rounds": 1},
    )
    with simulation(raw) as sim:
        env, algo = sim.envs[0], sim.algo
        payload = algo.configure(sim.senv, sim.server, 0, ServerContext(1, "train"))
        ctx = round_context(env.run, 1, "train")
        update = train_client(algo, env, payload, sim.client_state(0), ctx, 0)
        model = env.models.new_model(env.arch)
        w_g = payload["weights"]
        model.load_state_dict(w_g)
        x, y = env.data.train_x, env.data.train_y
        for step in range(2):
            g = per_sample_clipped_mean(model, x, y, clip)
            with torch.no_grad():
                for k, p in model.named_parameters():
                    p -= lr * (g[k] + (mu * (p - w_g[k]) if step else 0))
        for k, v in get_weights(model).items():
            assert torch.allclose(update.upload["weights"][k], v, atol=1e-6), k
        # without the proximal term the second step lands elsewhere
        model.load_state_dict(w_g)
        for _ in range(2):
            g = per_sample_clipped_mean(model, x, y, clip)
            with torch.no_grad():
                for k, p in model.named_parameters():
                    p -= lr * g[k]
        gap = max(
            (update.upload["weights"][k] - v).abs().max() for k, v in get_weights(model).items()
        )
        assert gap > 1e-4
        assert update.state[HISTORY] == [[0.0, 1.0, 2]]
        assert "dpsgd_epsilon" not in update.metrics  # no noise: no finite epsilon


def test_proximal_gradient_is_data_free():
    """The added gradient of a regulariser is computed on no private sample: with the model at
    the proximal anchor's offset d and zero noise, a data term whose per-sample gradients are
    all clipped to 0 (C tiny) leaves exactly -lr * mu * d."""
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    anchor = {k: v + 0.5 for k, v in get_weights(model).items()}
    before = get_weights(model)
    x, y = torch.randn(10, 4) * 100, torch.randint(0, 3, (10,))
    dp = SampleDPConfig(max_grad_norm=1e-12, noise_multiplier=0.0)
    with accounting():
        dp_sgd(model, x, y, dp, epochs=1, batch_size=10, lr=0.1,
               loss_fn=proximal_loss(anchor, 2.0), steps=1)  # fmt: skip
    for k, v in get_weights(model).items():
        assert torch.allclose(v, before[k] - 0.1 * 2.0 * (before[k] - anchor[k]), atol=1e-6)


# -- accounting ----------------------------------------------------------------------------------


def test_each_clients_epsilon_is_opacus_rdp_and_dp_accountings():
    """After two rounds every client has run 2 * ceil(n_k / B) DP-SGD steps at rate B / n_k
    (its own accountant); its epsilon at delta 1 / n_k equals Opacus's RDPAccountant stepped
    once per step, and dp-accounting's RDP of the Poisson-subsampled Gaussian to 0.5%."""
    import dp_accounting
    from dp_accounting import rdp
    from opacus.accountants import RDPAccountant

    z, batch = 1.1, 16
    raw = dp_config(sample_dp={"noise_multiplier": z}, train={"rounds": 2, "batch_size": batch})
    with simulation(raw) as sim:
        for rnd in (1, 2):
            sim.run_round(rnd)
        for cid, env in enumerate(sim.envs):
            n = env.num_train
            q, steps = batch / n, 2 * math.ceil(n / batch)
            history = sim.client_state(cid)[HISTORY]
            assert history == [[z, q, steps]]
            ours = dpsgd.epsilon(history, 1 / n, "rdp")
            opacus = RDPAccountant()
            for _ in range(steps):
                opacus.step(noise_multiplier=z, sample_rate=q)
            assert ours == opacus.get_epsilon(1 / n)
            acc = rdp.RdpAccountant()
            event = dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(z))
            acc.compose(dp_accounting.SelfComposedDpEvent(event, steps))
            assert ours == pytest.approx(acc.get_epsilon(1 / n), rel=5e-3)
        # the update's metrics report it (what the engine's rows summarise)
        env = sim.envs[0]
        payload = sim.algo.configure(sim.senv, sim.server, 0, ServerContext(3, "train"))
        up = train_client(
            sim.algo, env, payload, sim.client_state(0), round_context(env.run, 3, "train"), 0
        )
        n = env.num_train
        history = [[z, batch / n, 3 * math.ceil(n / batch)]]
        assert up.state[HISTORY] == history
        assert up.metrics["dpsgd_epsilon"] == dpsgd.epsilon(history, 1 / n)
        assert up.metrics["dpsgd_steps"] == 3 * math.ceil(n / batch)


def test_personal_steps_are_counted_too():
    """Ditto trains its personal model after the global one: twice the steps a round;
    FedRep's head epochs add to its body epochs."""
    raw = dp_config("ditto", train={"rounds": 1, "batch_size": 16})
    with simulation(raw) as sim:
        sim.run_round(1)
        n = sim.envs[1].num_train
        assert sim.client_state(1)[HISTORY][0][2] == 2 * math.ceil(n / 16)
    raw = dp_config({"name": "fedrep", "head_epochs": 3}, train={"rounds": 1, "batch_size": 16})
    with simulation(raw) as sim:
        sim.run_round(1)
        n = sim.envs[1].num_train
        assert sim.client_state(1)[HISTORY][0][2] == (3 + 1) * math.ceil(n / 16)


@pytest.mark.parametrize("kind", ["prv", "gdp"])
def test_other_accountants_are_opacus(kind):
    from opacus.accountants import create_accountant

    acc = create_accountant(kind)
    for _ in range(40):
        acc.step(noise_multiplier=1.2, sample_rate=0.05)
    assert dpsgd.epsilon([[1.2, 0.05, 40]], 1e-4, kind) == pytest.approx(acc.get_epsilon(1e-4))
    assert dpsgd.epsilon([], 1e-4, kind) == 0.0
    assert dpsgd.epsilon([[0.0, 0.05, 3]], 1e-4, kind) == math.inf


def test_epsilon_table_summarises_the_clients_and_survives_a_checkpoint():
    table = dpsgd.EpsilonTable()
    assert table.row() == {}
    table.record(0, {"train_loss": 1.0, "dpsgd_epsilon": 1.0})
    table.record(3, {"dpsgd_epsilon": 3.0})
    table.record(0, {"dpsgd_epsilon": 2.0})  # client 0's newer epsilon replaces its older one
    assert table.row() == {"dpsgd_epsilon_max": 3.0, "dpsgd_epsilon_mean": 2.5}
    again = dpsgd.EpsilonTable()
    again.load(table.state())
    assert again.row() == table.row()


def test_rows_report_the_clients_epsilons():
    """Each metrics row carries the max and mean over the clients that have trained of their
    epsilon so far (the engine keeps an EpsilonTable)."""
    raw = dp_config(train={"rounds": 2, "client_fraction": 0.5})
    with simulation(raw) as sim:
        rows = [sim.run_round(r) for r in (1, 2)]
        eps = []
        for c, env in enumerate(sim.envs):
            history = sim.client_state(c).get(HISTORY)
            if history:
                eps.append(dpsgd.epsilon(history, 1 / env.num_train))
        assert rows[-1]["dpsgd_epsilon_max"] == max(eps)
        assert rows[-1]["dpsgd_epsilon_mean"] == pytest.approx(sum(eps) / len(eps))


# -- determinism, workers, resume ---------------------------------------------------------------


def test_runs_are_bit_identical_in_process_and_with_two_workers():
    raw = dp_config("ditto", train={"rounds": 2})
    rows, states = [], []
    for runner in (InProcess(), InProcess(), ProcessPool(2)):
        with simulation(raw, runner) as sim:
            rows.append(rows_without_time([sim.run_round(r) for r in (1, 2)]))
            states.append([sim.client_state(c) for c in range(4)])
    assert rows[0] == rows[1] == rows[2]
    for a, b in zip(states[0], states[2], strict=True):
        assert a[HISTORY] == b[HISTORY]
        assert all(torch.equal(a["personal"][k], b["personal"][k]) for k in a["personal"])


def test_the_step_count_survives_the_disk_store_a_checkpoint_and_resume(tmp_path):
    """States kept on disk (engine.state_memory 0: every state a safetensors file), a
    checkpoint after round 2, a new simulation resumed from it: round 3 and every client's
    step count are those of the uninterrupted run."""
    raw = dp_config("fedavg", train={"rounds": 3, "client_fraction": 0.5})
    raw["engine"]["state_memory"] = 0
    cfg = validate(raw)
    with Simulation(cfg, runner=InProcess(), state_dir=tmp_path / "a") as whole:
        rows = rows_without_time([whole.run_round(r) for r in (1, 2, 3)])
        want = [whole.client_state(c).get(HISTORY) for c in range(4)]
    with Simulation(cfg, runner=InProcess(), state_dir=tmp_path / "b") as first:
        for r in (1, 2):
            first.run_round(r)
        first.save(tmp_path / "ckpt.pt")
    with Simulation(cfg, runner=InProcess(), state_dir=tmp_path / "b") as resumed:
        resumed.restore(tmp_path / "ckpt.pt")
        assert rows_without_time([resumed.run_round(3)]) == rows[2:]
        assert [resumed.client_state(c).get(HISTORY) for c in range(4)] == want
    assert sum(h is not None for h in want) >= 2


def test_the_algorithm_never_sees_the_reserved_entry():
    seen = []

    class Spy(InProcess):
        def run(self, algo, envs, jobs, meanwhile=None):
            real = algo.client_update

            def spy(env, payload, state, ctx):
                seen.append(set(state))
                return real(env, payload, state, ctx)

            algo.client_update = spy
            try:
                return super().run(algo, envs, jobs, meanwhile)
            finally:
                del algo.client_update

    with simulation(dp_config("local", train={"rounds": 2}), Spy()) as sim:
        for r in (1, 2):
            sim.run_round(r)
    assert seen and all(HISTORY not in keys for keys in seen)


# -- what is covered, what is refused -----------------------------------------------------------


def covered_config(name: str) -> dict:
    raw = dp_config(name, train={"rounds": 1})
    raw["data"]["public"] = {"dataset": "digits", "size": 64}
    if name in ("feddf", "pfeddf"):
        raw["algorithm"].update(server_steps=5, eval_every=5, patience=5)
    if name == "fedmmd":  # covered without its MMD term only
        raw["algorithm"]["lam"] = 0.0
    return raw


COVERED = sorted(n for n in ALGORITHMS if dpsgd.covered(ALGORITHMS.lookup(n)))


def test_every_algorithm_is_covered_or_refused_with_a_reason():
    assert sorted(n for n in ALGORITHMS if n not in COVERED and n not in dpsgd.REFUSED) == []


@pytest.mark.parametrize("name", COVERED)
def test_every_covered_algorithm_trains_under_dp_sgd(name):
    with simulation(covered_config(name)) as sim:
        row = sim.run_round(1)
        assert math.isfinite(row["pers_acc_mean"])
        steps = [(sim.client_state(c).get(HISTORY) or [[0, 0, 0]])[0][2] for c in range(4)]
        assert all(s > 0 for s in steps), steps


@pytest.mark.parametrize(
    "name", sorted(n for n, why in dpsgd.REFUSED.items() if isinstance(why, str))
)
def test_every_refused_algorithm_is_refused_in_one_sentence(name):
    with pytest.raises(PflkitError) as err:
        simulation(covered_config(name)).close()
    msg = str(err.value)
    assert msg.startswith(f"privacy.sample_dp cannot cover algorithm '{name}': ")
    assert "\n" not in msg and msg.count(". ") == 0


@pytest.mark.parametrize(
    "algorithm, refused",
    [
        ({"name": "fedmmd", "lam": 0.01}, True),
        ({"name": "fedmmd", "lam": 0.0}, False),
        ({"name": "fedphp", "kt": "mmd"}, True),
        ({"name": "fedphp", "kt": "kd"}, False),
        ({"name": "fedaws", "client_loss": "positive"}, True),
        ({"name": "fedaws"}, False),
    ],
)
def test_refusals_that_depend_on_parameters(algorithm, refused):
    raw = dp_config(algorithm, train={"rounds": 1})
    if refused:
        with pytest.raises(PflkitError, match=f"cannot cover algorithm '{algorithm['name']}'"):
            simulation(raw).close()
    else:
        with simulation(raw) as sim:
            sim.run_round(1)


def test_an_unknown_algorithm_is_refused_until_it_opts_in():
    from pflkit.algorithms.fedavg import FedAvg

    class Mine(FedAvg):
        name = "mine"

    algo = Mine(Mine.Params())
    assert "has not been checked for DP-SGD" in dpsgd.algorithm_refusal(algo)
    Mine.sample_dp_covered = True
    assert dpsgd.algorithm_refusal(algo) is None


@pytest.mark.parametrize(
    "sections, words",
    [
        (
            {"model": {"name": "resnet8", "options": {}}},
            "cannot train model 'resnet8': its BatchNorm2d layer",
        ),
        ({"eval": {"finetune_epochs": 1}}, "cannot cover eval.finetune_epochs"),
        ({"data": {"holdout_clients": 0.25}}, "cannot cover data.holdout_clients"),
    ],
)
def test_config_refusals(sections, words):
    with pytest.raises(PflkitError, match=words):
        simulation(dp_config(**sections)).close()


def test_dp_sgd_outside_a_training_job_is_refused():
    """Training at evaluation (what FedAvg-FT's personal_model does) would not be counted."""
    with pytest.raises(PflkitError, match="outside a client's training job"):
        dp_sgd(nn.Linear(2, 2), torch.zeros(2, 2), torch.zeros(2, dtype=torch.long),
               SampleDPConfig(), epochs=1, batch_size=1, lr=0.1)  # fmt: skip


def test_tensors_outside_the_model_are_refused():
    model, extra = nn.Linear(2, 2), torch.zeros(2, requires_grad=True)
    with accounting(), pytest.raises(PflkitError, match="tensors outside the model's layers"):
        dp_sgd(model, torch.zeros(2, 2), torch.zeros(2, dtype=torch.long), SampleDPConfig(),
               epochs=1, batch_size=1, lr=0.1, params=[*model.parameters(), extra])  # fmt: skip


def test_cli_refuses_a_batchnorm_model_with_exit_code_2(tmp_path):
    raw = dp_config(model={"name": "resnet8", "options": {}})
    (tmp_path / "cfg.yaml").write_text(yaml.safe_dump(raw))
    r = subprocess.run(
        [sys.executable, "-m", "pflkit.cli", "run", "cfg.yaml", "--out", "run"],
        cwd=tmp_path, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert "Traceback" not in r.stderr
    assert "privacy.sample_dp cannot train model 'resnet8': its BatchNorm2d layer" in r.stderr
    assert not (tmp_path / "run").exists()


def test_cli_refuses_an_uncovered_algorithm_with_exit_code_2(cli, tmp_path):
    (tmp_path / "cfg.yaml").write_text(yaml.safe_dump(dp_config("fedrs")))
    r = cli("run", "cfg.yaml", "--out", "run", cwd=tmp_path)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert "privacy.sample_dp cannot cover algorithm 'fedrs': its restricted softmax" in r.stderr
    assert not (tmp_path / "run").exists()
