#!/usr/bin/env bash
# pFedSim Table 3 reproduction on real Fashion-MNIST (docs/pfedsim.md, "Reproduction"): every
# method of configs/pfedsim/fmnist_dir01.yaml (its 3 seeds first: Dir(0.1) is where the paper's
# claim is sharpest), then fmnist_dir05.yaml; JOBS whole runs at a time (one torch thread
# each), into runs/pfedsim-dir<A>, every finished run kept in results/pfedsim-dir<A>
# (benchmarks/compare_kept.sh) and not run again:
#   benchmarks/pfedsim_repro.sh [JOBS]            # default 2
#   python benchmarks/paper_table.py pfedsim/dir01 results/pfedsim-dir01
# Safe to stop (SIGTERM: the runs stop at the end of their rounds) and to restart.
set -euo pipefail
JOBS=${1:-2}
for a in 01 05; do
    benchmarks/compare_kept.sh "results/pfedsim-dir$a" "runs/pfedsim-dir$a" \
        "configs/pfedsim/fmnist_dir$a.yaml" -q --jobs "$JOBS"
done
