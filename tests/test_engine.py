"""Engine: sampling, byte counting, determinism, resume, run folders, evaluation summary."""

from __future__ import annotations

import io
import json
import pickle
import shutil

import numpy as np
import pytest
import torch
import yaml

from pflkit.algorithms.base import nbytes, weighted_average
from pflkit.engine import Simulation, run_experiment, sample_clients
from pflkit.errors import PflkitError
from pflkit.eval import summarize_clients


def strip_timing(rows):
    return [{k: v for k, v in r.items() if not k.startswith("seconds_")} for r in rows]


def test_sampling_is_seeded_and_sized():
    a = [sample_clients(3, r, 100, 0.2) for r in range(1, 6)]
    b = [sample_clients(3, r, 100, 0.2) for r in range(1, 6)]
    assert a == b
    assert all(len(s) == 20 and len(set(s)) == 20 for s in a)
    assert a[0] != a[1]  # differs between rounds
    assert sample_clients(4, 1, 100, 0.2) != a[0]  # and between seeds
    assert sample_clients(0, 1, 10, 1.0) == list(range(10))
    assert len(sample_clients(0, 1, 10, 0.01)) == 1  # at least one client


def test_nbytes_counts_tensors_exactly():
    payload = {
        "w": torch.zeros(3, 4),
        "h": torch.zeros(5, dtype=torch.float64),
        "n": 7,
        "tag": "ab",
    }
    assert nbytes(payload) == 3 * 4 * 4 + 5 * 8 + 8 + 2
    with pytest.raises(TypeError):
        nbytes({"model": torch.nn.Linear(2, 2)})


def test_weighted_average_weights_by_samples():
    ups = {
        0: {"weights": {"a": torch.tensor([1.0, 2.0]), "steps": torch.tensor(5)}, "num_samples": 1},
        1: {"weights": {"a": torch.tensor([4.0, 8.0]), "steps": torch.tensor(9)}, "num_samples": 3},
    }
    avg = weighted_average(ups)
    assert torch.allclose(avg["a"], torch.tensor([0.25 * 1 + 0.75 * 4, 0.25 * 2 + 0.75 * 8]))
    assert avg["steps"].item() == 5  # integer buffers come from the first upload


def test_summarize_clients():
    acc = np.array([0.1, 0.5, 0.9, 1.0] + [0.8] * 16)
    counts = np.array([10, 30] + [1] * 18, dtype=float)
    s = summarize_clients(acc, counts)
    assert s["pers_acc_mean"] == pytest.approx(acc.mean())
    assert s["pers_acc_weighted"] == pytest.approx((acc * counts).sum() / counts.sum())
    assert s["pers_acc_std"] == pytest.approx(acc.std())
    assert s["pers_acc_worst10"] == pytest.approx((0.1 + 0.5) / 2)  # 10% of 20 clients = 2


def test_same_seed_gives_bit_identical_metrics(tiny, tmp_path):
    cfg = tiny(train={"client_fraction": 0.5})
    a = run_experiment(cfg, out=tmp_path / "a")
    b = run_experiment(cfg, out=tmp_path / "b")
    assert strip_timing(a.rows) == strip_timing(b.rows)
    c = run_experiment(tiny(seed=1, train={"client_fraction": 0.5}), out=tmp_path / "c")
    assert strip_timing(c.rows) != strip_timing(a.rows)


def test_run_folder_contents(tiny, tmp_path):
    res = run_experiment(
        tiny(output={"checkpoint_every": 2, "progress": False}), out=tmp_path / "r"
    )
    files = {p.name for p in res.run_dir.iterdir()}
    assert {"config.yaml", "metrics.jsonl", "summary.json", "curves.png", "checkpoints"} <= files
    rows = [json.loads(x) for x in (res.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows] == [1, 2, 3]
    summary = json.loads((res.run_dir / "summary.json").read_text())
    assert summary["final"]["round"] == 3
    assert summary["final"]["pers_acc_mean"] == rows[-1]["pers_acc_mean"]
    # FedAvg downloads and uploads exactly the model (plus the upload's sample count)
    sim = Simulation(tiny())
    model_bytes = nbytes(sim.server["weights"])
    assert all(b == model_bytes for r in rows for b in r["bytes_down"])
    assert all(b == model_bytes + 8 for r in rows for b in r["bytes_up"])


def test_resume_after_interrupt_matches_uninterrupted(tiny, tmp_path, monkeypatch):
    cfg = tiny(
        train={"rounds": 5, "client_fraction": 0.5},
        output={"checkpoint_every": 2, "progress": False},
    )
    full = run_experiment(cfg, out=tmp_path / "full")

    real = Simulation.run_round

    def crash_in_round_4(self, rnd):
        if rnd == 4:
            raise KeyboardInterrupt
        return real(self, rnd)

    monkeypatch.setattr(Simulation, "run_round", crash_in_round_4)
    from pflkit.errors import PflkitError

    with pytest.raises(PflkitError, match="--resume"):
        run_experiment(cfg, out=tmp_path / "cut")
    monkeypatch.setattr(Simulation, "run_round", real)
    resumed = run_experiment(resume=tmp_path / "cut")
    assert strip_timing(resumed.rows) == strip_timing(full.rows)
    assert resumed.summary["final"] == full.summary["final"]


def test_eval_schedule(tiny, tmp_path):
    res = run_experiment(tiny(train={"rounds": 5}, eval={"every": 2}), out=tmp_path / "r")
    evaluated = [r["round"] for r in res.rows if "pers_acc_mean" in r]
    assert evaluated == [2, 4, 5]  # and always the last round


def test_a_dead_worker_is_one_clear_error_not_a_hang(tiny):
    from pflkit.errors import PflkitError

    sim = Simulation(tiny(engine={"workers": 2}))
    sim.run_round(1)
    for proc in list(sim.runner.executor._processes.values()):
        proc.kill()
    with pytest.raises(PflkitError, match="a worker process died while training in round 2"):
        sim.run_round(2)
    assert sim.runner.executor is None  # every worker was stopped
    sim.close()


@pytest.mark.parametrize("every", [0, 2, 3])  # 3: its first checkpoint not yet written
def test_a_run_a_dead_worker_stopped_says_how_to_continue_and_that_works(
    tiny, tmp_path, monkeypatch, every
):
    cfg = tiny(train={"rounds": 4}, engine={"workers": 2}, output={"checkpoint_every": every})
    full = run_experiment(
        cfg.model_copy(update={"engine": cfg.engine.model_copy(update={"workers": 1})}),
        out=tmp_path / "full",
    )
    real = Simulation.run_round

    def kill_workers_in_round_3(self, rnd):
        if rnd == 3:
            for proc in list(self.runner.executor._processes.values()):
                proc.kill()
        return real(self, rnd)

    monkeypatch.setattr(Simulation, "run_round", kill_workers_in_round_3)
    cut = tmp_path / "cut"
    with pytest.raises(PflkitError) as err:
        run_experiment(cfg, out=cut)
    command = f"pflkit run --resume {cut} --set engine.workers=1"
    how = {
        0: f"it has no checkpoint (output.checkpoint_every: 0): {command} runs it again from round 1",
        2: f"to continue from its checkpoint of round 2: {command}",
        3: f"it has no checkpoint: {command} runs it again from round 1",
    }[every]
    assert str(err.value).endswith(
        f"in round 3 (out of memory, or killed): set engine.workers: "
        f"1 to run in this process; {how}"
    )
    assert f"stopped: {err.value}" in (cut / "run.log").read_text()
    again = pickle.loads(pickle.dumps(err.value))  # as a compare's job process returns it
    assert (str(again), again.setting) == (str(err.value), "engine.workers=1")
    monkeypatch.setattr(Simulation, "run_round", real)
    resumed = run_experiment(resume=cut, overrides=["engine.workers=1"])
    assert strip_timing(resumed.rows) == strip_timing(full.rows)


def test_train_weighting_sets_every_averaging_algorithm_and_refuses_a_clash(tiny, tmp_path):
    from pflkit.engine.compare import run_compare

    for name in ("fedavg", "fedprox", "fedphp", "ditto", "scaffold", "map"):
        cfg = tiny(algorithm={"name": name}, train={"weighting": "samples"})
        assert cfg.algorithm["weighting"] == "samples"
    assert tiny(algorithm={"name": "fedavg"}).algorithm["weighting"] == "samples"  # own default
    assert tiny(algorithm={"name": "map"}).algorithm["weighting"] == "uniform"
    assert (
        "weighting"
        not in tiny(algorithm={"name": "local"}, train={"weighting": "uniform"}).algorithm
    )
    with pytest.raises(
        PflkitError, match="sets weighting: samples, but train.weighting is uniform"
    ):
        tiny(algorithm={"name": "fedavg", "weighting": "samples"}, train={"weighting": "uniform"})
    # compare applies it to every entry, and refuses a clash before anything runs
    cfg = tiny(
        train={"weighting": "uniform", "rounds": 1},
        compare={"algorithms": ["fedavg", "local"], "seeds": [0]},
    )
    out = run_compare(cfg, tmp_path / "c", progress=False)
    saved = (tmp_path / "c" / "fedavg-s0" / "config.yaml").read_text()
    assert "weighting: uniform" in saved and out["results"]
    bad = cfg.model_copy(
        update={
            "compare": cfg.compare.model_copy(
                update={"algorithms": [{"name": "fedavg", "weighting": "samples"}]}
            )
        }
    )
    with pytest.raises(PflkitError, match="train.weighting"):
        run_compare(bad, tmp_path / "d", progress=False)
    assert not (tmp_path / "d").exists()


def test_compare_entry_label_names_the_setting_and_is_not_an_algorithm_parameter(tiny, tmp_path):
    from pflkit.engine.compare import compare_plan, run_compare, sweep_plan

    fixed = {"name": "fedprox", "label": "prox_small", "mu": 0.001}
    cfg = tiny(train={"rounds": 1}, compare={"algorithms": ["fedavg", fixed], "seeds": [0]})
    assert [p[0] for p in compare_plan(cfg)] == ["fedavg", "prox_small"]
    run_compare(cfg, tmp_path / "c", progress=False)
    saved = yaml.safe_load((tmp_path / "c" / "prox_small-s0" / "config.yaml").read_text())
    assert saved["algorithm"]["mu"] == 0.001 and "label" not in saved["algorithm"]
    swept = cfg.model_copy(update={"sweep": cfg.sweep.model_copy(update={"grid": {
        "algorithm.mu": [0.1, 0.2]}})})  # fmt: skip
    assert [p[0] for p in sweep_plan(swept)][1:] == [
        "prox_small[algorithm.mu=0.1]",
        "prox_small[algorithm.mu=0.2]",
    ]
    for label in ("a/b", "", 3):
        bad = tiny(compare={"algorithms": [{"name": "fedavg", "label": label}]})
        with pytest.raises(PflkitError, match="cannot name a run folder"):
            compare_plan(bad)


def test_eval_last_evaluates_the_final_rounds_and_summarises_their_mean(tiny, tmp_path):
    res = run_experiment(
        tiny(train={"rounds": 6}, eval={"every": 4, "last": 2}), out=tmp_path / "r"
    )
    evaluated = [r["round"] for r in res.rows if "pers_acc_mean" in r]
    assert evaluated == [4, 5, 6]
    by_round = {r["round"]: r for r in res.rows}
    m = res.summary["mean_last"]
    assert m["rounds"] == [5, 6]
    for key in ("global_acc", "pers_acc_mean"):
        assert m[key] == pytest.approx((by_round[5][key] + by_round[6][key]) / 2)
    assert "mean_last" not in run_experiment(tiny(), out=tmp_path / "s").summary


# -- run-folder safety (engine/folder.py) ----------------------------------------------------------
def _interrupted_run(tiny, tmp_path, monkeypatch, rounds=5, stop_in=4, **sections):
    """A run stopped inside round ``stop_in`` (checkpoints every 2 rounds) and its folder."""
    cfg = tiny(
        train={"rounds": rounds}, output={"checkpoint_every": 2, "progress": False}, **sections
    )
    real = Simulation.run_round

    def stop(self, rnd):
        if rnd == stop_in:
            raise KeyboardInterrupt
        return real(self, rnd)

    monkeypatch.setattr(Simulation, "run_round", stop)
    with pytest.raises(PflkitError, match="last checkpoint is kept"):
        run_experiment(cfg, out=tmp_path / "cut")
    monkeypatch.setattr(Simulation, "run_round", real)
    return cfg, tmp_path / "cut"


def test_a_second_writer_is_refused_and_a_stale_lock_taken_over(tiny, tmp_path, monkeypatch):
    from pflkit.engine.folder import FolderLock

    _, folder = _interrupted_run(tiny, tmp_path, monkeypatch)
    with FolderLock(folder):  # another process is running it
        with pytest.raises(PflkitError, match=r"is in use by process \d+ on .*wait for it"):
            run_experiment(resume=folder)
    # a lock left by a process that no longer exists is taken over
    (folder / ".lock").write_text(
        json.dumps({"pid": 2**22 + 7, "host": __import__("socket").gethostname()})
    )
    res = run_experiment(resume=folder)
    assert res.summary["rounds"] == 5 and not (folder / ".lock").exists()


def test_resume_refuses_an_edited_config_or_a_foreign_checkpoint(tiny, tmp_path, monkeypatch):
    _, folder = _interrupted_run(tiny, tmp_path, monkeypatch)
    text = (folder / "config.yaml").read_text()
    (folder / "config.yaml").write_text(text.replace("lr: 0.05", "lr: 0.07"))
    with pytest.raises(PflkitError, match="belongs to another configuration"):
        run_experiment(resume=folder)
    (folder / "config.yaml").write_text(text)
    other_cfg, other = _interrupted_run(
        tiny, tmp_path / "o", monkeypatch, algorithm={"name": "fedprox"}
    )
    shutil.copy(other / "checkpoints" / "latest.pt", folder / "checkpoints" / "latest.pt")
    with pytest.raises(PflkitError, match="belongs to another configuration"):
        run_experiment(resume=folder)


def test_resume_survives_a_new_algorithm_parameter_and_reads_legacy_checkpoints(
    tiny, tmp_path, monkeypatch
):
    from pflkit.algorithms import ALGORITHMS, param
    from pflkit.engine.checkpoint import load_checkpoint
    from pflkit.engine.folder import fingerprint
    from pflkit.engine.runner import CHECKPOINT
    from pflkit.experiment import validate

    _, folder = _interrupted_run(tiny, tmp_path, monkeypatch, algorithm={"name": "fedprox"})
    fedprox = ALGORITHMS["fedprox"]

    class Later(fedprox.Params):  # a later release adds a parameter at a neutral default
        added: int = param(0, "test")

    monkeypatch.setattr(fedprox, "Params", Later)
    assert run_experiment(resume=folder).summary["rounds"] == 5
    assert "added: 0" in (folder / "config.yaml").read_text()
    # a non-default value of the new parameter is another configuration
    _, other = _interrupted_run(tiny, tmp_path / "o", monkeypatch, algorithm={"name": "fedprox"})
    text = (other / "config.yaml").read_text()
    (other / "config.yaml").write_text(text.replace("added: 0", "added: 3"))
    with pytest.raises(PflkitError, match="belongs to another configuration"):
        run_experiment(resume=other)
    (other / "config.yaml").write_text(text)
    # a checkpoint written before defaults were left out of algorithm parameters
    # (and one from before checksums: a plain torch.save file)
    ckpt = load_checkpoint(other / CHECKPOINT)
    cfg = validate(yaml.safe_load(text))
    pid = Simulation(cfg).data.partition_id
    new, legacy = fingerprint(cfg, pid), fingerprint(cfg, pid, legacy=True)
    assert ckpt["fingerprint"] == new != legacy
    torch.save(ckpt | {"fingerprint": legacy}, other / CHECKPOINT)
    assert run_experiment(resume=other).summary["rounds"] == 5


def test_resume_keeps_the_covered_rows_byte_for_byte_and_drops_a_torn_line(
    tiny, tmp_path, monkeypatch
):
    cfg, folder = _interrupted_run(tiny, tmp_path, monkeypatch)
    full = run_experiment(cfg, out=tmp_path / "full")
    metrics = folder / "metrics.jsonl"
    lines = metrics.read_bytes().splitlines(keepends=True)
    assert len(lines) == 3  # rounds 1-3 written, the checkpoint covers 1-2
    metrics.write_bytes(b"".join(lines) + b'{"round": 4, "train_lo')  # killed mid-write
    res = run_experiment(resume=folder)
    after = metrics.read_bytes()
    assert after.startswith(lines[0] + lines[1])  # covered rows: the same bytes
    assert strip_timing(res.rows) == strip_timing(full.rows)
    # rows the checkpoint covers but the file lacks: an error, not a partial history
    _, gone = _interrupted_run(tiny, tmp_path / "g", monkeypatch)
    (gone / "metrics.jsonl").unlink()
    with pytest.raises(PflkitError, match="lacks rounds that the checkpoint covers"):
        run_experiment(resume=gone)


@pytest.mark.parametrize("workers", [1, 2])
def test_on_nan_stop_or_skip_the_diverging_client(tiny, tmp_path, monkeypatch, workers):
    from pflkit.algorithms.fedavg import FedAvg

    real = FedAvg.client_update

    def client_2_blows_up(self, env, payload, state, ctx):
        update = real(self, env, payload, state, ctx)
        if env.cid == 2 and ctx.round == 2:  # finite loss, but inf weights uploaded
            update.upload["weights"] = {
                k: v * float("inf") for k, v in update.upload["weights"].items()
            }
        return update

    monkeypatch.setattr(FedAvg, "client_update", client_2_blows_up)
    cfg = tiny(train={"rounds": 3}, engine={"workers": workers})
    with pytest.raises(PflkitError, match="client 2's upload holds inf or nan values in round 2"):
        run_experiment(cfg, out=tmp_path / "stop")
    skip = tiny(train={"rounds": 3, "on_nan": "skip_client"}, engine={"workers": workers})
    res = run_experiment(skip, out=tmp_path / "skip")
    row2 = res.rows[1]
    assert row2["diverged_clients"] == [2] and row2["failed_clients"] == [2]
    assert "diverged_clients" not in res.rows[0] and "diverged_clients" not in res.rows[2]
    assert all(np.isfinite(r["pers_acc_mean"]) for r in res.rows)
    lines = (tmp_path / "skip" / "metrics.jsonl").read_text().splitlines()
    assert all("NaN" not in line and "Infinity" not in line for line in lines)


def test_a_full_disk_during_a_checkpoint_is_one_sentence_and_leaves_no_temp_file(
    tmp_path, monkeypatch
):
    import errno

    from pflkit.engine import checkpoint

    path = tmp_path / "checkpoints" / "latest.pt"
    checkpoint.save_checkpoint(path, {"round": 1})

    class Full(io.FileIO):
        def write(self, b):
            super().write(b"partial")
            raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(checkpoint, "open", Full, raising=False)
    with pytest.raises(
        PflkitError, match=r"No space left on device\); the previous checkpoint is kept"
    ):
        checkpoint.save_checkpoint(path, {"round": 2})
    assert sorted(p.name for p in path.parent.iterdir()) == ["latest.pt"]
    assert checkpoint.load_checkpoint(path) == {"round": 1}


def test_a_model_too_large_to_allocate_is_one_sentence(tiny):
    with pytest.raises(PflkitError, match="is too large to build here"):
        Simulation(tiny(model={"name": "mlp", "options": {"hidden": [10**11]}}))


def test_workers_on_an_accelerator_are_a_pool_of_fresh_processes(tiny, monkeypatch):
    """engine.workers N with a CUDA device: N workers that share the GPU, each started from a
    fresh process (a forked CUDA context is unusable), not a refusal."""
    from pflkit.engine import clients

    cfg = tiny(engine={"workers": 3})
    assert isinstance(clients.make_runner(cfg), clients.ProcessPool)
    assert not clients.make_runner(cfg).fresh  # on the CPU: forked, as before
    monkeypatch.setattr(clients, "resolve_device", lambda name: "cuda")
    runner = clients.make_runner(cfg)
    assert isinstance(runner, clients.ProcessPool) and runner.fresh and runner.workers == 3


@pytest.mark.parametrize(
    ("cores", "clients_", "gib", "want"),
    [(16, 20, 80, 8), (4, 20, 80, 4), (16, 5, 80, 5), (16, 20, 12, 3), (16, 20, 6, 1)],
)
def test_auto_workers_on_a_gpu(tiny, monkeypatch, cores, clients_, gib, want):
    """engine.workers auto on a GPU: 8 processes, at most one per core, one per client and one
    per 4 GiB of device memory (1: in-process); on the CPU one per core and client."""
    from types import SimpleNamespace

    from pflkit.engine import clients

    monkeypatch.setattr(clients.os, "sched_getaffinity", lambda pid: set(range(cores)))
    cfg = tiny(engine={"workers": "auto"}, data={"num_clients": clients_})
    assert clients.auto_workers(cfg) == min(cores, clients_)  # CPU
    monkeypatch.setattr(clients, "resolve_device", lambda name: "cuda")
    memory = SimpleNamespace(total_memory=gib * 2**30)
    monkeypatch.setattr(clients.torch.cuda, "get_device_properties", lambda device: memory)
    assert clients.auto_workers(cfg) == want
    runner = clients.make_runner(cfg)
    assert isinstance(runner, clients.ProcessPool if want > 1 else clients.InProcess)


def test_fresh_worker_processes_give_the_in_process_numbers(tiny, tmp_path):
    """The pool the GPU path uses (workers from a fork server, the data sent to them on the
    CPU), run on the CPU: every metric as in this process."""
    from pflkit.engine.clients import ProcessPool

    cfg = tiny(train={"rounds": 2, "client_fraction": 0.75})
    here = run_experiment(cfg, out=tmp_path / "here")
    pool = run_experiment(cfg, out=tmp_path / "pool", runner=ProcessPool(2, 1, fresh=True))
    assert strip_timing(pool.rows) == strip_timing(here.rows)


@pytest.mark.parametrize("algorithm", ["fedavg", "fedrep", "pfedhn"])
def test_every_runner_and_worker_count_gives_the_same_numbers(tmp_path, algorithm):
    """Issue 38: by default (``engine.workers: auto``, one torch thread in this process and in
    each worker) a seed gives the same metrics bit for bit in this process and with 2 or 3
    worker processes, for a FedAvg-like, a stateful personalized and a server-trained method."""
    from conftest import tiny_config
    from pflkit.experiment import validate

    raw = tiny_config(algorithm={"name": algorithm}, train={"rounds": 3, "client_fraction": 0.75})
    del raw["engine"], raw["threads"]  # the defaults
    default = validate(raw)
    assert default.threads == 1 and default.engine.workers == "auto"
    base = strip_timing(run_experiment(default, out=tmp_path / "default").rows)
    for n in (1, 2, 3):
        cfg = validate({**raw, "engine": {"workers": n}})
        assert strip_timing(run_experiment(cfg, out=tmp_path / f"w{n}").rows) == base, n
