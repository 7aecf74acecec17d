"""Issue 40, bad input: every mistake below was a traceback, a silent exit code, a silently
accepted value or a half-written folder; each is now one sentence on stderr with exit code 2
(130 for Ctrl-C), naming the value and the fix, with nothing left behind. Through the console
script's entry point in this process (conftest's ``cli``)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml

from conftest import tiny_config
from pflkit.errors import PflkitError
from pflkit.experiment import validate


def listing(folder: Path) -> dict[str, bytes]:
    """Every file under ``folder`` with its bytes (a folder as b'/')."""
    return {
        str(p.relative_to(folder)): b"/" if p.is_dir() else p.read_bytes()
        for p in sorted(folder.rglob("*"))
    }


def one_sentence(r, message: str, code: int = 2) -> None:
    assert r.returncode == code, (r.returncode, r.stdout, r.stderr)
    assert message in r.stderr, r.stderr
    assert "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr


@pytest.fixture
def cfg_file(tmp_path):
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(tiny_config()))
    return path


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """A finished 3-round run without checkpoints, and one with a checkpoint every round."""
    from pflkit.engine import run_experiment

    base = tmp_path_factory.mktemp("runs")
    run_experiment(validate(tiny_config()), out=base / "plain")
    run_experiment(validate(tiny_config(output={"checkpoint_every": 1})), out=base / "ckpt")
    return base


def copy_run(finished: Path, name: str, to: Path) -> Path:
    return Path(shutil.copytree(finished / name, to / name))


# -- 1. report of damaged files ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("file", "text", "message"),
    [
        ("plan.json", "{bad", "the compare plan 'cmp/plan.json' is not valid JSON"),
        ("plan.json", '{"options": {}}', "the compare plan 'cmp/plan.json' has no list of 'settings'"),
        ("plan.json", "[1]", "'cmp/plan.json' holds a JSON list, not an object"),
        ("plan.json", '{"settings": [{"label": "a"}]}', "a setting without a 'label' and a list"),
        ("plan.json", '{"settings": [{"label": "a", "folders": ["a-s0"]}], "options": 3}', "'options'"),
        ("a-s0/summary.json", "{bad", "the run summary 'cmp/a-s0/summary.json' is not valid JSON"),
        ("a-s0/summary.json", "[]", "'cmp/a-s0/summary.json' holds a JSON list"),
        ("a-s0/summary.json", "{}", "'cmp/a-s0/summary.json' lacks 'comm'"),
        ("a-s0/config.yaml", "a: [", "the run config 'cmp/a-s0/config.yaml' is not valid YAML"),
        ("a-s0/config.yaml", "- 1\n", "'cmp/a-s0/config.yaml' is not a mapping"),
        ("a-s0/config.yaml", "", "the run config 'cmp/a-s0/config.yaml' is empty (no settings, or only comments): it is damaged"),
    ],
)  # fmt: skip
def test_report_of_a_damaged_file_is_one_sentence(cli, finished, tmp_path, file, text, message):
    cmp = tmp_path / "cmp"
    copy_run(finished, "plain", cmp).rename(cmp / "a-s0")
    plan = {"settings": [{"label": "a", "folders": ["a-s0"]}], "options": {}}
    (cmp / "plan.json").write_text(json.dumps(plan))
    assert cli("report", "cmp", cwd=tmp_path).returncode == 0  # intact, it reports
    (cmp / file).write_text(text)
    r = cli("report", "cmp", "--out", "rep", cwd=tmp_path)
    one_sentence(r, message)
    assert not (tmp_path / "rep").exists()


# -- 2. plugin modules that fail to import -------------------------------------------------------


@pytest.mark.parametrize(
    ("source", "message"),
    [
        ("def f(:\n", "has a syntax error (MOD.py, line 1: invalid syntax): fix it"),
        ("import pflkit_no_such_dependency\n", "imports 'pflkit_no_such_dependency', which is not installed"),
        ("raise RuntimeError('boom')\n", "failed while being imported (RuntimeError: boom)"),
        ("exit(3)\n", "called exit(3) while being imported"),
        ("import sys\nsys.exit('bye')\n", "called exit('bye') while being imported"),
    ],
)  # fmt: skip
def test_a_failing_plugin_module_is_one_sentence(
    cli, cfg_file, tmp_path, monkeypatch, source, message
):
    name = f"plugin40_{abs(hash(source))}"
    (tmp_path / f"{name}.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    r = cli("run", str(cfg_file), "--import", name, "--out", "r", cwd=tmp_path)
    one_sentence(r, f"plugin module '{name}' " + message.replace("MOD", name))
    assert not (tmp_path / "r").exists()


# -- 3, 4, 9. output paths, names and seconds ----------------------------------------------------


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["partition", "CFG", "--out", "/proc/x.png"], "cannot write the heatmap '/proc/x.png'"),
        (["partition", "CFG", "--out", "/proc/nope/x.png"], "cannot write the heatmap '/proc/nope/x.png'"),
        (["partition", "CFG", "--out", "x.xyz"], "--out 'x.xyz' does not end in .png"),
        (["partition", "CFG", "--out", "afile/x.png"], "lies under"),
        (["analyze", "similarity", "CFG", "--out", "/proc/simx"], "cannot write the output folder '/proc/simx'"),
        (["analyze", "similarity", "CFG", "--out", "afile"], "--out 'afile' is a file, not a folder"),
        (["analyze", "similarity", "CFG", "--out", "arun"], "--out 'arun' already holds other files (config.yaml"),
        (["flower", "local", "CFG", "--workdir", "afile"], "--workdir 'afile' is a file, not a folder"),
        (["flower", "local", "CFG", "--workdir", "/proc/wd"], "cannot write the Flower work folder '/proc/wd'"),
        (["flower", "local", "CFG", "--timeout", "nan"], "--timeout nan is not a number of seconds"),
        (["flower", "local", "CFG", "--timeout", "0"], "--timeout 0.0 is not a number of seconds"),
        (["flower", "certs", "certs", "--host", ""], "--host '' is not a host name or an IP address"),
        (["flower", "certs", "certs", "--host", "localhost", "--host", "a b"], "--host 'a b' is not"),
        (["flower", "node-key", "keys", "../../name40"], "key name '../../name40' is not a plain file name"),
        (["flower", "node-key", "keys", ".."], "key name '..' is not a plain file name"),
    ],
)  # fmt: skip
def test_bad_output_paths_names_and_seconds(cli, cfg_file, finished, tmp_path, args, message):
    (tmp_path / "afile").write_text("")
    copy_run(finished, "plain", tmp_path).rename(tmp_path / "arun")
    before = listing(tmp_path)
    r = cli(*[str(cfg_file) if a == "CFG" else a for a in args], cwd=tmp_path)
    one_sentence(r, message)
    assert listing(tmp_path) == before  # nothing written, the run folder untouched
    assert not list(tmp_path.parent.glob("name40*"))  # keys/../../name40: outside it


def test_a_png_heatmap_and_a_rerun_similarity_study_still_work(cli, cfg_file, tmp_path):
    r = cli("partition", str(cfg_file), "--out", "sub/p.PNG", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "sub" / "p.PNG").read_bytes()[:4] == b"\x89PNG"
    for _ in range(2):  # a folder holding only an earlier study is written over
        r = cli("analyze", "similarity", str(cfg_file), "--out", "sim", "--steps", "1",
                cwd=tmp_path)  # fmt: skip
        assert r.returncode == 0, r.stderr
    assert sorted(p.name for p in (tmp_path / "sim").iterdir()) == [
        "similarity.json", "similarity.md", "similarity.png",
    ]  # fmt: skip


# -- 5, 7. data folders, cache, subset -----------------------------------------------------------


def test_data_folders_that_are_files_and_a_subset_above_the_data(cli, cfg_file, tmp_path):
    (tmp_path / "afile").write_text("")
    r = cli("run", str(cfg_file), "--set", "data.root=afile", "--out", "r", cwd=tmp_path)
    one_sentence(r, "data.root 'afile' is a file, not a folder")
    r = cli("run", str(cfg_file), "--set", "data.subset=100000", "--out", "r", cwd=tmp_path)
    one_sentence(r, "data.subset 100000 exceeds the 1797 training samples of 'digits'")
    r = cli("run", str(cfg_file), "--out", "r", cwd=tmp_path, PFLKIT_DATA=str(tmp_path / "afile"))
    one_sentence(r, f"$PFLKIT_DATA '{tmp_path / 'afile'}' is a file, not a folder")
    assert not (tmp_path / "r").exists()


def test_a_truncated_partition_cache_is_rebuilt_the_same(tmp_path):
    from pflkit.data.federated import build_federated

    cfg = validate(tiny_config(data={"root": str(tmp_path / "data")}))
    first = build_federated(cfg.data)
    (entry,) = (tmp_path / "data" / "partitions").glob("*.npz")
    whole = entry.read_bytes()
    entry.write_bytes(whole[:100])  # a write cut short
    again = build_federated(cfg.data)
    assert entry.read_bytes() == whole  # rebuilt and written over
    for a, b in zip(first.train_indices + first.test_indices,
                    again.train_indices + again.test_indices, strict=True):  # fmt: skip
        assert (a == b).all()


def test_a_tampered_partition_cache_is_refused_and_one_without_a_checksum_rebuilt(tmp_path):
    import numpy as np

    from pflkit.data.federated import build_federated

    cfg = validate(tiny_config(data={"root": str(tmp_path / "data")}))
    first = build_federated(cfg.data)
    (entry,) = (tmp_path / "data" / "partitions").glob("*.npz")
    whole = entry.read_bytes()
    with np.load(entry) as z:
        arrays = {k: z[k] for k in z.files}
    # well-formed, in range, no sample twice: only the checksum tells (clients 0, 1 swap parts)
    arrays["tr0"], arrays["tr1"] = arrays["tr1"], arrays["tr0"]
    np.savez(entry, **arrays)
    with pytest.raises(PflkitError, match=r"partition cache '.*\.npz' fails its checksum"):
        build_federated(cfg.data)
    del arrays["sha256"]  # a cache written before checksums
    np.savez(entry, **arrays)
    again = build_federated(cfg.data)
    assert entry.read_bytes() == whole  # rebuilt and written over
    pairs = zip(first.train_indices, again.train_indices, strict=True)
    assert all((a == b).all() for a, b in pairs)


# -- 6, 7. bounds ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("override", "field", "bound"),
    [
        ("train.rounds=100000000000000000000000", "train.rounds", "1000000"),
        ("train.batch_size=1000000000", "train.batch_size", "1000000"),
        ("eval.batch_size=1000000000000", "eval.batch_size", "1000000"),
        ("train.local_epochs=1000000000000", "train.local_epochs", "10000"),
        ("eval.finetune_epochs=1000000000000", "eval.finetune_epochs", "10000"),
        ("eval.every=100000000000000000000", "eval.every", "1000000"),
        ("eval.last=100000000000000000000", "eval.last", "1000000"),
        ("output.checkpoint_every=10000000", "output.checkpoint_every", "1000000"),
        ("train.lr_step_rounds=10000000", "train.lr_step_rounds", "1000000"),
        ("model.per_client=[{name: mlp, count: 1000000000000}]", "model.per_client.0.count", "1000000"),
    ],
)  # fmt: skip
def test_counts_have_upper_bounds(override, field, bound):
    from pflkit.config_io import apply_overrides

    with pytest.raises(PflkitError) as err:
        validate(apply_overrides(tiny_config(), [override]))
    assert f"invalid config value '{field}'" in str(err.value)
    assert f"less than or equal to {bound}" in str(err.value)


@pytest.mark.parametrize(
    "override",
    ["model.per_client=[{name: mlp, count: 1000000000000}]", "train.batch_size=1000000000"],
)
def test_a_huge_count_on_the_command_line_is_one_sentence(cli, cfg_file, tmp_path, override):
    r = cli("run", str(cfg_file), "--set", override, "--out", "r", cwd=tmp_path)
    one_sentence(r, "Input should be less than or equal to 1000000")
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize(
    ("override", "field"),
    [("engine.vectorize=maybe", "engine.vectorize"), ("engine.workers=many", "engine.workers"),
     ("eval.clients=x", "eval.clients")],
)  # fmt: skip
def test_a_value_that_fits_no_member_of_a_union_names_each_member(override, field):
    """``bool | 'auto'`` and ``int | 'auto'``: the sentence says both kinds of value that fit,
    not only the first member's."""
    from pflkit.config_io import apply_overrides

    with pytest.raises(PflkitError) as err:
        validate(apply_overrides(tiny_config(), [override]))
    said = str(err.value)
    assert said.startswith(f"invalid config value '{field}' (got ")
    first, second = said.split("; or ")
    assert "should be a valid" in first
    assert second in ("Input should be 'auto'", "Input should be 'all'")


# -- 8. resuming a finished run ------------------------------------------------------------------


def test_resuming_a_finished_run_without_a_checkpoint_says_it_is_finished(cli, finished, tmp_path):
    run = copy_run(finished, "plain", tmp_path)
    before = listing(run)
    r = cli("run", "--resume", "plain", "-q", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "has finished its 3 rounds: nothing to resume" in r.stdout and not r.stderr
    r = cli("run", "--resume", "plain", "--set", "train.rounds=5", cwd=tmp_path)
    one_sentence(r, "finished its 3 rounds without a checkpoint")
    r = cli("run", "--resume", "plain", "--set", "train.rounds=2", cwd=tmp_path)
    one_sentence(r, "--set train.rounds=2 is below the rounds the run in 'plain' has run")
    assert listing(run) == before  # not run again from round 1


def test_a_resume_may_not_lower_the_rounds_below_those_run(cli, finished, tmp_path):
    run = copy_run(finished, "ckpt", tmp_path)
    before = listing(run)
    r = cli("run", "--resume", "ckpt", "--set", "train.rounds=2", cwd=tmp_path)
    one_sentence(r, "(its checkpoint is at round 3): its config.yaml would disagree")
    assert listing(run) == before
    r = cli("run", "--resume", "ckpt", "--set", "train.rounds=4", "-q", cwd=tmp_path)
    assert r.returncode == 0, r.stderr  # more rounds continue it
    summary = json.loads((run / "summary.json").read_text())
    assert summary["rounds"] == 4 and "rounds: 4" in (run / "config.yaml").read_text()


# -- 9, 10. sweeps, compares, report options -----------------------------------------------------


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["sweep", "CFG", "--algorithms", "fedavg", "--seeds", "0", "--select", "none",
          "--grid", "model.name=[mlp,nosuchmodel]"], "unknown model 'nosuchmodel'"),
        (["compare", "CFG", "--algorithms", "fedavg,local", "--seeds", "0", "--keep-going",
          "--set", "model.name=nosuchmodel"], "unknown model 'nosuchmodel'"),
        (["compare", "CFG", "--algorithms", "fedavg", "--seeds", "0,1,0", "--jobs", "2"],
         "compare.seeds lists seed 0 twice: list each seed once"),
        (["sweep", "CFG", "--algorithms", "fedavg", "--seeds", "0", "--select", "none",
          "--grid", "train.lr=[0.1]", "--grid", "train.lr=[0.2]"], "--grid gives 'train.lr' twice"),
        (["sweep", "CFG", "--algorithms", "fedavg", "--seeds", "0", "--select", "none",
          "--grid", "train.lr=[0.1]", "--metric", ""], "invalid config value 'sweep.metric' (got '')"),
    ],
)  # fmt: skip
def test_a_bad_setting_of_a_sweep_or_compare_writes_nothing(cli, cfg_file, tmp_path, args, message):
    r = cli(*[str(cfg_file) if a == "CFG" else a for a in args], "--out", "out", "-q",
            cwd=tmp_path)  # fmt: skip
    one_sentence(r, message)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(("option", "message"), [
    ("--metric", "unknown metric ''"), ("--at", "unknown --at ''"), ("--select", "unknown --select ''"),
])  # fmt: skip
def test_an_empty_report_option_is_refused(cli, finished, tmp_path, option, message):
    copy_run(finished, "plain", tmp_path)
    r = cli("report", "plain", option, "", "--out", "rep", cwd=tmp_path)
    one_sentence(r, message)
    assert not (tmp_path / "rep").exists()


# -- Ctrl-C outside the round loop ---------------------------------------------------------------


def test_ctrl_c_while_a_plugin_imports_is_exit_130(cli, cfg_file, tmp_path, monkeypatch):
    (tmp_path / "ctrl_c_40.py").write_text("raise KeyboardInterrupt\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    r = cli("run", str(cfg_file), "--import", "ctrl_c_40", "--out", "r", cwd=tmp_path)
    one_sentence(r, "interrupted (Ctrl-C)", code=130)
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize(
    ("interrupt", "how", "code"),
    [("raise KeyboardInterrupt", "Ctrl-C", 130), ("os.kill(os.getpid(), 15)", "SIGTERM", 143)],
)
def test_an_interrupt_while_pflkit_itself_imports_is_one_line(tmp_path, interrupt, how, code):
    import subprocess
    import sys

    program = (  # a Ctrl-C or SIGTERM while the command line's modules load
        "import os, sys\n"
        "class Interrupt:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'typer':\n"
        f"            {interrupt}\n"
        "sys.meta_path.insert(0, Interrupt())\n"
        "sys.argv = ['pflkit', 'list']\n"
        "from pflkit.__main__ import main\n"
        "main()\n"
    )
    r = subprocess.run(
        [sys.executable, "-c", program], cwd=tmp_path, capture_output=True, text=True
    )
    one_sentence(r, f"interrupted ({how}) while pflkit was starting: nothing ran", code=code)


def test_import_pflkit_is_light_and_its_api_loads_on_use():
    import subprocess
    import sys

    code = (
        "import sys, pflkit\n"
        "assert 'torch' not in sys.modules, 'import pflkit loaded torch'\n"
        "from pflkit import run_experiment, PflkitError\n"
        "assert run_experiment.__module__ == 'pflkit.engine.runner'\n"
        "assert set(pflkit.__all__) <= set(dir(pflkit))\n"
        "try:\n"
        "    pflkit.nosuch\n"
        "except AttributeError as err:\n"
        "    print(err)\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert r.stdout == "module 'pflkit' has no attribute 'nosuch'\n"


def test_a_full_disk_while_config_yaml_is_written_is_one_sentence(tmp_path, monkeypatch):
    import errno

    from pflkit.engine import run_experiment

    real = Path.write_text

    def full(self, text, *args, **kwargs):
        if self.name == "config.yaml.tmp":
            real(self, text[:10])
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(self, text, *args, **kwargs)

    monkeypatch.setattr(Path, "write_text", full)
    with pytest.raises(PflkitError, match=r"config.yaml' \(No space left on device\): free disk"):
        run_experiment(validate(tiny_config()), out=tmp_path / "r")
    assert not list((tmp_path / "r").glob("*.tmp"))


def ctrl_c(*args, **kwargs):
    raise KeyboardInterrupt


@pytest.mark.parametrize("existed", [False, True])
def test_ctrl_c_before_the_first_round_leaves_nothing(
    cli, cfg_file, tmp_path, monkeypatch, existed
):
    from pflkit.engine import runner

    if existed:
        (tmp_path / "r").mkdir()
    monkeypatch.setattr(runner, "record_provenance", ctrl_c)  # after config.yaml is written
    r = cli("run", str(cfg_file), "--out", "r", cwd=tmp_path)
    one_sentence(r, "interrupted (Ctrl-C) before the first round: nothing was written", 130)
    assert (tmp_path / "r").exists() == existed and not listing(tmp_path / "r")


def test_ctrl_c_while_data_loads_and_after_the_last_round(cli, cfg_file, tmp_path, monkeypatch):
    from pflkit.engine import simulation
    from pflkit.report import plots

    with monkeypatch.context() as m:
        m.setattr(simulation, "build_federated", ctrl_c)
        r = cli("run", str(cfg_file), "--out", "r", cwd=tmp_path)
    one_sentence(r, "interrupted (Ctrl-C) before the first round: nothing was written", 130)
    assert not (tmp_path / "r").exists()
    monkeypatch.setattr(plots, "plot_run", ctrl_c)
    r = cli("run", str(cfg_file), "--out", "r", cwd=tmp_path)
    one_sentence(r, "interrupted (Ctrl-C) after the last round: the run finished", 130)
    assert (tmp_path / "r" / "summary.json").exists()


def test_python_api_misuse_is_one_sentence_and_a_dict_is_a_config(tmp_path):
    from pflkit import load_config, run_experiment

    raw = tiny_config(train={"rounds": 1})
    cfg = load_config(raw, ["train.lr=0.2"])  # a dict is what a YAML file holds
    assert (cfg.train.lr, cfg.train.rounds, raw["train"]["lr"]) == (0.2, 1, 0.05)  # raw untouched
    assert load_config(raw) == validate(raw)
    with pytest.raises(PflkitError, match=r"^overrides is one string \('train.lr=0.2'\): give a "):
        load_config(raw, "train.lr=0.2")  # type: ignore[arg-type]
    with pytest.raises(PflkitError, match="^run_experiment needs a config"):
        run_experiment()
    with pytest.raises(PflkitError, match=r"^run_experiment\(cfg\) takes no overrides"):
        run_experiment(cfg, out=tmp_path / "new", overrides=["train.rounds=2"])
    run_experiment(cfg, out=tmp_path / "run", progress=False)
    with pytest.raises(PflkitError, match="drop cfg and out"):
        run_experiment(cfg, resume=tmp_path / "run")
    with pytest.raises(PflkitError, match="drop cfg and out"):
        run_experiment(out=tmp_path / "other", resume=tmp_path / "run")
    # a path, an example's name or a dict where a loaded config belongs (AttributeError before)
    from pflkit import run_compare, run_sweep
    from pflkit.engine.simulation import Simulation

    for call, where, value in [
        (lambda v: run_experiment(v, out=tmp_path / "x"), "run_experiment", "quickstart_digits"),
        (lambda v: run_compare(v, tmp_path / "x"), "run_compare", tmp_path / "c.yaml"),
        (lambda v: run_sweep(v, tmp_path / "x"), "run_sweep", raw),
        (lambda v: Simulation(v), "Simulation", "c.yaml"),
    ]:
        how = "load_config(...)" if value is raw else f"load_config('{value}')"
        with pytest.raises(PflkitError) as err:
            call(value)
        assert str(err.value) == (
            f"{where} takes a config (an ExperimentConfig), got {type(value).__name__}: pass "
            f"{how}, which reads a file, an example's name or a dict"
        )
    with pytest.raises(PflkitError, match=r"^invalid --set 3: give key=value strings, e\.g\. "):
        load_config(raw, [3])  # type: ignore[list-item]
    for value in (["quickstart"], 3):
        with pytest.raises(PflkitError, match="^load_config takes a config file's path, an "):
            load_config(value)  # type: ignore[arg-type]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]  # nothing half-written


def test_a_report_takes_a_list_of_folders_and_refuses_what_is_not_a_path(finished):
    """``make_report(glob(...))``: a list stands for its folders (a TypeError before), and
    a value that is no path is one sentence."""
    from pflkit import load_runs, make_report

    one_by_one = make_report(finished / "plain", finished / "ckpt").markdown()
    assert make_report([finished / "plain", str(finished / "ckpt")]).markdown() == one_by_one
    assert make_report((finished / "plain",), finished / "ckpt").markdown() == one_by_one
    for call in (make_report, load_runs):
        with pytest.raises(PflkitError, match=r"^runs are read from folders given as paths, got "
                           r"int 3: pass run, compare or sweep folders$"):  # fmt: skip
            call(finished / "plain", 3)
