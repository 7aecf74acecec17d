"""Tables of a MAP reproduction next to the paper's numbers (MAP Tables I and II).

    python benchmarks/map_table.py fmnist_lenet runs/map-fmnist_lenet [--json OUT.json]

reads every ``<method>-s<seed>/summary.json`` under the given folders (``pflkit compare`` or
``benchmarks/map_repro.sh``) and prints, for aggregation accuracy (``global_acc``) and
personalization accuracy (``pers_acc_selected``: the selected clients after local training,
unweighted mean), a markdown table: ours as mean ± std over seeds of the last round and of the
mean over the last 10 rounds (``mean_last``), the paper's number, and the **ranking verdict**.

The verdict compares each method with FedAvg, as the paper's claims do, and was fixed before
any result was seen: Delta = method - FedAvg on the mean over the last 10 rounds, paired by seed
(same partition, same client sampling). "reproduced": same sign as the paper's Delta and
|mean Delta| > its std over seeds; "same direction, within noise": same sign, not larger than
the std; "reversed": opposite sign and larger than the std; "not resolved": otherwise; "–"
with fewer than 2 paired seeds. Also printed: Spearman's rank correlation of the whole column.
``--json`` writes every number per method and seed (for docs and later sessions).
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
    args = sys.argv[1:]
    out_json = None
    if "--json" in args:
        i = args.index("--json")
        out_json = Path(args[i + 1])
        del args[i : i + 2]
    column, folders = args[0], args[1:]
    paper = PAPER.get(column, {})
    runs: dict[str, dict[int, dict]] = {}
    for folder in folders:
        for path in sorted(Path(folder).glob("*-s*/summary.json")):
            label, seed = path.parent.name.rsplit("-s", 1)
            s = json.loads(path.read_text())
            runs.setdefault(label, {})[int(seed)] = s
    order = [a for a in paper if a in runs] + sorted(a for a in runs if a not in paper)
    print(f"MAP reproduction, column {column}; ours: mean ± std over seeds\n")
    for i, (key, title) in enumerate(
        [
            ("global_acc", "aggregation"),
            ("pers_acc_selected", "personalization"),
            ("pers_acc_mean", "all-client personalized (pflkit's metric, not in the paper)"),
        ]
    ):
        print(f"### {title} accuracy (%)\n")
        print(
            "| method | seeds | last round | mean of last 10 | paper | Delta vs FedAvg (ours) "
            "| Delta vs FedAvg (paper) | ranking verdict |"
        )
        print("|---|---|---|---|---|---|---|---|")
        ours_rank, paper_rank = [], []
        for algo in order:
            by_seed = runs[algo]
            last = [100 * s["final"][key] for s in by_seed.values() if key in s["final"]]
            mean10 = [100 * v[key] for v in _mean_last(by_seed).values() if key in v]
            ref = paper.get(algo, (None, None, None))[i] if i < 2 else None
            delta, verdict, pdelta = _verdict(runs, algo, key, paper, i)
            print(
                f"| {algo} | {len(by_seed)} | {_ms(last)} | {_ms(mean10)} | {ref or '–'} "
                f"| {delta} | {pdelta} | {verdict} |"
            )
            if ref is not None and mean10:
                ours_rank.append(float(np.mean(mean10)))
                paper_rank.append(ref)
        if len(ours_rank) > 2:
            rho = _spearman(ours_rank, paper_rank)
            print(
                f"\nSpearman rank correlation with the paper over {len(ours_rank)} methods: {rho:.2f}"
            )
        print()
    if out_json:
        out_json.write_text(json.dumps(runs_digest(runs), indent=1) + "\n")


def _mean_last(by_seed: dict[int, dict]) -> dict[int, dict]:
    return {seed: s["mean_last"] for seed, s in by_seed.items() if "mean_last" in s}


def _ms(v: list[float]) -> str:
    if not v:
        return "–"
    return f"{np.mean(v):.1f} ± {np.std(v):.1f}" if len(v) > 1 else f"{v[0]:.1f}"


def _verdict(runs, algo: str, key: str, paper, i: int) -> tuple[str, str, str]:
    if algo == "fedavg" or "fedavg" not in runs:
        return "–", "–", "–"
    known = i < 2 and algo in paper and "fedavg" in paper
    pd = paper[algo][i] - paper["fedavg"][i] if known else float("nan")
    mine, base = _mean_last(runs[algo]), _mean_last(runs["fedavg"])
    both = [s for s in sorted(set(mine) & set(base)) if key in mine[s] and key in base[s]]
    d = [100 * (mine[s][key] - base[s][key]) for s in both]
    if not d:
        return "–", "–", f"{pd:+.1f}" if known else "–"
    m, sd = float(np.mean(d)), float(np.std(d))
    cell = f"{m:+.1f} ± {sd:.1f} (n={len(d)})" if len(d) > 1 else f"{m:+.1f} (n=1)"
    if len(d) < 2 or not known:
        return cell, "–", f"{pd:+.1f}" if known else "–"
    if np.sign(m) == np.sign(pd):
        verdict = "reproduced" if abs(m) > sd else "same direction, within noise"
    else:
        verdict = "reversed" if abs(m) > sd else "not resolved"
    return cell, verdict, f"{pd:+.1f}"


def _spearman(a: list[float], b: list[float]) -> float:
    ra, rb = np.argsort(np.argsort(a)), np.argsort(np.argsort(b))
    return float(np.corrcoef(ra, rb)[0, 1])


def runs_digest(runs: dict[str, dict[int, dict]]) -> dict:
    return {
        algo: {
            str(seed): {"final": s["final"], "mean_last": s.get("mean_last")}
            for seed, s in sorted(by_seed.items())
        }
        for algo, by_seed in runs.items()
    }


if __name__ == "__main__":
    main()
