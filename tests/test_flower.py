"""pflkit on Flower, in process: the ServerApp's round loop and the ClientApp's handlers talk
through a fake Grid that delivers each message to the node's handler at once (the real
SuperLink/SuperNode path is tests/test_flower_e2e.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("flwr")

from flwr.app import RecordDict  # noqa: E402

from conftest import tiny_config  # noqa: E402
from flower_fakes import FakeGrid, assert_rows_close, flower_run, task_identity  # noqa: E402
from pflkit.engine.runner import run_experiment  # noqa: E402
from pflkit.errors import PflkitError  # noqa: E402
from pflkit.experiment import validate  # noqa: E402
from pflkit.flower.client import hosted_clients  # noqa: E402
from pflkit.flower.codec import decode, encode, get, put  # noqa: E402

_task_identity = pytest.fixture(autouse=True)(task_identity)


THREE_NODES = {101: {"client-ids": "0"}, 202: {"client-ids": "1,2"}, 303: {"partition-id": 3}}

CASES = {
    "fedavg": {"algorithm": {"name": "fedavg"}},
    "map": {"algorithm": {"name": "map"}, "eval": {"selected_clients": True}},
    "fedavg_ft": {"algorithm": {"name": "fedavg_ft"}},  # trains while it evaluates
    # eval.metrics: the nodes send each metric's statistics, the server sums them
    "metrics": {"algorithm": {"name": "fedper"}, "eval": {"metrics": ["loss", "f1_macro", "ece"]}},
    "ktpfl": {
        "algorithm": {"name": "ktpfl"},
        "data": {"public": {"dataset": "digits", "size": 64}},
        "model": {"per_client": [{"name": "mlp", "options": {"hidden": [16]}}, "mlp"]},
    },
}


@pytest.mark.parametrize("name", CASES)
def test_flower_round_loop_equals_the_embedded_engine(name, tmp_path):
    raw = tiny_config(**CASES[name])
    raw["train"]["client_fraction"] = 0.75  # 3 of 4 clients per round: sampling must match
    cfg = validate(raw)
    embedded = run_experiment(cfg, out=tmp_path / "embedded")
    flower, grid = flower_run(cfg, tmp_path, THREE_NODES)
    assert len(flower.rows) == len(embedded.rows) == 3
    for a, b in zip(flower.rows, embedded.rows, strict=True):
        assert_rows_close(a, b)
    assert (tmp_path / "flower" / "summary.json").exists()
    assert (tmp_path / "flower" / "curves.png").exists()
    # each client's state lives on its own node, one entry per client
    states = {
        n: sorted(k for k in c.state if k.startswith("state.")) for n, c in grid.contexts.items()
    }
    assert states[202] == ["state.1.arrays", "state.1.schema", "state.2.arrays", "state.2.schema"]


def test_a_dead_node_fails_its_clients_and_the_others_keep_their_state(tmp_path):
    cfg = validate(tiny_config(algorithm={"name": "map"}))  # full participation, 3 rounds
    grid = FakeGrid(THREE_NODES, kill_at=(202, "train", 2))
    result, _ = flower_run(cfg, tmp_path, THREE_NODES, grid=grid)
    r1, r2, r3 = result.rows
    assert "failed_clients" not in r1
    assert r2["failed_clients"] == [1, 2]
    assert {f["client"] for f in r2["failures"]} == {1, 2}
    assert r3["failed_clients"] == [1, 2]
    assert r3["eval_failed_clients"] == [1, 2]
    assert r3["pers_acc_clients"][1] is None and r3["pers_acc_clients"][0] is not None
    # the survivors' states saw every round (MAP's HPM counts them too)
    assert r3["node_state_rounds"] == {"0": 3, "3": 3}
    assert get(grid.contexts[303].state, "state.3")["selected"] == 3
    assert len(r3["bytes_up"]) == 4 and r3["bytes_up"][1] == 0


def test_nodes_must_cover_every_client(tmp_path):
    cfg = validate(tiny_config())
    with pytest.raises(PflkitError, match=r"no SuperNode hosts client\(s\) 3 of the 4"):
        flower_run(cfg, tmp_path, {1: {"client-ids": "0-2"}})
    assert not (tmp_path / "flower").exists()


@pytest.mark.parametrize(
    "spec, ids",
    [
        ({"client-ids": "3"}, [3]),
        ({"client-ids": "0, 4,8"}, [0, 4, 8]),
        ({"client-ids": "2-4,0"}, [0, 2, 3, 4]),
        ({"partition-id": 5}, [5]),
    ],
)
def test_hosted_clients(spec, ids):
    assert hosted_clients(spec) == ids


@pytest.mark.parametrize(
    "spec, match", [({}, "names no clients"), ({"client-ids": "a-b"}, "'a-b'")]
)
def test_bad_node_config_is_one_sentence(spec, match):
    with pytest.raises(PflkitError, match=match):
        hosted_clients(spec)


def test_codec_round_trips_exactly():
    obj = {
        "weights": {"w": torch.randn(3, 2), "n": torch.tensor(7), "b": torch.tensor([True, False])},
        "personal": {3: torch.ones(2, dtype=torch.float64)},
        "scalars": [1, 0.1, "x", None, True, np.float32(1.5)],
        "pair": (1, 2),
        "array": np.arange(4, dtype=np.int16).reshape(2, 2),
    }
    records = RecordDict()
    put(records, "x", obj)
    back = get(records, "x")
    assert back["weights"]["w"].equal(obj["weights"]["w"])
    assert back["weights"]["n"].shape == () and back["weights"]["b"].dtype == torch.bool
    assert back["personal"][3].dtype == torch.float64 and 3 in back["personal"]
    assert back["scalars"][:5] == [1, 0.1, "x", None, True]
    assert back["scalars"][5] == np.float32(1.5) and back["scalars"][5].dtype == np.float32
    assert back["pair"] == (1, 2) and back["array"].dtype == np.int16
    assert get(records, "missing", 42) == 42


def test_codec_refuses_what_cannot_cross_the_network():
    with pytest.raises(TypeError, match=r"value\['f'\] is a function"):
        encode({"f": lambda: 0})
    with pytest.raises(TypeError, match="dict key"):
        encode({(1, 2): 0})
    assert decode(*encode({})) == {}


def test_nodes_run_in_the_round_context_their_jobs_carry(tmp_path, monkeypatch):
    """The server's round contexts are made unlike any the config gives (half the lr factor,
    a 0.75 work share for every client): a node that rebuilt its context from the config
    would train and score in another one. Every node call gets the job's context, exactly."""
    import dataclasses

    from pflkit.engine import clients, simulation
    from pflkit.flower.server import FlowerRunner

    real = simulation.round_context

    def unusual(run, rnd, phase, straggler=False):
        ctx = real(run, rnd, phase, straggler)
        return dataclasses.replace(ctx, lr_factor=ctx.lr_factor / 2, work=0.75)

    sent, received = {}, {}
    real_run, real_train, real_eval = (
        FlowerRunner.run,
        clients.train_client,
        clients.evaluate_client,
    )

    def run(self, algo, envs, jobs, meanwhile=None):
        sent.update({(type(j).__name__, j.cid, j.ctx.round): j.ctx for j in jobs})
        return real_run(self, algo, envs, jobs, meanwhile)

    def train(algo, env, payload, state, ctx, p):
        received[("TrainJob", env.cid, ctx.round)] = ctx
        return real_train(algo, env, payload, state, ctx, p)

    def evaluate(algo, env, view, state, ctx, *args, **kwargs):
        received[("EvalJob", env.cid, ctx.round)] = ctx
        return real_eval(algo, env, view, state, ctx, *args, **kwargs)

    monkeypatch.setattr(simulation, "round_context", unusual)
    monkeypatch.setattr(FlowerRunner, "run", run)
    monkeypatch.setattr(clients, "train_client", train)
    monkeypatch.setattr(clients, "evaluate_client", evaluate)
    raw = tiny_config(algorithm={"name": "fedavg_ft"}, train={"rounds": 2, "lr_schedule": "cosine"})
    cfg = validate(raw)
    flower_run(cfg, tmp_path, THREE_NODES)
    assert len(sent) == 16 and received == sent  # 4 clients x (train, evaluate) x 2 rounds
    from pflkit.engine.schedule import lr_factor

    ctx = received[("TrainJob", 0, 2)]  # what the config gives: the cosine factor, all work
    assert (ctx.round, ctx.lr_factor, ctx.work) == (2, lr_factor(cfg.train, 2) / 2, 0.75)
    assert 0 < lr_factor(cfg.train, 2) < 1
