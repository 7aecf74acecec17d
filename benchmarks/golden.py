"""Golden harness for refactors that must not move a number (issue 37, contract v3).

Runs every registered algorithm for a few rounds on a tiny config (scikit-learn digits, 4
clients, 3 per round, an MLP, a public set for the distilling algorithms, one torch thread),
once with each evaluation protocol (``eval.selected_clients`` off and on: MAP's), with the
default client runner (``engine.workers: auto``: a worker process per core, one torch thread
each; golden.json was recorded in-process and the pool reproduces it), and keeps a sha256 of
every metrics row (all fields but the ``seconds_*`` timings, floats written exactly) plus the
last row's personalized accuracy to read.

    python benchmarks/golden.py record benchmarks/golden.json   # before a change
    python benchmarks/golden.py check benchmarks/golden.json    # after: exit 1 on any change

Bit-identical results need the same machine kind, torch version and thread count; the file
records the torch version and ``check`` refuses a file from another one.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from pathlib import Path

import torch

from pflkit.algorithms import ALGORITHMS
from pflkit.engine import Simulation
from pflkit.experiment import validate

ROUNDS = 3
# shorter than the paper's defaults (the same code paths run), as in tests/test_conformance.py
FAST = {
    name: {"server_steps": 30, "eval_every": 10, "patience": 10} for name in ("feddf", "pfeddf")
}


def config(name: str, selected: bool):
    return validate(
        {
            "name": "golden",
            "seed": 0,
            "threads": 1,
            "data": {
                "dataset": "digits",
                "num_clients": 4,
                "partition": {"name": "dirichlet", "alpha": 0.5},
                "test_fraction": 0.25,
                "public": {"dataset": "digits", "size": 64},
            },
            "model": {"name": "mlp", "options": {"hidden": [32]}},
            "algorithm": {"name": name, **FAST.get(name, {})},
            "train": {
                "rounds": ROUNDS,
                "batch_size": 16,
                "lr": 0.05,
                "local_epochs": 1,
                "client_fraction": 0.75,
            },
            "eval": {"selected_clients": selected},
            "output": {"progress": False},
        }
    )


def digest(rows: list[dict]) -> str:
    """sha256 of the rows without their timings; floats by repr (exact)."""
    kept = [{k: v for k, v in r.items() if not k.startswith("seconds_")} for r in rows]
    return hashlib.sha256(json.dumps(kept, sort_keys=True).encode()).hexdigest()


def run_all(names: list[str]) -> dict[str, dict]:
    out = {}
    for name in names:
        for selected in (False, True):
            key = f"{name}/{'selected' if selected else 'all'}"
            t0 = time.perf_counter()
            with Simulation(config(name, selected)) as sim:
                rows = [sim.run_round(r) for r in range(1, ROUNDS + 1)]
            out[key] = {"sha256": digest(rows), "pers_acc_mean": rows[-1].get("pers_acc_mean")}
            print(f"{key}: {out[key]['sha256'][:12]} ({time.perf_counter() - t0:.1f} s)",
                  file=sys.stderr)  # fmt: skip
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("action", choices=["record", "check"])
    ap.add_argument("file", type=Path)
    ap.add_argument("--algorithms", help="comma-separated subset (default: every registered one)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    names = args.algorithms.split(",") if args.algorithms else sorted(ALGORITHMS)
    unknown = [n for n in names if n not in ALGORITHMS]
    if unknown:
        print(f"error: unknown algorithm {unknown[0]!r}: see `pflkit list`", file=sys.stderr)
        return 2
    if args.action == "record":
        results = run_all(names)
        body = {"torch": torch.__version__, "rounds": ROUNDS, "runs": results}
        args.file.write_text(json.dumps(body, indent=1, sort_keys=True) + "\n")
        print(f"recorded {len(results)} runs in {args.file}")
        return 0
    if not args.file.is_file():
        print(f"error: no golden file '{args.file}': record one first", file=sys.stderr)
        return 2
    golden = json.loads(args.file.read_text())
    if golden["torch"] != torch.__version__:
        print(f"error: '{args.file}' was recorded with torch {golden['torch']}, this is "
              f"{torch.__version__}: record it again on the old code", file=sys.stderr)  # fmt: skip
        return 2
    results = run_all(names)
    changed = [k for k, v in results.items() if golden["runs"].get(k) != v]
    for k in changed:
        was = golden["runs"].get(k, {}).get("pers_acc_mean")
        print(f"CHANGED {k}: pers_acc_mean {was} -> {results[k]['pers_acc_mean']}")
    print(f"{len(results) - len(changed)} of {len(results)} runs bit-identical")
    return 1 if changed else 0


if __name__ == "__main__":
    sys.exit(main())
