"""A reproduction's tables next to the paper's numbers, with a ranking verdict.

    python benchmarks/paper_table.py COLUMN FOLDER... [--json OUT.json] [--by-round]

COLUMN is one of :data:`COLUMNS`: ``map/fmnist_lenet`` and ``map/fmnist_mlpnet`` (MAP Tables
I-II), ``ktpfl/fmnist20`` (KT-pFL Table 2, Fashion-MNIST, 20 clients), ``pfedsim/dir01`` and
``pfedsim/dir05`` (pFedSim Table 3, against its EMNIST columns), ``gpfl/fmnist_pat`` and
``gpfl/fmnist_prac`` (GPFL Table 1's Fashion-MNIST columns), ``pfedpm/fmnist_n3``, ``_n4``,
``_n5`` (pFedPM Table I's MNIST columns), ``pfedsim/rho_dir01`` (pFedSim Table 6, rho, against
its EMNIST Dir(0.1) column) and ``gpfl/ablation_prac`` (GPFL Table 6's ablations, TINY*).
FOLDER: compare folders,
``benchmarks/map_repro.sh``'s folder, or a folder of kept runs (``benchmarks/keep_runs.sh``);
every ``<label>-s<seed>/summary.json`` under them is read; a label in several folders is
read from the last of them only (:func:`run_files`). A label's method is its name before
any ``(options)``, e.g. ``pfedme(personal_lr=0.01)`` is pFedMe; a column whose rows are
settings of one method (a sweep, an ablation) lists whole labels, which match first.

For each metric of the column, a markdown table: ours as mean ± std over seeds of the last round
and of the mean over the last ``eval.last`` rounds (``mean_last``), the paper's number, and the
**ranking verdict** against the column's reference method (MAP: FedAvg, the method its claims
are made against; KT-pFL, pFedSim and GPFL: the paper's own method, which it ranks above every
baseline). Where the paper's claim is a pattern (pFedSim: first, with FedAvg, FedProx, FedDyn,
FedGen and FedBN the five last under Dir(0.1)), a line says whether our order shows it.

pFedSim has no Fashion-MNIST column; its reproduction on Fashion-MNIST is compared with the
EMNIST columns (chosen 2026-11-24, before any pFedSim run: the same LeNet5 on 28x28 grayscale
images, the nearest of the paper's four datasets). Levels are not comparable, orders are.

The verdict was fixed before any result was seen (for MAP, 2026-11-23; the same rule for KT-pFL):
Delta = method - reference on the mean over the last rounds, paired by seed (same partition, same
client sampling). "reproduced": same sign as the paper's Delta and |mean Delta| > its std over
seeds; "same direction, within noise": same sign, not larger than the std; "reversed": opposite
sign and larger than the std; "not reproduced": otherwise (opposite sign, within noise); "–"
with fewer than 2 paired seeds (``ranking_verdict``; benchmarks/claims.py applies it too). Also
printed: both orders of the methods and Spearman's rank correlation of the whole column.
``--json`` writes every number per method and seed. ``--by-round`` adds, per metric, the
reference method against the best other method at every evaluated round (each method's mean
over its seeds, from the runs' metrics.jsonl) and the round from which the reference stays
first.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pflkit.report.archive import files


@dataclass(frozen=True)
class Column:
    title: str
    reference: str  # the method every Delta is taken against
    metrics: tuple[tuple[str, str], ...]  # (summary key, title)
    paper: dict[str, tuple[float | None, ...]]  # method -> one number per metric, as printed
    last: tuple[str, ...] = ()  # methods the paper's claim puts below every other method


MAP_METRICS = (
    ("global_acc", "aggregation"),
    ("pers_acc_selected", "personalization"),
    ("pers_acc_mean", "all-client personalized (pflkit's metric, not in the paper)"),
)

COLUMNS = {
    # (aggregation, personalization) as printed in MAP Tables I and II (specs/map.md §6)
    "map/fmnist_lenet": Column(
        "MAP reproduction, Fashion-MNIST LeNet",
        "fedavg",
        MAP_METRICS,
        {
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
    ),
    "map/fmnist_mlpnet": Column(
        "MAP reproduction, Fashion-MNIST MLPNet",
        "fedavg",
        MAP_METRICS,
        {
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
    ),
    # KT-pFL Table 2, Fashion_MNIST 20 clients (specs/ktpfl.md §6); the paper's KT-pFL there is
    # the homogeneous variant, pflkit's ktpfl_homo
    "ktpfl/fmnist20": Column(
        "KT-pFL Table 2 reproduction, Fashion-MNIST, 20 clients",
        "ktpfl_homo",
        (("pers_acc_mean", "personalized (mean over clients)"),),
        {
            "fedavg": (80.69,),
            "perfedavg": (85.91,),
            "fedavg_ft": (90.17,),
            "pfedme": (90.97,),
            "fedamp": (90.79,),
            "fedfomo": (88.33,),
            "pfedhn": (92.22,),
            "ktpfl_homo": (93.93,),
        },
    ),
}

PFEDSIM_METRICS = (
    ("pers_acc_weighted", "pooled personalized (the paper's and FL-bench's)"),
    ("pers_acc_mean", "personalized, mean over clients"),
)
# pFedSim Table 3, EMNIST Dir(0.1) and Dir(0.5) (specs/pfedsim.md §6), in compare's method names
_PFEDSIM_EMNIST = {
    "local": (93.54, 84.17),
    "fedavg": (75.27, 82.17),
    "fedprox": (74.22, 81.81),
    "feddyn": (72.39, 80.04),
    "fedgen": (75.97, 83.20),
    "fedbn": (77.45, 82.28),
    "perfedavg": (93.04, 86.90),
    "fedper": (94.42, 87.50),
    "fedrep": (95.12, 88.38),
    "fedfomo": (93.20, 83.43),
    "fedap": (94.34, 89.00),
    "pfedsim": (95.70, 90.18),
}


def _cells(table: dict[str, tuple[float, ...]], i: int) -> dict[str, tuple[float]]:
    """Column ``i`` of a paper table given as method -> one number per column."""
    return {m: (v[i],) for m, v in table.items()}


COLUMNS["pfedsim/dir01"] = Column(
    "pFedSim Table 3 reproduction, Fashion-MNIST Dir(0.1); paper: EMNIST Dir(0.1)",
    "pfedsim",
    PFEDSIM_METRICS,
    _cells(_PFEDSIM_EMNIST, 0),
    ("fedavg", "fedprox", "feddyn", "fedgen", "fedbn"),
)
COLUMNS["pfedsim/dir05"] = Column(
    "pFedSim Table 3 reproduction, Fashion-MNIST Dir(0.5); paper: EMNIST Dir(0.5)",
    "pfedsim",
    PFEDSIM_METRICS,
    _cells(_PFEDSIM_EMNIST, 1),
)

# GPFL Table 1, Fashion-MNIST paLS and prLS (specs/gpfl.md §6): PFLlib pools correct predictions
# over every client's test split (pers_acc_weighted); the paper's cell is the best round's
_GPFL_FMNIST = {
    "fedavg": (80.41, 85.85),
    "fedprox": (78.08, 85.63),
    "perfedavg": (99.18, 95.10),
    "pfedme": (99.35, 97.25),
    "ditto": (99.44, 97.47),
    "fedper": (99.47, 97.44),
    "fedrep": (99.56, 97.56),
    "fedrod": (99.52, 97.52),
    "fedphp": (99.30, 97.38),
    "fedproto": (99.49, 97.40),
    "gpfl": (99.85, 97.81),
}


GPFL_METRICS = (("pers_acc_weighted", "pooled personalized (PFLlib's)"),)
COLUMNS["gpfl/fmnist_pat"] = Column(
    "GPFL Table 1 reproduction, Fashion-MNIST paLS", "gpfl", GPFL_METRICS, _cells(_GPFL_FMNIST, 0)
)
COLUMNS["gpfl/fmnist_prac"] = Column(
    "GPFL Table 1 reproduction, Fashion-MNIST prLS", "gpfl", GPFL_METRICS, _cells(_GPFL_FMNIST, 1)
)

# pFedSim Table 6 (B.1), the effect of rho, EMNIST (LeNet5) Dir(0.1) (specs/pfedsim.md §6): one
# row per swept warmup_ratio (configs/pfedsim/fmnist_dir01_rho.yaml's labels), against the
# default 0.5; rho = 1 is FedAvg for every round
_RHO = (0.0, 0.1, 0.3, 0.5, 0.7, 0.9, 1.0)
_RHO_EMNIST01 = (94.91, 95.12, 95.49, 95.70, 95.81, 92.89, 75.27)
COLUMNS["pfedsim/rho_dir01"] = Column(
    "pFedSim Table 6 reproduction (rho), Fashion-MNIST Dir(0.1); paper: EMNIST Dir(0.1)",
    "pfedsim(warmup_ratio=0.5)",
    PFEDSIM_METRICS[:1],
    {f"pfedsim(warmup_ratio={r})": (v,) for r, v in zip(_RHO, _RHO_EMNIST01, strict=True)},
)

# GPFL Table 6, ablations on TINY* (ResNet-18, Tiny-ImageNet, practical; specs/gpfl.md §6):
# the labels of configs/gpfl/fmnist_practical_cpu_ablation.yaml, GPFL and FedPer from the fair
# arm (configs/gpfl/fmnist_practical_cpu.yaml)
_GPFL = "gpfl(lam=0.01,mu=0.1"
COLUMNS["gpfl/ablation_prac"] = Column(
    "GPFL Table 6 reproduction (ablations), Fashion-MNIST prLS; paper: TINY*",
    f"{_GPFL})",
    GPFL_METRICS,
    {
        f"{_GPFL})": (43.70,),
        f"{_GPFL},use_pci=False)": (42.74,),
        f"{_GPFL},use_cov=False)": (40.23,),
        f"{_GPFL},use_mlg=False)": (41.72,),
        f"{_GPFL},use_gce=False)": (39.48,),
        "fedper": (38.45,),
    },
)

# pFedPM Table I, MNIST, stdev 2, n = 3 / 4 / 5 (specs/pfedpm.md §6.1): the test accuracy averaged
# over the 20 clients (pers_acc_mean). Its baseline rows are FedProto's Table 1 copied (§6.3),
# so FedProto's own row there is given too. pFedPM-mh runs under the compare label pfedpm-mh
# (configs/pfedpm/fmnist_nway_mh.yaml); R-pFedPM (Table II) is not a Table I row: see
# benchmarks/pfedpm_relation.py. Ours: Fashion-MNIST as MNIST's stand-in (docs/pfedpm.md).
_PFEDPM_MNIST = {
    "local": (94.05, 93.35, 92.92),
    "fesem": (95.26, 97.06, 96.31),
    "fedprox": (96.26, 96.40, 95.65),
    "fedper": (95.57, 96.44, 95.55),
    "fedavg": (95.04, 94.32, 93.22),
    "fedrep": (94.96, 95.18, 94.94),
    "l2gd": (97.42, 96.38, 95.86),
    "fedproto": (97.13, 96.80, 96.70),
    "pfedpm": (98.50, 97.52, 96.84),
    "pfedpm-mh": (98.24, 97.70, 96.89),
}
for _i, _n in enumerate((3, 4, 5)):
    COLUMNS[f"pfedpm/fmnist_n{_n}"] = Column(
        f"pFedPM Table I reproduction, n = {_n}, Fashion-MNIST; paper: MNIST",
        "pfedpm",
        (("pers_acc_mean", "personalized, mean over clients (the paper's)"),),
        _cells(_PFEDPM_MNIST, _i),
    )


def run_files(folders: list[str], name: str) -> dict[str, dict[int, Path]]:
    """Label -> seed -> the file ``name`` of every ``<label>-s<seed>`` run under ``folders``.
    A label found in several folders takes its runs from the last of them only: a
    paper-protocol folder given after the fair arm's replaces a method's runs whole, so a
    partial arm shows fewer seeds, never a mix of the two arms' seeds."""
    by_label: dict[str, dict[int, Path]] = {}
    for folder in folders:
        found: dict[str, dict[int, Path]] = {}
        for path in files(folder, name):
            label, seed = path.parent.name.rsplit("-s", 1)
            found.setdefault(label, {})[int(seed)] = path
        by_label.update(found)
    return by_label


def read_runs(folders: list[str]) -> dict[str, dict[int, dict]]:
    """Label -> seed -> summary.json of every run under ``folders`` (:func:`run_files`)."""
    return {
        label: {seed: json.loads(path.read_text()) for seed, path in by_seed.items()}
        for label, by_seed in run_files(folders, "summary.json").items()
    }


def method(label: str) -> str:
    return label.split("(", 1)[0]


def paper_key(col: Column, label: str) -> str | None:
    """The row of ``col.paper`` a run label belongs to: the label itself where the column
    lists settings of one method (a sweep's or an ablation's labels), else its method."""
    return label if label in col.paper else method(label) if method(label) in col.paper else None


def main() -> None:
    args = sys.argv[1:]
    out_json = None
    by_round = "--by-round" in args
    if by_round:
        args.remove("--by-round")
    if "--json" in args:
        i = args.index("--json")
        out_json = Path(args[i + 1])
        del args[i : i + 2]
    if len(args) < 2 or args[0] not in COLUMNS:
        print(
            f"usage: paper_table.py COLUMN FOLDER... [--json OUT.json] [--by-round], COLUMN one of "
            f"{', '.join(COLUMNS)}",
            file=sys.stderr,
        )
        sys.exit(2)
    col, runs = COLUMNS[args[0]], read_runs(args[1:])
    ref = next((label for label in runs if paper_key(col, label) == col.reference), None)
    order = [lb for m in col.paper for lb in runs if paper_key(col, lb) == m]
    order += sorted(lb for lb in runs if lb not in order)
    print(f"{col.title}; ours: mean ± std over seeds\n")
    for i, (key, title) in enumerate(col.metrics):
        print(f"### {title} accuracy (%)\n")
        print(
            f"| method | seeds | last round | mean of last rounds | paper | Delta vs "
            f"{col.reference} (ours) | Delta vs {col.reference} (paper) | ranking verdict |"
        )
        print("|---|---|---|---|---|---|---|---|")
        ours, theirs = {}, {}
        for label in order:
            by_seed = runs[label]
            last = [100 * s["final"][key] for s in by_seed.values() if key in s["final"]]
            mean10 = [100 * v[key] for v in _mean_last(by_seed).values() if key in v]
            key_ = paper_key(col, label)
            paper = col.paper.get(key_, ()) if key_ else ()
            number = paper[i] if i < len(paper) else None
            delta, verdict, pdelta = _verdict(runs, label, ref, key, col, i)
            print(
                f"| {label} | {len(by_seed)} | {_ms(last)} | {_ms(mean10)} | {number or '–'} "
                f"| {delta} | {pdelta} | {verdict} |"
            )
            if number is not None and mean10:
                ours[key_], theirs[key_] = float(np.mean(mean10)), number
        if len(ours) > 2:
            print(f"\nOrder, ours (mean of last rounds): {_order(ours)}")
            print(f"Order, paper: {_order(theirs)}")
            rho = _spearman(list(ours.values()), list(theirs.values()))
            print(f"Spearman rank correlation with the paper over {len(ours)} methods: {rho:.2f}")
            if max(theirs, key=theirs.__getitem__) == col.reference:
                print(_pattern(ours, col))
        print()
        if by_round and ref is not None:
            print(_lead_by_round(args[1:], ref, key, title))
    if out_json:
        out_json.write_text(json.dumps(runs_digest(runs), indent=1) + "\n")


def curves(folders: list[str], key: str) -> dict[str, dict[int, float]]:
    """Label -> evaluated round -> 100 x ``key`` averaged over the label's seeds that have it
    at that round (metrics.jsonl of every ``<label>-s<seed>`` run under ``folders``)."""
    sums: dict[str, dict[int, list[float]]] = {}
    for label, by_seed in run_files(folders, "metrics.jsonl").items():
        for path in by_seed.values():
            for line in path.read_text().splitlines():
                row = json.loads(line)
                if row.get(key) is not None:
                    sums.setdefault(label, {}).setdefault(row["round"], []).append(row[key])
    return {
        lb: {r: 100 * float(np.mean(v)) for r, v in sorted(by.items())} for lb, by in sums.items()
    }


def _lead_by_round(folders: list[str], ref: str, key: str, title: str) -> str:
    """The reference's lead over the best other method at every round all methods evaluated."""
    curve = curves(folders, key)
    rounds = sorted(set.intersection(*(set(c) for c in curve.values())))
    lines = [
        f"#### {title}: {ref} against the best other method, by round (means over seeds)\n",
        f"| round | {ref} (%) | best other method | its accuracy (%) | lead (points) |",
        "|---|---|---|---|---|",
    ]
    since = None
    for r in rounds:
        best = max((lb for lb in curve if lb != ref), key=lambda lb: curve[lb][r])
        lead = curve[ref][r] - curve[best][r]
        since = (since or r) if lead > 0 else None
        lines.append(f"| {r} | {curve[ref][r]:.2f} | {best} | {curve[best][r]:.2f} | {lead:+.2f} |")
    stays = f"from round {since} on" if since else "not at the last evaluated round"
    lines.append(f"\n{ref} is above every other method {stays}.\n")
    return "\n".join(lines)


def _mean_last(by_seed: dict[int, dict]) -> dict[int, dict]:
    return {seed: s["mean_last"] for seed, s in by_seed.items() if "mean_last" in s}


def _ms(v: list[float]) -> str:
    if not v:
        return "–"
    return f"{np.mean(v):.1f} ± {np.std(v):.1f}" if len(v) > 1 else f"{v[0]:.1f}"


def _order(scores: dict[str, float]) -> str:
    return " > ".join(sorted(scores, key=scores.__getitem__, reverse=True))


def _pattern(ours: dict[str, float], col: Column) -> str:
    """Whether our order shows the paper's claim (printed where the paper has the reference
    method first): the reference first, and ``col.last`` below every other method."""
    order = sorted(ours, key=ours.__getitem__, reverse=True)
    first = "yes" if order[0] == col.reference else "no"
    missing = set(col.paper) - set(ours)
    if first == "yes" and missing:  # a "no" is final; a "yes" holds only for what has run
        first += f" so far ({len(missing)} of the paper's {len(col.paper)} methods not run yet)"
    line = f"Paper's claim, {col.reference} first: {first}"
    if col.last:
        tail = order[-len(col.last) :]
        if not set(col.last) <= set(ours):
            shown = "not all run yet"
        else:
            shown = "yes" if set(tail) == set(col.last) else f"no (ours last: {', '.join(tail)})"
        line += f"; {', '.join(col.last)} last: {shown}"
    return line


def _verdict(runs, label: str, ref: str | None, key: str, col: Column, i: int):
    """(our Delta vs the reference, the verdict, the paper's Delta) as table cells."""
    if ref is None or label == ref:
        return "–", "–", "–"
    mine_p = col.paper.get(paper_key(col, label) or "", ())
    ref_p = col.paper.get(col.reference, ())
    known = i < len(mine_p) and i < len(ref_p)
    pd = mine_p[i] - ref_p[i] if known else float("nan")
    pcell = f"{pd:+.1f}" if known else "–"
    mine, base = _mean_last(runs[label]), _mean_last(runs[ref])
    both = [s for s in sorted(set(mine) & set(base)) if key in mine[s] and key in base[s]]
    d = [100 * (mine[s][key] - base[s][key]) for s in both]
    if not d:
        return "–", "–", pcell
    m, sd = float(np.mean(d)), float(np.std(d))
    cell = f"{m:+.1f} ± {sd:.1f} (n={len(d)})" if len(d) > 1 else f"{m:+.1f} (n=1)"
    return cell, ranking_verdict(d, pd) if known else "–", pcell


def ranking_verdict(d: list[float], paper_delta: float) -> str:
    """The verdict on paired per-seed Deltas ``d`` (method - reference) against the paper's
    Delta: "reproduced" (the paper's sign and |mean| > std), "same direction, within noise",
    "reversed" (opposite sign, |mean| > std), "not reproduced" (otherwise); "–" with fewer
    than 2 seeds."""
    if len(d) < 2:
        return "–"
    m, sd = float(np.mean(d)), float(np.std(d))
    if np.sign(m) == np.sign(paper_delta):
        return "reproduced" if abs(m) > sd else "same direction, within noise"
    return "reversed" if abs(m) > sd else "not reproduced"


def _spearman(a: list[float], b: list[float]) -> float:
    ra, rb = np.argsort(np.argsort(a)), np.argsort(np.argsort(b))
    return float(np.corrcoef(ra, rb)[0, 1])


def runs_digest(runs: dict[str, dict[int, dict]]) -> dict:
    return {
        label: {
            str(seed): {"final": s["final"], "mean_last": s.get("mean_last")}
            for seed, s in sorted(by_seed.items())
        }
        for label, by_seed in runs.items()
    }


if __name__ == "__main__":
    main()
