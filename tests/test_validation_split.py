"""The per-client validation split (``data.val_fraction``) and the ``val_*`` metrics.

Checked by value against independent computations: index arithmetic on the splits, and each
model's accuracy recomputed here with plain tensor algebra (not pflkit's scoring code)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import yaml

from conftest import tiny_config
from pflkit.config import DataConfig
from pflkit.data.federated import build_federated
from pflkit.data.sources import default_data_root, load_source
from pflkit.engine import Simulation
from pflkit.errors import PflkitError
from pflkit.experiment import load_config, validate
from test_federated import signed

VAL_KEYS = {
    "val_pers_acc_mean",
    "val_pers_acc_weighted",
    "val_pers_acc_std",
    "val_pers_acc_worst10",
    "val_global_acc",
}
# the evaluation fields of a tiny FedAvg row before validation splits existed
TEST_KEYS = {
    "global_acc",
    "global_loss",
    "pers_acc_mean",
    "pers_acc_weighted",
    "pers_acc_std",
    "pers_acc_worst10",
    "pers_acc_clients",
}


def data_cfg(**kw) -> DataConfig:
    return DataConfig.model_validate(tiny_config()["data"] | kw)


def union(*parts: np.ndarray) -> np.ndarray:
    return np.sort(np.concatenate(parts))


# -- the split ---------------------------------------------------------------------------------


def test_val_fraction_0_is_the_split_and_partition_id_of_before():
    before = build_federated(data_cfg())  # no val_fraction key at all
    zero = build_federated(data_cfg(val_fraction=0.0))
    # the id the tiny config's partition had before val_fraction existed (pflkit 0.x)
    assert before.partition_id == zero.partition_id == "7c7b485a29b67dad"
    parts = zip(
        before.train_indices + before.test_indices,
        zero.train_indices + zero.test_indices,
        strict=True,
    )
    assert all(np.array_equal(a, b) for a, b in parts)
    assert zero.val_indices is None and not zero.has_val
    assert all(c.val_x is None and c.val_y is None for c in zero.clients)


@pytest.mark.parametrize("frac", [0.2, 0.05])
def test_val_split_keeps_the_test_split_and_comes_out_of_train(frac):
    base = build_federated(data_cfg())
    fd = build_federated(data_cfg(val_fraction=frac))
    assert fd.has_val and fd.partition_id != base.partition_id
    assert len(fd.val_indices) == fd.num_clients == 4
    for k in range(fd.num_clients):
        tr, te, va = fd.train_indices[k], fd.test_indices[k], fd.val_indices[k]
        samples = union(base.train_indices[k], base.test_indices[k])  # client k's samples
        n = len(samples)
        assert np.array_equal(te, base.test_indices[k])  # the test split is untouched
        assert len(va) == max(int(frac * n), 1)
        assert len(tr) == len(base.train_indices[k]) - len(va)
        assert np.array_equal(union(tr, te, va), samples)  # disjoint, nothing lost
        assert np.isin(va, base.train_indices[k]).all()  # validation comes out of train
        # the tensors are the source's samples at those indices
        c = fd.clients[k]
        assert len(c.train_y) == len(tr) and len(c.test_y) == len(te) and len(c.val_y) == len(va)
    src = load_source("digits", default_data_root())
    c, va = fd.clients[2], fd.val_indices[2]
    assert torch.equal(c.val_x, src.train_x[va]) and torch.equal(c.val_y, src.train_y[va])
    # the class table of the three local splits adds up to the client's samples
    total = fd.class_table("train") + fd.class_table("test") + fd.class_table("val")
    assert np.array_equal(total, base.class_table("train") + base.class_table("test"))
    with pytest.raises(PflkitError, match="no validation split"):
        base.class_table("val")


def test_val_split_is_cached_and_a_cache_entry_without_it_is_recomputed(tmp_path):
    cfg = data_cfg(root=str(tmp_path), val_fraction=0.2)
    a = build_federated(cfg)
    path = tmp_path / "partitions" / f"{a.partition_id}.npz"
    with np.load(path) as z:
        arrays = {k: z[k] for k in z.files}
    assert all(np.array_equal(arrays[f"va{i}"], a.val_indices[i]) for i in range(4))
    b = build_federated(cfg)  # read back
    assert all(np.array_equal(x, y) for x, y in zip(a.val_indices, b.val_indices, strict=True))
    for tamper in ("no_val", "val_overlaps_train"):
        bad = dict(arrays)
        if tamper == "no_val":
            bad = {k: v for k, v in bad.items() if not k.startswith("va")}
        else:
            bad["va1"] = np.append(bad["va1"], bad["tr1"][0])
        np.savez(path, **signed(bad))  # a wrong entry that pflkit wrote: its checksum holds
        c = build_federated(cfg)
        assert all(np.array_equal(x, y) for x, y in zip(a.val_indices, c.val_indices, strict=True))
        with np.load(path) as z:  # and the entry was rewritten
            assert np.array_equal(z["va1"], a.val_indices[1])
    # a partition without validation writes no va arrays (its cache file is as before)
    zero = build_federated(data_cfg(root=str(tmp_path)))
    with np.load(tmp_path / "partitions" / f"{zero.partition_id}.npz") as z:
        assert not [k for k in z.files if k.startswith("va")]


# -- bad input ---------------------------------------------------------------------------------


@pytest.mark.parametrize(("test", "val"), [(0.25, 0.8), (0.25, 0.75), (0.7, 0.3)])
def test_fractions_that_leave_nothing_to_train_are_refused(test, val):
    overrides = [f"data.test_fraction={test}", f"data.val_fraction={val}"]
    with pytest.raises(PflkitError) as err:
        load_config(None, overrides)
    msg = str(err.value)
    assert f"data.test_fraction + data.val_fraction must be below 1 (got {test} + {val})" in msg
    assert "\n" not in msg
    assert load_config(None, ["data.test_fraction=0.25", "data.val_fraction=0.7"])


def test_a_client_too_small_for_three_splits_is_one_sentence():
    # iid over 600 clients: 2 or 3 samples each; enough for train/test, not for validation
    cfg = {"dataset": "digits", "num_clients": 600, "partition": {"name": "iid"}}
    assert build_federated(DataConfig.model_validate(cfg)).num_clients == 600
    with pytest.raises(
        PflkitError, match=r"got 2 sample\(s\).*too few for a train/validation/test"
    ):
        build_federated(DataConfig.model_validate(cfg | {"val_fraction": 0.1}))
    # 3 samples each, but test (2) and validation (1) take all of them
    cfg = {"dataset": "digits", "num_clients": 599, "partition": {"name": "iid"}}
    with pytest.raises(PflkitError, match=r"got 3 sample\(s\).*train/validation/test"):
        build_federated(
            DataConfig.model_validate(cfg | {"test_fraction": 0.9, "val_fraction": 0.05})
        )


def test_cli_refuses_bad_fractions_with_exit_2(cli, tmp_path):
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(tiny_config()))
    r = cli("run", str(path), "--set", "data.val_fraction=0.8", "--out", "bad", cwd=tmp_path)
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert "data.test_fraction + data.val_fraction must be below 1 (got 0.25 + 0.8)" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr
    assert not (tmp_path / "bad").exists()


# -- the metrics -------------------------------------------------------------------------------


def mlp_accuracy(weights: dict, x: torch.Tensor, y: torch.Tensor) -> float:
    """The tiny config's MLP (flatten, linear, relu, linear) by hand."""
    h = torch.relu(x.flatten(1) @ weights["body.1.weight"].T + weights["body.1.bias"])
    logits = h @ weights["head.weight"].T + weights["head.bias"]
    return (logits.argmax(1) == y).double().mean().item()


def summary(acc: list[float], counts: list[int]) -> dict[str, float]:
    """Unweighted mean, sample-weighted mean, std, worst client (4 clients: worst 10% is one)."""
    a, n = np.array(acc), np.array(counts, dtype=float)
    return {
        "mean": a.mean(),
        "weighted": (a * n).sum() / n.sum(),
        "std": math.sqrt(((a - a.mean()) ** 2).mean()),
        "worst10": a.min(),
    }


def run(rounds: int = 2, **sections) -> tuple[Simulation, list[dict]]:
    cfg = validate(tiny_config(train={"rounds": rounds}, **sections))
    with Simulation(cfg) as sim:
        rows = [sim.run_round(r) for r in range(1, rounds + 1)]
    return sim, rows


@pytest.mark.parametrize("algo", ["fedavg", "local"])
def test_val_metrics_equal_an_independent_computation(algo):
    sim, rows = run(algorithm={"name": algo}, data={"val_fraction": 0.2})
    row = rows[-1]
    data = sim.data
    # the models the last round evaluated: FedAvg's global model, each client's own for Local
    if algo == "fedavg":
        models = [sim.server["weights"]] * data.num_clients
    else:
        models = [sim.clients[k]["weights"] for k in range(data.num_clients)]
    # validation data straight from the source, at the split's indices
    src = load_source("digits", default_data_root())
    val = [(src.train_x[va], src.train_y[va]) for va in data.val_indices]
    test = [(src.train_x[te], src.train_y[te]) for te in data.test_indices]
    val_acc = [mlp_accuracy(w, x, y) for w, (x, y) in zip(models, val, strict=True)]
    test_acc = [mlp_accuracy(w, x, y) for w, (x, y) in zip(models, test, strict=True)]
    assert val_acc != test_acc  # the check below can tell the splits apart
    want = summary(val_acc, [len(y) for _, y in val])
    for k, v in want.items():
        assert row[f"val_pers_acc_{k}"] == pytest.approx(v, abs=1e-12), k
    # the test metrics are still the test split's
    assert row["pers_acc_clients"] == pytest.approx(test_acc, abs=1e-12)
    assert row["pers_acc_mean"] == pytest.approx(np.mean(test_acc), abs=1e-12)
    if algo == "fedavg":  # the global model on the union of the validation splits
        x, y = torch.cat([x for x, _ in val]), torch.cat([y for _, y in val])
        assert row["val_global_acc"] == pytest.approx(mlp_accuracy(models[0], x, y), abs=1e-6)
        assert row["global_acc"] != row["val_global_acc"]
    else:  # Local has no global model
        assert "val_global_acc" not in row and "global_acc" not in row
        assert VAL_KEYS - {"val_global_acc"} <= row.keys()
    assert all(VAL_KEYS - {"val_global_acc"} <= r.keys() for r in rows)  # every evaluation


def test_one_set_of_weights_is_scored_on_both_splits(monkeypatch):
    """FedAvg-FT fine-tunes while it evaluates: one fine-tuning per client and evaluation."""
    from pflkit.algorithms.fedavg_ft import FedAvgFT

    calls = []
    real = FedAvgFT.personal_model

    def counted(self, env, view, state, ctx, upload=None):
        calls.append(env.cid)
        return real(self, env, view, state, ctx, upload)

    monkeypatch.setattr(FedAvgFT, "personal_model", counted)
    _, rows = run(rounds=1, algorithm={"name": "fedavg_ft"}, data={"val_fraction": 0.2})
    assert sorted(calls) == [0, 1, 2, 3]
    assert VAL_KEYS <= rows[0].keys()


def test_without_a_val_split_rows_have_no_val_keys_and_are_unchanged():
    sim, rows = run(eval={"selected_clients": True})
    for r in rows:
        assert not [k for k in r if k.startswith("val_")]
        assert TEST_KEYS | {"pers_acc_selected"} <= r.keys()
    # the test metrics, by hand, as before validation splits existed
    src = load_source("digits", default_data_root())
    test_acc = [
        mlp_accuracy(sim.server["weights"], src.train_x[te], src.train_y[te])
        for te in sim.data.test_indices
    ]
    assert rows[-1]["pers_acc_clients"] == pytest.approx(test_acc, abs=1e-12)
    # a validation split adds exactly the val_* keys
    _, val_rows = run(eval={"selected_clients": True}, data={"val_fraction": 0.2})
    assert val_rows[-1].keys() - rows[-1].keys() == VAL_KEYS
    assert rows[-1].keys() - val_rows[-1].keys() == set()


def strip(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if not k.startswith("seconds_")} for r in rows]


@pytest.fixture
def one_thread():
    """Runners agree bit for bit at the same torch thread count per process: one, as each pool
    worker has (the config's ``threads: 1`` sets it for this process; restored after)."""
    threads = torch.get_num_threads()
    yield {"threads": 1}
    torch.set_num_threads(threads)


def test_process_pool_gives_the_in_process_val_metrics(one_thread):
    sections = {"algorithm": {"name": "fedavg_ft"}, "data": {"val_fraction": 0.2}, **one_thread}
    _, here = run(**sections)
    _, pool = run(engine={"workers": 2}, **sections)
    assert VAL_KEYS <= here[-1].keys()
    assert strip(pool) == strip(here)


def test_flower_gives_the_embedded_val_metrics(tmp_path):
    pytest.importorskip("flwr")
    from flower_fakes import assert_rows_close, flower_run, task_identity
    from pflkit.engine.runner import run_experiment

    gen = task_identity()
    next(gen)
    try:
        raw = tiny_config(algorithm={"name": "fedavg_ft"}, data={"val_fraction": 0.2})
        raw["train"]["rounds"] = 2
        cfg = validate(raw)
        embedded = run_experiment(cfg, out=tmp_path / "embedded")
        nodes = {101: {"client-ids": "0,1"}, 202: {"client-ids": "2-3"}}
        flower, _ = flower_run(cfg, tmp_path, nodes)
    finally:
        next(gen, None)
    assert VAL_KEYS <= embedded.rows[-1].keys()
    for a, b in zip(flower.rows, embedded.rows, strict=True):
        assert_rows_close(a, b)
