"""Devices: every algorithm names the device of every tensor it creates (checked on CPU-only
machines through :mod:`device_audit`), the data and models sit on the run's device, and an
unknown or missing device is refused. The ``cuda`` tests run where a CUDA device exists."""

from __future__ import annotations

import pytest
import torch

from conftest import tiny_config
from device_audit import DefaultDeviceElsewhere
from pflkit.algorithms import ALGORITHMS
from pflkit.data.federated import build_federated
from pflkit.devices import resolve_device
from pflkit.engine import Simulation
from pflkit.errors import PflkitError
from pflkit.experiment import validate

NAMES = sorted(ALGORITHMS)
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def two_rounds(name: str, device: str = "cpu", **sections):
    """Every algorithm on a tiny run that exercises its whole round: partial participation, a
    public set, a validation split, MAP's selected-clients protocol, two rounds (the second
    uses the first's server state), one torch thread (tiny_config's)."""
    raw = tiny_config(algorithm={"name": name}, device=device, **sections)
    raw["data"] |= {"public": {"dataset": "digits", "size": 64}, "val_fraction": 0.2}
    raw["train"] |= {"client_fraction": 0.75, "rounds": 2}
    raw["eval"] = {"selected_clients": True}
    return validate(raw)


def run(cfg, data=None) -> tuple[Simulation, list[dict]]:
    with Simulation(cfg, data) as sim:
        rows = [sim.run_round(r) for r in (1, 2)]
    return sim, rows


def tensors(obj) -> list[torch.Tensor]:
    """The tensors in a state, except optimiser step counters (torch keeps Adam's on the CPU)."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for k, v in obj.items() if k != "step" for t in tensors(v)]
    if isinstance(obj, list | tuple):
        return [t for v in obj for t in tensors(v)]
    return []


@pytest.mark.parametrize("name", NAMES)
def test_every_algorithm_names_the_device_of_what_it_creates(name):
    """Tensors that pflkit code creates without a device land on ``meta`` here, so a forgotten
    ``device=`` fails on CPU as it would on a GPU."""
    cfg = two_rounds(name)
    data = build_federated(cfg.data)  # data loading builds CPU tensors by design
    with DefaultDeviceElsewhere():
        _, rows = run(cfg, data)
    assert all(torch.isfinite(torch.tensor(r["pers_acc_mean"])) for r in rows)


def test_the_audit_catches_a_forgotten_device():
    """The check itself: pflkit code that adds a device-less tensor to the run's tensors fails,
    and the same code naming the device passes."""
    scope = {"__name__": "pflkit.algorithms.example", "torch": torch}
    exec(
        "def forgot(x): return x + torch.ones(3)\n"
        "def named(x): return x + torch.ones(3, device=x.device)\n"
        "def indexed(x): return x[torch.arange(2)]\n",
        scope,
    )
    x = torch.zeros(3)
    with DefaultDeviceElsewhere():
        assert scope["named"](x).tolist() == [1.0, 1.0, 1.0]
        for fn in ("forgot", "indexed"):
            with pytest.raises(RuntimeError):
                scope[fn](x)
        assert (x + torch.ones(3)).device.type == "cpu"  # code outside pflkit is not touched


def test_data_are_moved_once_and_a_moved_dataset_is_itself():
    cfg = two_rounds("fedavg")
    data = build_federated(cfg.data)
    assert data.to("cpu") is data
    meta = data.to("meta")
    assert meta.test_x.is_meta and meta.public_x.is_meta
    assert all(t.is_meta for c in meta.clients for t in vars(c).values())  # val_x, val_y too
    assert meta.has_val
    assert meta.num_clients == data.num_clients and meta.partition_id == data.partition_id


def test_devices_are_resolved_or_refused_in_one_sentence(monkeypatch):
    assert resolve_device("cpu") == "cpu"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto") == "cpu"
    for name, message in [
        ("cuda", "device 'cuda' is not available: this machine has no CUDA device"),
        ("cuda:1", "device 'cuda:1' is not available"),
        ("gpu", "unknown device 'gpu': use auto, cpu, cuda or cuda:N"),
        ("mps", "unknown device 'mps'"),
    ]:
        with pytest.raises(PflkitError, match=message):
            resolve_device(name)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert resolve_device("auto") == "cuda" and resolve_device("cuda:1") == "cuda:1"
    with pytest.raises(PflkitError, match="this machine has 2 CUDA device"):
        resolve_device("cuda:2")


@cuda
@pytest.mark.parametrize("name", NAMES)
def test_every_algorithm_runs_on_cuda(name):
    """On a GPU: the whole round on the device, every state tensor there, and the same
    accuracies as on the CPU up to float differences (batches and initial weights are drawn
    on the CPU, so a seed means the same run on both)."""
    sim, rows = run(two_rounds(name, "cuda"))
    states = [sim.server, *sim.clients.values()]
    assert all(t.device.type == "cuda" for t in tensors(states))
    assert all(t.device.type == "cuda" for c in sim.data.clients for t in vars(c).values())
    _, cpu_rows = run(two_rounds(name, "cpu"))
    for key in ("pers_acc_mean", "pers_acc_selected", "global_acc"):
        if key in rows[-1]:
            assert rows[-1][key] == pytest.approx(cpu_rows[-1][key], abs=0.05), key


@cuda
def test_an_interrupted_cuda_run_resumes_on_the_device(tmp_path, monkeypatch):
    from pflkit.engine import run_experiment

    raw = tiny_config(device="cuda", train={"rounds": 4}, output={"checkpoint_every": 2})
    full = run_experiment(validate(raw), out=tmp_path / "full")
    real = Simulation.run_round

    def crash_in_round_3(self, rnd):
        if rnd == 3:
            raise KeyboardInterrupt
        return real(self, rnd)

    monkeypatch.setattr(Simulation, "run_round", crash_in_round_3)
    with pytest.raises(PflkitError, match="--resume"):
        run_experiment(validate(raw), out=tmp_path / "cut")
    monkeypatch.setattr(Simulation, "run_round", real)
    resumed = run_experiment(resume=tmp_path / "cut")
    assert resumed.rows[-1]["pers_acc_mean"] == pytest.approx(full.rows[-1]["pers_acc_mean"])


@cuda
@pytest.mark.parametrize("workers", [2, 3])
def test_workers_sharing_the_gpu_give_the_in_process_numbers(tmp_path, workers):
    """On a GPU (issue 38): ``engine.workers: N`` starts N fresh processes that share the
    device; every metric of every round equals the in-process cuda run's."""
    from pflkit.engine import run_experiment

    def rows(n):
        raw = tiny_config(device="cuda", engine={"workers": n}, train={"rounds": 2})
        res = run_experiment(validate(raw), out=tmp_path / f"w{n}")
        return [{k: v for k, v in r.items() if not k.startswith("seconds_")} for r in res.rows]

    assert rows(workers) == rows(1)
