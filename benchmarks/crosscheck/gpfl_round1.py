"""GPFL's first evaluated round in PFLlib and in pflkit (docs/crosscheck.md, GPFL row).

Both sides score, after one round, each client's model with the conditional input p_i of the
client's own trained GCE table, while its head trained with the zero inputs the code starts
from (PFLlib ``clientgpfl.py`` lines 31-32, ``set_GCE`` lines 101-113, called after training;
pflkit ``cond_source: local_previous``). This prints, per seed, the pooled accuracy as scored
and the same models scored with zero inputs:

    python benchmarks/crosscheck/gpfl_round1.py --pfllib /path/to/PFLlib \
        --python /path/to/ref-venv/bin/python --out runs/xc-gpfl-round1 --seeds 6

PFLlib runs one process per seed from a seeded copy (``crosscheck.seeded_copy``) whose
``clientgpfl.py`` also scores with zero inputs and whose ``servergpfl.py`` prints that
accuracy; nothing else in the copy changes. pflkit runs the cross-check's GPFL case (with
``train.drop_last``, as PFLlib) for one round per seed in this process.
"""

from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import sys
from pathlib import Path

import torch
import yaml

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from crosscheck import (  # noqa: E402
    CASES,
    CONFIGS,
    Usage,
    _one_thread,
    pfllib_command,
    prepare_pfllib,
    seeded_copy,
)

# The PFLlib copy's two additions: the zero-input accuracy per client, its pooled print
PATCHES = {
    "flcore/clients/clientgpfl.py": (
        "                test_num += y.shape[0]\n",
        "                test_num += y.shape[0]\n"
        "                zero = self.model.head(self.CoV(feat, torch.zeros_like("
        "self.personalized_conditional_input)))\n"
        "                self.acc_zero = getattr(self, 'acc_zero', 0) + "
        "(torch.argmax(zero, dim=1) == y).sum().item()\n",
    ),
    "flcore/servers/servergpfl.py": (
        "                self.evaluate()\n",
        "                for c in self.clients:\n"
        "                    c.acc_zero = 0\n"
        "                self.evaluate()\n"
        "                print('Zero-input Test Accuracy:', sum(c.acc_zero for c in self.clients)"
        " / sum(c.test_samples for c in self.clients))\n",
    ),
}
_SCORED = re.compile(r"Averaged Test Accuracy: ([0-9.]+)")
_ZERO = re.compile(r"Zero-input Test Accuracy: ([0-9.]+)")


def pfllib_round1(ref: Path, python: str, out: Path, cfg: dict, seed: int) -> tuple[float, float]:
    """(scored, zero-input) pooled accuracy of PFLlib's GPFL after one round, torch seed ``seed``."""
    case = CASES["gpfl"]
    name = prepare_pfllib(CONFIGS["pfllib"], cfg, ref, out)
    system = seeded_copy(out / "pfllib" / "system", seed)
    for rel, (old, new) in PATCHES.items():
        text = (system / rel).read_text()
        if new not in text:
            if text.count(old) != 1:
                raise Usage(f"PFLlib's {rel} has changed: this diagnostic needs d832e76's")
            (system / rel).write_text(text.replace(old, new))
    one = {**cfg, "train": {**cfg["train"], "rounds": 1}}
    cmd = [python, "-u", *pfllib_command(case, one, name, 1)]
    log = subprocess.run(
        cmd, cwd=system, capture_output=True, text=True, env=_one_thread(), check=True
    ).stdout
    return float(_SCORED.findall(log)[-1]), float(_ZERO.findall(log)[-1])


def pflkit_round1(cfg: dict, seed: int) -> tuple[float, float]:
    """(scored, zero-input) pooled accuracy of pflkit's GPFL case after one round."""
    from pflkit.algorithms import RoundContext
    from pflkit.algorithms.gpfl import GPFLNet, cov_params
    from pflkit.engine import Simulation
    from pflkit.experiment import validate
    from pflkit.primitives.training import predict

    case = CASES["gpfl"]
    raw = {**cfg, "algorithm": dict(case.pflkit), "seed": seed}
    raw["train"] = {**cfg["train"], "rounds": 1, "drop_last": True}
    with Simulation(validate(raw)) as sim:
        row = sim.run_round(1)
        right = total = 0
        for env in sim.envs:
            shared = sim.server["shared"]
            view, ctx = {"shared": shared}, RoundContext(1, "evaluate")
            model = sim.algo.personal_model(env, view, sim.client_state(env.cid), ctx)
            zero = torch.zeros(model.model.feature_dim)  # p_i = 0: CoV's conditional input
            model = GPFLNet(model.model, *cov_params(shared, zero))
            right += int((predict(model, env.data.test_x).argmax(1) == env.data.test_y).sum())
            total += len(env.data.test_y)
    return row["pers_acc_weighted"], right / total


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pfllib", type=Path, required=True, help="a PFLlib checkout")
    ap.add_argument("--python", default=sys.executable, help="interpreter for PFLlib")
    ap.add_argument("--out", type=Path, required=True, help="work folder (PFLlib's copies)")
    ap.add_argument("--seeds", type=int, default=6)
    args = ap.parse_args(argv)
    try:
        if args.seeds < 2:
            raise Usage(f"--seeds {args.seeds}: give at least 2 seeds")
        if not (args.pfllib / "system" / "main.py").is_file():
            raise Usage(f"--pfllib {args.pfllib} has no system/main.py: give a PFLlib checkout")
        cfg = yaml.safe_load(CONFIGS["pfllib"].read_text())
        args.out.mkdir(parents=True, exist_ok=True)
        rows = {"PFLlib": [], "pflkit": []}
        for s in range(args.seeds):
            rows["PFLlib"].append(pfllib_round1(args.pfllib, args.python, args.out, cfg, s))
            rows["pflkit"].append(pflkit_round1(cfg, s))
            print(f"seed {s}: PFLlib {rows['PFLlib'][-1]}, pflkit {rows['pflkit'][-1]}", flush=True)
    except Usage as err:
        print(f"gpfl_round1: {err}", file=sys.stderr)
        return 2
    print("\n| side | scored (p_i of the trained table) | zero inputs |\n|---|---:|---:|")
    for side, vals in rows.items():
        cols = [[100 * v[i] for v in vals] for i in (0, 1)]
        cells = [f"{statistics.mean(c):.1f} ± {statistics.stdev(c):.1f}" for c in cols]
        print(f"| {side} | {cells[0]} | {cells[1]} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
