"""Populations of 1,000 to 100,000 clients on one machine (issue 53): what a round costs when
the population grows and the cohort does not.

Each case is one ``pflkit run`` in a subprocess of its own, with 20 clients a round
(``train.client_fraction`` = 20 / clients), a few rounds, and one evaluation at the last round
of a seeded sample of clients (``eval.clients``). While it runs, this script samples the sum of
the proportional set sizes (PSS: shared pages split between the processes that share them, so
the workers' copy-on-write view of the dataset counts once) over the run's process tree every
0.2 s: the peak is the memory figure. From the run's metrics.jsonl it takes the seconds per
round (``seconds_train``, the mean over the rounds after the first) and the evaluation's seconds
(``seconds_eval`` of the last round); the seconds to partition are measured apart, in a fresh
process, as ``build_federated`` with the partition cache off.

Cases:

- ``synthetic``: FedProx's Synthetic(1, 1) with 10,000 users (about 4.2 M samples, one
  dataset for every population size), split over 1,000 / 10,000 / 100,000 clients of 40
  samples on average (a subset at the smaller sizes) by the client-first label-skew
  partitioner (``dirichlet_clients``, alpha 0.3), an MLP; FedAvg, Ditto, FedRep. The cohort's
  work is the same at every size, so these rows judge the goals.
- ``fmnist``: Fashion-MNIST's 60,000 training images, all of them, over 1,000 / 10,000
  clients (60 and 6 samples a client on average), the same partitioner, ``cnn4``; FedAvg,
  Ditto, FedRep.
- ``resnet``: Ditto with ResNet-18 on Fashion-MNIST, 1,000 clients, 6 rounds: 47 MB a
  personal state (about 47 GB once every client has trained), ``engine.state_memory`` 512 MB,
  so most of the 120 trained clients' states live on disk, and every client scored at the
  last round (a never-trained client is scored with the global model: Ditto's first state
  is empty).

    python benchmarks/population.py                       # every case (about an hour on 2 cores)
    python benchmarks/population.py --cases synthetic --clients 1000,100000 --rounds 3
    python benchmarks/population.py --out docs/population.json

Goals (issue 53): peak memory at 100,000 clients at most 1.5x that at 1,000 (same cohort);
seconds per round at most 1.3x; the ResNet-18 run finishes within the machine's 24 GB;
partitioning 100,000 clients under 30 s.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).parent))
from bench_fedavg import process_tree, pss_mib  # noqa: E402

# one synthetic dataset for every population (10,000 users, about 4.2 M samples), each client
# 40 samples on average whatever the population: the cohort's work is the same at every size
SYNTHETIC = {
    "dataset": "synthetic",
    "options": {"num_users": 10000},
    "partition": {"name": "dirichlet_clients", "alpha": 0.3, "mean_size": 40},
}
# Fashion-MNIST's 60,000 training images, all of them: clients get smaller as they get more
FMNIST = {"dataset": "fashion_mnist", "partition": {"name": "dirichlet_clients", "alpha": 0.3}}


def case_config(data: dict, clients: int, algorithm: str, model: dict, rounds: int) -> dict:
    """One run: ``clients`` clients, 20 a round, one sampled evaluation at the last round."""
    return {
        "name": f"population-{clients}",
        "seed": 0,
        "data": {**data, "num_clients": clients, "test_fraction": 0.25},
        "model": model,
        "algorithm": {"name": algorithm},
        "train": {"rounds": rounds, "client_fraction": 20 / clients, "batch_size": 10},
        "eval": {"every": rounds, "clients": 100, "global_model": False},
        "output": {"progress": False},
    }


class Peak:
    """The peak over time of the PSS summed over a process and everything below it."""

    def __init__(self, pid: int):
        self.pid, self.peak_mib = pid, 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.peak_mib = max(self.peak_mib, pss_mib(process_tree(self.pid)))
            time.sleep(0.2)

    def stop(self) -> float:
        self._stop.set()
        self._thread.join()
        return self.peak_mib


def partition_seconds(data: dict, clients: int) -> float:
    """Seconds of ``build_federated`` (load, partition, split) with the cache off, in a fresh
    process."""
    cfg = {**data, "num_clients": clients, "cache": False}
    code = (
        "import time; from pflkit.config import DataConfig; "
        "from pflkit.data.federated import build_federated; "
        "from pflkit.data.sources import load_source, default_data_root; "
        f"cfg = DataConfig(**{cfg!r}); "
        "load_source(cfg.dataset, default_data_root(), **cfg.options); "  # the source, cached
        "t = time.perf_counter(); build_federated(cfg); print(time.perf_counter() - t)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return float(out.stdout.split()[-1])


def run_case(cfg: dict, sets: list[str], work: Path) -> dict:
    """Run ``cfg`` (with ``--set`` overrides ``sets``) in a subprocess; its figures."""
    folder = work / f"{cfg['name']}-{cfg['algorithm']['name']}-{len(list(work.iterdir()))}"
    path = folder.with_suffix(".yaml")
    path.write_text(yaml.safe_dump(cfg))
    cmd = [sys.executable, "-m", "pflkit", "run", str(path), "--out", str(folder), "-q"]
    for item in sets:
        cmd += ["--set", item]
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
    peak = Peak(proc.pid)
    _, err = proc.communicate()
    peak_mib, wall = peak.stop(), time.perf_counter() - start
    if proc.returncode:
        return {"error": err.strip().splitlines()[-1] if err.strip() else f"exit {proc.returncode}"}
    rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    train = [r["seconds_train"] for r in rows[1:]] or [rows[0]["seconds_train"]]
    states = folder / "states"
    return {
        "peak_pss_gib": peak_mib / 1024,
        "s_per_round": sum(train) / len(train),
        "eval_s": rows[-1]["seconds_eval"],
        "wall_s": wall,
        "pers_acc": rows[-1].get("pers_acc_mean"),
        "state_files": len(list(states.iterdir())) if states.exists() else 0,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", default="synthetic,fmnist,resnet")
    ap.add_argument("--clients", default="1000,10000,100000", help="population sizes")
    ap.add_argument("--algorithms", default="fedavg,ditto,fedrep")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--out", type=Path, help="also write the results as JSON here")
    args = ap.parse_args()
    sizes = [int(x) for x in args.clients.split(",")]
    algorithms = args.algorithms.split(",")
    results = []
    with tempfile.TemporaryDirectory(prefix="pflkit-population-") as tmp:
        work = Path(tmp)
        plans = []
        cases = args.cases.split(",")
        mlp, cnn4 = {"name": "mlp", "options": {"hidden": [200]}}, {"name": "cnn4"}
        if "synthetic" in cases:
            plans += [("synthetic", SYNTHETIC, n, a, mlp, []) for n in sizes for a in algorithms]
        if "fmnist" in cases:
            fm = [n for n in sizes if n <= 10_000]
            plans += [("fmnist", FMNIST, n, a, cnn4, []) for n in fm for a in algorithms]
        if "resnet" in cases:
            sets = ["engine.state_memory=512MB", "eval.clients=all"]
            plans.append(("resnet", FMNIST, 1000, "ditto", {"name": "resnet18"}, sets))
        parted: dict[tuple[str, int], float] = {}
        for name, data, n, algo, model, sets in plans:
            key = (name if name != "resnet" else "fmnist", n)
            if key not in parted:
                parted[key] = partition_seconds(data, n)
            cfg = case_config(data, n, algo, model, 6 if name == "resnet" else args.rounds)
            row = {"case": name, "clients": n, "algorithm": algo, "partition_s": parted[key]}
            row |= run_case(cfg, sets, work)
            results.append(row)
            print(json.dumps(row), flush=True)
    print()
    print("| case | clients | algorithm | peak PSS (GiB) | s/round | eval s | partition s |")
    print("|---|---:|---|---:|---:|---:|---:|")
    for r in results:
        if "error" in r:
            print(f"| {r['case']} | {r['clients']:,} | {r['algorithm']} | {r['error']} | | | |")
            continue
        print(
            f"| {r['case']} | {r['clients']:,} | {r['algorithm']} | {r['peak_pss_gib']:.2f} "
            f"| {r['s_per_round']:.2f} | {r['eval_s']:.1f} | {r['partition_s']:.1f} |"
        )
    print()
    for name in ("synthetic", "fmnist"):  # the goals: the largest population against 1,000
        for algo in algorithms:
            runs = {r["clients"]: r for r in results if (r["case"], r["algorithm"]) == (name, algo)}
            small, large = runs.get(1000), runs.get(max(runs, default=0))
            if small and large and large is not small and "error" not in small | large:
                print(
                    f"{name} {algo}: {large['clients']:,} vs 1,000 clients: peak memory "
                    f"{large['peak_pss_gib'] / small['peak_pss_gib']:.2f}x (goal <= 1.5x), "
                    f"s/round {large['s_per_round'] / small['s_per_round']:.2f}x (goal <= 1.3x)"
                )
    if args.out:
        args.out.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
