"""Deliberate breaks of MAP's defining math (issue 10): apply each to src/, run tests/test_map.py,
revert, and print which tests caught it. Run from anywhere:  python tests/mutations/map_breaks.py
(needs a clean src/ tree; every break is reverted even on error)."""

import os
import pathlib
import subprocess
import sys

R = pathlib.Path(__file__).resolve().parents[2]
B = [
    (
        "RS logits scaled by alpha^2",
        "src/pflkit/algorithms/blocks/rs.py",
        "F.cross_entropy(model(x) * scale, y)",
        "F.cross_entropy(model(x) * scale * scale, y)",
    ),
    (
        "Eq.13 lambda swapped",
        "src/pflkit/algorithms/blocks/hpm.py",
        "(1 - p.lam) * F.cross_entropy(logits, y) + p.lam * kt",
        "p.lam * F.cross_entropy(logits, y) + (1 - p.lam) * kt",
    ),
    (
        "KT teacher is the student",
        "src/pflkit/algorithms/blocks/hpm.py",
        "            hp = teacher.features(x)\n            gp = teacher.head(hp)",
        "            hp = model.features(x)\n            gp = model.head(hp)",
    ),
    (
        "KD sums over the batch",
        "src/pflkit/algorithms/blocks/hpm.py",
        'reduction="batchmean"',
        'reduction="sum"',
    ),
    (
        "partition drops 1/n_k",
        "src/pflkit/data/partition.py",
        "d[client, chosen] = 1.0 / n_k[client]",
        "d[client, chosen] = 1.0",
    ),
    (
        "protocol scores the upload",
        "src/pflkit/algorithms/base.py",
        '        return personal if personal is not None else upload["weights"]',
        '        return upload["weights"]',
    ),
    (
        "protocol scores every client",
        "src/pflkit/engine/simulation.py",
        "self.runner.evaluate(rnd, {cid: views[cid] for cid in uploads}, uploads)",
        "self.runner.evaluate(rnd, views, uploads)",
    ),
    (
        "stage B ignores stage_b_lr_scale",
        "src/pflkit/algorithms/map.py",
        "lr_b = env.run.train.lr * self.params.stage_b_lr_scale",
        "lr_b = env.run.train.lr",
    ),
    (
        "FedPHP uploads its HPM",
        "src/pflkit/algorithms/fedphp.py",
        'upload = {"weights": get_weights(model), "num_samples": env.num_train}',
        'upload = {"weights": state["hpm"], "num_samples": env.num_train}',
    ),
]
for name, f, old, new in B:
    p = R / f
    s = p.read_text()
    assert s.count(old) == 1, (name, s.count(old))
    p.write_text(s.replace(old, new))
    try:
        r = subprocess.run(
            [
                sys.executable,
                "-m",
                "pytest",
                "-q",
                "tests/test_map.py",
                "-p",
                "no:cacheprovider",
            ],
            cwd=R,
            capture_output=True,
            text=True,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
        failed = [
            l.split("::")[1].split(" ")[0] for l in r.stdout.splitlines() if l.startswith("FAILED")
        ]
        print(
            f"{name}: {'CAUGHT by ' + ','.join(failed) if r.returncode else 'NOT CAUGHT'}",
            flush=True,
        )
    finally:
        p.write_text(s)
