#!/usr/bin/env bash
# GPFL Table 1's Fashion-MNIST columns on a CPU (docs/gpfl.md, "Reproduction"): every method of
# configs/gpfl/fmnist_pathological_cpu.yaml, then fmnist_practical_cpu.yaml (a 10% training
# subset: the configs' one stated deviation), 3 seeds, JOBS whole runs at a time (one torch
# thread each), into runs/gpfl-<column>_cpu, every finished run kept in
# results/gpfl-<column>_cpu (benchmarks/compare_kept.sh) and not run again:
#   benchmarks/gpfl_repro.sh [JOBS]            # default 2
#   python benchmarks/paper_table.py gpfl/fmnist_pat results/gpfl-pathological_cpu
#   python benchmarks/paper_table.py gpfl/fmnist_prac results/gpfl-practical_cpu
# A failed run (e.g. a diverged loss) stops only itself (--keep-going); the script goes on and
# exits 2 at the end, after the sentence naming it.
# Safe to stop (SIGTERM: the runs stop at the end of their rounds) and to restart.
set -euo pipefail
status=0
went_on() {  # --keep-going: exit 2 names failed runs; go on, exit 2 at the end
    [[ $1 == 2 ]] || exit "$1"
    status=2
}
JOBS=${1:-2}
for column in pathological practical; do
    benchmarks/compare_kept.sh "results/gpfl-${column}_cpu" "runs/gpfl-${column}_cpu" \
        "configs/gpfl/fmnist_${column}_cpu.yaml" -q --jobs "$JOBS" --keep-going || went_on $?
done
exit $status
