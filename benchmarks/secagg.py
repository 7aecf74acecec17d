"""Secure aggregation overhead on Flower: the same config plain and with ``--secagg``, side by
side on one local federation (a SuperLink and SuperNodes on 127.0.0.1, started once).

Per mode and run: the ``flwr run`` wall time; per round (medians) the training phase
(``seconds_train``: for --secagg the four SecAgg+ stages with the training inside the third)
and the evaluation; the bytes of the records the ServerApp sent to and received from the nodes
in a round (array data and config values, as the ServerApp's round log line reports them;
Flower's framing not counted); and pflkit's logical upload per client and round
(``bytes_up``). Runs alternate (plain, secagg, plain, ...) so that machine noise hits both.

    python benchmarks/secagg.py [--nodes 3] [--rounds 3] [--hidden 32] [--repeat 1]

The config: scikit-learn digits, one client per node, an MLP with ``--hidden`` units, FedAvg,
evaluation in the last round only, one torch thread.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from pflkit.experiment import validate
from pflkit.flower.local import Federation, split_clients
from pflkit.flower.secagg import SecAggOptions

LINE = re.compile(r"pflkit: round (\d+)/\d+ .*\(records: (\d+) bytes sent, (\d+) received\)")


def config(clients: int, rounds: int, hidden: list[int]) -> dict:
    return {
        "name": "bench-secagg",
        "seed": 0,
        "threads": 1,
        "data": {
            "dataset": "digits",
            "num_clients": clients,
            "partition": {"name": "dirichlet", "alpha": 0.5},
            "test_fraction": 0.25,
        },
        "model": {"name": "mlp", "options": {"hidden": hidden}},
        "algorithm": {"name": "fedavg"},
        "train": {"rounds": rounds, "batch_size": 16, "lr": 0.05, "local_epochs": 1},
        "eval": {"every": rounds},
        "output": {"progress": False},
        "engine": {"workers": 1},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--hidden", type=int, nargs="+", default=[32])
    ap.add_argument("--repeat", type=int, default=1)
    args = ap.parse_args()
    cfg = validate(config(args.nodes, args.rounds, args.hidden))
    work = Path(tempfile.mkdtemp(prefix="pflkit-bench-secagg-"))
    stats: dict[str, dict[str, list[float]]] = {}
    with Federation(split_clients(args.nodes, args.nodes), work / "fed") as fed:
        for i in range(args.repeat):
            for mode in ("plain", "secagg"):
                out = work / f"{mode}-{i}"
                extra = SecAggOptions().run_config() if mode == "secagg" else {}
                t0 = time.perf_counter()
                fed.run(cfg.to_yaml(), out, timeout=3600, **extra)
                wall = time.perf_counter() - t0
                rows = [json.loads(x) for x in (out / "metrics.jsonl").open()]
                log = (work / "fed" / "flwr-run.log").read_text()
                traffic = [(int(s), int(r)) for _, s, r in LINE.findall(log)]
                s = stats.setdefault(mode, {})
                s.setdefault("wall", []).append(wall)
                s.setdefault("train", []).extend(r["seconds_train"] for r in rows)
                s.setdefault("eval", []).extend(r["seconds_eval"] for r in rows[-1:])
                # a training round's traffic: the rounds without evaluation
                s.setdefault("sent", []).extend(t[0] for t in traffic[:-1])
                s.setdefault("received", []).extend(t[1] for t in traffic[:-1])
                s.setdefault("up", []).append(rows[0]["bytes_up"][0])
                s.setdefault("final", []).append(rows[-1]["global_acc"])
                print(f"{mode} run {i + 1}: {wall:.1f} s", flush=True)
    shutil.rmtree(work, ignore_errors=True)
    med = {m: {k: statistics.median(v) for k, v in s.items()} for m, s in stats.items()}
    p, q = med["plain"], med["secagg"]
    print(
        f"\n{args.nodes} SuperNodes (one client each), MLP {args.hidden} on digits, "
        f"{args.rounds} rounds, medians of {args.repeat} run(s) per mode\n"
    )
    print("| | plain | --secagg | ratio |")
    print("|---|---|---|---|")
    for key, label, fmt in (
        ("wall", "`flwr run` wall time (s)", "{:.1f}"),
        ("train", "training phase per round (s)", "{:.1f}"),
        ("eval", "evaluation round (s)", "{:.1f}"),
        ("sent", "bytes sent by the server per training round", "{:,.0f}"),
        ("received", "bytes received by the server per training round", "{:,.0f}"),
        ("up", "logical upload per client and round (bytes)", "{:,.0f}"),
        ("final", "final global accuracy", "{:.4f}"),
    ):
        ratio = q[key] / p[key] if p[key] else float("nan")
        print(f"| {label} | {fmt.format(p[key])} | {fmt.format(q[key])} | {ratio:.2f}x |")


if __name__ == "__main__":
    main()
