"""benchmarks/vectorize_ops.py: what its counter counts (by value on a known sequence of
operations), a tiny round on both paths, and its bad-input exit."""

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.func import functional_call, grad, vmap

from conftest import tiny_config

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.fixture(scope="module")
def vo():
    sys.path.insert(0, str(BENCH))  # the script imports bench_fedavg beside it
    try:
        spec = importlib.util.spec_from_file_location(
            "vectorize_ops_under_test", BENCH / "vectorize_ops.py"
        )
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(BENCH))
    return module


def test_views_and_allocations_are_not_counted_composites_count_as_what_they_run(vo):
    x, w, b = torch.ones(4, 3), torch.ones(2, 3), torch.ones(2)
    with vo.Dispatched() as mode:
        y = torch.nn.functional.linear(x, w, b)  # t (a view) and addmm
        y.view(-1).unsqueeze(0).add(1)  # two views, one add
        torch.empty(3)
    assert dict(mode.counts) == {"addmm": 1, "add": 1}


def test_a_vmapped_step_counts_once_for_every_client(vo):
    """vmap over 5 clients runs the batched operations once: the same count as one client's
    step, not five times it."""
    model = torch.nn.Linear(3, 2)
    params = {k: v.detach() for k, v in model.named_parameters()}

    def loss(p, x):
        return functional_call(model, p, (x,)).sum()

    with vo.Dispatched() as one:
        grad(loss)(params, torch.ones(4, 3))
    stacked = {k: torch.stack([v] * 5) for k, v in params.items()}
    with vo.Dispatched() as five:
        vmap(grad(loss))(stacked, torch.ones(5, 4, 3))
    assert sum(one.counts.values()) > 0
    assert sum(five.counts.values()) < 2 * sum(one.counts.values())


def test_a_tiny_round_dispatches_fewer_operations_vectorised(vo):
    raw = tiny_config(train={"batch_size": 8})
    per_client = vo.count_round(raw, vectorize=False)
    vectorised = vo.count_round(raw, vectorize=True)
    assert sum(vectorised.values()) < sum(per_client.values())
    # the per-client path runs one forward matrix product a layer and step, the vectorised one
    # a batched product (bmm) instead
    assert per_client["addmm"] > 0 and vectorised["bmm"] > 0


def test_a_graphed_round_counts_each_replayed_step_as_one_launch(vo):
    """train_graphed's round: the steps a CUDA graph replays count one launch each (a capture
    per number of rows stepped), far fewer than the vectorised round's operations."""
    raw = tiny_config(train={"batch_size": 8})
    vectorised = vo.count_round(raw, vectorize=True)
    graphed = vo.count_round(raw, vectorize=True, graphs=True)
    # one computation of 4 clients: a graph of 4 rows, then of 2 and 1 as clients finish
    assert graphed["graph replay"] > 0 and 1 <= graphed["graph capture"] <= 3
    assert "graph replay" not in vectorised
    # each replayed step stepped at least one client's row, and some fewer than all 4
    assert graphed["graph replay"] <= graphed["replayed rows"] < 4 * graphed["graph replay"]
    assert sum(graphed.values()) < sum(vectorised.values()) / 2


def test_a_subset_below_one_exits_2_in_one_sentence():
    r = subprocess.run(
        [sys.executable, str(BENCH / "vectorize_ops.py"), "--subset", "0"],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 2
    assert "--subset 0: give a positive number of images" in r.stderr
