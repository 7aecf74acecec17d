#!/usr/bin/env bash
# What a lent GPU machine lacks for the GPU scripts (benchmarks/gpu_vectorize.sh,
# benchmarks/gpu_check.sh), gathered here into one folder that the device tool carries
# (docs/benchmarks.md, "Running the GPU scripts on a lent machine"). The machine starts bare and
# reaches no network; its image (2026-11) has Python 3.12 with torch, numpy, scipy, PyYAML,
# typer, rich, matplotlib, safetensors, scikit-learn, h5py, torchvision and pytest, but neither
# pydantic nor PFLlib's cvxpy and calmsize, and no dataset. The folder (default .gpukit, ignored
# by git) holds:
#   whl/                 wheels for PYVER (default 3.12): pydantic and its own dependencies, at
#                        this environment's versions; cvxpy-base 1.7.5 (cvxpy's code with no
#                        solver: PFLlib imports it for FedPAC alone; later versions need a 12 MB
#                        extension) and calmsize, both for PFLlib's main.py to import;
#   data/fashion_mnist/  the four official Fashion-MNIST files (Debian's dataset-fashion-mnist
#                        or $PFLKIT_DATA/fashion_mnist);
#   PFLlib/system/       with PFLLIB=<a PFLlib checkout>: its code (vs_libraries.py's reference),
#                        and PFLlib/COMMIT, the checkout's commit.
# It ends by checking what would travel (git's tracked and untracked-not-ignored files, and the
# folder) against the device tool's 64 MiB.
#
#   PFLLIB=~/refs/PFLlib benchmarks/gpu_kit.sh [KIT]
#   PYVER=3.11 benchmarks/gpu_kit.sh /tmp/kit311     # for a rehearsal on this machine
set -euo pipefail
KIT=${1:-.gpukit}
PY=${PYTHON:-python3}
PYVER=${PYVER:-3.12}
LIMIT_MIB=64
fail() { echo "gpu_kit.sh: $*" >&2; exit 2; }

FMNIST=""
for dir in "${PFLKIT_DATA:-$HOME/.cache/pflkit/data}/fashion_mnist" \
    "${FMNIST_SYSTEM:-/usr/share/datasets/fashion-mnist}"; do
    [ -f "$dir/train-images-idx3-ubyte.gz" ] && { FMNIST=$dir; break; }
done
[ -n "$FMNIST" ] || fail "no Fashion-MNIST files found: install them (apt-get install" \
    "dataset-fashion-mnist) or put the four .gz files in \$PFLKIT_DATA/fashion_mnist"
if [ -n "${PFLLIB:-}" ] && [ ! -f "$PFLLIB/system/main.py" ]; then
    fail "PFLLIB=$PFLLIB has no system/main.py: give a PFLlib checkout" \
        "(git clone https://github.com/TsingZ0/PFLlib)"
fi
version() { "$PY" -c "import importlib.metadata as m; print(m.version('$1'))" 2>/dev/null \
    || fail "$PY has no $1: run this with the interpreter that runs pflkit (PYTHON=...)"; }

rm -rf "$KIT"
trap 'rm -rf "$KIT"' EXIT  # no half-made kit: removed unless everything below succeeds
mkdir -p "$KIT/whl" "$KIT/data/fashion_mnist"
pins=()
for name in pydantic pydantic-core annotated-types typing-inspection typing-extensions; do
    pins+=("$name==$(version "$name")")
done
platforms=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64; do
    platforms+=(--platform "$p")
done
echo "wheels for Python $PYVER: ${pins[*]} cvxpy-base==1.7.5 calmsize"
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version "$PYVER" --implementation cp \
    "${platforms[@]}" -d "$KIT/whl" "${pins[@]}" cvxpy-base==1.7.5 \
    || fail "pip could not download the wheels for Python $PYVER (its error is above): give PYVER as major.minor, e.g. 3.12"
"$PY" -m pip wheel -q --no-deps -w "$KIT/whl" calmsize==0.1.3  # an sdist only: pure Python
cp "$FMNIST"/*-ubyte.gz "$KIT/data/fashion_mnist/"
if [ -n "${PFLLIB:-}" ]; then
    mkdir -p "$KIT/PFLlib"
    cp -r "$PFLLIB/system" "$KIT/PFLlib/"
    rm -rf "$KIT"/PFLlib/system/{dataset,results,models}  # what earlier runs left there
    # the checkout's commit as the cross-check names it ("unknown" unless PFLLIB is the top of
    # its own git checkout): vs_libraries.py's tables name it
    "$PY" -c 'import sys; from pathlib import Path; sys.path.insert(0, sys.argv[1])
from crosscheck import commit; print(commit(Path(sys.argv[2])))' \
        "$(dirname "$0")/crosscheck" "$PFLLIB" >"$KIT/PFLlib/COMMIT"
fi

tree_bytes=$(git ls-files -z --cached --others --exclude-standard \
    | xargs -0 -r stat -c %s -- 2>/dev/null | awk '{s += $1} END {print s + 0}')
kit_bytes=$(du -sb "$KIT" | cut -f1)
total_mib=$(( (tree_bytes + kit_bytes) / 1048576 ))
echo "$KIT: $(( kit_bytes / 1048576 )) MiB; with the working tree $total_mib MiB" \
    "of the device tool's $LIMIT_MIB"
[ "$total_mib" -lt "$LIMIT_MIB" ] || fail "$total_mib MiB would travel, over the device tool's" \
    "$LIMIT_MIB MiB: leave PFLLIB unset or remove untracked files"
trap - EXIT
echo "carry [\"$KIT\"] and start the command with: bash benchmarks/gpu_vectorize.sh ..."
