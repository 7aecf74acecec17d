"""The contract, checked for every registered algorithm (a new one is covered without writing a
test): plain-data payloads, uploads and states that survive the Flower codec and
``torch.load(weights_only=True)``; exact byte accounting; determinism; resume; and equal
results from every client runner (in-process, process pool, Flower)."""

from __future__ import annotations

import importlib
import io
import math
import pkgutil

import numpy as np
import pytest
import torch

pytest.importorskip("flwr")

from conftest import tiny_config  # noqa: E402
from flower_fakes import FakeGrid, assert_rows_close, flower_run, task_identity  # noqa: E402
from pflkit import algorithms  # noqa: E402
from pflkit.algorithms import ALGORITHM_MODULES, ALGORITHMS  # noqa: E402
from pflkit.algorithms.base import nbytes  # noqa: E402
from pflkit.engine import Simulation, run_experiment  # noqa: E402
from pflkit.engine.clients import InProcess, ProcessPool, TrainJob  # noqa: E402
from pflkit.errors import PflkitError  # noqa: E402
from pflkit.experiment import validate  # noqa: E402
from pflkit.flower.codec import decode, encode  # noqa: E402
from pflkit.testing import check_record  # noqa: E402

_task_identity = pytest.fixture(autouse=True)(task_identity)

NAMES = sorted(ALGORITHMS)
NODES = {101: {"client-ids": "0"}, 202: {"client-ids": "1,2"}, 303: {"client-ids": "3"}}


# shorter than the paper's defaults, so the contract checks stay fast (the same code paths run)
FAST = {
    name: {"server_steps": 30, "eval_every": 10, "patience": 10} for name in ("feddf", "pfeddf")
}


def conformance_config(name: str, **sections):
    """Every algorithm on the same tiny run: 3 of 4 clients per round (partial participation),
    a public set (for the algorithms that distil), MAP's selected-clients protocol on (so
    ``personal_model`` with the upload is exercised too), one torch thread (as each pool worker has)."""
    raw = tiny_config(algorithm={"name": name, **FAST.get(name, {})}, **sections)
    raw["data"]["public"] = {"dataset": "digits", "size": 64}
    raw["train"]["client_fraction"] = 0.75
    raw["eval"] = {"selected_clients": True}
    raw["threads"] = 1
    return validate(raw)


def rows_of(result) -> list[dict]:
    return [{k: v for k, v in r.items() if not k.startswith("seconds_")} for r in result.rows]


class Recording(InProcess):
    """The in-process runner, recording every payload, upload and state it handles."""

    def __init__(self):
        self.payloads, self.uploads, self.states = [], [], []

    def run(self, algo, envs, jobs, meanwhile=None):
        out = super().run(algo, envs, jobs, meanwhile)
        for job in jobs:
            if isinstance(job, TrainJob):
                rnd, cid = job.ctx.round, job.cid
                self.payloads.append((rnd, cid, job.payload))
                self.uploads.append((rnd, cid, out[cid].upload))
                self.states.append(out[cid].state)
        return out


def leaves(obj) -> list:
    """The tensors, numbers and strings inside a plain-data value."""
    if isinstance(obj, dict):
        return [x for v in obj.values() for x in leaves(v)]
    if isinstance(obj, list | tuple):
        return [x for v in obj for x in leaves(v)]
    return [] if obj is None else [obj]


def wire_bytes(obj) -> int:
    """Bytes of a value as the Flower codec lays it out: its arrays' buffers, plus 8 per
    number and the UTF-8 length of each string (an independent count to check ``nbytes``)."""
    _, arrays = encode(obj)
    numbers = [x for x in leaves(obj) if isinstance(x, bool | int | float)]
    strings = [x for x in leaves(obj) if isinstance(x, str)]
    return (
        sum(a.nbytes for a in arrays.values())
        + 8 * len(numbers)
        + sum(len(s.encode()) for s in strings)
    )


def assert_equal(a, b, where="value"):
    """Exact equality of plain data: same structure, types, dtypes, shapes and bits."""
    assert type(a) is type(b), f"{where}: {type(a).__name__} vs {type(b).__name__}"
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape, where
        assert torch.equal(a, b), where
    elif isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and np.array_equal(a, b), where
    elif isinstance(a, dict):
        assert list(a) == list(b), where
        for k in a:
            assert_equal(a[k], b[k], f"{where}[{k!r}]")
    elif isinstance(a, list | tuple):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_equal(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


@pytest.fixture(scope="module", autouse=True)
def _restore_torch_threads():
    threads = torch.get_num_threads()  # the runs here set one thread (config ``threads: 1``)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """One recorded in-process run per algorithm (computed on first use)."""
    cache = {}

    def get(name):
        if name not in cache:
            out = tmp_path_factory.mktemp(name)
            recording = Recording()
            result = run_experiment(conformance_config(name), out=out / "ref", runner=recording)
            cache[name] = (result, recording)
        return cache[name]

    return get


def test_every_algorithm_module_registers_an_algorithm():
    registered = {cls.__module__ for cls in ALGORITHMS.values()}
    on_disk = {
        f"pflkit.algorithms.{m.name}"
        for m in pkgutil.iter_modules(algorithms.__path__)
        if m.name not in algorithms.NOT_ALGORITHMS
    }
    assert on_disk == {f"pflkit.algorithms.{m}" for m in ALGORITHM_MODULES}
    assert on_disk <= registered, f"modules that register nothing: {on_disk - registered}"
    for m in on_disk:
        importlib.import_module(m)


@pytest.mark.parametrize("name", NAMES)
def test_every_parameter_names_the_source_of_its_default(name):
    for key, field in ALGORITHMS[name].Params.model_fields.items():
        extra = field.json_schema_extra
        assert isinstance(extra, dict) and extra.get("source"), f"{name}.{key} has no source"


@pytest.mark.parametrize("name", NAMES)
def test_payloads_uploads_and_states_are_plain_data(name, reference):
    result, rec = reference(name)
    assert rec.payloads and rec.uploads and rec.states
    for kind, items in (("payload", rec.payloads), ("upload", rec.uploads)):
        for rnd, cid, obj in items:
            assert_equal(decode(*encode(obj)), obj, f"{kind} of client {cid}, round {rnd}")
    for state in rec.states:
        assert_equal(decode(*encode(state)), state, "client state")
    # states (and the server's) load with torch.load(weights_only=True), as checkpoints do
    sim = Simulation(conformance_config(name))
    sim.run_round(1)
    for obj in (sim.server, dict(sim.clients)):
        buf = io.BytesIO()
        torch.save(obj, buf)
        buf.seek(0)
        assert_equal(torch.load(buf, weights_only=True), obj, "checkpointed state")


class RecordChecking(InProcess):
    """The in-process runner, checking every payload, client state (received and returned)
    and upload against the algorithm's declared records."""

    def run(self, algo, envs, jobs, meanwhile=None):
        out = super().run(algo, envs, jobs, meanwhile)
        cls = type(algo)
        for job in jobs:
            if isinstance(job, TrainJob):
                at = f"client {job.cid}, round {job.ctx.round}, phase {job.ctx.phase}"
                check_record(job.payload, cls.payload, f"{cls.name}'s payload ({at})")
                check_record(job.state, cls.state, f"{cls.name}'s client state ({at})")
                check_record(out[job.cid].upload, cls.upload, f"{cls.name}'s upload ({at})")
                check_record(out[job.cid].state, cls.state, f"{cls.name}'s new state ({at})")
        return out


@pytest.mark.parametrize("name", NAMES)
def test_records_match_their_declarations(name):
    """Every payload, upload, client state and server state of a run is a value of the record
    its algorithm declares (``Algorithm.payload``, ``upload``, ``state``, ``server``)."""
    with Simulation(conformance_config(name), runner=RecordChecking()) as sim:
        server = type(sim.algo).server
        check_record(sim.server, server, f"{name}'s server state (server_init)")
        for rnd in (1, 2, 3):
            sim.run_round(rnd)
            check_record(sim.server, server, f"{name}'s server state (round {rnd})")


@pytest.mark.parametrize("name", NAMES)
def test_bytes_are_counted_exactly(name, reference):
    result, rec = reference(name)
    down: dict[tuple[int, int], list] = {}
    up: dict[tuple[int, int], list] = {}
    for rnd, cid, payload in rec.payloads:
        down.setdefault((rnd, cid), []).append(payload)
    for rnd, cid, upload in rec.uploads:
        up.setdefault((rnd, cid), []).append(upload)
    for row in result.rows:
        for i, cid in enumerate(row["clients"]):
            for counted, sent in ((row["bytes_down"][i], down), (row["bytes_up"][i], up)):
                objs = sent[(row["round"], cid)]
                assert counted == sum(wire_bytes(o) for o in objs)
                # zero exactly when nothing crosses the network
                assert (counted == 0) == (not any(leaves(o) for o in objs))


@pytest.mark.parametrize("name", NAMES)
def test_two_runs_are_identical(name, reference, tmp_path):
    result, _ = reference(name)
    again = run_experiment(conformance_config(name), out=tmp_path / "again")
    assert rows_of(again) == rows_of(result)


@pytest.mark.parametrize("name", NAMES)
def test_resume_equals_an_uninterrupted_run(name, reference, tmp_path, monkeypatch):
    result, _ = reference(name)
    real = Simulation.run_round

    def interrupted_in_round_3(self, rnd):  # as a second Ctrl-C would, mid-round
        if rnd == 3:
            raise KeyboardInterrupt
        return real(self, rnd)

    monkeypatch.setattr(Simulation, "run_round", interrupted_in_round_3)
    cfg = conformance_config(name, output={"checkpoint_every": 2, "progress": False})
    with pytest.raises(PflkitError, match="the last checkpoint is kept"):
        run_experiment(cfg, out=tmp_path / "cut")
    monkeypatch.setattr(Simulation, "run_round", real)
    resumed = run_experiment(resume=tmp_path / "cut")
    assert rows_of(resumed) == rows_of(result)


@pytest.mark.parametrize("name", NAMES)
def test_states_on_disk_equal_states_in_memory_and_resume(name, reference, tmp_path, monkeypatch):
    """engine.state_memory 0 keeps no client state in memory: every state goes to disk after
    its write and is read back when next needed; the rows are the in-memory run's bit for
    bit, and so are those of a run cut in round 3 and resumed from its checkpoint (whose
    state versions are the files the store kept)."""
    result, _ = reference(name)
    disk = {"state_memory": 0, "workers": 1}
    sim = Simulation(conformance_config(name, engine=disk), state_dir=tmp_path / "states")
    rows = [sim.run_round(rnd) for rnd in (1, 2, 3)]
    assert sim.clients.bytes_in_memory == 0
    reads, writes = sim.clients.reads, sim.clients.writes  # in the rounds
    if any(nbytes(state) for state in sim.clients.values()):  # the clients keep a state
        assert writes > 0 and reads > 0
    sim.close()
    assert [{k: v for k, v in r.items() if not k.startswith("seconds_")} for r in rows] == rows_of(
        result
    )
    real = Simulation.run_round

    def interrupted_in_round_3(self, rnd):
        if rnd == 3:
            raise KeyboardInterrupt
        return real(self, rnd)

    monkeypatch.setattr(Simulation, "run_round", interrupted_in_round_3)
    cfg = conformance_config(name, engine=disk, output={"checkpoint_every": 2, "progress": False})
    with pytest.raises(PflkitError, match="the last checkpoint is kept"):
        run_experiment(cfg, out=tmp_path / "cut")
    monkeypatch.setattr(Simulation, "run_round", real)
    assert rows_of(run_experiment(resume=tmp_path / "cut")) == rows_of(result)


@pytest.mark.parametrize("name", NAMES)
def test_process_pool_equals_in_process(name, reference, tmp_path):
    result, _ = reference(name)
    pooled = run_experiment(
        conformance_config(name), out=tmp_path / "pool", runner=ProcessPool(2, 1)
    )
    assert rows_of(pooled) == rows_of(result)


@pytest.mark.parametrize("name", NAMES)
def test_flower_equals_embedded(name, reference, tmp_path):
    result, _ = reference(name)
    flower, grid = flower_run(conformance_config(name), tmp_path, NODES, grid=FakeGrid(NODES))
    assert len(flower.rows) == len(result.rows)
    for a, b in zip(flower.rows, result.rows, strict=True):
        assert_rows_close(a, b)


@pytest.mark.parametrize("name", NAMES)
def test_uploads_follow_the_release_map_and_never_carry_a_private_part(name, reference):
    """Every upload carries only what the algorithm's release map names (and num_samples), and
    none of its tensors is one of the client's private parts (``Algorithm.private``)."""
    from pflkit.privacy.client_dp import META

    cls = ALGORITHMS.lookup(name)
    _, rec = reference(name)
    private_seen = False
    for (rnd, cid, upload), state in zip(rec.uploads, rec.states, strict=True):
        if cls.release is not None:
            extra = set(upload) - set(cls.release) - META
            assert not extra, f"{name} uploads {extra} outside its release map (round {rnd})"
        mine = [t for k in cls.private if k in state for t in leaves(state[k])]
        private_seen |= bool(mine)
        sent = [t for t in leaves(upload) if isinstance(t, torch.Tensor)]
        for p in mine:
            assert not any(s.shape == p.shape and torch.equal(s, p) for s in sent), (
                f"{name}: client {cid}'s upload in round {rnd} carries a private tensor"
            )
    # the check is not vacuous: every declared private part exists (pFedSim's BN buffers and
    # FedBN's only with BatchNorm layers, which the conformance MLP has none of)
    assert private_seen or not cls.private or name in ("pfedsim", "fedbn", "fedap")


@pytest.mark.parametrize("name", NAMES)
def test_client_dp_runs_or_is_refused_in_one_sentence(name, tmp_path):
    """Client-level DP runs every algorithm with a release map (central, or local where the
    server uses each upload) and reports epsilon; the others are refused with their reason."""
    cls = ALGORITHMS.lookup(name)
    mode = "local" if cls.uses_each_upload else "central"
    dp = {"clip": 1.0, "noise_multiplier": 1.0, "mode": mode}
    cfg = conformance_config(name, privacy={"client_dp": dp})
    if not cls.release:
        with pytest.raises(PflkitError, match=f"'{name}'"):
            Simulation(cfg)
        return
    with Simulation(cfg) as sim:
        row = sim.run_round(1)
    assert row["dp_epsilon"] > 0 and math.isfinite(row["dp_epsilon"])
