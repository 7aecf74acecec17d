"""Fuzz target of the config loader (issue 58): random YAML documents, read as a config file,
and random ``--set`` strings, through :func:`pflkit.experiment.load_config` (what every
command calls). Every outcome is a config or one sentence (a PflkitError of one line: the CLI
prints it and exits 2); never another exception, never a hang (each example must end within
``HANG_S`` seconds: an alarm fails it otherwise).

Bounded: ``FUZZ_EXAMPLES`` examples (default 300, derandomized: the same ones on every run),
under 60 s on a CI machine; set PFLKIT_FUZZ_EXAMPLES for a longer hunt (with
PFLKIT_FUZZ_RANDOM=1 for new examples each run)."""

from __future__ import annotations

import os
import signal

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import tiny_config
from pflkit.errors import PflkitError
from pflkit.experiment import load_config

FUZZ_EXAMPLES = int(os.environ.get("PFLKIT_FUZZ_EXAMPLES", "300"))
HANG_S = 20  # far above any single load (milliseconds), far below "until killed"

# YAML's syntax characters, some words and numbers, anchors and aliases
TOKENS = st.sampled_from(
    ["\n", "  ", " ", ":", ": ", "- ", "[", "]", "{", "}", ",", "&a ", "*a", "&b ", "*b", "!!",
     "!!str ", "!!python/object ", "|", ">", "#", "'", '"', "?", "%YAML 1.1\n", "---\n", "...",
     "name", "model", "options", "algorithm", "train", "rounds", "lr", "compare",
     "algorithms", "fedavg", "1", "-1", "1e-1", "0.5", ".inf", ".nan", "null", "true", "~",
     "\t", "\x00", "é", "\ufeff", "=", "."]
)  # fmt: skip
SOUP = st.lists(TOKENS, max_size=40).map("".join)


def nested(depth: int, alias: bool) -> str:
    """A list nested ``depth`` deep, or a chain of anchors that doubles ``depth`` times."""
    if alias:
        lines = ["  l0: &l0 [x, x]"] + [
            f"  l{i}: &l{i} [*l{i - 1}, *l{i - 1}]" for i in range(1, depth + 1)
        ]
        return "model:\n options:\n" + "\n".join(" " + x for x in lines) + "\n"
    return f"model:\n  options:\n    x: {'[' * depth}1{']' * depth}\n"


def flow_bomb(depth: int) -> str:
    """The alias chain of :func:`nested` as one flow mapping (a --set value)."""
    items = ["l0: &l0 [x, x]"] + [
        f"l{i}: &l{i} [*l{i - 1}, *l{i - 1}]" for i in range(1, depth + 1)
    ]
    return "{" + ", ".join(items) + "}"


# a real config, mutated: a key removed, a value replaced by soup
def mutated(data: st.DataObject) -> str:
    lines = yaml.safe_dump(tiny_config()).splitlines()
    for _ in range(data.draw(st.integers(0, 3))):
        i = data.draw(st.integers(0, len(lines) - 1))
        choice = data.draw(st.integers(0, 2))
        if choice == 0:
            del lines[i]
        elif choice == 1:
            key = lines[i].split(":")[0]
            lines[i] = f"{key}: {data.draw(SOUP)}"
        else:
            lines.insert(i, data.draw(SOUP))
        if not lines:
            break
    return "\n".join(lines) + "\n"


KEYS = st.sampled_from(
    ["name", "seed", "train.rounds", "train.lr", "model.options", "model.options.hidden",
     "algorithm.name", "compare.algorithms", "data.partition", "output.dir", "a.b.c", "",
     ".", "train", "engine.workers", "x" * 60, ".".join(["a"] * 60)]
)  # fmt: skip
SETS = st.lists(
    st.one_of(
        st.builds(lambda k, v: f"{k}={v}", KEYS, SOUP),
        st.builds(lambda k, d: f"{k}={flow_bomb(d)}", KEYS, st.integers(0, 30)),
        SOUP,
    ),
    max_size=3,
)


class Hang(Exception):
    pass


def _alarm(signum, frame):
    raise Hang(f"one example ran past {HANG_S} s")


@pytest.mark.filterwarnings("ignore")
@settings(
    max_examples=FUZZ_EXAMPLES,
    deadline=None,  # a loaded machine is slow, not hung: the alarm below catches a hang
    derandomize=not os.environ.get("PFLKIT_FUZZ_RANDOM"),
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(data=st.data(), sets=SETS)
def test_any_document_and_sets_load_or_are_one_sentence(data, sets, tmp_path, monkeypatch):
    kind = data.draw(st.sampled_from(["soup", "mutated", "deep", "bomb"]))
    if kind == "soup":
        text = data.draw(SOUP)
    elif kind == "mutated":
        text = mutated(data)
    else:
        text = nested(data.draw(st.integers(0, 70 if kind == "deep" else 30)), kind == "bomb")
    path = tmp_path / "fuzz.yaml"
    path.write_text(text, encoding="utf-8", errors="surrogatepass")
    # a random `plugins:` list must not import whatever it names
    monkeypatch.setattr("pflkit.plugins.load_plugins", _no_plugins)
    before = signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(HANG_S)
    try:
        load_config(path, sets)
    except PflkitError as err:
        assert "\n" not in str(err) and str(err).strip(), repr(err)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, before)


def _no_plugins(names) -> None:
    if names:
        raise PflkitError("plugins are not loaded in the fuzz test")
