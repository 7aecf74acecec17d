#!/usr/bin/env bash
# One round of one algorithm, this checkout against an older commit (docs/benchmarks.md):
#
#   benchmarks/bench_vs_commit.sh BASE CONFIG ALGORITHM
#   benchmarks/bench_vs_commit.sh eaca5c8 configs/ktpfl/fmnist_homogeneous.yaml pfedhn
#   benchmarks/bench_vs_commit.sh 5d09787 configs/gpfl/fmnist_pathological_cpu.yaml fedrep
#   benchmarks/bench_vs_commit.sh 8b3a683 configs/gpfl/fmnist_practical_cpu.yaml \
#       '{name: pfedme, personal_lr: 0.01}'
#
# Times one whole `pflkit run` (set-up, one round, the evaluation) of CONFIG with `algorithm:
# {name: ALGORITHM}` (its defaults; or ALGORITHM as a YAML mapping with its parameters), 1
# round, no checkpoint: A = this checkout, B = BASE (a git worktree), in turn with farm-bench
# (3 pairs, medians). Then both runs' round lines, which show the round's own seconds and that
# A and B gave the same numbers; exit 1 if a timed run failed (its times mean nothing).
set -euo pipefail
if [[ $# -ne 3 ]]; then
    echo "usage: benchmarks/bench_vs_commit.sh BASE CONFIG ALGORITHM" >&2
    exit 2
fi
BASE=$1 CONFIG=$2 ALGO=$3
WORK=$(mktemp -d)
trap 'git worktree remove --force "$WORK/base" >/dev/null 2>&1 || true; rm -rf "$WORK"' EXIT
git worktree add -q --detach "$WORK/base" "$BASE"
PY=$(pwd)/.venv/bin/python
"$PY" - "$CONFIG" "$ALGO" "$WORK/one_round.yaml" <<'PYEOF'
import sys, yaml
config, algo, out = sys.argv[1:]
c = yaml.safe_load(open(config))
c.pop("compare", None)
spec = yaml.safe_load(algo)
c["algorithm"] = spec if isinstance(spec, dict) else {"name": algo}
c["train"]["rounds"] = 1
c["eval"] = {"every": 1, "last": 0}
c["output"] = {"progress": False, "checkpoint_every": 0}
yaml.safe_dump(c, open(out, "w"))
PYEOF
one() {  # one LABEL SRC: the shell line of one timed run with the code under SRC
    echo "rm -rf $WORK/$1 && PYTHONPATH=$2 exec $PY -m pflkit.cli run $WORK/one_round.yaml -q --out $WORK/$1"
}
farm-bench -n 3 --warmup 0 --timeout 1200 --vs "sh -c '$(one b "$WORK/base/src")'" -- \
    sh -c "$(one a "$(pwd)/src")"
for side in a b; do
    if ! grep -h "round 1/1" "$WORK/$side/run.log" 2>/dev/null; then
        echo "error: run ${side^^} did not finish its round, so the times above are of a failed" \
            "run; run it alone to see why: pflkit run $CONFIG --set train.rounds=1" >&2
        exit 1
    fi
done
