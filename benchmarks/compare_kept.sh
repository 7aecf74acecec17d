#!/usr/bin/env bash
# `pflkit compare` that goes on over sessions whose checkouts have no runs/ folder:
#
#   benchmarks/compare_kept.sh KEEP OUT CONFIG [pflkit compare options...]
#
# starts OUT from the runs kept in KEEP (KEEP.zip, or a folder; when OUT does not exist yet), runs
# `pflkit compare CONFIG --out OUT [options]` (finished runs are skipped, so kept runs are not
# run again), and keeps every finished run's record in KEEP (benchmarks/keep_runs.sh) every
# two minutes and at the end, also when stopped (SIGINT/SIGTERM: the compare stops at the end
# of its current rounds, interrupted runs keep their checkpoints). Commit KEEP to keep the runs.
# PFLKIT_COMMAND=sweep runs `pflkit sweep` instead (a sweep folder keeps and continues alike).
set -euo pipefail
if [[ $# -lt 3 ]]; then
    echo "usage: benchmarks/compare_kept.sh KEEP OUT CONFIG [pflkit compare options...]" >&2
    exit 2
fi
keep=$1 out=$2 config=$3
shift 3
here=$(dirname "$0")
PFLKIT=${PFLKIT:-.venv/bin/pflkit}
keep=${keep%/}
if [[ -f $keep.zip && ! -e $out ]]; then  # what keep_runs.sh keeps: KEEP.zip
    mkdir -p "$(dirname "$out")"
    "${PYTHON:-.venv/bin/python}" -m pflkit.report.archive unpack "$keep.zip" "$out"
elif [[ -d $keep && ! -e $out ]]; then
    mkdir -p "$(dirname "$out")"
    cp -r "$keep" "$out"
fi
(while sleep 120; do "$here/keep_runs.sh" "$keep" "$out" || true; done) >/dev/null 2>&1 &
keeper=$!
trap 'kill $keeper 2>/dev/null || true; if [[ -d $out ]]; then "$here/keep_runs.sh" "$keep" "$out"; fi' EXIT
"$PFLKIT" "${PFLKIT_COMMAND:-compare}" "$config" --out "$out" "$@" &
compare=$!
trap 'kill -TERM $compare 2>/dev/null' INT TERM  # compare stops at the end of its rounds
status=0
wait $compare || status=$?
if kill -0 $compare 2>/dev/null; then wait $compare || status=$?; fi  # after a signal
exit $status
