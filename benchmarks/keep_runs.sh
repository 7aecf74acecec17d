#!/usr/bin/env bash
# Keep the record of finished runs in the repository, so that a later checkout (which has no
# runs/ folder) can still report them and a long reproduction can be finished over sessions:
#
#   benchmarks/keep_runs.sh DEST FOLDER...     # FOLDER: a run, compare or sweep folder
#   pflkit report DEST                         # the table of every kept run
#
# For every finished run (a folder with summary.json) in FOLDER or directly under it, copies
# config.yaml, summary.json, metrics.jsonl, provenance.json and relation.json (R-pFedPM's
# scores, benchmarks/pfedpm_relation.py) into DEST/<run folder name>/; checkpoints and logs
# stay behind. Unfinished runs are skipped. A run already kept with the same summary gets only
# the files it lacks (a relation.json written after it was kept); one with a different summary
# is an error (exit 2), so two different runs never share a name. A compare folder's
# compare.yaml (the config every run shares) is kept too, so a later session continues the
# compare from what is kept (benchmarks/compare_kept.sh does both: it keeps, and it continues
# from DEST).
#
# What is kept lives in one archive, DEST.zip (pflkit.report.archive: deterministic, read in
# place by pflkit report and the table scripts, which accept DEST for DEST.zip). A folder DEST
# kept before the archives is packed into DEST.zip and removed.
set -euo pipefail
if [[ $# -lt 2 ]]; then
    echo "usage: benchmarks/keep_runs.sh DEST FOLDER... (run, compare or sweep folders)" >&2
    exit 2
fi
dest=${1%/}
shift
PYTHON=${PYTHON:-.venv/bin/python}
archive=$dest.zip
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
if [[ -f $archive ]]; then
    "$PYTHON" -m pflkit.report.archive unpack "$archive" "$work/kept"
elif [[ -d $dest ]]; then
    cp -r "$dest" "$work/kept"
fi
shown=$dest
dest=$work/kept
kept=0
for folder in "$@"; do
    if [[ ! -d $folder ]]; then
        echo "keep_runs: '$folder' is not a folder: give run, compare or sweep folders" >&2
        exit 2
    fi
    if [[ -f $folder/compare.yaml ]]; then
        mkdir -p "$dest"
        if [[ ! -f $dest/compare.yaml ]]; then
            cp "$folder/compare.yaml" "$dest/compare.yaml"
        elif ! cmp -s "$folder/compare.yaml" "$dest/compare.yaml"; then
            echo "keep_runs: '$shown' holds runs of another config than '$folder':" \
                "keep them under another DEST" >&2
            exit 2
        fi
    fi
    while IFS= read -r summary; do
        run=$(dirname "$summary")
        target=$dest/$(basename "$run")
        shown_target=$shown/$(basename "$run")
        if [[ -f $target/summary.json ]] && ! cmp -s "$summary" "$target/summary.json"; then
            echo "keep_runs: '$shown_target' already holds a different run than '$run':" \
                "keep it under another DEST or remove it first" >&2
            exit 2
        fi
        if [[ ! -f $target/summary.json ]]; then kept=$((kept + 1)); fi
        mkdir -p "$target"
        for f in config.yaml summary.json metrics.jsonl provenance.json relation.json; do
            if [[ -f $run/$f && ! -f $target/$f ]]; then cp "$run/$f" "$target/$f"; fi
        done
    done < <(find "$folder" -maxdepth 2 -name summary.json -type f | sort)
done
if [[ -d $dest ]]; then
    "$PYTHON" -m pflkit.report.archive pack "$dest" "$archive"
    if [[ -d $shown ]]; then rm -rf "$shown"; fi
fi
echo "kept $kept new run(s) in $archive"
