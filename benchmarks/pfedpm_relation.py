"""R-pFedPM (pFedPM Table II): score finished pFedPM runs through the relation module.

    python benchmarks/pfedpm_relation.py runs/pfedpm-n3 [runs/pfedpm-mh-n3 ...]

pFedPM's training does not depend on how it predicts (``inference: head`` or ``relation``;
tests/algorithms/test_pfedpm.py checks that both train bit-identically), so R-pFedPM needs no second run:
for every finished pFedPM run (summary.json, checkpoints/latest.pt of its last round) this
loads the final state, switches ``algorithm.inference`` to ``relation`` and evaluates each
client on its local test split, exactly as the engine's evaluation does (the same state scored
with ``inference: head`` must give the run's recorded last-round accuracy; checked). It writes
``relation.json`` into the run folder and prints head vs relation accuracy (last round), per
run and as mean ± std over each setting's seeds, with their difference paired by seed. A run
whose ``relation.json`` is of its last round is not scored again, so kept runs
(benchmarks/keep_runs.sh keeps relation.json, not the checkpoints) report too.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

from pflkit.data.federated import build_federated
from pflkit.engine import Simulation
from pflkit.experiment import load_config
from pflkit.report.archive import files

METRICS = ("pers_acc_mean", "pers_acc_weighted", "pers_acc_std", "pers_acc_worst10")


def scores(run: Path, inference: str) -> dict:
    cfg = load_config(run / "config.yaml", overrides=[f"algorithm.inference={inference}"])
    with Simulation(cfg, build_federated(cfg.data)) as sim:
        sim.restore(run / "checkpoints" / "latest.pt")
        row = sim.evaluate(sim.round, {})
    return {"round": sim.round, **{k: row[k] for k in METRICS}}


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__.strip().splitlines()[2].strip(), file=sys.stderr)
        return 2
    print("| run | round | head pers_acc_mean | relation pers_acc_mean |")
    print("|---|---:|---:|---:|")
    by_setting: dict[str, list[tuple[float, float]]] = {}
    for folder in map(Path, argv):
        for summary in files(folder, "summary.json", "*"):
            run, s = summary.parent, json.loads(summary.read_text())
            if s["algorithm"] != "pfedpm":
                continue
            rel = relation(run, s)
            if rel is None:
                return 2
            acc = (100 * s["final"]["pers_acc_mean"], 100 * rel["pers_acc_mean"])
            setting = f"{folder.name}: {run.name.rsplit('-s', 1)[0]}"  # seeds of one folder
            by_setting.setdefault(setting, []).append(acc)
            print(f"| {run.name} | {rel['round']} | {acc[0]:.2f} | {acc[1]:.2f} |")
    if not by_setting:
        print("no finished pfedpm runs in those folders", file=sys.stderr)
        return 2
    print("\n| folder: setting | seeds | head (%) | relation (%) | relation - head (paired) |")
    print("|---|---:|---:|---:|---:|")
    for setting, accs in by_setting.items():
        head, rel = np.array(accs).T
        print(f"| {setting} | {len(accs)} | {_ms(head)} | {_ms(rel)} | {_ms(rel - head)} |")
    return 0


def relation(run: Path, s: dict) -> dict | None:
    """The run's relation scores at its last round: its relation.json, else scored from its
    checkpoint (and written to relation.json); None, with a sentence, if neither can be had."""
    kept = run / "relation.json"
    if kept.is_file():
        rel = json.loads(kept.read_text())
        if rel["round"] == s["rounds"]:
            return rel
    if not (run / "checkpoints" / "latest.pt").is_file():
        print(f"{run}: no relation.json of its last round and no checkpoint", file=sys.stderr)
        return None
    rel, head = scores(run, "relation"), scores(run, "head")
    if rel["round"] != s["rounds"]:
        print(f"{run}: its checkpoint is of round {rel['round']}, not the last", file=sys.stderr)
        return None
    # the restored state must score the run's own recorded head accuracy
    assert abs(head["pers_acc_mean"] - s["final"]["pers_acc_mean"]) < 1e-9, run
    kept.write_text(json.dumps(rel, indent=1) + "\n")
    return rel


def _ms(v: np.ndarray) -> str:
    return f"{v.mean():.2f} ± {v.std():.2f}" if len(v) > 1 else f"{v[0]:.2f}"


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
