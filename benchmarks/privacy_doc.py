"""The generated part of docs/privacy.md: the privacy-utility table (runs of
benchmarks/privacy_utility.sh under results/privacy-fmnist/), Bietti et al.'s claim judged on
it, the accuracy-epsilon plot, and the seed papers' privacy claims judged from the attack
results in results/privacy-attacks/ (benchmarks/privacy_attacks.py).

    python benchmarks/privacy_doc.py            # rewrite docs/privacy.md below its marker
    python benchmarks/privacy_doc.py --check    # exit 1 if docs/privacy.md is not what the runs give

The statistic is each run's ``mean_last.pers_acc_mean`` (the mean personalized accuracy over
the last ``eval.last`` rounds, in %). Bietti et al. (ICML 2022) claim that personalization
improves the privacy-accuracy trade-off: a personalized method loses less accuracy to DP than
FedAvg. Per seed, loss_M(eps) = acc_M(inf) - acc_M(eps) and Delta = loss_FedAvg - loss_M
(positive: the claim's direction), paired by seed; the verdict is docs/claims.md's rule
(``paper_table.ranking_verdict``).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from pflkit.report.archive import files

sys.path.insert(0, str(Path(__file__).parent))
from paper_table import ranking_verdict  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "privacy.md"
MARK = "<!-- generated: benchmarks/privacy_doc.py writes everything below this line -->"
EPS = ["inf", "8", "3", "1"]
METHODS = ["fedavg", "ditto", "fedrep", "gpfl"]
PERSONALIZED = ["ditto", "fedrep", "gpfl"]
STAT = ("mean_last", "pers_acc_mean")


def per_seed(folder: Path, method: str) -> dict[int, float]:
    out = {}
    for p in files(folder, "summary.json", f"{method}*-s*"):
        name, seed = p.parent.name.rsplit("-s", 1)
        if name.split("(")[0] != method:
            continue
        s = json.loads(p.read_text())
        v = s.get(STAT[0], {}).get(STAT[1])
        if v is not None:
            out[int(seed)] = 100 * v
    return out


def folder(eps: str, method: str) -> str:
    """Where benchmarks/privacy_utility.sh puts ``method``'s runs at ``eps``."""
    return f"eps-{eps}-gpfl" if method == "gpfl" else f"eps-{eps}"


def epsilon_of(folder: Path) -> str:
    vals = sorted(
        {
            round(json.loads(p.read_text()).get("privacy", {}).get("epsilon", float("inf")), 2)
            for p in files(folder, "summary.json")
        }
    )
    return ", ".join("∞" if v == float("inf") else f"{v:g}" for v in vals) or "–"


def fmt(v: dict[int, float]) -> str:
    if not v:
        return "not run yet"
    a = np.array(list(v.values()))
    return f"{a.mean():.2f} ± {a.std():.2f} (n={len(a)})"


def utility(results: Path) -> tuple[list[str], dict]:
    acc = {e: {m: per_seed(results / folder(e, m), m) for m in METHODS} for e in EPS}
    acc_sim = {
        e: per_seed(results / f"pfedsim-{'local-' if e != 'inf' else ''}eps-{e}", "pfedsim")
        for e in ("inf", "8")
    }
    lines = [
        "## Privacy-utility table",
        "",
        "configs/privacy/fmnist_dp.yaml (its header says where every setting comes from): GPFL's",
        "prLS Fashion-MNIST at 10% data, 20 clients, MAP's LeNet, 20 rounds, uniform averaging for every",
        "method, client-level DP-FedAvg (central mode, C = 0.29, the median round-1 update norm),",
        "delta = 1/20, noise calibrated to each epsilon with the RDP accountant over the 20 rounds.",
        "Mean personalized test accuracy (%) over the last 3 rounds, mean ± std over 3 seeds.",
        "Runs: `benchmarks/privacy_utility.sh`; this table: `python benchmarks/privacy_doc.py`.",
        "",
        "| method | " + " | ".join(f"ε = {'∞ (no DP)' if e == 'inf' else e}" for e in EPS) + " |",
        "|---|" + "---|" * len(EPS),
    ]
    for m in METHODS:
        lines.append(f"| {m} | " + " | ".join(fmt(acc[e][m]) for e in EPS) + " |")
    lines.append(
        f"| pfedsim (mode: local) | {fmt(acc_sim['inf'])} | {fmt(acc_sim['8'])} | refused: central only | refused: central only |"
    )
    local = per_seed(results / "local", "local")
    lines.append(
        f"| local (nothing released: ε = 0 for every column) | {fmt(local)} | {fmt(local)} | {fmt(local)} | {fmt(local)} |"
    )
    if local and all(acc["1"][m] for m in METHODS):
        floor = float(np.mean(list(local.values())))
        above = [m for m in METHODS if np.mean(list(acc["1"][m].values())) > floor]
        lines += [
            "",
            f"At ε = 1, methods above Local's {floor:.2f}%: {', '.join(above) or 'none'}. "
            "A personalized method keeping its accuracy under DP here says that its private "
            "part carries it, not that federating under DP helps: in this setting (20 clients, "
            "all in every round, so no sampling amplification) the noised global part adds "
            "nothing over training alone.",
        ]
    lines += [
        "",
        "Client-level DP covers what leaves a client: Ditto's personal model and the heads of "
        "FedRep and GPFL are trained on the client's own data and never released, so they are "
        'not noised (docs/privacy.md, "The guarantee, precisely"). Under strong DP a '
        "personalized method can therefore fall back to what its private part learns alone; "
        "the Local row (each client trains alone, nothing leaves it) is that floor.",
        "",
        "The ε each arm spent (read from the runs' summary.json): "
        + "; ".join(f"arm {e}: {epsilon_of(results / f'eps-{e}')}" for e in EPS)
        + ".",
        "",
        "pFedPM cannot run under client-level DP: its upload names the classes a client holds "
        "(and their counts), statistics with no clipping defined, so pflkit refuses it. pFedSim's "
        "server mixes each client's extractor by the similarity of each client's classifier, "
        "which the central mechanism (only the noised mean reaches the server) cannot serve; it "
        "runs under `mode: local` (noise zC on each upload, the same accountant, a far noisier "
        "mechanism), in its own row: not comparable with the central rows.",
        "",
        "![accuracy against epsilon](img/privacy_utility.png)",
        "",
    ]
    return lines, acc


def bietti(acc: dict) -> list[str]:
    lines = [
        "## Bietti et al.: personalization loses less accuracy under DP",
        "",
        "Claim (Bietti, Wei, Dudík, Langford & Wu, ICML 2022): personalized methods lose less",
        "accuracy under client-level DP than FedAvg. Per seed, loss = acc(∞) - acc(ε), Δ =",
        "loss(FedAvg) - loss(method); the claim's direction is Δ > 0. Verdict rule of",
        "docs/claims.md (reproduced: the claim's sign and |mean Δ| > its std over seeds).",
        "",
        "| method | ε | loss of FedAvg | loss of the method | Δ | verdict |",
        "|---|---|---|---|---|---|",
    ]
    for m in PERSONALIZED:
        for e in EPS[1:]:
            seeds = sorted(
                set(acc["inf"]["fedavg"])
                & set(acc[e]["fedavg"])
                & set(acc["inf"][m])
                & set(acc[e][m])
            )
            if not seeds:
                lines.append(f"| {m} | {e} | – | – | – | not run yet |")
                continue
            lf = [acc["inf"]["fedavg"][s] - acc[e]["fedavg"][s] for s in seeds]
            lm = [acc["inf"][m][s] - acc[e][m][s] for s in seeds]
            d = [a - b for a, b in zip(lf, lm, strict=True)]
            verdict = ranking_verdict(d, 1.0) if len(d) >= 3 else "too few seeds"
            lines.append(
                f"| {m} | {e} | {np.mean(lf):.2f} ± {np.std(lf):.2f} | {np.mean(lm):.2f} ± "
                f"{np.std(lm):.2f} | {np.mean(d):+.2f} ± {np.std(d):.2f} (n={len(d)}) | {verdict} |"
            )
    lines.append("")
    return lines


def plot(acc: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.5, 3.6))
    xs = {"1": 1, "3": 3, "8": 8, "inf": 20}
    for m in METHODS:
        pts = [
            (xs[e], np.mean(list(acc[e][m].values())), np.std(list(acc[e][m].values())))
            for e in EPS
            if acc[e][m]
        ]
        if pts:
            pts.sort()
            x, y, s = zip(*pts, strict=True)
            ax.errorbar(x, y, yerr=s, marker="o", capsize=3, label=m)
    ax.set_xscale("log")
    ax.set_xticks([1, 3, 8, 20], ["1", "3", "8", "∞"])
    ax.set_xlabel("client-level ε (δ = 1/20)")
    ax.set_ylabel("personalized accuracy (%)")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def attacks(results: Path) -> list[str]:
    """The seed papers' privacy claims judged from results/privacy-attacks/claims.md (written
    by benchmarks/privacy_attacks.py), included as it is."""
    path = results / "claims.md"
    if not path.is_file():
        return [
            "## The seed papers' privacy claims",
            "",
            "Not run yet: `python benchmarks/privacy_attacks.py`.",
            "",
        ]
    return [path.read_text().rstrip(), ""]


def build(results: Path, attack_results: Path, image: Path | None) -> str:
    head = DOC.read_text().split(MARK)[0]
    lines, acc = utility(results)
    if image is not None:
        plot(acc, image)
    body = "\n".join(lines + bietti(acc) + attacks(attack_results))
    return head + MARK + "\n\n" + body.rstrip() + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--results", type=Path, default=ROOT / "results" / "privacy-fmnist")
    ap.add_argument("--attacks", type=Path, default=ROOT / "results" / "privacy-attacks")
    ap.add_argument("--check", action="store_true")
    a = ap.parse_args()
    if a.check:
        text = build(a.results, a.attacks, None)
        if text != DOC.read_text():
            print("docs/privacy.md is not what the runs give: python benchmarks/privacy_doc.py")
            return 1
        return 0
    DOC.write_text(build(a.results, a.attacks, ROOT / "docs" / "img" / "privacy_utility.png"))
    print(f"wrote {DOC.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
