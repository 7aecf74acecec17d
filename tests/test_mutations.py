"""The mutation harness's own contract (tests/mutations/mutate.py): every registered algorithm
has at least three breaks of its defining math, every break still applies to the source, and a
test session run for a mutant refuses to test any pflkit but the mutated copy. Running the
breaks themselves is slow and lives outside the default suite:
``python tests/mutations/mutate.py``."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from pflkit.algorithms import ALGORITHMS

MUTATIONS = Path(__file__).resolve().parent / "mutations"
sys.path.insert(0, str(MUTATIONS))
import mutate  # noqa: E402

BREAKS = mutate.load_breaks()


@pytest.mark.parametrize("name", sorted(ALGORITHMS))
def test_every_algorithm_has_three_breaks_of_its_math(name):
    mine = [b.name for b in BREAKS if b.algorithm == name]
    assert len(mine) >= 3, f"{name} has {len(mine)} break(s) in tests/mutations/breaks_*.py"


def test_every_break_applies_to_the_current_source_and_names_existing_tests():
    root = Path(__file__).resolve().parents[1]
    assert not [f"{b.algorithm} / {b.name}: {why}" for b in BREAKS if (why := b.check())]
    missing = {t for b in BREAKS for t in b.tests if not (root / t.split("::")[0]).is_file()}
    assert not missing
    assert {b.algorithm for b in BREAKS} <= set(ALGORITHMS)
    names = [(b.algorithm, b.name) for b in BREAKS]
    assert len(names) == len(set(names))


def test_a_mutant_session_refuses_the_installed_pflkit(tmp_path):
    env = {**os.environ, "PFLKIT_MUTANT": str(tmp_path / "pflkit")}
    r = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:xdist", __file__],
        cwd=Path(__file__).resolve().parents[1],
        env=env,
        capture_output=True,
        text=True,
    )
    assert r.returncode != 0
    assert "put the mutated copy first on PYTHONPATH" in r.stdout + r.stderr
