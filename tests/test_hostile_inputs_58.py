"""Issue 58, hostile inputs: a ``name:`` that would escape the output folder, configs that
would cost without bound to read (alias bombs, endless or huge files, deep nesting), usage
errors, a checkpoint holding a pickle, and -q with downloads. Each case is one sentence on
stderr with exit code 2, within a second, with nothing written (through the console script's
entry point in this process: conftest's ``cli``). The interrupts of a parallel compare are in
test_interrupts_58.py (real processes)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import yaml

from conftest import tiny_config
from pflkit.config_io import apply_overrides, parse_value, read_yaml
from pflkit.errors import PflkitError
from pflkit.experiment import load_config


def one_line(r, message: str, code: int = 2) -> None:
    assert r.returncode == code, (r.returncode, r.stdout, r.stderr)
    assert r.stderr.count("\n") == 1 and r.stderr.startswith("error: "), r.stderr
    assert message in r.stderr, r.stderr


def files(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


@pytest.fixture
def cfg_file(tmp_path):
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(tiny_config(train={"rounds": 1})))
    return path


# -- names never become paths --------------------------------------------------------------------

ESCAPE = "name=../../../escaped"


def escaped(tmp_path: Path) -> list[Path]:
    """Anything named escaped* outside tmp_path/out/x (the output.dir of every case)."""
    return [p for p in tmp_path.rglob("escaped*") if not p.is_relative_to(tmp_path / "out/x")]


@pytest.mark.parametrize("command", ["run", "compare", "sweep"])
def test_a_name_never_leaves_output_dir(cli, cfg_file, tmp_path, command):
    """`name: ../../../escaped` wrote `out/x/compare-../../../escaped-<time>`, a folder beside
    out/ (compare, sweep); every command now makes the name one folder-name part."""
    extra = {
        "run": [],
        "compare": ["--algorithms", "fedavg", "--seeds", "0"],
        "sweep": ["--algorithms", "fedavg", "--seeds", "0", "--grid", "train.lr=[0.05]"],
    }[command]
    if command == "sweep":
        extra += ["--select", "none"]
    r = cli(command, str(cfg_file), *extra, "--set", ESCAPE, "--set", "output.dir=out/x", "-q",
            cwd=tmp_path)  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert escaped(tmp_path) == []
    made = list((tmp_path / "out/x").iterdir())
    assert len(made) == 1 and made[0].name.startswith(
        {"run": "escaped-fedavg-s0-", "compare": "compare-escaped-", "sweep": "sweep-escaped-"}[
            command
        ]
    ), made


@pytest.mark.parametrize("study", ["similarity", "privacy"])
def test_a_study_folder_from_a_name_stays_here(cli, cfg_file, tmp_path, monkeypatch, study):
    """analyze similarity / privacy write <study>-<name> in the current folder by default."""
    import pflkit.analysis

    seen = []
    monkeypatch.setattr(
        pflkit.analysis, f"{study}_study", lambda cfg, folder, **kw: seen.append(folder)
    )
    with pytest.raises(TypeError):  # the fake returns None: the folder is what counts
        cli("analyze", study, str(cfg_file), "--set", ESCAPE, cwd=tmp_path)
    assert seen == [Path(f"{study}-escaped")]


def test_flower_local_names_its_run_folder_safely(cli, cfg_file, tmp_path, monkeypatch):
    pytest.importorskip("flwr")
    import json

    from pflkit.flower import local

    seen = []

    class Fake:
        port, tls, auth = 1, False, False

        def __init__(self, *a, **kw):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def run(self, text, run_dir, **kw):
            seen.append(run_dir)
            run_dir.mkdir(parents=True)
            (run_dir / "summary.json").write_text(json.dumps({"final": {}}))

    monkeypatch.setattr(local, "Federation", Fake)
    r = cli("flower", "local", str(cfg_file), "--set", ESCAPE, "--set", "output.dir=out/x",
            cwd=tmp_path)  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert len(seen) == 1 and seen[0].parent == (tmp_path / "out/x").resolve()
    assert seen[0].name.startswith("escaped-fedavg-s0-") and escaped(tmp_path) == []


def test_a_link_out_of_a_compare_folder_is_refused(cli, cfg_file, tmp_path):
    """Every run folder a compare builds is checked to lie in --out once links are followed."""
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "cmp").mkdir()
    (tmp_path / "cmp" / "fedavg-s0").symlink_to(tmp_path / "elsewhere")
    r = cli("compare", str(cfg_file), "--algorithms", "fedavg", "--seeds", "0", "--out", "cmp",
            "-q", cwd=tmp_path)  # fmt: skip
    one_line(r, "the run folder 'cmp/fedavg-s0' would lie outside 'cmp'")
    assert files(tmp_path / "elsewhere") == [] and files(tmp_path / "cmp") == ["fedavg-s0"]


def test_folder_name_keeps_one_part():
    from pflkit.engine.folder import NAME_MAX, folder_name

    assert folder_name("../../x") == "x"
    assert folder_name("a/b\\c\x00d e") == "a-b-c-d-e"
    assert folder_name("..") == folder_name("") == folder_name("///") == "experiment"
    assert folder_name("-rf") == "rf" and folder_name(".hidden") == "hidden"
    assert folder_name("fedavg_ft-1.5") == "fedavg_ft-1.5"  # a plain name is kept
    assert len(folder_name("x" * 1000)) == NAME_MAX


# -- limits on what a config may cost --------------------------------------------------------------


def bomb(levels: int = 9) -> str:
    """A "billion laughs" list: 9**levels strings from 10 short lines."""
    lines = ['    a0: &a0 ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    for i in range(1, levels + 1):
        lines.append(f"    a{i}: &a{i} [" + ",".join([f"*a{i - 1}"] * 9) + "]")
    return "\n".join(lines) + "\n"


def with_bomb(where: str) -> str:
    """tiny_config with the bomb's anchors under model.options and its top alias ``where``."""
    text = yaml.safe_dump(tiny_config(model={"name": "mlp", "options": {}}))
    text = text.replace("  options: {}\n", "  options:\n" + bomb())
    if where == "name":
        return text.replace("name: tiny", "name: *a9")
    if where == "compare":
        return text + "compare:\n  algorithms: *a9\n"
    return text.replace(bomb(), bomb() + "    hidden: *a9\n")  # model.options.hidden


CASES = {
    "bomb under model": lambda p: p.write_text(with_bomb("model")),
    "bomb under name": lambda p: p.write_text(with_bomb("name")),
    "bomb in compare": lambda p: p.write_text(with_bomb("compare")),
    "deep nesting": lambda p: p.write_text("model:\n  options:\n    x: " + "[" * 60 + "]" * 60),
    "alias inside itself": lambda p: p.write_text("model:\n  options: &o {x: *o}\n"),
    "too many aliases": lambda p: p.write_text(
        "model:\n  options:\n    a: &a 1\n    b: [" + ",".join(["*a"] * 1001) + "]\n"
    ),
    "100 MB file": lambda p: p.write_bytes(b"name: big\n" + b"#" * (100 * 2**20) + b"\n"),
    "folder": lambda p: p.mkdir(),
    "named pipe": lambda p: os.mkfifo(p),
}
MESSAGES = {
    "bomb under model": "holds too many values once its aliases are expanded (more than 100000)",
    "bomb under name": "holds too many values once its aliases are expanded",
    "bomb in compare": "holds too many values once its aliases are expanded",
    "deep nesting": "nests too deep (more than 50): simplify it, or raise PFLKIT_CONFIG_MAX_DEPTH",
    "alias inside itself": "alias *o is used inside its own anchor &o",
    "too many aliases": "uses too many aliases (more than 1000)",
    "100 MB file": "is 100.0 MiB, above the 1.0 MiB limit of a config",
    "folder": "is a folder, not a regular file",
    "named pipe": "is a named pipe, not a regular file",
}
COMMANDS = [
    ["run", "{cfg}", "--out", "out"],
    ["compare", "{cfg}", "--out", "out"],
    ["sweep", "{cfg}", "--grid", "train.lr=[0.1]", "--out", "out"],
    ["partition", "{cfg}", "--out", "out.png"],
    ["analyze", "similarity", "{cfg}", "--out", "out"],
    ["flower", "local", "{cfg}", "--out", "out"],
]


@pytest.mark.parametrize("case", CASES)
def test_a_config_that_costs_too_much_is_one_sentence_within_a_second(cli, tmp_path, case):
    """Each ran until killed (a bomb, a 100 MB file, a pipe, /dev/zero) or was a traceback (a
    deep nesting: RecursionError); now one sentence within a second, nothing written."""
    path = tmp_path / "c.yaml"
    CASES[case](path)
    for command in COMMANDS:
        args = [a.format(cfg=path) for a in command]
        start = time.perf_counter()
        r = cli(*args, cwd=tmp_path)
        assert time.perf_counter() - start < 1.0, (case, command)
        one_line(r, MESSAGES[case])
        assert sorted(p.name for p in tmp_path.iterdir()) == ["c.yaml"], command


def test_dev_zero_is_refused_at_once(cli, tmp_path):
    start = time.perf_counter()
    r = cli("run", "/dev/zero", "--out", "out", cwd=tmp_path)
    one_line(r, "config file '/dev/zero' is a device, not a regular file: give a YAML file")
    assert time.perf_counter() - start < 1.0 and list(tmp_path.iterdir()) == []


def test_report_refuses_a_run_config_bomb(cli, cfg_file, tmp_path):
    """A shared run folder whose config.yaml is a bomb: report says so (it hung)."""
    r = cli("run", str(cfg_file), "--out", "r", "-q", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    (tmp_path / "r" / "config.yaml").write_text(with_bomb("name"))
    start = time.perf_counter()
    one_line(cli("report", "r", cwd=tmp_path), "the run config 'r/config.yaml' is refused")
    assert time.perf_counter() - start < 1.0


def test_the_flower_server_app_reads_its_run_config_within_the_limits(monkeypatch):
    """The ServerApp validates the run config's `config` text with the same limits: a bomb is
    one error line and exit 2 (it hung in yaml.safe_load / validation)."""
    pytest.importorskip("flwr")
    import logging

    from pflkit.flower import apps

    class Context:
        run_config = {"config": with_bomb("name"), "out": "never"}

    logged = []
    monkeypatch.setattr(apps.log, "error", lambda fmt, e: logged.append(str(e)))
    start = time.perf_counter()
    with pytest.raises(SystemExit) as stop:
        apps.main(None, Context())
    assert stop.value.code == 2 and time.perf_counter() - start < 1.0
    assert len(logged) == 1 and "the run config's 'config' is refused" in logged[0]
    assert "\n" not in logged[0]
    logging.getLogger("pflkit.flower").handlers.clear()


def test_limits_can_be_raised_and_are_checked(tmp_path, monkeypatch):
    from pflkit.config_io import limit

    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(tiny_config()) + "#" * 2000 + "\n")
    monkeypatch.setenv("PFLKIT_CONFIG_MAX_BYTES", "1KiB")
    with pytest.raises(PflkitError, match=r"above the 1024 bytes limit .* PFLKIT_CONFIG_MAX_BYTES"):
        read_yaml(path)
    monkeypatch.setenv("PFLKIT_CONFIG_MAX_BYTES", "4KiB")
    assert read_yaml(path)["name"] == "tiny"
    monkeypatch.setenv("PFLKIT_CONFIG_MAX_DEPTH", "sixty")
    with pytest.raises(PflkitError, match="PFLKIT_CONFIG_MAX_DEPTH='sixty' is not a positive"):
        read_yaml(path)
    monkeypatch.setenv("PFLKIT_CONFIG_MAX_DEPTH", "100")
    assert limit("depth") == 100
    deep = tmp_path / "deep.yaml"
    deep.write_text("x: " + "[" * 60 + "1" + "]" * 60 + "\n")
    x = read_yaml(deep)["x"]
    for _ in range(60):
        x = x[0]
    assert x == 1
    monkeypatch.delenv("PFLKIT_CONFIG_MAX_DEPTH")
    with pytest.raises(PflkitError, match="nests too deep"):
        read_yaml(deep)


def test_the_value_count_is_exact():
    """A list of n items is n + 1 values, an alias counts as the whole value it stands for."""
    from pflkit.config_io import LIMITS, load_yaml

    most = LIMITS["values"][1]
    assert len(load_yaml("[" + ",".join(["1"] * (most - 1)) + "]")) == most - 1
    with pytest.raises(yaml.YAMLError, match="too many values"):
        load_yaml("[" + ",".join(["1"] * most) + "]")

    # {x: [1] * 99, y: [*a] * k}: the mapping, 2 keys, x (100 values), y (1 + 100 k values)
    def aliased(k: int) -> str:
        return "x: &a [" + ",".join(["1"] * 99) + "]\ny: [" + ",".join(["*a"] * k) + "]\n"

    k = (most - 104) // 100  # 104 + 100 k <= most; under the limit of aliases, too
    assert len(load_yaml(aliased(k))["y"]) == k
    with pytest.raises(yaml.YAMLError, match="too many values"):
        load_yaml(aliased(k + 1))


def test_set_values_have_limits_too():
    with pytest.raises(PflkitError, match=r"a --set value of 10001 characters is above the limit"):
        apply_overrides({}, ["name=" + "x" * 9996])
    assert apply_overrides({}, ["name=" + "x" * 9995])["name"] == "x" * 9995
    bomb_set = "model.options={" + bomb(6).replace("\n    ", ", ").strip().strip(",") + "}"
    with pytest.raises(PflkitError, match="--set value .* is refused: it holds too many values"):
        apply_overrides({}, [bomb_set.replace("    ", "")])
    with pytest.raises(
        PflkitError, match="--set key 'a.a.a.*' has 51 parts, deeper than any config"
    ):
        apply_overrides({}, [".".join(["a"] * 51) + "=1"])
    with pytest.raises(PflkitError, match="--grid value .* is refused: it nests too deep"):
        parse_value("[" * 60 + "]" * 60, "--grid")
    assert parse_value("[1, {a: 2}]") == [1, {"a": 2}] and parse_value("a: [") == "a: ["


def test_a_valid_config_still_loads(cfg_file):
    cfg = load_config(cfg_file, ["model.options={a: &h [32], hidden: *h}"])
    assert cfg.model.options == {"a": [32], "hidden": [32]}


# -- usage errors, a pickled checkpoint, -q ---------------------------------------------------------


@pytest.mark.parametrize(
    "args, message",
    [
        (["runn", "x.yaml"], "error: pflkit: no such command 'runn': did you mean 'run'? "
         "(`pflkit --help` shows how to call it)"),
        (["compare", "x.yaml", "--jobs", "two"], "error: pflkit compare: invalid value for "
         "'--jobs': 'two' is not a valid integer (`pflkit compare --help` shows how to call it)"),
        (["run", "--bogus"], "error: pflkit run: no such option '--bogus': did you mean '--out'?"),
        (["flower", "lokal"], "error: pflkit flower: no such command 'lokal': did you mean "
         "'local'?"),
        (["run", "a.yaml", "b.yaml"], "error: pflkit run: got unexpected extra argument (b.yaml)"),
    ],
)  # fmt: skip
def test_a_usage_error_is_one_sentence(cli, tmp_path, args, message):
    """Click printed three lines (usage, a hint, the error, with "Did you mean" twice)."""
    r = cli(*args, cwd=tmp_path)
    one_line(r, message)
    assert r.stdout == "" and r.stderr.count("did you mean") <= 1


def test_resume_of_a_pickled_checkpoint_is_one_sentence(cli, cfg_file, tmp_path):
    """torch's weights_only refusal is a dozen lines; the checkpoint is refused in one."""
    import hashlib
    import io
    from collections import OrderedDict

    import torch

    from pflkit.engine.checkpoint import MAGIC

    sets = ["--set", "train.rounds=2", "--set", "output.checkpoint_every=1"]
    r = cli("run", str(cfg_file), *sets, "--out", "r", "-q", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    ckpt = tmp_path / "r" / "checkpoints" / "latest.pt"
    buf = io.BytesIO()
    torch.save({"round": 2, "x": OrderedDict(a=Path("/"))}, buf)  # a class: a pickle
    payload = buf.getvalue()
    ckpt.write_bytes(MAGIC + hashlib.sha256(payload).hexdigest().encode() + b"\n" + payload)
    r = cli("run", "--resume", "r", "--set", "train.rounds=3", "-q", cwd=tmp_path)
    one_line(r, "holds Python objects other than tensors and plain values")


def test_quiet_silences_the_downloading_lines(cli, cfg_file, tmp_path, monkeypatch):
    """-q said nothing of progress but still printed "downloading <url>"."""
    from pflkit.data import download

    def fake_build(data_cfg):
        download.notice("downloading https://example.org/x.gz")
        raise PflkitError("stop here")

    monkeypatch.setattr("pflkit.data.federated.build_federated", fake_build)
    monkeypatch.setattr("pflkit.engine.simulation.build_federated", fake_build, raising=False)
    loud = cli("run", str(cfg_file), "--out", "a", cwd=tmp_path)
    quiet = cli("run", str(cfg_file), "--out", "b", "-q", cwd=tmp_path)
    assert "downloading https://example.org/x.gz" in loud.stderr, loud.stderr
    one_line(quiet, "error: stop here")
    assert "downloading" not in quiet.stderr
