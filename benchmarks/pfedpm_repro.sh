#!/usr/bin/env bash
# pFedPM Tables I-II reproduction on real Fashion-MNIST (docs/pfedpm.md, "Reproduction"):
# for n = 3, 4, 5 ways, every arm of configs/pfedpm/fmnist_nway.yaml (pFedPM, FedProto and the
# baselines) and of fmnist_nway_mh.yaml (pFedPM-mh), 3 seeds each, JOBS whole runs at a time
# (one torch thread each), into OUT/pfedpm-n<N> and OUT/pfedpm-mh-n<N>, each followed by
# R-pFedPM (the same pFedPM runs scored through the relation module, relation.json, kept with
# the runs). Then the tables and the communication table:
#   benchmarks/pfedpm_repro.sh [JOBS] [OUT] [N ...]       # defaults: 2, runs, 3 4 5
#   python benchmarks/paper_table.py pfedpm/fmnist_n3 results/pfedpm-n3 \
#       results/pfedpm-mh-n3                  # the table and the ranking verdict
#   python benchmarks/pfedpm_relation.py results/pfedpm-n3 results/pfedpm-mh-n3
#   python benchmarks/pfedpm_comm.py results/pfedpm-n3 results/pfedpm-mh-n3
# A failed run (e.g. a diverged loss) stops only itself (--keep-going); the script goes on and
# exits 2 at the end, after the sentence naming it. Safe to stop and restart: compare keeps
# finished runs and resumes interrupted ones. Every finished run's record is also kept in
# KEEP/pfedpm-n<N> (default KEEP: results, by benchmarks/compare_kept.sh) and not run
# again, so the tables go on over sessions whose checkouts have no runs/ folder (report the
# kept folders then).
set -euo pipefail
status=0
went_on() {  # --keep-going: exit 2 names failed runs; go on, exit 2 at the end
    [[ $1 == 2 ]] || exit "$1"
    status=2
}
JOBS=${1:-2}
OUT=${2:-runs}
shift $(($# < 2 ? $# : 2))
NS=${*:-3 4 5}
KEEP=${KEEP:-results}
PY=${PY:-.venv/bin/python}
for n in $NS; do
    for arm in pfedpm pfedpm-mh; do
        config=configs/pfedpm/fmnist_nway.yaml
        if [[ $arm == pfedpm-mh ]]; then config=configs/pfedpm/fmnist_nway_mh.yaml; fi
        benchmarks/compare_kept.sh "$KEEP/$arm-n$n" "$OUT/$arm-n$n" "$config" \
            --set data.partition.n="$n" --jobs "$JOBS" -q --keep-going || went_on $?
        # R-pFedPM needs the final checkpoints, which are not kept: score now, keep the scores
        "$PY" benchmarks/pfedpm_relation.py "$OUT/$arm-n$n" || went_on $?
        benchmarks/keep_runs.sh "$KEEP/$arm-n$n" "$OUT/$arm-n$n"
    done
done
exit $status
