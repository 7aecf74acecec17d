"""engine.vectorize (pflkit.engine.vectorized): the cohort trained and scored as one batched
computation equals the per-client path within float tolerance, after one step and after one
round, for every covered algorithm; its optimisers equal torch's; what it cannot run is refused
in one sentence."""

from __future__ import annotations

import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from conftest import tiny_config
from pflkit.engine import vectorized
from pflkit.engine.clients import InProcess, ProcessPool, make_runner
from pflkit.engine.simulation import Simulation
from pflkit.engine.vectorized import FunctionalOptimizer, Request, covered
from pflkit.errors import PflkitError
from pflkit.experiment import validate
from pflkit.primitives.training import StackableLoss

pytestmark = pytest.mark.usefixtures("one_thread")

COVERED = ["ditto", "fedavg", "fedbn", "fedper", "fedprox", "fedrep", "local", "pfedsim"]
# FedRep: one head epoch, so that "one step" is one step of each of its two training calls;
# pFedSim: warm-up of one round of two, so round 2 mixes extractors by similarity
PARAMS = {"fedrep": {"head_epochs": 1}, "pfedsim": {"warmup_ratio": 0.5}}
ONE_STEP = {"batch_size": 100_000}  # a whole client's split per batch: one step per epoch


def test_the_covered_list_is_the_declared_one():
    assert covered() == COVERED


def run(raw: dict, vectorize: bool, rounds: int = 2, runner=None):
    """The rows, the client states and the server state after ``rounds`` rounds."""
    raw = {**raw, "engine": {**raw.get("engine", {}), "vectorize": vectorize}}
    cfg = validate(raw)
    with Simulation(cfg, runner=runner) as sim:
        assert sim.runner.vectorize == vectorize
        rows = [sim.run_round(r) for r in range(1, rounds + 1)]
        states = {c: sim.client_state(c) for c in range(cfg.data.num_clients)}
        return rows, states, sim.server


def close(a, b, path: str = "") -> None:
    """``a`` equals ``b`` within float tolerance, tensors and numbers at any depth."""
    if isinstance(a, torch.Tensor):
        assert a.shape == b.shape and a.dtype == b.dtype, path
        if a.is_floating_point():
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=path)
        else:
            assert torch.equal(a, b), path
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), path
        for k in a:
            if not str(k).startswith("seconds_"):
                close(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, list | tuple):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            close(x, y, f"{path}[{i}]")
    elif isinstance(a, float) and not math.isnan(a):
        assert b == pytest.approx(a, rel=1e-5, abs=1e-6), path
    else:
        assert a == b, path


def same(raw: dict, rounds: int = 2, runner=None) -> None:
    per_client = run(raw, False, rounds)
    batched = run(raw, True, rounds, runner)
    close(per_client, batched)


@pytest.mark.parametrize("name", COVERED)
def test_one_step_equals_the_per_client_path(name):
    """Every training call one step (a whole split per batch): the states, the server and the
    row (losses, every client's accuracy) after round 1, with momentum and grad_clip on."""
    train = {**ONE_STEP, "momentum": 0.9, "grad_clip": 0.5}
    raw = tiny_config(algorithm={"name": name, **PARAMS.get(name, {})}, train=train)
    same(raw, rounds=1)


def graphed(on: bool) -> InProcess | None:
    """train_graphed's runner where ``on`` (on CPU its fixed-shape, masked steps run as
    written, uncaptured: the arithmetic a CUDA graph replays), else the default."""
    return InProcess(vectorize=True, graphs=True) if on else None


@pytest.mark.parametrize("graphs", [False, True], ids=["stacked", "graphed"])
@pytest.mark.parametrize("name", COVERED)
def test_two_rounds_equal_the_per_client_path(name, graphs):
    """Two rounds of mini-batches on clients of unequal sizes (Dirichlet 0.5: the step mask
    stops the small ones first; each epoch's last batch is short), 3 of 4 clients a round,
    SGD with momentum and weight decay, grad_clip: the same states, server and rows."""
    train = {"client_fraction": 0.75, "momentum": 0.5, "weight_decay": 1e-3, "grad_clip": 1.0}
    raw = tiny_config(algorithm={"name": name, **PARAMS.get(name, {})}, train=train)
    same(raw, runner=graphed(graphs))


@pytest.mark.parametrize("graphs", [False, True], ids=["stacked", "graphed"])
def test_adam_batchnorm_augmentation_and_stragglers(graphs):
    """LeNet5-BN on Fashion-MNIST images (per-client BatchNorm statistics), crop-flip batches
    (each client's augmentation drawn from its own stream), Adam with weight decay, a cosine lr
    schedule, drop_last and stragglers (fewer steps: the step mask). Adam's weight decay is on:
    without it, the biases of the convolutions before BatchNorm, whose gradient is 0 up to
    rounding, take steps of about lr in the direction of their rounding noise, which differs
    between the two paths (a direction the model's outputs do not depend on)."""
    raw = tiny_config(
        data={"dataset": "fashion_mnist", "subset": 400},
        model={"name": "lenet5_bn", "options": {}},
        algorithm={"name": "fedavg"},
        train={
            "batch_size": 32,
            "lr": 0.01,
            "optimizer": "adam",
            "weight_decay": 0.01,
            "lr_schedule": "cosine",
            "augment": "crop_flip",
            "drop_last": True,
        },
        system={"stragglers": 0.5},
    )
    same(raw, runner=graphed(graphs))


@pytest.mark.parametrize("graphs", [False, True], ids=["stacked", "graphed"])
@pytest.mark.parametrize("name", ["fedavg", "ditto", "fedrep"])
def test_adamw_equals_the_per_client_path(name, graphs):
    train = {"optimizer": "adamw", "weight_decay": 0.05, "lr": 0.01, "drop_last": True}
    raw = tiny_config(algorithm={"name": name, **PARAMS.get(name, {})}, train=train)
    same(raw, runner=graphed(graphs))


def test_two_vectorised_workers_equal_the_per_client_path():
    """A process pool whose two workers each train their share of the cohort as one
    computation gives what one process gives client by client."""
    raw = tiny_config(algorithm={"name": "ditto"}, train={"momentum": 0.5})
    cfg = validate({**raw, "engine": {"workers": 2, "vectorize": True}})
    runner = make_runner(cfg)
    assert isinstance(runner, ProcessPool) and runner.vectorize
    same(raw, runner=runner)


# -- the functional optimisers against torch's -----------------------------------------------------


def _request(optimizer: str, momentum: float, wd: float, max_norm: float | None) -> Request:
    loss = StackableLoss(lambda *a: None, {})
    x = torch.zeros(1)
    return Request(
        torch.nn.Linear(1, 1), {}, (), loss, x, x, [], None, optimizer, 0.05, momentum, wd,
        max_norm, torch.get_rng_state(),
    )  # fmt: skip


@pytest.mark.parametrize("masked", [False, True], ids=["shrinking", "masked"])
@pytest.mark.parametrize(
    "optimizer,momentum,wd,max_norm",
    [("sgd", 0.0, 0.0, None), ("sgd", 0.9, 0.01, 0.3), ("adam", 0.0, 0.01, None),
     ("adamw", 0.0, 0.1, 0.3)],
)  # fmt: skip
def test_functional_optimiser_equals_torchs_with_a_step_mask(
    optimizer, momentum, wd, max_norm, masked
):
    """Three clients, four steps of random gradients, stepped as train_stacked steps them
    (shrinking: client 2 stops after step 2, the stack keeps its first two rows, and at step 2
    the rows step in two runs, a batch size that differs) or as train_graphed's captured step
    does (masked: every step all rows in place, a mask keeping client 2 out after step 2, the
    bias as tensors). Each client's parameters equal those of torch's own optimiser (and
    clip_grad_norm_) run on that client alone for its steps."""
    gen = torch.Generator().manual_seed(0)
    start = {"w": torch.randn(3, 4, 2, generator=gen), "b": torch.randn(3, 2, generator=gen)}
    grads = [{k: torch.randn(v.shape, generator=gen) for k, v in start.items()} for _ in range(4)]
    steps = [4, 4, 2]
    params = {k: v.clone() for k, v in start.items()}
    opt = FunctionalOptimizer(_request(optimizer, momentum, wd, max_norm), params, masked)
    out = {}
    if masked:
        for t in range(4):
            mask = torch.tensor([t < n for n in steps])
            bias = tuple(torch.tensor(b) for b in opt.bias(t + 1))
            every = slice(0, 3)
            new = opt.step(params, grads[t], every, bias, mask)
            vectorized._put(params, every, new, static=True, mask=mask)
        out = {i: {k: v[i] for k, v in params.items()} for i in range(3)}
    else:
        runs = [[(0, 3)], [(0, 1), (1, 3)], [(0, 2)], [(0, 2)]]  # each step's runs of rows
        for t in range(4):
            if t == 2:  # client 2 is done: the stack keeps the first two rows
                out[2] = {k: v[2].clone() for k, v in params.items()}
                params = {k: v[:2] for k, v in params.items()}
                opt.keep(2)
            for lo, hi in runs[t]:
                rows = slice(lo, hi)
                g = {k: v[rows] for k, v in grads[t].items()}
                new = opt.step({k: v[rows] for k, v in params.items()}, g, rows, opt.bias(t + 1))
                vectorized._put(params, rows, new)
        out |= {i: {k: v[i] for k, v in params.items()} for i in range(2)}
    for i in range(3):
        mine = [start[k][i].clone().requires_grad_() for k in ("w", "b")]
        kind = {"sgd": torch.optim.SGD, "adam": torch.optim.Adam, "adamw": torch.optim.AdamW}
        extra = {"momentum": momentum} if optimizer == "sgd" else {}
        ref = kind[optimizer](mine, lr=0.05, weight_decay=wd, **extra)
        for t in range(steps[i]):
            for p, k in zip(mine, ("w", "b"), strict=True):
                p.grad = grads[t][k][i].clone()
            if max_norm is not None:
                torch.nn.utils.clip_grad_norm_(mine, max_norm)
            ref.step()
        for p, k in zip(mine, ("w", "b"), strict=True):
            torch.testing.assert_close(out[i][k], p.detach(), rtol=1e-6, atol=1e-7)


# -- CUDA graphs -------------------------------------------------------------------------------------


def test_graphed_steps_take_the_fewest_rows_a_power_of_two_allows(monkeypatch):
    """train_graphed's masked steps on 12 clients of unequal sizes: each steps the first m
    rows, m the number of clients still training rounded up to a power of two (at most 12),
    and those clients are the first rows (the stack sorted by step count)."""
    seen = []
    real = vectorized._Cohort.step

    def step(self, rows, x, y, bias, mask=None):
        if mask is not None:
            seen.append((rows.stop, mask.tolist()))
        real(self, rows, x, y, bias, mask)

    monkeypatch.setattr(vectorized._Cohort, "step", step)
    raw = tiny_config(data={"num_clients": 12, "partition": {"name": "dirichlet", "alpha": 0.3}})
    run(raw, True, rounds=1, runner=graphed(True))
    assert seen
    sizes = set()
    for m, mask in seen:
        active = sum(mask)
        assert mask == [True] * active + [False] * (m - active)
        assert m == min(12, 1 << (active - 1).bit_length())
        sizes.add(m)
    assert len(sizes) > 1  # the stack steps fewer rows as clients finish


def test_graphed_batchnorm_rows_of_done_clients_keep_their_statistics(monkeypatch):
    """LeNet5-BN, 6 clients of unequal sizes, drop_last (every step masked): steps whose rows
    include done clients (3 training: 4 rows) leave those clients' running statistics, and
    everything else, as the per-client path has them."""
    partly = []
    real = vectorized._Cohort.step

    def step(self, rows, x, y, bias, mask=None):
        if mask is not None and not bool(mask.all()):
            partly.append(rows.stop)
        real(self, rows, x, y, bias, mask)

    monkeypatch.setattr(vectorized._Cohort, "step", step)
    raw = tiny_config(
        data={"dataset": "fashion_mnist", "subset": 600, "num_clients": 6},
        model={"name": "lenet5_bn", "options": {}},
        train={"batch_size": 16, "momentum": 0.5, "drop_last": True},
    )
    same(raw, rounds=1, runner=graphed(True))
    assert partly  # the mask kept some done client's rows


# what a CUDA graph cannot hold: a copy to the host (item, bool, int), an operation whose output
# size depends on values (nonzero and those built on it) or a tensor made from host data
SYNCS = {
    "_local_scalar_dense", "nonzero", "masked_select", "is_nonzero", "equal", "allclose",
    "_unique2", "unique_dim", "unique_consecutive", "repeat_interleave", "lift_fresh",
    "lift_fresh_copy",
}  # fmt: skip


def storage_of(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


class Replays(TorchDispatchMode):
    """The operations that reach torch's backend while a step runs (below autograd and
    ``vmap``), each as a CUDA graph would hold it: its name, and for each argument a number's
    value, or a tensor's shape and dtype and, where the tensor comes from outside the step,
    its address (a graph reads such tensors where they were at capture); and the outside
    tensors written (their storages)."""

    def __init__(self):
        super().__init__()
        self.ops, self.made, self.outside, self.written = [], set(), set(), set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        sig = []
        for a in tree_flatten((args, kwargs))[0]:
            if not isinstance(a, torch.Tensor):
                sig.append(repr(a))
                continue
            storage = storage_of(a)
            if storage not in self.made:
                self.outside.add(storage)
            where = a.data_ptr() if storage in self.outside else "made"
            sig.append((tuple(a.shape), a.dtype, where))
        names = [a.name for a in func._schema.arguments]  # args: the first of them
        named = {**dict(zip(names, args, strict=False)), **kwargs}
        for a in func._schema.arguments:  # the outside tensors the operation writes
            if a.alias_info is not None and a.alias_info.is_write:
                for t in tree_flatten(named.get(a.name))[0]:
                    if isinstance(t, torch.Tensor) and storage_of(t) in self.outside:
                        self.written.add(storage_of(t))
        out = func(*args, **kwargs)
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and storage_of(t) not in self.outside:
                self.made.add(storage_of(t))
        self.ops.append((func.overloadpacket.__name__, tuple(sig)))
        return out


@pytest.mark.parametrize("kind", ["sgd", "adam_bn"])
def test_graphed_steps_could_be_captured_and_replayed(monkeypatch, kind):
    """On CPU, what a CUDA capture would refuse or replay wrongly: every call of a step that
    train_graphed captures (one a row count m) makes no host synchronisation and no tensor from
    host data, runs the same operations on the same shapes, numbers and outside tensors (the
    stack, the tables, the step number: their addresses) as the first call, and writes only
    tensors that the capture's warm-up puts back (_Cohort.written)."""
    calls: list[list] = []  # each captured step's calls: their operations

    def record(fn, c):
        runs: list = []
        calls.append(runs)
        restored = {storage_of(t) for t in c.written()}  # what _graphed undoes after warm-up

        def step():
            with Replays() as mode:
                fn()
            runs.append(mode.ops)
            assert mode.written and mode.written <= restored

        return step

    monkeypatch.setattr(vectorized, "_graphed", record)
    if kind == "sgd":
        raw = tiny_config(
            data={"num_clients": 12, "partition": {"name": "dirichlet", "alpha": 0.3}},
            train={"momentum": 0.5, "weight_decay": 1e-3, "grad_clip": 1.0},
        )
    else:
        raw = tiny_config(
            data={"dataset": "fashion_mnist", "subset": 600, "num_clients": 6},
            model={"name": "lenet5_bn", "options": {}},
            train={"optimizer": "adam", "lr": 1e-3, "drop_last": True},
        )
    run(raw, True, rounds=1, runner=graphed(True))
    assert any(len(runs) > 1 for runs in calls)  # a step replayed: something to compare
    for runs in calls:
        names = {name for name, _ in runs[0]}
        assert not names & SYNCS, names & SYNCS
        for later in runs[1:]:
            assert later == runs[0]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
@pytest.mark.parametrize("workers", [1, 2])
def test_cuda_graphs_are_captured_replayed_and_equal_the_per_client_path(monkeypatch, workers):
    """On CUDA, engine.cuda_graphs' runners (from the config, in this process and in a pool)
    capture the masked step and replay it; the run equals the per-client one."""
    captured = []
    real = vectorized._graphed

    def spy(fn, c):
        replay = real(fn, c)
        captured.append(replay is not fn)
        return replay

    monkeypatch.setattr(vectorized, "_graphed", spy)
    train = {"client_fraction": 0.75, "momentum": 0.5, "weight_decay": 1e-3, "grad_clip": 1.0}
    raw = tiny_config(train=train, device="cuda")
    engine = {"workers": workers, "vectorize": True, "cuda_graphs": True}
    runner = make_runner(validate({**raw, "engine": engine}))
    assert runner.graphs
    same(raw, runner=runner)
    if workers == 1:  # a pool's workers capture in their own processes
        assert captured and all(captured)


# -- refusals and auto ------------------------------------------------------------------------------


def test_auto_is_the_per_client_path_on_cpu():
    cfg = validate(tiny_config())
    assert cfg.engine.vectorize == "auto"
    runner = make_runner(cfg)
    assert isinstance(runner, InProcess) and not runner.vectorize


def test_an_uncovered_algorithm_is_refused_in_one_sentence():
    cfg = validate(tiny_config(algorithm={"name": "scaffold"}, engine={"vectorize": True}))
    with pytest.raises(PflkitError) as err:
        make_runner(cfg)
    msg = str(err.value)
    assert msg.startswith("algorithm 'scaffold' does not support engine.vectorize: true")
    assert "covered: ditto, fedavg, fedbn" in msg and msg.endswith("set engine.vectorize: false")
    assert msg.count(". ") == 0
    # auto runs it per client, quietly
    auto = validate(tiny_config(algorithm={"name": "scaffold"}, engine={"vectorize": "auto"}))
    assert not make_runner(auto).vectorize


def test_cuda_graphs_without_the_vectorised_engine_or_cuda_are_refused():
    cfg = validate(tiny_config(engine={"cuda_graphs": True}))
    with pytest.raises(PflkitError) as err:
        make_runner(cfg)
    assert str(err.value) == (
        "engine.cuda_graphs: true replays the vectorised engine's steps, which this run does "
        "not use (engine.vectorize: auto): set engine.vectorize: true, or engine.cuda_graphs: "
        "false"
    )
    cfg = validate(tiny_config(engine={"vectorize": True, "cuda_graphs": True}, device="cpu"))
    with pytest.raises(PflkitError, match="needs a CUDA device, and this run's device is 'cpu'"):
        make_runner(cfg)
    assert not make_runner(validate(tiny_config(engine={"vectorize": True}))).graphs


@pytest.mark.parametrize("runner", ["ray", "flower"])
def test_runners_other_than_this_process_or_the_pool_are_refused(runner):
    """Before any runner is made: engine.vectorize: true, and engine.cuda_graphs: true
    (which needs it), on a runner that cannot honour them."""
    cfg = validate(tiny_config(engine={"runner": runner, "vectorize": True}))
    with pytest.raises(PflkitError) as err:
        Simulation(cfg)
    assert str(err.value) == (
        "engine.vectorize: true runs in this process or the process pool, not on "
        f"engine.runner: {runner}: set engine.vectorize: false"
    )
    cfg = validate(tiny_config(engine={"runner": runner, "cuda_graphs": True}))
    with pytest.raises(PflkitError, match="engine.cuda_graphs: true replays the vectorised"):
        Simulation(cfg)


def test_dp_sgd_and_dropout_models_are_refused():
    dp = {"sample_dp": {"noise_multiplier": 1.0, "max_grad_norm": 1.0}}
    cfg = validate(tiny_config(privacy=dp, engine={"vectorize": True}))
    with pytest.raises(PflkitError, match="privacy.sample_dp.*set engine.vectorize: false"):
        make_runner(cfg)
    raw = tiny_config(
        data={"dataset": "fashion_mnist", "subset": 400},
        model={"name": "fedproto_cnn", "options": {}},
        engine={"vectorize": True},
    )
    with pytest.raises(PflkitError, match="model 'fedproto_cnn' has dropout layers"):
        Simulation(validate(raw))


def test_the_cli_refuses_in_one_sentence_and_writes_nothing(cli, tmp_path):
    import yaml

    (tmp_path / "c.yaml").write_text(yaml.safe_dump(tiny_config()))
    for sets, said in [
        (
            ("algorithm.name=scaffold", "engine.vectorize=true"),
            "algorithm 'scaffold' does not support engine.vectorize: true",
        ),
        (
            ("engine.cuda_graphs=true", "device=cpu"),
            "engine.cuda_graphs: true replays the vectorised engine's steps",
        ),
    ]:
        args = [a for s in sets for a in ("--set", s)]
        r = cli("run", "c.yaml", *args, "--out", "bad", cwd=tmp_path)
        assert r.returncode == 2, (r.stdout, r.stderr)
        assert said in r.stderr
        assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1
        assert not (tmp_path / "bad").exists()
