#!/usr/bin/env bash
# pFedHN's server step, side by side with an older commit (docs/benchmarks.md, "pFedHN").
#
#   benchmarks/bench_pfedhn.sh [BASE]      # BASE: the commit to compare with (default eaca5c8,
#                                          # the last one with the out-of-place server step)
#
# Times one whole `pflkit run` (set-up, one round, the evaluation) of KT-pFL's Table 2 config
# with algorithm pfedhn (cnn4, 20 clients: a ~58M-parameter hypernetwork, stepped once per
# client), A = this checkout, B = BASE, in turn with farm-bench. Both give the same accuracy.
set -euo pipefail
BASE=${1:-eaca5c8}
WORK=$(mktemp -d)
trap 'git worktree remove --force "$WORK/base" >/dev/null 2>&1 || true; rm -rf "$WORK"' EXIT
git worktree add -q --detach "$WORK/base" "$BASE"
PY=$(pwd)/.venv/bin/python
"$PY" - "$WORK/one_round.yaml" <<'PYEOF'
import sys, yaml
c = yaml.safe_load(open("configs/ktpfl/fmnist_homogeneous.yaml"))
c.pop("compare")
c["algorithm"] = {"name": "pfedhn"}
c["train"]["rounds"] = 1
c["eval"] = {"every": 1, "last": 0}
c["output"] = {"progress": False, "checkpoint_every": 0}
yaml.safe_dump(c, open(sys.argv[1], "w"))
PYEOF
farm-bench -n 3 --warmup 0 --timeout 1200 \
    --vs "sh -c 'rm -rf $WORK/b && PYTHONPATH=$WORK/base/src exec $PY -m pflkit.cli run $WORK/one_round.yaml -q --out $WORK/b'" \
    -- sh -c "rm -rf $WORK/a && PYTHONPATH=$(pwd)/src exec $PY -m pflkit.cli run $WORK/one_round.yaml -q --out $WORK/a"
grep -h "round 1/1" "$WORK/a/run.log" "$WORK/b/run.log"
