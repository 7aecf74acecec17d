#!/usr/bin/env bash
# The privacy-utility table's runs (docs/privacy.md): configs/privacy/fmnist_dp.yaml at
# client-level epsilon infinity (no DP), 8, 3 and 1, 3 seeds each, into runs/privacy-fmnist/ (kept
# as one archive per compare in results/privacy-fmnist/):
# FedAvg, Ditto and FedRep at every epsilon first, then GPFL at every epsilon (its own folders,
# eps-E-gpfl), then pFedSim, which only the local mechanism can run, at infinity and 8.
# Rerunning continues (pflkit compare keeps finished runs). Then: python benchmarks/privacy_doc.py
set -euo pipefail
cd "$(dirname "$0")/.."
CFG=configs/privacy/fmnist_dp.yaml
OUT=${OUT:-runs/privacy-fmnist}
KEEP=${KEEP:-results/privacy-fmnist}  # one run archive per compare (benchmarks/keep_runs.sh)
dp() {  # dp EPSILON -> the --set that gives it
    if [[ $1 == inf ]]; then echo "privacy.client_dp=null"; else echo "privacy.client_dp.target_epsilon=$1"; fi
}
for eps in inf 8 3 1; do
    pflkit compare "$CFG" -q --jobs 2 --algorithms fedavg,ditto,fedrep --set "$(dp $eps)" --out "$OUT/eps-$eps"
done
for eps in inf 8 3 1; do
    pflkit compare "$CFG" -q --jobs 2 --algorithms gpfl --set "$(dp $eps)" --out "$OUT/eps-$eps-gpfl"
done
pflkit compare "$CFG" -q --jobs 2 --algorithms pfedsim --set privacy.client_dp=null --out "$OUT/pfedsim-eps-inf"
pflkit compare "$CFG" -q --jobs 2 --algorithms pfedsim --set privacy.client_dp.mode=local \
    --set privacy.client_dp.target_epsilon=8 --out "$OUT/pfedsim-local-eps-8"
# the floor of personalization: every client alone (nothing released)
pflkit compare "$CFG" -q --jobs 2 --algorithms local --set privacy.client_dp=null --out "$OUT/local"
for sub in "$OUT"/*/; do
    sub=$(basename "$sub")
    benchmarks/keep_runs.sh "$KEEP/$sub" "$OUT/$sub"
done
