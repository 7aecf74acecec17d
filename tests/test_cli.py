"""The command line, run as a user would: real subprocesses, exit codes, output folders (the
checks of bad input call the same entry point in this process: conftest's ``cli``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from conftest import tiny_config


def pflkit(*args: str, cwd: Path, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pflkit.cli", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=300,
        env=os.environ | {"COLUMNS": "200"} | env,
    )


@pytest.fixture
def cfg_file(tmp_path):
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(tiny_config()))
    return path


def test_list_shows_every_registry(tmp_path):
    r = pflkit("list", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    for word in ("fedavg", "fedprox", "local", "fedavg_ft", "fashion_mnist", "dirichlet", "cnn4"):
        assert word in r.stdout


def test_run_writes_a_run_folder(cfg_file, tmp_path):
    r = pflkit("run", str(cfg_file), "--set", "train.rounds=2", "--out", "r1", "-q", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    summary = json.loads((tmp_path / "r1" / "summary.json").read_text())
    assert summary["rounds"] == 2 and summary["algorithm"] == "fedavg"


def test_compare_writes_table_and_plot(cfg_file, tmp_path):
    r = pflkit(
        "compare", str(cfg_file), "--algorithms", "local,fedavg", "--seeds", "0,1",
        "--set", "train.rounds=2", "--out", "cmp", "-q", cwd=tmp_path,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    table = (tmp_path / "cmp" / "results.md").read_text()
    assert "| local |" in table and "| fedavg |" in table and "±" in table
    assert (tmp_path / "cmp" / "accuracy.png").stat().st_size > 1000
    assert sorted(p.name for p in (tmp_path / "cmp").iterdir() if p.is_dir()) == [
        "fedavg-s0", "fedavg-s1", "local-s0", "local-s1",
    ]  # fmt: skip


def test_algorithms_option_selects_the_configs_entries_with_their_parameters():
    from pflkit.config_io import select_algorithms

    entries = [
        {"name": "fedrep", "head_epochs": 1},
        {"name": "gpfl", "label": "no_cov", "use_cov": False},
        {"name": "gpfl", "label": "no_gce", "use_gce": False},
        "fedavg",
    ]
    raw = {"compare": {"algorithms": entries}}
    got = select_algorithms(raw, "fedrep,gpfl,fedprox,{name: ditto, lam: 0.5}")
    assert got["compare"]["algorithms"] == [
        {"name": "fedrep", "head_epochs": 1},
        {"name": "gpfl", "label": "no_cov", "use_cov": False},
        {"name": "gpfl", "label": "no_gce", "use_gce": False},
        "fedprox",  # not among the config's entries: at its defaults
        {"name": "ditto", "lam": 0.5},
    ]
    assert select_algorithms(raw, "no_gce,fedavg")["compare"]["algorithms"] == [
        entries[2],
        "fedavg",
    ]
    assert select_algorithms({}, "local")["compare"]["algorithms"] == ["local"]
    assert raw["compare"]["algorithms"] == entries  # the caller's dict is not changed


def test_compare_algorithms_option_keeps_an_entrys_parameters(cfg_file, tmp_path):
    """`--algorithms fedprox` on a config whose compare.algorithms has {name: fedprox, mu: 0.5}
    runs mu 0.5 (pflkit <= 4f4cdb4 ran the bare name, mu at its default)."""
    raw = yaml.safe_load(cfg_file.read_text())
    raw["compare"] = {"algorithms": [{"name": "fedprox", "mu": 0.5}, "local"], "seeds": [0]}
    cfg_file.write_text(yaml.safe_dump(raw))
    r = pflkit(
        "compare", str(cfg_file), "--algorithms", "fedprox", "--set", "train.rounds=1",
        "--out", "cmp", "-q", cwd=tmp_path,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert [p.name for p in (tmp_path / "cmp").iterdir() if p.is_dir()] == ["fedprox(mu=0.5)-s0"]
    run = yaml.safe_load((tmp_path / "cmp" / "fedprox(mu=0.5)-s0" / "config.yaml").read_text())
    assert run["algorithm"]["mu"] == 0.5


def test_bad_algorithms_option_is_one_sentence(cli, cfg_file, tmp_path):
    r = cli("compare", str(cfg_file), "--algorithms", "{name: fedprox", cwd=tmp_path)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert "invalid --algorithms '{name: fedprox': give comma-separated names" in r.stderr
    assert not any(tmp_path.glob("runs*"))


def test_partition_prints_table_and_heatmap(cfg_file, tmp_path):
    r = pflkit("partition", str(cfg_file), "--out", "p.png", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "client" in r.stdout
    assert (tmp_path / "p.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    t = pflkit("partition", str(cfg_file), "--out", "t.png", "--train-only", cwd=tmp_path)
    assert t.returncode == 0, t.stderr
    assert (tmp_path / "t.png").stat().st_size > 1000


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("algorithm.name=fedavgg", "unknown algorithm 'fedavgg': did you mean 'fedavg'"),
        (
            "data.dataset=fashion_mnits",
            "unknown dataset 'fashion_mnits': did you mean 'fashion_mnist'",
        ),
        ("model.name=cnn5", "unknown model 'cnn5'"),
        ("data.partition={name: dirichlet, alpha: 0}", "alpha"),
        ("data.partition={name: diriclet, alpha: 1}", "did you mean 'dirichlet'"),
        ("data.partition={name: pathological, classes_per_client: 11}", "11"),
        ("train.client_fraction=1.5", "train.client_fraction"),
        ("train.client_fraction=0", "train.client_fraction"),
        ("data.num_clients=5000", "5000"),
        ("train.lr=-1", "train.lr"),
        ("trian.rounds=3", "unknown config key 'trian'"),
        ("algorithm.mu=1", "has no parameter 'mu'"),
        ("device=gpu", "unknown device 'gpu': use auto, cpu, cuda or cuda:N"),
        ("device=mps", "unknown device 'mps'"),
        ("device=meta", "unknown device 'meta'"),
        ("device=cuda:7", "device 'cuda:7' is not available"),
        ("plugins=my_module", "plugins must be a list of module names"),
        ("train.weighting=mean", "train.weighting"),
        ("seed=-1", "'seed' (got -1): Input should be greater than or equal to 0"),
        ("data.seed=4294967296", "data.seed"),
        ("algorithm.name=[a, b]", "'name' must be a name (a string)"),
        ("data.partition={name: {x: 1}}", "'name' must be a name (a string)"),
        ("threads=100000", "'threads' (got 100000): Input should be less than or equal to 512"),
        ("train.lr=1e308", "must be below 1e30"),
        ("train.lr=.inf", "Input should be a finite number"),
        ("train.rounds=true", "'train.rounds' (got True): must be a number"),
        ("algorithm={name: fedprox, mu: .nan}", "'fedprox.mu' (got nan)"),
        ("compare.algorithms=[]", "compare.algorithms"),
    ],
)
def test_bad_input_is_one_sentence_and_exit_2(cli, cfg_file, tmp_path, override, message):
    r = cli("run", str(cfg_file), "--set", override, "--out", "bad", cwd=tmp_path)
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert message in r.stderr
    assert "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "bad").exists()  # no half-written run folder


def test_unreadable_and_invalid_config_files(cli, tmp_path):
    r = cli("run", "missing.yaml", cwd=tmp_path)
    assert r.returncode == 2 and "cannot read config file 'missing.yaml'" in r.stderr
    (tmp_path / "broken.yaml").write_text("data: [unclosed\n")
    r = cli("run", "broken.yaml", cwd=tmp_path)
    assert r.returncode == 2 and "not valid YAML" in r.stderr
    (tmp_path / "list.yaml").write_text("- a\n- b\n")
    r = cli("run", "list.yaml", cwd=tmp_path)
    assert r.returncode == 2 and "must be a mapping" in r.stderr
    (tmp_path / "dup.yaml").write_text("train:\n  rounds: 1\n  rounds: 2\n")
    r = cli("run", "dup.yaml", cwd=tmp_path)
    assert r.returncode == 2 and "line 3: key 'rounds' appears twice" in r.stderr
    (tmp_path / "latin1.yaml").write_bytes("name: caf\xe9\n".encode("latin-1"))
    r = cli("run", "latin1.yaml", cwd=tmp_path)
    assert r.returncode == 2 and "is not UTF-8 text" in r.stderr and "Traceback" not in r.stderr
    for text in ("", "# only a comment\n"):  # runs nothing: an empty file is not every default
        (tmp_path / "empty.yaml").write_text(text)
        r = cli("run", "empty.yaml", "--out", "e", cwd=tmp_path)
        assert r.returncode == 2 and "config file 'empty.yaml' is empty" in r.stderr
        assert "'{}' for every default" in r.stderr and not (tmp_path / "e").exists()


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        ("emptied", "the run config 'r/config.yaml' is empty (no settings, or only comments): "
         "it is damaged"),
        ("lr", "the checkpoint 'r/checkpoints/latest.pt' belongs to another configuration"),
    ],
)  # fmt: skip
def test_a_refused_resume_changes_nothing_in_the_folder(cli, tmp_path, edit, message):
    """A config.yaml emptied, or edited by hand so that the checkpoint refuses it: one
    sentence, and every file as it was. Before, the emptied file read as every default, and a
    resume wrote its config (with the --set) over config.yaml before the checkpoint refused."""
    raw = tiny_config(train={"rounds": 2}, output={"checkpoint_every": 1})
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(raw))
    assert cli("run", "c.yaml", "--out", "r", cwd=tmp_path).returncode == 0
    config = tmp_path / "r" / "config.yaml"
    config.write_text(
        "" if edit == "emptied" else config.read_text().replace("lr: 0.05", "lr: 0.07")
    )
    before = {p.name: p.read_bytes() for p in (tmp_path / "r").iterdir() if p.is_file()}
    r = cli("run", "--resume", "r", "--set", "train.rounds=3", cwd=tmp_path)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert message in r.stderr
    assert {p.name: p.read_bytes() for p in (tmp_path / "r").iterdir() if p.is_file()} == before


def test_yaml_reads_1e_minus_1_as_a_number(tmp_path):
    from pflkit.experiment import load_config

    (tmp_path / "c.yaml").write_text("data:\n  partition: {name: dirichlet, alpha: 1e-1}\n")
    assert load_config(tmp_path / "c.yaml").data.partition["alpha"] == 0.1


def test_missing_dataset_without_network_says_where_to_put_files(cli, cfg_file, tmp_path):
    r = cli(
        "run", str(cfg_file), "--set", "data.dataset=cifar10", "--set", f"data.root={tmp_path / 'empty'}",
        "--out", "bad", cwd=tmp_path, PFLKIT_MIRROR="http://127.0.0.1:9",  # a closed port
    )  # fmt: skip
    assert r.returncode == 2, r.stderr
    assert str(tmp_path / "empty") in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "bad").exists()


def test_existing_run_folder_is_not_overwritten(cli, cfg_file, tmp_path):
    (tmp_path / "r").mkdir()
    (tmp_path / "r" / "keep.txt").write_text("x")
    r = cli("run", str(cfg_file), "--out", "r", cwd=tmp_path)
    assert r.returncode == 2 and "already exists" in r.stderr


# -- typed parameters and the process pool, as a user meets them ------------------------------------


def test_config_yaml_records_every_algorithm_default_and_list_params_shows_them(cfg_file, tmp_path):
    r = pflkit(
        "run", str(cfg_file), "--set", "algorithm.name=map", "--out", "r", "-q", cwd=tmp_path
    )
    assert r.returncode == 0, r.stderr
    algo = yaml.safe_load((tmp_path / "r" / "config.yaml").read_text())["algorithm"]
    assert algo["name"] == "map" and algo["alpha"] == 0.9 and algo["stage_b_fraction"] is None
    assert algo["weighting"] == "uniform" and algo["kd_form"] == "paper" and len(algo) == 16
    assert algo["mmd_form"] == "multi_kernel" and algo["hpm_init"] == "trained"
    r = pflkit("list", "--params", "scamap", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "stage_b_fraction" in r.stdout and "authors' code" in r.stdout and "0.2" in r.stdout
    # scamap: SCAFFOLD's two deltas summed only under uniform weighting; RS is not DP-SGD
    assert "--secagg: sums delta_y, delta_c (weighting: uniform)" in r.stdout
    assert "DP-SGD: refused, its restricted softmax" in r.stdout
    r = pflkit("list", "--params", "fedfomo", cwd=tmp_path)
    assert "--secagg: refused, its server sends each client" in r.stdout
    r = pflkit("list", "--params", "scamapp", cwd=tmp_path)
    assert r.returncode == 2 and r.stderr.strip() == (
        "error: unknown algorithm 'scamapp': did you mean 'scamap'? (`pflkit list` shows all)"
    )


def test_a_user_error_inside_a_worker_is_one_sentence_and_exit_2(tmp_path):
    raw = tiny_config(engine={"workers": 2}, train={"lr": 1e10})  # the loss is NaN in round 1
    path = tmp_path / "nan.yaml"
    path.write_text(yaml.safe_dump(raw))
    r = pflkit("run", str(path), "--out", "r", "-q", cwd=tmp_path)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in r.stderr
    assert "in round 1: local training diverged; lower train.lr" in lines[0]


def test_bad_engine_settings_are_one_sentence(cli, cfg_file, tmp_path):
    r = cli("run", str(cfg_file), "--set", "engine.workers=0", "--out", "r", cwd=tmp_path)
    assert r.returncode == 2 and "engine.workers" in r.stderr and "positive number" in r.stderr
    assert not (tmp_path / "r").exists()
    r = cli("run", str(cfg_file), "--set", "engine.workers=2", "--set", "device=cuda:0",
            "--out", "r", cwd=tmp_path)  # fmt: skip
    # no accelerator here: the device itself is refused first
    assert r.returncode == 2 and "device 'cuda:0' is not available" in r.stderr
    assert not (tmp_path / "r").exists()


def run_and_signal(config: Path, out: Path, sig: int) -> tuple[int, str]:
    """``pflkit run CONFIG --out OUT``, sent ``sig`` once two rounds are written; its exit
    code and stderr."""
    import time

    proc = subprocess.Popen(
        [sys.executable, "-m", "pflkit.cli", "run", str(config), "--out", str(out), "-q"],
        cwd=config.parent, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    metrics = out / "metrics.jsonl"
    deadline = time.monotonic() + 120
    while not (metrics.exists() and metrics.read_text().count("\n") >= 2):
        assert time.monotonic() < deadline and proc.poll() is None
        time.sleep(0.05)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=60)
    return proc.returncode, err


def test_ctrl_c_stops_every_worker_and_leaves_a_resumable_run(tmp_path):
    import signal

    raw = tiny_config(engine={"workers": 2}, train={"rounds": 500})
    path = tmp_path / "long.yaml"
    path.write_text(yaml.safe_dump(raw))
    out = tmp_path / "ctrl-c-run"
    code, err = run_and_signal(path, out, signal.SIGINT)
    assert code == 130, err
    assert "SIGINT received: stopped after round" in err and "--resume" in err
    assert "Traceback" not in err
    # no worker outlives the run (forked workers share the parent's command line)
    left = subprocess.run(["pgrep", "-f", str(out)], capture_output=True, text=True)
    assert left.stdout.strip() == ""
    assert (out / "checkpoints" / "latest.pt").exists()


def _table_numbers(folder: Path) -> dict:
    """results.json without the timing column (the only field that differs between runs)."""
    res = json.loads((folder / "results.json").read_text())
    return {k: {f: v for f, v in r.items() if f != "seconds_per_round"} for k, r in res.items()}


def test_a_killed_compare_continues_to_the_same_table(cfg_file, tmp_path):
    import signal
    import time

    args = ["--algorithms", "local,fedavg", "--seeds", "0,1", "-q"]
    sets = ["--set", "train.rounds=8", "--set", "output.checkpoint_every=1"]
    whole = pflkit("compare", str(cfg_file), *args, *sets, "--out", "whole", cwd=tmp_path)
    assert whole.returncode == 0, whole.stderr
    cmd = [sys.executable, "-m", "pflkit.cli", "compare", str(cfg_file), *args, *sets]
    proc = subprocess.Popen([*cmd, "--out", "cut"], cwd=tmp_path, stderr=subprocess.DEVNULL)
    ckpt = tmp_path / "cut" / "local-s1" / "checkpoints" / "latest.pt"
    deadline = time.time() + 120
    while not ckpt.exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)  # mid-way through the second run
    proc.wait()
    assert not (tmp_path / "cut" / "local-s1" / "summary.json").exists()
    assert not (tmp_path / "cut" / "results.json").exists()
    again = pflkit("compare", str(cfg_file), *args, *sets, "--out", "cut", cwd=tmp_path)
    assert again.returncode == 0, again.stderr
    assert _table_numbers(tmp_path / "cut") == _table_numbers(tmp_path / "whole")
    # a finished compare is not rerun: its run folders are left as they are
    stamp = (tmp_path / "cut" / "local-s0" / "metrics.jsonl").stat().st_mtime_ns
    assert (
        pflkit("compare", str(cfg_file), *args, *sets, "--out", "cut", cwd=tmp_path).returncode == 0
    )
    assert (tmp_path / "cut" / "local-s0" / "metrics.jsonl").stat().st_mtime_ns == stamp
    # another config into the same folder is refused in one sentence
    other = pflkit(
        "compare", str(cfg_file), *args, "--set", "train.lr=0.5", "--out", "cut", cwd=tmp_path
    )
    assert other.returncode == 2 and "holds a compare of another config" in other.stderr
    assert "Traceback" not in other.stderr


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGINT"])
def test_a_signalled_parallel_compare_stops_its_workers_and_continues(sig, tmp_path):
    """A signal to the compare process alone (a cluster's SIGTERM, `kill -INT`) reaches its
    job workers: each stops at its round's end with a checkpoint, no worker outlives the
    compare, and the same command continues from there."""
    import signal
    import time

    path = tmp_path / "long.yaml"
    path.write_text(yaml.safe_dump(tiny_config(train={"rounds": 400}, eval={"every": 50})))
    cmd = [sys.executable, "-m", "pflkit.cli", "compare", str(path), "--algorithms",
           "local,fedavg", "--seeds", "0", "--jobs", "2", "-q", "--out", "cut"]  # fmt: skip
    proc = subprocess.Popen(cmd, cwd=tmp_path, stderr=subprocess.PIPE, text=True)
    rows = [tmp_path / "cut" / f"{a}-s0" / "metrics.jsonl" for a in ("local", "fedavg")]
    pids: list[int] = []

    def alive() -> list[int]:
        return [p for p in [proc.pid, *pids] if Path(f"/proc/{p}/cmdline").exists()]

    try:
        deadline = time.monotonic() + 120
        while not all(r.exists() and r.read_text().count("\n") >= 2 for r in rows):
            assert time.monotonic() < deadline and proc.poll() is None
            time.sleep(0.05)
        found = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True)
        pids = [int(p) for p in found.stdout.split()]
        assert len(pids) >= 2
        proc.send_signal(getattr(signal, sig))
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == (143 if sig == "SIGTERM" else 130), err
        assert "run the same command with --out cut to continue" in err and "Traceback" not in err
        deadline = time.monotonic() + 10  # the resource tracker exits once its pipe closes
        while alive():
            assert time.monotonic() < deadline, "a job worker outlived the compare"
            time.sleep(0.1)
    finally:  # a failed check leaves no process behind
        for pid in alive():
            os.kill(pid, signal.SIGKILL)
    for r in rows:
        assert (r.parent / "checkpoints" / "latest.pt").exists()
        assert not (r.parent / "summary.json").exists() and not (r.parent / ".lock").exists()
    if sig == "SIGTERM":  # the same command finishes the runs from their checkpoints
        again = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True)
        assert again.returncode == 0, again.stderr
        assert json.loads((rows[0].parent / "summary.json").read_text())["rounds"] == 400


@pytest.mark.parametrize("jobs", ["1", "2"])
def test_keep_going_finishes_the_other_runs_and_names_the_failed_one(cfg_file, tmp_path, jobs):
    """pFedMe first, with a personal lr that makes its loss NaN in round 1: by default the
    failure stops the compare (FedAvg, queued behind it, never runs with one job); with
    --keep-going FedAvg finishes and one sentence at the end names the failed run."""
    args = ["--algorithms", "{name: pfedme, personal_lr: 1e10},fedavg", "--seeds", "0", "-q"]
    args += ["--jobs", jobs]
    r = pflkit("compare", str(cfg_file), *args, "--keep-going", "--out", "k", cwd=tmp_path)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("error: 1 of 2 runs failed, every other run finished (pfedme(")
    assert "-s0: client" in last and "local training diverged" in last
    assert (tmp_path / "k" / "fedavg-s0" / "summary.json").exists()
    assert not (tmp_path / "k" / "results.md").exists()
    if jobs == "1":
        r = pflkit("compare", str(cfg_file), *args, "--out", "stop", cwd=tmp_path)
        assert r.returncode == 2 and "local training diverged" in r.stderr, r.stderr
        assert "runs failed" not in r.stderr
        assert not (tmp_path / "stop" / "fedavg-s0").exists()


def test_keep_going_still_stops_at_a_signal(monkeypatch, tmp_path):
    """A signalled run (RunInterrupted, itself a PflkitError) is not a failure to go past: the
    one-job compare stops there and the next run never starts."""
    from pflkit.engine import compare
    from pflkit.errors import RunInterrupted
    from pflkit.experiment import validate

    started = []

    def run_one(cfg, folder, data, progress):
        started.append(folder.name)
        raise RunInterrupted("stopped", "SIGTERM")

    monkeypatch.setattr(compare, "_run_one", run_one)
    monkeypatch.setattr(compare, "build_federated", lambda data: None)
    cfg = validate(tiny_config())
    tasks = [(cfg, tmp_path / "a-s0"), (cfg, tmp_path / "b-s0")]
    with pytest.raises(RunInterrupted):
        compare._run_all(tasks, 1, False, keep_going=True)
    assert started == ["a-s0"]


def test_compare_jobs_gives_the_one_job_numbers(cfg_file, tmp_path):
    args = ["--algorithms", "local,fedavg,fedprox", "--seeds", "0", "-q"]
    one = pflkit("compare", str(cfg_file), *args, "--out", "one", cwd=tmp_path)
    two = pflkit("compare", str(cfg_file), *args, "--jobs", "2", "--out", "two", cwd=tmp_path)
    assert one.returncode == 0 and two.returncode == 0, two.stderr
    assert _table_numbers(tmp_path / "two") == _table_numbers(tmp_path / "one")
    bad = pflkit("compare", str(cfg_file), *args, "--jobs", "0", "--out", "bad", cwd=tmp_path)
    assert bad.returncode == 2 and "jobs must be at least 1" in bad.stderr
    assert not (tmp_path / "bad").exists()


def test_sigterm_stops_at_the_round_end_and_the_resumed_run_equals_an_uninterrupted_one(tmp_path):
    import signal

    raw = tiny_config(train={"rounds": 100}, eval={"every": 10})
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(raw))
    whole = pflkit("run", str(path), "--out", "whole", "-q", cwd=tmp_path)
    assert whole.returncode == 0, whole.stderr
    out = tmp_path / "cut"
    code, err = run_and_signal(path, out, signal.SIGTERM)  # a cluster's time limit
    assert code == 143, err
    assert "SIGTERM received: stopped after round" in err and "Traceback" not in err
    again = pflkit("run", "--resume", str(out), "-q", cwd=tmp_path)
    assert again.returncode == 0, again.stderr

    def rows(folder):
        text = (tmp_path / folder / "metrics.jsonl").read_text().splitlines()
        return [
            {k: v for k, v in json.loads(r).items() if not k.startswith("seconds")} for r in text
        ]

    assert rows("cut") == rows("whole")
    provenance = json.loads((out / "provenance.json").read_text())
    assert len(provenance) == 2  # the first process and the resuming one
    assert provenance[1]["command"][1:3] == ["run", "--resume"]
    assert {"pflkit", "torch", "python", "numpy"} <= set(provenance[0]["versions"])


def test_a_run_stopped_before_its_first_checkpoint_leaves_nothing(tiny, tmp_path, monkeypatch):
    from pflkit.engine import Simulation, run_experiment
    from pflkit.errors import RunInterrupted

    def ctrl_c_twice(self, rnd):
        raise KeyboardInterrupt

    monkeypatch.setattr(Simulation, "run_round", ctrl_c_twice)
    with pytest.raises(RunInterrupted, match="nothing was kept"):
        run_experiment(tiny(), out=tmp_path / "r")
    assert not (tmp_path / "r").exists()


def test_version_and_run_without_a_config(tmp_path):
    from pflkit import __version__

    v = pflkit("--version", cwd=tmp_path)
    assert v.returncode == 0 and v.stdout.strip() == f"pflkit {__version__}"
    r = pflkit("run", cwd=tmp_path)
    assert r.returncode == 2 and "needs a CONFIG file" in r.stderr
    assert "Usage" in r.stdout and not list(tmp_path.iterdir())
    h = pflkit("--help", cwd=tmp_path)
    assert "pflkit[flower]" in h.stdout


def test_a_run_without_a_terminal_logs_every_round_and_feeds_the_trackers(tmp_path):
    raw = tiny_config(
        train={"rounds": 3}, output={"progress": True, "trackers": ["tensorboard", "wandb"]}
    )
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(raw))
    r = pflkit("run", str(path), "--out", "r", cwd=tmp_path, WANDB_SILENT="true")
    assert r.returncode == 0, r.stderr
    for rnd in (1, 2, 3):  # stdout is a pipe here: one plain line per round
        assert f"round {rnd}/3  train_loss" in r.stdout
    log = (tmp_path / "r" / "run.log").read_text()
    assert "round 3/3" in log and "started" in log and "finished after round 3" in log
    rows = [json.loads(x) for x in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    import csv

    with (tmp_path / "r" / "metrics.csv").open() as f:
        long = {(int(a), b): float(c) for a, b, c in list(csv.reader(f))[1:]}
    assert long[(3, "global_acc")] == rows[2]["global_acc"]
    assert long[(1, "train_loss")] == rows[0]["train_loss"]
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tmp_path / "r" / "tensorboard"))
    acc.Reload()
    events = acc.Scalars("pers_acc_mean")
    assert [e.step for e in events] == [1, 2, 3]
    assert events[-1].value == pytest.approx(rows[2]["pers_acc_mean"])
    # W&B offline: the run's record file holds the logged keys and values (protobuf records
    # with JSON-encoded values; `wandb sync` uploads it)
    record = next((tmp_path / "r" / "wandb").glob("offline-run-*/run-*.wandb")).read_bytes()
    assert b"pers_acc_mean" in record and json.dumps(rows[2]["global_acc"]).encode() in record


def test_a_tracker_without_its_package_is_refused_before_anything_is_written(
    tiny, tmp_path, monkeypatch
):
    import importlib.util

    from pflkit.engine import run_experiment
    from pflkit.errors import PflkitError

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a)
    )
    with pytest.raises(PflkitError, match="'wandb' package is not installed: pip install wandb"):
        run_experiment(tiny(output={"trackers": ["wandb"]}), out=tmp_path / "r")
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["run", "CFG", "--out", "afile"], "'afile' is a file, not a folder"),
        (
            ["run", "CFG", "--out", "/proc/pflkit-x"],
            "cannot create the run folder '/proc/pflkit-x'",
        ),
        (["run", "CFG", "--out", "x" * 300], "is not a usable folder path (File name too long)"),
        (["compare", "CFG", "--out", "afile"], "'afile' already exists and is not an empty folder"),
        (["partition", "CFG", "--out", "adir"], "--out 'adir' is a folder: give a file name"),
        (
            ["flower", "certs", "/proc/pflkit-certs"],
            "cannot create the folder '/proc/pflkit-certs'",
        ),
        (["flower", "node-key", "afile"], "cannot create the folder 'afile'"),
        (["flower", "local", "CFG", "--node-wait", "nan"], "--node-wait nan is not a number"),
    ],
)
def test_bad_paths_and_waits_are_one_sentence(cli, cfg_file, tmp_path, args, message):
    (tmp_path / "afile").write_text("")
    (tmp_path / "adir").mkdir()
    before = sorted(p.name for p in tmp_path.iterdir())
    r = cli(*[str(cfg_file) if a == "CFG" else a for a in args], cwd=tmp_path)
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert message in r.stderr and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # nothing left behind


def test_a_continued_run_takes_the_compares_engine_not_its_stored_one(monkeypatch, tmp_path):
    """A run started with two client worker processes (one job) and continued by a compare at
    --jobs 2 (one worker a run) gets one worker: the stored engine.workers would put three busy
    processes on two cores. Nothing else stored changes."""
    from pflkit.engine import compare, runner
    from pflkit.experiment import validate

    folder = tmp_path / "fedavg-s0"
    folder.mkdir()
    stored = tiny_config(engine={"workers": 2}, train={"lr": 0.03})
    (folder / "config.yaml").write_text(yaml.safe_dump(stored))
    seen = []
    monkeypatch.setattr(
        compare,
        "run_experiment",
        lambda resume, data, progress, overrides=None, **_: seen.append(
            runner.resume_config(resume, overrides or [])
        ),
    )
    solo = validate(tiny_config(engine={"workers": 1, "threads_per_worker": 2}))
    compare._run_one(solo, folder, None, False)
    assert seen[0].engine.workers == 1 and seen[0].engine.threads_per_worker == 2
    assert seen[0].train.lr == 0.03
