"""Where KT-pFL's knowledge coefficients put their mass (issue 14, item 5; docs/ktpfl.md).

    python benchmarks/ktpfl_groups.py runs/ktpfl-groups

For every finished run in the folders of a method that mixes soft predictions into per-client
teachers (ktpfl and its fixed-c arms, Sim-pFD, TopK-pFD, FedMD), this reads the teacher weights
of the run's final state from its last checkpoint (the algorithm's own ``mixing_weights``: KT-pFL's
``c``, Sim-pFD's cosine similarities, ...; ``w[m, n]``: client m's weight in client n's teacher)
and the run's partition, groups the clients whose training sets hold exactly the same classes,
and prints per run the mean over clients n of

- self: ``c[n, n]``;
- group: the total weight on the other members of n's group;
- overlap: on clients that share some but not all of n's classes;
- disjoint: on clients that share none of n's classes;

and, for comparison, what uniform ``c`` gives (``1 / N`` per client). A ``c`` that found the
structure puts more than the uniform share on the group and less on the disjoint clients.
It writes ``groups.json`` into each run folder.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

from pflkit.algorithms import build_algorithm
from pflkit.algorithms.blocks.distill import SoftTeacherKD
from pflkit.data.federated import build_federated
from pflkit.engine.checkpoint import load_checkpoint
from pflkit.experiment import load_config

KINDS = ("self", "group", "overlap", "disjoint")


def relations(class_sets: list[frozenset[int]]) -> np.ndarray:
    """``rel[m, n]``: 0 self, 1 same classes, 2 some shared classes, 3 none (indices of KINDS)."""
    n = len(class_sets)
    rel = np.empty((n, n), dtype=int)
    for m in range(n):
        for j in range(n):
            shared = class_sets[m] & class_sets[j]
            same = class_sets[m] == class_sets[j]
            rel[m, j] = 0 if m == j else 1 if same else 2 if shared else 3
    return rel


def masses(c: np.ndarray, rel: np.ndarray) -> dict[str, float]:
    """Mean over students n (columns) of the weight ``c[:, n]`` puts on each relation."""
    return {k: float(np.mean([(c[:, n] * (rel[:, n] == i)).sum() for n in range(c.shape[1])]))
            for i, k in enumerate(KINDS)}  # fmt: skip


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__.strip().splitlines()[2].strip(), file=sys.stderr)
        return 2
    print("| run | round | " + " | ".join(KINDS) + " |")
    print("|---|---:|" + "---:|" * len(KINDS))
    found = 0
    for folder in map(Path, argv):
        for summary in sorted(folder.glob("*/summary.json")):
            run = summary.parent
            ckpt_path = run / "checkpoints" / "latest.pt"
            if not ckpt_path.exists():
                continue
            ckpt = load_checkpoint(ckpt_path)
            cfg = load_config(run / "config.yaml")
            algo = build_algorithm(cfg.algorithm)
            if not isinstance(algo, SoftTeacherKD) or "soft" not in ckpt["server"]:
                continue
            found += 1
            data = build_federated(cfg.data)
            table = data.class_table("train")
            rel = relations([frozenset(np.flatnonzero(row).tolist()) for row in table])
            c = algo.mixing_weights(ckpt["server"]).double().numpy()
            got = masses(c, rel)
            uniform = masses(np.full_like(c, 1.0 / len(c)), rel)
            (run / "groups.json").write_text(
                json.dumps({"round": ckpt["round"], "c": got, "uniform": uniform}, indent=1)
            )
            cells = " | ".join(f"{got[k]:.3f} ({uniform[k]:.3f})" for k in KINDS)
            print(f"| {run.name} | {ckpt['round']} | {cells} |")
    if not found:
        print("no finished run of a soft-teacher method in those folders", file=sys.stderr)
        return 2
    print("(in brackets: the same for uniform weights)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
