"""``eval.finetune_epochs``: every client scored after K epochs of local fine-tuning of a copy of
its scoring model (FedProto's code, lib/update.py ``LocalTest.fine_tune``). By value against
two SGD steps written out by hand; training untouched; K = 0 exactly as before; the same
numbers in every runner; bad values refused in one sentence."""

from __future__ import annotations

import copy

import pytest
import torch
import yaml

from conftest import tiny_config
from pflkit.algorithms import build_algorithm
from pflkit.engine import Simulation
from pflkit.engine import clients as clients_module
from pflkit.engine.clients import EVALUATE, evaluate_client, round_context
from pflkit.engine.runner import run_experiment
from pflkit.errors import PflkitError
from pflkit.experiment import validate

pytestmark = pytest.mark.usefixtures("one_thread")

LINEAR = {"name": "mlp", "options": {"hidden": []}}  # multinomial logistic regression


def evaluation(env):
    """The engine's context for evaluating after round 1."""
    return round_context(env.run, 1, EVALUATE)


def rows(result_rows) -> list[dict]:
    return [{k: v for k, v in r.items() if not k.startswith("seconds_")} for r in result_rows]


def run(cfg, rounds: int):
    with Simulation(cfg) as sim:
        out = [sim.run_round(r) for r in range(1, rounds + 1)]
        return rows(out), sim.server, dict(sim.clients)


def equal(a, b) -> bool:
    """Bit-identical plain data (tensors compared exactly)."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(equal(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(equal(x, y) for x, y in zip(a, b, strict=True))
    return a == b


# -- by value ------------------------------------------------------------------------------------


def hand_sgd(w, b, x, y, steps: int, lr: float, momentum: float, wd: float):
    """Full-batch SGD with momentum and L2 weight decay on the mean cross-entropy of the
    linear model ``x w^T + b``, in float64, the gradient written out:
    dL/dw = (softmax(x w^T + b) - onehot(y))^T x / n, dL/db = mean(softmax(...) - onehot(y));
    torch's SGD: g = grad + wd * p; buf = g (first step), buf = momentum * buf + g; p -= lr buf."""
    w, b, x = w.double(), b.double(), x.double().flatten(1)
    onehot = torch.nn.functional.one_hot(y, w.shape[0]).double()
    buf_w = buf_b = None
    for _ in range(steps):
        logits = x @ w.T + b
        p = torch.exp(logits - logits.max(1, keepdim=True).values)
        p = p / p.sum(1, keepdim=True)
        gw = (p - onehot).T @ x / len(y) + wd * w
        gb = (p - onehot).mean(0) + wd * b
        buf_w = gw if buf_w is None else momentum * buf_w + gw
        buf_b = gb if buf_b is None else momentum * buf_b + gb
        w, b = w - lr * buf_w, b - lr * buf_b
    return w, b


def hand_accuracy(w, b, x, y) -> float:
    logits = x.double().flatten(1) @ w.double().T + b.double()
    return float((logits.argmax(1) == y).double().mean())


def test_scores_equal_two_hand_sgd_steps_at_the_rounds_lr(tiny):
    """FedAvg with a linear model; batch_size above every client's sample count, so one epoch
    is one full-batch step. Round 2's scores are those of the global model after 2 hand-written
    SGD steps (momentum, weight decay) on each client's training split at round 2's lr
    (train.lr_schedule step: lr * 0.5), on that client's test split."""
    train = {
        "rounds": 2,
        "batch_size": 10_000,
        "lr": 0.5,
        "momentum": 0.5,
        "weight_decay": 0.01,
        "lr_schedule": "step",
        "lr_gamma": 0.5,
    }
    cfg = tiny(model=LINEAR, train=train, eval={"finetune_epochs": 2})
    with Simulation(cfg) as sim:
        sim.run_round(1)
        row = sim.run_round(2)
        gw = sim.server["weights"]
        w0, b0 = gw["head.weight"], gw["head.bias"]
        hand, untuned = [], []
        for env in sim.envs:
            d = env.data
            assert len(d.train_y) < train["batch_size"]
            w, b = hand_sgd(w0, b0, d.train_x, d.train_y, 2, 0.25, 0.5, 0.01)
            hand.append(hand_accuracy(w, b, d.test_x, d.test_y))
            untuned.append(hand_accuracy(w0, b0, d.test_x, d.test_y))
    assert row["pers_acc_clients"] == pytest.approx(hand, abs=1e-12)
    assert hand != untuned  # the fine-tuning changes what is scored
    assert row["global_acc"] == pytest.approx(
        hand_accuracy(w0, b0, sim.data.test_x, sim.data.test_y), abs=1e-6
    )  # the global model is scored as it is (a float32 mean)


def test_finetuned_copy_has_the_hand_weights(tiny):
    """The copy that :func:`evaluate_client` scores, weight by weight."""
    train = {"batch_size": 10_000, "lr": 0.3, "momentum": 0.9, "weight_decay": 0.05}
    cfg = tiny(model=LINEAR, train=train)
    with Simulation(cfg) as sim:
        env = sim.envs[1]
        model = env.model()
        before = copy.deepcopy(model.state_dict())
        tuned = clients_module.finetune_for_eval(model, env, evaluation(env), 3)
        w, b = hand_sgd(
            before["head.weight"], before["head.bias"], env.data.train_x, env.data.train_y,
            3, 0.3, 0.9, 0.05,
        )  # fmt: skip
    assert tuned is not model
    assert equal(model.state_dict(), before)  # the model it was given is untouched
    torch.testing.assert_close(tuned.head.weight.double(), w, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(tuned.head.bias.double(), b, atol=1e-5, rtol=1e-5)


# -- what it leaves alone -----------------------------------------------------------------------


def test_zero_is_exactly_the_unset_option(tiny, monkeypatch):
    algorithm = {"name": "ditto"}
    unset = run(tiny(algorithm=algorithm, eval={"selected_clients": True}), 2)
    monkeypatch.setattr(clients_module, "finetuned", None)  # K = 0 must not fine-tune at all
    zero = run(tiny(algorithm=algorithm, eval={"selected_clients": True, "finetune_epochs": 0}), 2)
    assert equal(zero, unset)


@pytest.mark.parametrize("name", ["ditto", "fedavg"])
def test_finetuning_changes_scores_not_training(tiny, name):
    """Three rounds of 3 of 4 clients with a validation split and MAP's protocol on: every
    trained weight, server state, training loss and the global model's scores are bit for bit
    those of K = 0; every client-side score (test, validation, selected) is of the copy."""
    raw = tiny_config(algorithm={"name": name}, data={"val_fraction": 0.2})
    raw["train"].update(rounds=3, client_fraction=0.75)

    def with_k(k: int):
        return run(validate({**raw, "eval": {"selected_clients": True, "finetune_epochs": k}}), 3)

    rows0, server0, clients0 = with_k(0)
    rows2, server2, clients2 = with_k(2)
    assert equal(server2, server0)
    assert equal(clients2, clients0)
    for r0, r2 in zip(rows0, rows2, strict=True):
        for k in ("clients", "train_loss", "bytes_up", "global_acc", "val_global_acc"):
            assert r2[k] == r0[k], k
        for k in ("pers_acc_clients", "val_pers_acc_mean", "pers_acc_selected"):
            assert r2[k] != r0[k], k


def test_evaluation_leaves_state_view_and_rng_alone(tiny):
    """One client's evaluation with K = 2: its state, the server's view and the reusable model
    (what ``personal_model`` loaded) are unchanged, and torch's global RNG ends where it
    does with K = 0 (the fine-tuning draws from a forked stream)."""
    cfg = tiny(algorithm={"name": "local"})
    with Simulation(cfg) as sim:
        sim.run_round(1)
        algo, env = build_algorithm(cfg.algorithm), sim.envs[2]
        state, view = sim.client_state(2), {}
        kept = copy.deepcopy(state)

        def score(k: int):
            acc = evaluate_client(algo, env, view, state, evaluation(env), 1000, finetune_epochs=k)
            return acc, torch.get_rng_state()

        acc0, rng0 = score(0)
        loaded = copy.deepcopy(env.model().state_dict())
        acc2, rng2 = score(2)
        assert equal(state, kept) and view == {}
        assert equal(env.model().state_dict(), loaded)  # fine-tuned a copy, not the pool's model
        assert torch.equal(rng2, rng0)
        assert acc2 != acc0
        again, rng = score(2)  # seeded: the same number again
        assert again == acc2 and torch.equal(rng, rng2)


def test_finetuning_draws_from_its_own_stream(tiny, monkeypatch):
    """The fine-tuning's batches are seeded by (seed, round, client) on a stream of their own:
    what ``personal_model`` draws before it (FedAvg-FT's fine-tuning) does not change them."""
    cfg = tiny(algorithm={"name": "local"})  # batch_size 16: several batches per epoch
    tuned, real = [], clients_module.finetuned

    def recording(*a):
        model = real(*a)
        tuned.append(model.state_dict())
        return model

    monkeypatch.setattr(clients_module, "finetuned", recording)
    with Simulation(cfg) as sim:
        sim.run_round(1)
        algo, env, state = sim.algo, sim.envs[0], sim.client_state(0)
        evaluate_client(algo, env, {}, state, evaluation(env), 1000, finetune_epochs=1)
        plain = algo.personal_model

        def drawing(*a):
            torch.rand(7)
            return plain(*a)

        monkeypatch.setattr(algo, "personal_model", drawing)
        evaluate_client(algo, env, {}, state, evaluation(env), 1000, finetune_epochs=1)
    assert equal(tuned[0], tuned[1])
    assert not equal(tuned[0], state["weights"])


# -- every runner, CLI and config ---------------------------------------------------------------


def test_worker_processes_give_the_same_numbers(tiny, tmp_path):
    raw = {"eval": {"finetune_epochs": 1, "selected_clients": True}, "algorithm": {"name": "map"}}
    here = run_experiment(tiny(**raw), out=tmp_path / "here")
    pool = run_experiment(tiny(**raw, engine={"workers": 2}), out=tmp_path / "pool")
    assert rows(pool.rows) == rows(here.rows)


def test_flower_gives_the_same_numbers(tiny, tmp_path):
    pytest.importorskip("flwr")
    from flower_fakes import assert_rows_close, flower_run, task_identity

    cfg = tiny(algorithm={"name": "fedavg_ft"}, eval={"finetune_epochs": 1})
    embedded = run_experiment(cfg, out=tmp_path / "embedded")
    identity = task_identity()
    next(identity)
    try:
        flower, _ = flower_run(
            cfg, tmp_path, {101: {"client-ids": "0,1"}, 202: {"client-ids": "2,3"}}
        )
    finally:
        next(identity, None)
    assert len(flower.rows) == len(embedded.rows) == 3
    for a, b in zip(flower.rows, embedded.rows, strict=True):
        assert_rows_close(a, b)
    base = run_experiment(tiny(algorithm={"name": "fedavg_ft"}), out=tmp_path / "base")
    assert flower.rows[-1]["pers_acc_mean"] != base.rows[-1]["pers_acc_mean"]


def test_cli_set_and_python_api(cli, tmp_path, tiny):
    cfg_file = tmp_path / "tiny.yaml"
    cfg_file.write_text(yaml.safe_dump(tiny_config()))
    r = cli("run", str(cfg_file), "--set", "eval.finetune_epochs=2", "--out", "r", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    written = yaml.safe_load((tmp_path / "r" / "config.yaml").read_text())
    assert written["eval"]["finetune_epochs"] == 2
    assert validate(tiny_config(eval={"finetune_epochs": 3})).eval.finetune_epochs == 3
    assert tiny().eval.finetune_epochs == 0


@pytest.mark.parametrize(
    "value, message",
    [
        (-1, "greater than or equal to 0"),
        (1.5, "valid integer"),
        ("two", "valid integer"),
        (True, "must be a number, not true/false"),
    ],
)
def test_bad_values_are_one_sentence(tiny, value, message):
    with pytest.raises(PflkitError, match=f"'eval.finetune_epochs'.*{message}"):
        tiny(eval={"finetune_epochs": value})


def test_bad_value_on_the_command_line_exits_2(cli, tmp_path):
    cfg_file = tmp_path / "tiny.yaml"
    cfg_file.write_text(yaml.safe_dump(tiny_config()))
    r = cli("run", str(cfg_file), "--set", "eval.finetune_epochs=-2", "--out", "bad", cwd=tmp_path)
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert "invalid config value 'eval.finetune_epochs' (got -2)" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "bad").exists()
