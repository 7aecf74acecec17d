"""Table of a MAP reproduction next to the paper's numbers (MAP Tables I and II).

    python benchmarks/map_table.py fmnist_lenet runs/map-fmnist_lenet-a runs/map-fmnist_lenet-b

reads every ``<algorithm>-s<seed>/summary.json`` under the given ``pflkit compare`` folders and
prints a markdown table: aggregation accuracy (``global_acc``, last round) and personalization
accuracy (``pers_acc_selected``: the last round's selected clients, after local training,
unweighted mean), ours next to the paper's, plus pflkit's all-client personalized mean.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

# (aggregation, personalization) as printed in MAP Tables I and II (specs/map.md §6)
PAPER = {
    "fmnist_lenet": {
        "fedavg": (86.3, 91.3),
        "fedprox": (87.4, 92.0),
        "scaffold": (89.2, 90.3),
        "ditto": (87.5, 88.2),
        "fedrs": (88.1, 91.7),
        "fedphp": (87.8, 92.1),
        "dittors": (88.3, 88.8),
        "scars": (89.1, 90.5),
        "map": (88.4, 91.8),
        "scamap": (89.6, 91.9),
    },
    "fmnist_mlpnet": {
        "fedavg": (86.2, 90.5),
        "fedprox": (86.8, 90.7),
        "scaffold": (88.6, 88.7),
        "ditto": (87.5, 87.0),
        "fedrs": (87.8, 90.4),
        "fedphp": (87.7, 90.9),
        "dittors": (87.8, 87.2),
        "scars": (88.0, 88.6),
        "map": (88.1, 92.1),
        "scamap": (88.3, 90.5),
    },
}


def main() -> None:
    column, folders = sys.argv[1], sys.argv[2:]
    paper = PAPER.get(column, {})
    runs: dict[str, list[dict]] = {}
    for folder in folders:
        for path in sorted(Path(folder).glob("*/summary.json")):
            s = json.loads(path.read_text())
            runs.setdefault(s["algorithm"], []).append(s["final"])
    print(f"MAP reproduction, column {column}: last round, mean over n seeds\n")
    print(
        "| method | aggregation (ours) | aggregation (paper) | personalization (ours) "
        "| personalization (paper) | all-client pers. mean (ours) | n |"
    )
    print("|---|---|---|---|---|---|---|")
    order = [a for a in paper if a in runs] + [a for a in runs if a not in paper]
    for algo in order:
        finals = runs[algo]
        agg, pers = paper.get(algo, (None, None))
        print(
            f"| {algo} | {cell(finals, 'global_acc')} | {agg or '–'} "
            f"| {cell(finals, 'pers_acc_selected')} | {pers or '–'} "
            f"| {cell(finals, 'pers_acc_mean')} | {len(finals)} |"
        )


def cell(finals: list[dict], key: str) -> str:
    v = [100 * f[key] for f in finals if key in f]
    return f"{np.mean(v):.1f}" if v else "–"


if __name__ == "__main__":
    main()
