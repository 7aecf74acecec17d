"""pFedPM's communication table (docs/pfedpm.md): per-round bytes per client, as the engine
counted them in finished runs, next to the paper's "Params (x1000)" column of Table I.

    python benchmarks/pfedpm_comm.py runs/pfedpm-n3 runs/pfedpm-mh-n3 [--clients 20]

For each run folder (``<label>-s<seed>`` with a metrics.jsonl) it reads the engine's exact
byte counts of every payload and upload in the run's last recorded round (the steady state:
prototype methods download nothing in round 1), averaged over that round's clients and over
seeds; finished or not, any run with a round recorded counts. The paper's column
counts values sent per round summed over the 20 clients, upload only, in thousands (spec
§4.6); the table converts our upload bytes the same way (4 bytes per float32 value), so the
two columns are comparable. Method labels are matched to the paper's rows by algorithm name.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

from pflkit.report.archive import files, tree

# pFedPM Table I, MNIST rows, "Params (x1000)" (specs/pfedpm.md §6.1); FedProto from its own
# Table 1 (§6.3). None: the paper has no row.
PAPER = {
    "local": 0,
    "fesem": 430,
    "fedprox": 430,
    "fedper": 106,
    "fedavg": 430,
    "fedrep": 110,
    "l2gd": 110,
    "pfedpm": 4,
    "pfedpm-mh": 4,  # the compare label of configs/pfedpm/fmnist_nway_mh.yaml
    "fedproto": 4,
}


def collect(folders: list[Path]) -> dict[str, dict]:
    """label -> {algorithm, mh, down, up: lists over seeds}."""
    rows: dict[str, dict] = defaultdict(lambda: {"down": [], "up": []})
    for folder in folders:
        for metrics in files(folder, "metrics.jsonl", "*"):
            lines = metrics.read_text().splitlines()
            if not lines:
                continue
            last = json.loads(lines[-1])
            label = metrics.parent.name.rsplit("-s", 1)[0]
            key = f"{label} [{folder.name}]" if "mh" in folder.name else label
            row = rows[key]
            row["algorithm"] = label.split("(")[0]
            row["down"].append(sum(last["bytes_down"]) / len(last["bytes_down"]))
            row["up"].append(sum(last["bytes_up"]) / len(last["bytes_up"]))
    return rows


def table(rows: dict[str, dict], clients: int) -> str:
    out = [
        "| method | down B/client/round | up B/client/round | ours: up values x 20 clients "
        "(x1000) | paper Params (x1000) |",
        "|---|---:|---:|---:|---:|",
    ]
    for label, r in rows.items():
        down = sum(r["down"]) / len(r["down"])
        up = sum(r["up"]) / len(r["up"])
        paper = PAPER.get(r["algorithm"])
        ours = up / 4 * clients / 1000
        out.append(
            f"| {label} | {down:,.0f} | {up:,.0f} | {ours:,.1f} | "
            f"{'-' if paper is None else paper} |"
        )
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("folders", nargs="+", type=Path, help="compare output folders")
    ap.add_argument("--clients", type=int, default=20, help="clients per round (paper: 20)")
    args = ap.parse_args(argv)
    missing = [str(f) for f in args.folders if not tree(f).is_dir()]
    if missing:
        print(f"no such folder: {missing[0]}; pass compare output folders", file=sys.stderr)
        return 2
    rows = collect(args.folders)
    if not rows:
        print("no finished runs (summary.json) in those folders", file=sys.stderr)
        return 2
    print(table(rows, args.clients))
    return 0


if __name__ == "__main__":
    sys.exit(main())
