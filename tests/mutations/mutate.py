"""Mutation harness: deliberate one-line breaks of every algorithm's defining math, each run
against the tests that should catch it.

Every ``breaks_*.py`` module beside this file holds ``BREAKS``, a list of :class:`Break`. For
each break the harness copies ``src/`` to a temporary folder, applies the break to the copy
(its ``old`` text must occur exactly once in the file), and runs the break's tests with the copy
first on ``PYTHONPATH``; ``tests/conftest.py`` then refuses to run unless ``pflkit`` was
imported from that copy (``PFLKIT_MUTANT``), so the installed pflkit is never what is tested.
The working tree is never touched. Before any break, every listed test runs once on an unbroken
copy: a break only counts as caught by tests that pass without it.

    python tests/mutations/mutate.py                 # every break; a markdown table
    python tests/mutations/mutate.py gpfl fedrep     # only these algorithms' breaks
    python tests/mutations/mutate.py --list          # the breaks, without running them
    python tests/mutations/mutate.py --jobs 2        # two breaks at a time

Exit status 0 when every break is caught, 1 when one survives or the unbroken tests fail, 2 for
a bad argument or a stale break (its ``old`` text no longer in the source).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent


@dataclass(frozen=True)
class Break:
    """One deliberate break: in ``src/pflkit/<file>`` replace ``old`` (which must occur exactly
    once) by ``new``; ``tests`` (pytest paths or node ids, relative to the repository) must
    then fail."""

    algorithm: str
    name: str
    file: str
    old: str
    new: str
    tests: tuple[str, ...]

    def source(self, src_root: Path = ROOT / "src") -> Path:
        return src_root / "pflkit" / self.file

    def check(self, src_root: Path = ROOT / "src") -> str | None:
        """Why this break cannot be applied (None when it can)."""
        path = self.source(src_root)
        if not path.is_file():
            return f"{self.file} does not exist"
        n = path.read_text().count(self.old)
        return None if n == 1 else f"its text occurs {n} times in {self.file}, not once"


def load_breaks() -> list[Break]:
    """Every break of every ``breaks_*.py`` module beside this file, in file order."""
    out: list[Break] = []
    for path in sorted(HERE.glob("breaks_*.py")):
        spec = importlib.util.spec_from_file_location(f"_pflkit_breaks_{path.stem}", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        out.extend(module.BREAKS)
    return out


def _pytest(
    tests: tuple[str, ...], src_root: Path, stop_first: bool = True
) -> tuple[bool, list[str]]:
    """Run ``tests`` against the pflkit under ``src_root``: (passed, names of failed tests;
    with ``stop_first``, only the first)."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(src_root), os.environ.get("PYTHONPATH", "")]),
        "PFLKIT_MUTANT": str(src_root / "pflkit"),
        "OMP_NUM_THREADS": "1",
    }
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist"]
    cmd += ["-x"] if stop_first else []
    r = subprocess.run(
        [*cmd, *tests], cwd=ROOT, env=env, capture_output=True, text=True, check=False
    )
    failed = [
        line.split(" ")[1].split("::", 1)[-1]
        for line in r.stdout.splitlines()
        if line.startswith(("FAILED ", "ERROR "))
    ]
    if r.returncode not in (0, 1):  # collection error, interrupted, internal error
        failed = failed or [f"pytest exit {r.returncode}"]
    return r.returncode == 0, failed


def _copy_src(tmp: Path) -> Path:
    dst = tmp / "src"
    shutil.copytree(
        ROOT / "src" / "pflkit",
        dst / "pflkit",
        ignore=shutil.ignore_patterns("__pycache__", "*.pyc"),
    )
    return dst


def run_break(b: Break) -> list[str]:
    """The tests that failed with ``b`` applied to a copy of src/ (empty: not caught)."""
    with tempfile.TemporaryDirectory(prefix="pflkit-mutant-") as tmp:
        src = _copy_src(Path(tmp))
        path = b.source(src)
        path.write_text(path.read_text().replace(b.old, b.new))
        return _pytest(b.tests, src)[1]


def baseline(tests: tuple[str, ...]) -> list[str]:
    """The tests that fail on an unbroken copy of src/ (should be none), in one session."""
    with tempfile.TemporaryDirectory(prefix="pflkit-clean-") as tmp:
        return _pytest(tests, _copy_src(Path(tmp)), stop_first=False)[1]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("algorithms", nargs="*", help="only these algorithms' breaks")
    ap.add_argument("--list", action="store_true", help="list the breaks, run nothing")
    ap.add_argument("--jobs", type=int, default=1, help="breaks run at a time (default 1)")
    args = ap.parse_args(argv)
    breaks = load_breaks()
    known = {b.algorithm for b in breaks}
    unknown = sorted(set(args.algorithms) - known)
    if unknown:
        print(f"error: no breaks for {', '.join(unknown)}: choose from {', '.join(sorted(known))}")
        return 2
    if args.jobs < 1:
        print(f"error: --jobs {args.jobs} must be at least 1")
        return 2
    if args.algorithms:
        breaks = [b for b in breaks if b.algorithm in args.algorithms]
    stale = [f"{b.algorithm} / {b.name}: {why}" for b in breaks if (why := b.check())]
    if stale:
        print("error: stale breaks (update them to the current source):\n" + "\n".join(stale))
        return 2
    if args.list:
        for b in breaks:
            print(f"{b.algorithm}\t{b.name}\t{b.file}\t{' '.join(b.tests)}")
        return 0

    every_test = tuple(sorted({t for b in breaks for t in b.tests}))
    if failed := baseline(every_test):
        print(f"error: these tests fail without any break: {', '.join(failed)}")
        return 1
    with ThreadPoolExecutor(args.jobs) as pool:
        print("| algorithm | break | caught by |\n|---|---|---|", flush=True)
        caught = 0
        for b, failed in zip(breaks, pool.map(run_break, breaks), strict=True):
            caught += bool(failed)
            verdict = ", ".join(failed) if failed else "**NOT CAUGHT**"
            name = b.name.replace("|", "\\|")  # a markdown cell
            print(f"| {b.algorithm} | {name} | {verdict} |", flush=True)
    print(f"\n{caught} of {len(breaks)} breaks caught")
    return 0 if caught == len(breaks) else 1


if __name__ == "__main__":
    sys.exit(main())
