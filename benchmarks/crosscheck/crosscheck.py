"""Cross-check pflkit against the authors' reference code on identical data (issue 35).

For each algorithm the harness

1. exports the config's partition (``pflkit export``) in the reference library's layout,
2. runs the reference implementation through its own entry point, with the hyper-parameters of
   :mod:`cases` (the same data, model, rounds, batch size, lr, local epochs and evaluation
   schedule as the pflkit config), and parses its per-round accuracy,
3. runs ``pflkit compare`` on the same config with the algorithm's authors'-code options,
4. prints one table per algorithm: both curves at every evaluated round, the final-round and
   last-10-round means over the seeds, their difference and whether it is inside seed noise.

Both sides report the **pooled** accuracy over every client's local test split (correct
predictions summed over clients / test samples summed over clients): PFLlib's "Averaged Test
Accuracy" is that number, and pflkit's ``pers_acc_weighted`` is the same pooling. Rounds are
counted alike: PFLlib's "Round number: i" is evaluated after i aggregations, pflkit's round i
after i rounds of training.

Seeds: PFLlib seeds torch once per process (``torch.manual_seed(0)`` in main.py) and runs
``-t`` repetitions one after the other, so its three "seeds" are its repetitions 0, 1, 2 of one
process; pflkit runs seeds 0, 1, 2. The two sides' seeds are therefore not paired; the verdict
compares the two means with the seeds' spread (``verdict``). PFLlib also calls
``torch.manual_seed(0)`` in every client's constructor, so its repetitions share every batch
order and differ only in the initial model; ``--independent-seeds`` runs each PFLlib seed as
its own process from a copy whose two seed calls use that seed (:func:`seeded_copy`).

    python benchmarks/crosscheck/crosscheck.py --pfllib ~/refs/PFLlib \
        --python ~/refenv/bin/python --algorithms fedavg,fedrep --out runs/xc

The reference checkouts are never copied into pflkit: the harness copies the reference's code
into ``--out`` (the reference writes its results beside its code) and runs it from there.
``--python`` is an interpreter with the reference's own dependencies (torchvision, h5py, ...);
pflkit's environment does not need them.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cases import CASES, Case  # noqa: E402

HERE = Path(__file__).resolve().parent
# each library's config: the setting of the seed paper whose table came from that library
CONFIGS = {"pfllib": HERE / "fmnist_practical_xc.yaml", "flbench": HERE / "fmnist_dir01_xc.yaml"}


class Usage(Exception):
    """A bad argument: one sentence, exit code 2."""


# ---------------------------------------------------------------- reference: PFLlib


def pfllib_command(case: Case, cfg: dict, name: str, seeds: int, device: str = "cpu") -> list[str]:
    """PFLlib's main.py arguments for ``case`` on the exported dataset ``name`` (``device``:
    PFLlib's -dev, cpu or cuda)."""
    tr, data = cfg["train"], cfg["data"]
    if cfg["model"]["name"] != "cnn4" or data["dataset"] not in ("fashion_mnist", "mnist"):
        raise Usage(
            "the PFLlib cross-check runs model cnn4 (PFLlib's FedAvgCNN) on fashion_mnist or mnist"
        )
    return [
        "main.py",
        *("-data", name, "-m", "CNN", "-algo", case.ref_name, "-dev", device),
        *("-nc", str(data["num_clients"]), "-ncl", "10", "-jr", str(tr["client_fraction"])),
        *("-lbs", str(tr["batch_size"]), "-lr", str(tr["lr"]), "-ls", str(tr["local_epochs"])),
        *("-gr", str(tr["rounds"]), "-eg", "1", "-t", str(seeds)),
        *case.ref_args,
    ]


_ROUND = re.compile(r"-+Round number: (\d+)-+")
_REPEAT = re.compile(r"Running time: (\d+)th")
# "Averaged" from serverbase.evaluate, "Average" from print_ (pFedMe's evaluate_personalized)
_ACC = re.compile(r"Averaged? Test Accuracy: ([0-9.]+)")


def parse_pfllib(text: str) -> list[dict[int, float]]:
    """Per repetition, {round: pooled test accuracy}. Where a round prints several accuracies
    (Ditto: the global model, then the personalized ones) the last one printed counts: every
    PFLlib server that evaluates twice evaluates the personalized models last."""
    runs: list[dict[int, float]] = []
    rnd = None
    for line in text.splitlines():
        if m := _REPEAT.search(line):
            runs.append({})
            rnd = None
        elif m := _ROUND.search(line):
            rnd = int(m.group(1))
        elif (m := _ACC.search(line)) and rnd is not None and runs:
            runs[-1][rnd] = float(m.group(1))
    return runs


# PFLlib's two torch seeds: once per process, and again in every client's constructor
PFLLIB_SEED_LINES = {
    "main.py": "torch.manual_seed(0)",
    "flcore/clients/clientbase.py": "torch.manual_seed(0)",
}


def seeded_copy(system: Path, seed: int) -> Path:
    """A copy of PFLlib's ``system`` folder whose two ``torch.manual_seed(0)`` calls
    (:data:`PFLLIB_SEED_LINES`) seed ``seed`` instead, so that its runs differ in batch order
    as well as initialisation (``--independent-seeds``). Refuses a checkout where either
    call is not there exactly once."""
    copy = system.with_name(f"system-seed{seed}")
    if not copy.is_dir():
        shutil.copytree(system, copy, ignore=shutil.ignore_patterns("__pycache__"))
        for rel, line in PFLLIB_SEED_LINES.items():
            text = (copy / rel).read_text()
            if text.count(line) != 1:
                raise Usage(
                    f"PFLlib's {rel} does not call {line} exactly once: this checkout "
                    "cannot run --independent-seeds"
                )
            (copy / rel).write_text(text.replace(line, f"torch.manual_seed({seed})"))
    return copy


def prepare_pfllib(cfg_path: Path, cfg: dict, ref: Path, out: Path) -> str:
    """Copy PFLlib's ``system`` folder to ``out/pfllib/system`` (where it runs: PFLlib writes
    its results beside its code) and export ``cfg``'s partition to ``out/pfllib/dataset/<name>``
    (each once); returns the dataset's name, PFLlib's -data."""
    work = out / "pfllib"
    if not (work / "system").is_dir():
        if not (ref / "system" / "main.py").is_file():
            raise Usage(f"--pfllib {ref} has no system/main.py: give a PFLlib checkout")
        shutil.copytree(
            ref / "system", work / "system", ignore=shutil.ignore_patterns("__pycache__")
        )
    name = f"{'FMNIST' if cfg['data']['dataset'] == 'fashion_mnist' else 'MNIST'}-{data_key(cfg)}"
    if not (work / "dataset" / name).is_dir():
        export(cfg_path, "pfllib", work / "dataset", name)
    return name


def run_pfllib(
    case: Case,
    cfg_path: Path,
    cfg: dict,
    ref: Path,
    python: str,
    out: Path,
    seeds: int,
    independent: bool = False,
):
    """(curves per repetition, seconds) of PFLlib's ``case`` on ``cfg``'s exported partition:
    one process running ``seeds`` repetitions, or with ``independent`` one process per seed
    with PFLlib's torch seed set to it (:func:`seeded_copy`)."""
    work = out / "pfllib"
    name = prepare_pfllib(cfg_path, cfg, ref, out)
    jobs = (
        [(seeded_copy(work / "system", s), 1, f"-seed{s}") for s in range(seeds)]
        if independent
        else [(work / "system", seeds, "")]
    )
    curves, seconds = [], 0.0
    for system, reps, tag in jobs:
        log = out / f"{case.key}-pfllib{tag}.log"
        cmd = [python, "-u", *pfllib_command(case, cfg, name, reps)]
        t0 = time.perf_counter()
        with open(log, "w") as f:
            f.write(" ".join(cmd) + "\n")
            f.flush()
            r = subprocess.run(
                cmd, cwd=system, stdout=f, stderr=subprocess.STDOUT, env=_one_thread()
            )
        seconds += time.perf_counter() - t0
        got = parse_pfllib(log.read_text())
        if r.returncode or len(got) != reps:
            raise RuntimeError(f"PFLlib {case.ref_name} failed (exit {r.returncode}); see {log}")
        curves += got
    return curves, seconds


# ---------------------------------------------------------------- reference: FL-bench

FLBENCH_MODELS = {"cnn4": "avgcnn", "lenet5_bn": "lenet5"}


def flbench_command(
    case: Case, cfg: dict, seed: int, verbose_gap: int = 100000, use_cuda: bool = False
) -> list[str]:
    """FL-bench's main.py overrides for ``case`` with training seed ``seed``. ``verbose_gap``:
    FL-bench logs "TRAINING EPOCH: r" (and each client's line) every that many rounds;
    ``use_cuda``: its common.use_cuda."""
    tr, data, model = cfg["train"], cfg["data"], cfg["model"]
    if model["name"] not in FLBENCH_MODELS or data["dataset"] not in ("fashion_mnist", "mnist"):
        raise Usage(
            "the FL-bench cross-check runs model cnn4 (FL-bench's avgcnn) or lenet5_bn (its "
            "lenet5) on fashion_mnist or mnist"
        )
    if model["name"] == "lenet5_bn" and not model.get("options", {}).get("fc_relu"):
        raise Usage("FL-bench's lenet5 has a ReLU after FC(84): set model.options.fc_relu: true")
    name = "fmnist" if data["dataset"] == "fashion_mnist" else "mnist"
    return [
        "main.py",
        f"method={case.ref_name}",
        f"dataset.name={name}",
        f"model.name={FLBENCH_MODELS[model['name']]}",
        f"common.seed={seed}",
        f"common.join_ratio={tr['client_fraction']}",
        f"common.global_epoch={tr['rounds']}",
        f"common.local_epoch={tr['local_epochs']}",
        f"common.batch_size={tr['batch_size']}",
        f"optimizer.lr={tr['lr']}",
        "common.test.client.interval=1",
        "common.client_side_evaluation=false",
        f"common.use_cuda={str(use_cuda).lower()}",
        "mode=serial",
        "common.save_learning_curve_plot=false",
        "common.save_metrics=false",
        f"common.verbose_gap={verbose_gap}",
        *case.ref_args,
    ]


_EPOCH = re.compile(r'^\s*"(\d+)": \{')
_FLB_ACC = re.compile(r'"accuracy": "([0-9.]+)% ->')


def parse_flbench(text: str) -> dict[int, float]:
    """{round: pooled test accuracy of every client's model before local training} from
    FL-bench's main.log (its closing JSON of test results; accuracies printed in %)."""
    curve: dict[int, float] = {}
    epoch = None
    for line in text.splitlines():
        if m := _EPOCH.match(line):
            epoch = int(m.group(1))
        elif (m := _FLB_ACC.search(line)) and epoch is not None:
            curve[epoch] = float(m.group(1)) / 100
    return curve


def prepare_flbench(cfg_path: Path, cfg: dict, ref: Path, out: Path) -> Path:
    """Copy the FL-bench checkout to ``out/flbench-<data key>`` (one copy per partition:
    FL-bench finds a dataset by its name only) with ``cfg``'s partition exported into its
    ``data/<dataset>`` (each once); returns the copy, where FL-bench's main.py runs."""
    code = out / f"flbench-{data_key(cfg)}"
    if not code.is_dir():
        if not (ref / "main.py").is_file() or not (ref / "src" / "server").is_dir():
            raise Usage(f"--flbench {ref} has no main.py and src/server: give an FL-bench checkout")
        shutil.copytree(ref, code, ignore=shutil.ignore_patterns(".git", "__pycache__", "out"))
    name = "fmnist" if cfg["data"]["dataset"] == "fashion_mnist" else "mnist"
    if not (code / "data" / name / "partition.pkl").is_file():
        shutil.rmtree(code / "data" / name, ignore_errors=True)
        export(cfg_path, "flbench", code / "data", name)
    return code


def run_flbench(
    case: Case, cfg_path: Path, cfg: dict, ref: Path, python: str, out: Path, seeds: int
):
    """(curves per seed, seconds) of FL-bench's ``case``, one process per seed."""
    code = prepare_flbench(cfg_path, cfg, ref, out)
    curves, seconds = [], 0.0
    for seed in range(seeds):
        log = out / f"{case.key}-flbench-s{seed}.log"
        cmd = [python, *flbench_command(case, cfg, seed)]
        t0 = time.perf_counter()
        with open(log, "w") as f:
            f.write(" ".join(cmd) + "\n")
            f.flush()
            r = subprocess.run(cmd, cwd=code, stdout=f, stderr=subprocess.STDOUT, env=_one_thread())
        seconds += time.perf_counter() - t0
        # FL-bench's main.py fixes its run folder: out/<method>/<dataset>/<start time>/
        logs = sorted((code / "out" / case.ref_name).glob("*/*/main.log"), key=os.path.getmtime)
        curve = parse_flbench(logs[-1].read_text()) if logs else {}
        if r.returncode or not complete(curve, cfg["train"]["rounds"]):
            raise RuntimeError(
                f"FL-bench {case.ref_name} seed {seed} failed (exit {r.returncode}); see {log}"
            )
        curves.append(curve)
    return curves, seconds


def complete(curve: dict[int, float], rounds: int) -> bool:
    """Whether a reference curve runs without a gap from its first round to round ``rounds``.
    It may start late: f-FedAP's FL-bench tests only after its pre-training rounds (its curve
    starts at round ``warmup_ratio * rounds + 1``)."""
    return bool(curve) and sorted(curve) == list(range(min(curve), rounds + 1))


# ---------------------------------------------------------------- pflkit


def data_key(cfg: dict) -> str:
    """A short digest of the config's data section: one export per distinct partition."""
    return hashlib.sha256(json.dumps(cfg["data"], sort_keys=True).encode()).hexdigest()[:8]


def export(cfg_path: Path, fmt: str, out: Path, name: str) -> None:
    cmd = [sys.executable, "-m", "pflkit", "export", str(cfg_path), "--format", fmt]
    subprocess.run([*cmd, "--out", str(out), "--name", name], check=True)


def pflkit_config(case: Case, cfg: dict, seeds: int) -> dict:
    """The config of ``case``'s pflkit side: the shared ``cfg`` with the case's settings, its
    algorithm, and a compare over ``seeds`` seeds."""
    cfg = {**cfg, "name": f"xc-{case.key}"}
    for section, values in case.settings.items():
        cfg[section] = {**cfg.get(section, {}), **values}
    cfg["algorithm"] = dict(case.pflkit)
    cfg["compare"] = {"seeds": list(range(seeds)), "algorithms": [dict(case.pflkit)]}
    return cfg


def run_pflkit(case: Case, cfg: dict, out: Path, seeds: int):
    """(curves per seed, seconds) of ``pflkit compare`` with ``case``'s pflkit options."""
    path = out / f"{case.key}-pflkit.yaml"
    path.write_text(yaml.safe_dump(pflkit_config(case, cfg, seeds), sort_keys=False))
    folder = out / f"{case.key}-pflkit"
    cmd = [sys.executable, "-m", "pflkit", "compare", str(path), "--out", str(folder), "-q"]
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, env=_one_thread())
    seconds = time.perf_counter() - t0
    curves = []
    for s in range(seeds):
        runs = [p for p in folder.iterdir() if p.is_dir() and p.name.endswith(f"-s{s}")]
        if len(runs) != 1:
            raise RuntimeError(
                f"pflkit compare left {len(runs)} run folders for seed {s} in {folder}"
            )
        run = runs[0]
        rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
        curves.append(
            {r["round"]: r["pers_acc_weighted"] for r in rows if "pers_acc_weighted" in r}
        )
    return curves, seconds


def commit(checkout: Path) -> str:
    """The reference checkout's commit (the table names it): a copy's ``COMMIT`` file
    (benchmarks/gpu_kit.sh writes one), else git's; "unknown" for a folder that is not the top
    of its own git checkout (a copy inside another repository would otherwise report that
    repository's commit)."""
    if (stamp := Path(checkout) / "COMMIT").is_file():
        return stamp.read_text().strip() or "unknown"

    def git(*args: str) -> str:
        r = subprocess.run(["git", "-C", str(checkout), *args], capture_output=True, text=True)
        return r.stdout.strip()

    top = git("rev-parse", "--show-toplevel")
    if not top or Path(top).resolve() != Path(checkout).resolve():
        return "unknown"
    return git("rev-parse", "--short", "HEAD") or "unknown"


def summary(paths: list[Path]) -> str:
    """One markdown row per case from results.jsonl files: docs/crosscheck.md's table."""
    rows = [json.loads(x) for p in paths for x in p.read_text().splitlines() if x.strip()]
    # a case run again: its last row; a run with independent PFLlib seeds is a row of its own
    latest = {(r["algorithm"], r.get("reference_seeds")): r for r in rows}
    out = [
        "| case | reference (commit) | pflkit options | reference, last-10 mean (%) | "
        "pflkit, last-10 mean (%) | pflkit - reference | verdict | s reference / pflkit |",
        "|---|---|---|---:|---:|---:|---|---:|",
    ]
    for r in latest.values():
        case = CASES[r["algorithm"]]
        opts = r.get("options") or ", ".join(
            f"{k}={v}" for k, v in case.pflkit.items() if k != "name"
        )
        label = r["algorithm"] + (" (independent seeds)" if r.get("reference_seeds") else "")
        out.append(
            f"| {label} | {case.library} {case.ref_name} ({r.get('ref_commit', '?')}) | "
            f"{opts or 'defaults'} | {_ms(r['reference'])} | {_ms(r['pflkit'])} | "
            f"{100 * r['diff']:+.2f} ± {100 * r['se']:.2f} | {r['verdict']} | "
            f"{r['seconds_reference']:.0f} / {r['seconds_pflkit']:.0f} |"
        )
    return "\n".join(out)


def _one_thread() -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


# ---------------------------------------------------------------- comparison


def last_mean(curve: dict[int, float], last: int) -> float:
    rounds = sorted(curve)[-last:]
    return statistics.fmean(curve[r] for r in rounds)


def verdict(a: list[float], b: list[float]) -> tuple[float, float, str]:
    """(difference of means b - a, its standard error, verdict). Unpaired: the two libraries'
    seeds are different random streams. "within noise" when the difference is at most two
    standard errors (Welch's, from the seeds' sample standard deviations)."""
    diff = statistics.fmean(b) - statistics.fmean(a)
    se = math.sqrt(statistics.variance(a) / len(a) + statistics.variance(b) / len(b))
    return diff, se, "within noise" if abs(diff) <= 2 * se else "differs"


def _ms(xs: list[float]) -> str:
    return f"{100 * statistics.fmean(xs):.2f} ± {100 * statistics.stdev(xs):.2f}"


def table(
    case: Case, ref: list[dict], ours: list[dict], last: int, secs: tuple[float, float]
) -> str:
    rounds = sorted(set.intersection(*(set(c) for c in ref + ours)) - {0})
    lines = [
        f"### {case.key}: {case.library} `{case.ref_name} {' '.join(case.ref_args)}` vs pflkit "
        f"`{json.dumps(case.pflkit)}`",
        "",
        f"{case.note}",
        "",
        "| round | reference (mean ± std, %) | pflkit (mean ± std, %) |",
        "|---:|---:|---:|",
    ]
    for r in rounds:
        lines.append(f"| {r} | {_ms([c[r] for c in ref])} | {_ms([c[r] for c in ours])} |")
    final_r, final_o = [c[rounds[-1]] for c in ref], [c[rounds[-1]] for c in ours]
    last_r, last_o = [last_mean(c, last) for c in ref], [last_mean(c, last) for c in ours]
    lines += [
        "",
        "| statistic | reference | pflkit | pflkit - reference | verdict |",
        "|---|---:|---:|---:|---|",
    ]
    for label, a, b in (("final", final_r, final_o), (f"last-{last} mean", last_r, last_o)):
        d, se, v = verdict(a, b)
        lines.append(f"| {label} | {_ms(a)} | {_ms(b)} | {100 * d:+.2f} ± {100 * se:.2f} | {v} |")
    lines += ["", f"Wall time, all seeds: reference {secs[0]:.0f} s, pflkit {secs[1]:.0f} s.", ""]
    return "\n".join(lines)


def summary_row(case: Case, ref, ours, last: int, secs) -> dict:
    a, b = [last_mean(c, last) for c in ref], [last_mean(c, last) for c in ours]
    d, se, v = verdict(a, b)
    return {
        "algorithm": case.key,
        "library": case.library,
        "reference": [last_mean(c, last) for c in ref],
        "pflkit": [last_mean(c, last) for c in ours],
        "diff": d,
        "se": se,
        "verdict": v,
        "seconds_reference": secs[0],
        "seconds_pflkit": secs[1],
        "curves_reference": [{str(k): v for k, v in c.items()} for c in ref],
        "curves_pflkit": [{str(k): v for k, v in c.items()} for c in ours],
    }


def aligned(curve: dict[int, float], shift: int, rounds: int) -> dict[int, float]:
    """The reference's curve under pflkit's round labels (``Case.round_shift``), rounds
    ``0..rounds`` only."""
    return {r + shift: a for r, a in curve.items() if 0 <= r + shift <= rounds}


def pflkit_overrides(items: list[str]) -> dict:
    """``--pflkit-option KEY=VALUE`` items as algorithm options (values read as YAML)."""
    out = {}
    for item in items:
        key, eq, value = item.partition("=")
        if not eq or not key.strip() or key.strip() == "name":
            raise Usage(
                f"--pflkit-option '{item}' is not KEY=VALUE of an algorithm option: write e.g. "
                "--pflkit-option gen_labels=seen"
            )
        out[key.strip()] = yaml.safe_load(value)
    return out


def pflkit_options(case: Case, cfg: dict) -> str:
    """The pflkit side's settings beside the config's shared ones: the algorithm's options, the
    case's other settings and the config's train.drop_last (docs/crosscheck.md's column)."""
    opts = [f"{k}={v}" for k, v in case.pflkit.items() if k != "name"]
    opts += [f"{s}.{k}={v}" for s, values in case.settings.items() for k, v in values.items()]
    if cfg["train"].get("drop_last"):
        opts.append("train.drop_last=True")
    return ", ".join(opts)


def load_reference(path: Path) -> tuple[list[dict[int, float]], float]:
    """The reference curves and seconds that an interrupted cross-check kept in ``path``."""
    kept = json.loads(path.read_text())
    return [{int(r): a for r, a in c.items()} for c in kept["curves"]], kept["seconds"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", type=Path, help="one config for every case (default: CONFIGS)")
    ap.add_argument("--algorithms", default="", help="comma-separated case keys (default: all)")
    ap.add_argument("--pfllib", type=Path, help="a PFLlib checkout (TsingZ0/PFLlib)")
    ap.add_argument("--flbench", type=Path, help="an FL-bench checkout (KarhouTam/FL-bench)")
    ap.add_argument("--python", default=sys.executable, help="interpreter for the references")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument(
        "--independent-seeds",
        action="store_true",
        help="PFLlib cases: one process per seed with PFLlib's torch seed set to it, so its "
        "seeds differ in batch order too (default: one process, -t repetitions)",
    )
    ap.add_argument(
        "--pflkit-option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="one case only: set (or change) an algorithm option of its pflkit side, e.g. "
        "gen_labels=seen, to find which option closes a gap (repeatable; the row names it)",
    )
    ap.add_argument("--last", type=int, default=10, help="rounds in the last-rounds mean")
    ap.add_argument("--out", type=Path, help="results folder (rerunning into it continues)")
    ap.add_argument("--list", action="store_true", help="list the cases and exit")
    ap.add_argument(
        "--summary",
        nargs="+",
        type=Path,
        metavar="RESULTS_JSONL",
        help="print docs/crosscheck.md's table from results.jsonl files and exit",
    )
    args = ap.parse_args(argv)
    try:
        if args.list:
            for c in CASES.values():
                print(
                    f"{c.key}\t{c.library}\t{c.ref_name} {' '.join(c.ref_args)}\t{json.dumps(c.pflkit)}"
                )
            return 0
        if args.summary:
            if missing := [str(p) for p in args.summary if not p.is_file()]:
                raise Usage(f"no results file {', '.join(missing)}: give results.jsonl files")
            print(summary(args.summary))
            return 0
        if args.out is None:
            raise Usage("give --out DIR, the folder for the runs and results.jsonl")
        keys = [k for k in args.algorithms.split(",") if k] or list(CASES)
        if unknown := [k for k in keys if k not in CASES]:
            raise Usage(f"unknown case(s) {', '.join(unknown)}: choose from {', '.join(CASES)}")
        if args.seeds < 2:
            raise Usage(f"--seeds {args.seeds}: seed noise needs at least 2 seeds")
        options = pflkit_overrides(args.pflkit_option)
        if options and len(keys) != 1:
            raise Usage(
                f"--pflkit-option changes one case's pflkit side: give one case with "
                f"--algorithms, not {len(keys)}"
            )
        if args.independent_seeds and (fl := [k for k in keys if CASES[k].library != "pfllib"]):
            raise Usage(
                f"--independent-seeds applies to PFLlib cases only ({', '.join(fl)} run "
                "FL-bench, which already runs one seeded process per seed): drop them or the flag"
            )
        refs = {"pfllib": args.pfllib, "flbench": args.flbench}
        for lib in sorted({CASES[k].library for k in keys}):
            if refs[lib] is None:
                raise Usage(
                    f"cases {', '.join(k for k in keys if CASES[k].library == lib)} "
                    f"run {lib}: give --{lib} PATH (a checkout)"
                )
        if args.config is not None and not args.config.is_file():
            raise Usage(f"--config {args.config} is not a file")
        args.out.mkdir(parents=True, exist_ok=True)
        results = args.out / "results.jsonl"
        done = (
            {json.loads(x)["algorithm"] for x in results.read_text().splitlines()}
            if results.exists()
            else set()
        )
        runners = {"pfllib": run_pfllib, "flbench": run_flbench}
        for key in keys:
            case = replace(CASES[key], pflkit={**CASES[key].pflkit, **options})
            if key in done:
                print(f"{key}: kept from an earlier run in {results}", flush=True)
                continue
            cfg_path = args.config or CONFIGS[case.library]
            cfg = yaml.safe_load(cfg_path.read_text())
            tag = "-independent" if args.independent_seeds else ""
            kept = args.out / f"{key}-reference{tag}.json"  # the reference side, once finished
            if kept.exists():
                ref, t_ref = load_reference(kept)
                print(f"{key}: the reference side is kept in {kept}", flush=True)
            else:
                extra = {"independent": True} if args.independent_seeds else {}
                ref, t_ref = runners[case.library](
                    case,
                    cfg_path,
                    cfg,
                    refs[case.library],
                    args.python,
                    args.out,
                    args.seeds,
                    **extra,
                )
                kept.write_text(json.dumps({"curves": ref, "seconds": t_ref}))
            ref = [aligned(c, case.round_shift, cfg["train"]["rounds"]) for c in ref]
            ours, t_ours = run_pflkit(case, cfg, args.out, args.seeds)
            print(table(case, ref, ours, args.last, (t_ref, t_ours)), flush=True)
            row = summary_row(case, ref, ours, args.last, (t_ref, t_ours))
            row |= {
                "config": str(cfg_path),
                "ref_commit": commit(refs[case.library]),
                "options": pflkit_options(case, cfg),
            }
            if args.independent_seeds:
                row["reference_seeds"] = "independent"
            with open(results, "a") as f:
                f.write(json.dumps(row) + "\n")
    except Usage as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
