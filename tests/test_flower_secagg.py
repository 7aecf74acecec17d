"""Secure aggregation on Flower (``pflkit flower local|run --secagg``, :mod:`pflkit.flower.secagg`):
Flower's SecAgg+ client mod and server workflow, driven by pflkit's round loop.

- In process (fast): the real mod and workflow (real keys, shares, masks), messages delivered
  through a fake Grid that serializes them as the SuperLink does. The secure mean is within
  SecAgg+'s quantization bound of the exact weighted mean of the nodes' uploads, every round;
  no reply carries a plain tensor and the masked vectors summed without their masks are noise;
  a node lost in the middle of the protocol costs only its own clients.
- Every algorithm :func:`~pflkit.flower.secagg.declared` admits gives the same run when its
  aggregate gets the mean of the uploads as every client's upload (the claim behind the list).
- On real SuperLink/SuperNode processes (``-m slow``): plain and --secagg runs of one config,
  side by side; a probe plugin algorithm writes each node's uploads and the server's aggregate.
- Bad input: one sentence, exit 2, before any process starts.
"""

from __future__ import annotations

import dataclasses
import json
import math
import textwrap
import time

import numpy as np
import pytest
import torch

pytest.importorskip("flwr")

from flwr.app import Error, Message  # noqa: E402
from flwr.common import bytes_to_ndarray  # noqa: E402
from flwr.common.secure_aggregation.quantization import dequantize  # noqa: E402
from flwr.common.secure_aggregation.secaggplus_constants import (  # noqa: E402
    RECORD_KEY_CONFIGS,
    Key,
)
from flwr.common.serde import recorddict_from_proto, recorddict_to_proto  # noqa: E402

from conftest import tiny_config  # noqa: E402
from flower_fakes import FakeGrid, task_identity  # noqa: E402
from pflkit.algorithms import ALGORITHMS  # noqa: E402
from pflkit.algorithms.base import Update  # noqa: E402
from pflkit.engine.clients import InProcess, TrainJob  # noqa: E402
from pflkit.engine.runner import run_experiment  # noqa: E402
from pflkit.errors import PflkitError  # noqa: E402
from pflkit.experiment import validate  # noqa: E402
from pflkit.flower import client as client_app  # noqa: E402
from pflkit.flower import secagg, server  # noqa: E402
from pflkit.flower.secagg import (  # noqa: E402
    MOD_RANGE,
    SecAggOptions,
    node_mean,
    rebuild,
    secure_uploads,
)
from pflkit.flower.server import FlowerRunner  # noqa: E402
from test_cli import cfg_file, pflkit  # noqa: E402, F401 (fixture)

_task_identity = pytest.fixture(autouse=True)(task_identity)

NODES = {101: {"client-ids": "0"}, 202: {"client-ids": "1,2"}, 303: {"client-ids": "3"}}


class SecureFakeGrid(FakeGrid):
    """The fake Grid, with each message serialized and parsed as on the wire (the SecAgg+ mod
    edits its records in place) and delivered through the ClientApp with its mods; keeps every
    reply; ``kill_at=(node, round)`` kills a node on its training (collect-stage) message."""

    def __init__(self, node_configs, kill_at=None):
        super().__init__(node_configs)
        self.secure_kill = kill_at
        self.seen: list[Message] = []

    def push_messages(self, messages):
        ids = []
        for msg in messages:
            msg.metadata.__dict__["_message_id"] = msg.object_id
            ids.append(msg.metadata.message_id)
            node = msg.metadata.dst_node_id
            wire = recorddict_from_proto(recorddict_to_proto(msg.content))
            if self.secure_kill and "pflkit" in wire and "cids" in wire["pflkit"]:
                if (node, wire["pflkit"]["round"]) == self.secure_kill:
                    self.dead.add(node)
            if node in self.dead:
                continue
            copy = Message(wire, dst_node_id=node, message_type=msg.metadata.message_type)
            kind = msg.metadata.message_type
            handler = client_app.query if kind == "query" else client_app.app
            try:
                reply = handler(copy, self.contexts[node])
                content = recorddict_from_proto(recorddict_to_proto(reply.content))
                reply = Message(content, reply_to=msg)
            except Exception as e:  # as Flower does: the exception becomes an error reply
                reply = Message(Error(code=0, reason=f"{type(e).__name__}: {e}"), reply_to=msg)
            self.seen.append(reply)
            self.replies[msg.metadata.message_id] = reply
        return ids


def secure_run(cfg, tmp_path, monkeypatch, grid=None, options=None, name="secure"):
    """A --secagg run on the secure fake grid, recording per round what each node handed to
    SecAgg+ (its mean and weight) and what the server got back."""
    nodes, results = [], []
    real_mean, real_phase = secagg.node_mean, server.secure_phase

    def recording_mean(uploads, keys, uniform, clip):
        layout, arrays, weight = real_mean(uploads, keys, uniform, clip)
        nodes.append((arrays, weight))
        return layout, arrays, weight

    def recording_phase(*args, **kw):
        out = real_phase(*args, **kw)
        results.append((list(nodes), out))
        nodes.clear()
        return out

    monkeypatch.setattr(secagg, "node_mean", recording_mean)
    monkeypatch.setattr(server, "secure_phase", recording_phase)
    grid = grid or SecureFakeGrid(NODES)
    runner = FlowerRunner(
        grid, node_wait=0, round_timeout=1.0, log=lambda s: None, secagg=options or SecAggOptions()
    )
    result = run_experiment(cfg, out=tmp_path / name, runner=runner)
    return result, results, grid


def exact_mean(nodes):
    """The weighted mean of the nodes' means, in float64."""
    total = sum(w for _, w in nodes)
    return [sum(w * a[i] for a, w in nodes) / total for i in range(len(nodes[0][0]))]


def secure_arrays(out, layout_keys=("weights",)):
    up = next(iter(out.uploads.values()))
    return [t.double().numpy() for key in layout_keys for t in up[key].values()]


def test_secure_mean_is_within_the_quantization_bound_of_the_exact_mean(tmp_path, monkeypatch):
    """FedAvg, 4 clients on 3 nodes (one hosts 2), 2 rounds, the real SecAgg+ mod and workflow.
    Bound (SecAgg+'s quantization, clip c = 8, range T = 2**22, n = 3 nodes, all answer):
    4 n c / T = 2.29e-5 per entry."""
    cfg = validate(tiny_config(train={"rounds": 2}))
    t0 = time.perf_counter()
    result, rounds, grid = secure_run(cfg, tmp_path, monkeypatch)
    seconds = time.perf_counter() - t0
    assert len(rounds) == 2 and len(result.rows) == 2
    for (nodes, out), row in zip(rounds, result.rows, strict=True):
        assert len(nodes) == 3 and not out.failed
        bound = out.facts["error_bound"]
        assert bound == pytest.approx(4 * 3 * 8.0 / 2**22)
        exact, got = exact_mean(nodes), secure_arrays(out)
        err = max(float(np.max(np.abs(g - e))) for g, e in zip(got, exact, strict=True))
        assert 0 < err <= bound + 1e-7, err  # quantized (not 0) and within the bound
        assert sorted(out.uploads) == [0, 1, 2, 3]
        assert row["secagg"][0]["nodes"] == 3 and row["secagg"][0]["threshold"] == 2
        assert "failed_clients" not in row and row["bytes_up"][0] > 0
    print(f"\n[secagg in process] 2 rounds {seconds:.1f} s; last error {err:.2e} <= {bound:.2e}")
    # the server never sees a plain upload: no reply holds tensor data, and the masked
    # vectors summed without removing their masks are noise, not the weighted sum
    assert all(not any(len(a.data) for r in m.content.array_records.values() for a in r.values())
               for m in grid.seen)  # fmt: skip
    masked = [
        [bytes_to_ndarray(b) for b in m.content[RECORD_KEY_CONFIGS][Key.MASKED_PARAMETERS]]
        for m in grid.seen
        if RECORD_KEY_CONFIGS in m.content
        and Key.MASKED_PARAMETERS in m.content[RECORD_KEY_CONFIGS]
    ]
    assert len(masked) == 6  # 3 nodes x 2 rounds
    last = masked[-3:]
    summed = [sum(v[i] for v in last) % MOD_RANGE for i in range(len(last[0]))]
    weights = dequantize(summed[1:], 8.0, 2**22)
    offset, scale = -2 * 8.0, 2**22 / float(summed[0][0])
    unmasked = [(w + offset) * scale for w in weights]
    nodes, _ = rounds[-1]
    exact = exact_mean(nodes)
    assert max(float(np.max(np.abs(u - e))) for u, e in zip(unmasked, exact, strict=True)) > 1


def test_a_node_lost_in_the_protocol_costs_only_its_clients(tmp_path, monkeypatch):
    """Node 202 (clients 1, 2) dies on its round-2 training message: SecAgg+ (threshold 2 of
    3) removes its masks with the others' shares; the round aggregates clients 0 and 3 within
    the bound, lists 1 and 2 as failed, and the node is not asked again (round 3 fails them at
    once: no evaluation in between has found the node dead instead)."""
    cfg = validate(tiny_config(train={"rounds": 3}, eval={"every": 3}))  # no evaluation between
    grid = SecureFakeGrid(NODES, kill_at=(202, 2))
    result, rounds, _ = secure_run(cfg, tmp_path, monkeypatch, grid=grid)
    r1, r2, r3 = result.rows
    assert "failed_clients" not in r1
    assert r2["failed_clients"] == [1, 2] and r3["failed_clients"] == [1, 2]
    assert "no SecAgg+ reply" in r2["failures"][0]["reason"]
    assert r3["failures"][0]["reason"] == "its SuperNode failed earlier"
    (nodes2, out2), (_, out3) = rounds[1], rounds[2]
    assert sorted(out2.uploads) == [0, 3] and out2.dead == {202}
    assert len(nodes2) == 2  # node 202 never got to train
    got, exact = secure_arrays(out2), exact_mean(nodes2)
    err = max(float(np.max(np.abs(g - e))) for g, e in zip(got, exact, strict=True))
    assert err <= out2.facts["error_bound"] + 1e-7
    assert out3.facts["nodes"] == 2 and sorted(out3.uploads) == [0, 3]


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # no client is left to score
def test_an_entry_beyond_the_clipping_range_fails_its_node_with_the_reason(tmp_path, monkeypatch):
    cfg = validate(tiny_config(train={"rounds": 1}))
    result, rounds, _ = secure_run(cfg, tmp_path, monkeypatch, options=SecAggOptions(clip=0.01))
    (row,) = result.rows
    assert row["failed_clients"] == [0, 1, 2, 3]
    assert "beyond --secagg-clip 0.01" in row["failures"][0]["reason"]
    assert "global_acc" in row  # the run goes on with the initial model


def test_the_server_app_refuses_an_algorithm_that_needs_each_upload(tmp_path):
    cfg = validate(tiny_config(algorithm={"name": "fedfomo"}))
    runner = FlowerRunner(FakeGrid(NODES), node_wait=0, log=lambda s: None, secagg=SecAggOptions())
    with pytest.raises(PflkitError, match=r"^--secagg cannot run 'fedfomo': its server sends"):
        run_experiment(cfg, out=tmp_path / "x", runner=runner)
    assert not (tmp_path / "x").exists()


# -- the list of algorithms that run on the mean of their uploads --------------------------------


class MeanOnly(InProcess):
    """The in-process runner, handing the algorithm the exact (float64) weighted mean of each
    phase's uploads as every client's upload: what --secagg gives it, without quantization."""

    def __init__(self, keys, uniform):
        self.keys, self.uniform = keys, uniform
        self.own: dict = {}  # each client's real upload, which a Flower node keeps for MAP's
        # protocol (scoring the model right after local training)

    def run(self, algo, envs, jobs, meanwhile=None):
        if jobs and not isinstance(jobs[0], TrainJob):
            jobs = [
                dataclasses.replace(j, upload=self.own[j.cid]) if j.upload is not None else j
                for j in jobs
            ]
        out = super().run(algo, envs, jobs, meanwhile)
        if not jobs or not isinstance(jobs[0], TrainJob):
            return out
        ups = {c: u.upload for c, u in out.items() if u is not None}
        self.own.update(ups)
        layout, arrays, weight = node_mean(ups, self.keys, self.uniform, math.inf)
        mean = rebuild(layout, arrays, jobs[0].payload)
        same = secure_uploads(mean, sorted(ups), weight)
        return {c: Update(same[c], u.state, u.metrics) for c, u in out.items()}


# one of each kind in the default suite (whole model, body only, delta + control variate,
# sum-based server state, a personal model besides); every entry with -m slow
DEFAULT = {("fedavg", "samples"), ("fedrep", "uniform"), ("scaffold", "uniform"),
           ("feddyn", "uniform"), ("ditto", "samples")}  # fmt: skip
CASES = [
    pytest.param(n, w, id=f"{n}-{w}", marks=() if (n, w) in DEFAULT else pytest.mark.slow)
    for n in secagg.eligible()
    for w in secagg.declared(ALGORITHMS.lookup(n))[1]
]


@pytest.mark.parametrize("name, weighting", CASES)
def test_every_listed_algorithm_runs_on_the_mean_of_its_uploads(name, weighting, tmp_path):
    from test_conformance import conformance_config

    cfg = conformance_config(name, train={"rounds": 2})
    cfg = validate(
        {**cfg.model_dump(mode="json"), "algorithm": {"name": name, "weighting": weighting}}
    )
    keys, uniform = secagg.secure_keys(cfg.algorithm)
    plain = run_experiment(cfg, out=tmp_path / "plain", runner=InProcess())
    mean = run_experiment(cfg, out=tmp_path / "mean", runner=MeanOnly(keys, uniform))
    for a, b in zip(plain.rows, mean.rows, strict=True):
        for k, v in a.items():
            if k.startswith("seconds_"):
                continue
            if isinstance(v, float):
                assert math.isclose(v, b[k], rel_tol=1e-4, abs_tol=1e-6), k
            elif k.startswith("pers_acc") and isinstance(v, list):
                assert b[k] == pytest.approx(v, abs=0.02), k
            else:
                assert v == b[k], k


# -- bad input -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "args, message",
    [
        (
            ["--secagg", "--set", "algorithm.name=fedfomo"],
            "--secagg cannot run 'fedfomo': its server sends each client other clients' "
            "own models, while secure aggregation shows the server only the sum",
        ),
        (
            ["--secagg", "--set", "algorithm.name=feddyn", "--set", "algorithm.weighting=samples"],
            "--secagg cannot run 'feddyn' with weighting: samples",
        ),
        (["--secagg", "--secagg-clip", "0"], "--secagg-clip 0.0 is not a positive number"),
        (["--secagg", "--secagg-clip", "inf"], "--secagg-clip inf is not a positive number"),
        (["--secagg", "--secagg-quantization", "1"], "--secagg-quantization 1 is not an integer"),
        (
            ["--secagg", "--secagg-quantization", str(2**31)],
            f"--secagg-quantization {2**31} is not an integer from 2 to 2**31 - 1",
        ),
        (
            ["--secagg", "--nodes", "3", "--secagg-quantization", str(2**31 - 1)],
            "times 3 SuperNodes reaches 2**32",
        ),
        (["--secagg-clip", "2"], "--secagg-clip needs --secagg"),
        (["--secagg", "--nodes", "1"], "--secagg needs at least 2 SuperNodes"),
        (
            ["--secagg", "--set", "train.client_fraction=0.25"],
            "--secagg needs each round's clients on at least 2 SuperNodes, but round 1",
        ),
    ],
    ids=[
        "fedfomo", "feddyn-samples", "clip-0", "clip-inf", "quantization-1", "quantization-2**31",
        "quantization-times-nodes", "clip-without-secagg", "one-node", "one-node-in-a-round",
    ],
)  # fmt: skip
def test_bad_secagg_input_is_one_sentence_and_exit_2(cli, args, message, cfg_file, tmp_path):  # noqa: F811
    r = cli(
        "flower", "local", str(cfg_file), *args, "--workdir", "work", "--out", "out", cwd=tmp_path
    )
    assert r.returncode == 2, r.stderr
    assert message in r.stderr and "Traceback" not in r.stderr
    assert r.stderr.strip().count("\n") == 0  # one line
    assert not (tmp_path / "out").exists() and not (tmp_path / "work").exists()  # nothing started


def test_flower_run_refuses_before_connecting(cli, cfg_file, tmp_path):  # noqa: F811
    r = cli(
        "flower", "run", str(cfg_file), "--superlink", "127.0.0.1:1", "--insecure", "--secagg",
        "--set", "algorithm.name=pfedsim", cwd=tmp_path,
    )  # fmt: skip
    assert r.returncode == 2
    assert "--secagg cannot run 'pfedsim': its server measures the similarity" in r.stderr


# -- real SuperLink and SuperNode processes --------------------------------------------------------

PROBE = textwrap.dedent(
    '''
    """FedAvg that writes each client's upload (on its node) and each aggregate (on the
    server) to `dump`: what tests/test_flower_secagg.py compares."""
    import torch
    from pflkit.algorithms.base import register, param
    from pflkit.algorithms.fedavg import FedAvg

    @register
    class Probe(FedAvg):
        name = "secagg_probe"
        description = "FedAvg writing its uploads and aggregates"
        release = {"weights": "weights"}
        secagg = ("samples", "uniform")  # its aggregate needs only the mean of "weights"

        class Params(FedAvg.Params):
            dump: str = param("", "test")

        def client_update(self, env, payload, state, ctx):
            up = super().client_update(env, payload, state, ctx)
            torch.save(up.upload, f"{self.params.dump}/up-r{ctx.round}-c{env.cid}.pt")
            return up

        def aggregate(self, env, server, uploads, rnd, phase):
            new = super().aggregate(env, server, uploads, rnd, phase)
            torch.save(new["weights"], f"{self.params.dump}/agg-r{rnd}.pt")
            return new
    '''
)


@pytest.mark.slow  # two runs of 2 rounds on a real federation: minutes on a shared 2-core box
def test_secagg_on_real_processes_equals_plain_within_the_quantization_bound(
    tmp_path, monkeypatch, capsys
):
    """A SuperLink and 3 SuperNodes on 127.0.0.1; FedAvg (a probe that writes its uploads
    and aggregates), 3 clients, 2 rounds, plain then --secagg on the same federation. Bound:
    4 n c / T = 4 * 3 * 8 / 2**22 = 2.29e-5 per entry. Round 1 starts from the same model, so
    the secure aggregate is within the bound of the plain one; every round, it is within the
    bound of the exact weighted mean of that run's own uploads."""
    from pflkit.flower.local import Federation

    (tmp_path / "secagg_probe_plugin.py").write_text(PROBE)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))  # the SuperLink's and nodes' processes
    runs = {}
    with Federation(["0", "1", "2"], tmp_path / "fed") as fed:
        for mode in ("plain", "secagg"):
            dump = tmp_path / f"dump-{mode}"
            dump.mkdir()
            raw = tiny_config(train={"rounds": 2})
            raw["data"]["num_clients"] = 3
            raw["plugins"] = ["secagg_probe_plugin"]
            raw["algorithm"] = {"name": "secagg_probe", "dump": str(dump)}
            raw["eval"] = {"every": 2}
            cfg = validate(raw)
            extra = SecAggOptions().run_config() if mode == "secagg" else {}
            t0 = time.perf_counter()
            fed.run(cfg.to_yaml(), tmp_path / mode, timeout=500, **extra)
            runs[mode] = time.perf_counter() - t0
    with capsys.disabled():
        print(f"\n[secagg e2e] plain {runs['plain']:.1f} s, secagg {runs['secagg']:.1f} s")
    bound = 4 * 3 * 8.0 / 2**22
    rows = [json.loads(x) for x in (tmp_path / "secagg" / "metrics.jsonl").open()]
    assert [r["secagg"][0]["error_bound"] for r in rows] == [pytest.approx(bound)] * 2

    def load(mode, name):
        return torch.load(tmp_path / f"dump-{mode}" / name, weights_only=True)

    errors = []
    for rnd in (1, 2):
        ups = [load("secagg", f"up-r{rnd}-c{c}.pt") for c in range(3)]
        n = sum(u["num_samples"] for u in ups)
        secure = load("secagg", f"agg-r{rnd}.pt")
        for k, v in secure.items():
            exact = sum(u["weights"][k].double() * u["num_samples"] for u in ups) / n
            errors.append(float((v.double() - exact).abs().max()))
            assert errors[-1] <= bound + 1e-6, (rnd, k)
    plain, secure = load("plain", "agg-r1.pt"), load("secagg", "agg-r1.pt")
    vs_plain = max(float((plain[k].double() - secure[k].double()).abs().max()) for k in plain)
    assert vs_plain <= bound + 1e-6
    with capsys.disabled():
        print(f"[secagg e2e] largest error {max(errors):.2e}, round 1 vs plain {vs_plain:.2e}")


def test_integer_entries_are_not_summed_and_the_server_keeps_its_own():
    """A BatchNorm step counter is no mean: the server keeps the value it sent (0 without
    one); floating entries are the weighted mean; other upload keys are refused."""
    ups = {
        0: {"weights": {"w": torch.ones(2), "n": torch.tensor(5)}, "num_samples": 3},
        1: {"weights": {"w": torch.full((2,), 3.0), "n": torch.tensor(9)}, "num_samples": 1},
    }
    layout, arrays, weight = node_mean(ups, ("weights",), False, 8.0)
    assert weight == 4 and len(arrays) == 1 and arrays[0].tolist() == [1.5, 1.5]
    sent = {"weights": {"w": torch.zeros(2), "n": torch.tensor(2)}}
    got = rebuild(layout, arrays, sent)["weights"]
    assert got["w"].dtype == torch.float32 and got["w"].tolist() == [1.5, 1.5]
    assert got["n"].dtype == torch.int64 and int(got["n"]) == 2
    assert int(rebuild(layout, arrays, {})["weights"]["n"]) == 0
    _, arrays, _ = node_mean(ups, ("weights",), True, 8.0)
    assert arrays[0].tolist() == [2.0, 2.0]
    with pytest.raises(PflkitError, match="client 0 uploads 'stats', which secure aggregation"):
        node_mean({0: {**ups[0], "stats": torch.ones(1)}}, ("weights",), False, 8.0)
    with pytest.raises(PflkitError, match="holds numbers or strings besides tensors"):
        node_mean({0: {"weights": {"w": 1.0}, "num_samples": 1}}, ("weights",), False, 8.0)


def test_a_declaration_counts_only_on_the_class_that_defines_the_aggregate():
    from pflkit.algorithms.fedavg import FedAvg

    class Mean(FedAvg):
        name = "secagg_mean_probe"
        release = {"weights": "weights"}
        secagg = ("samples",)

    class Inherits(Mean):
        name = "secagg_inherits_probe"

    class Own(Mean):
        name = "secagg_own_probe"

        def aggregate(self, env, server, uploads, rnd, phase):
            return server

    assert secagg.declared(Mean) == (("weights",), ("samples",))
    assert secagg.declared(Inherits) == (("weights",), ("samples",))
    assert secagg.declared(Own) is None  # its own aggregate, no declaration of its own
