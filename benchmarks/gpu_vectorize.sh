#!/usr/bin/env bash
# GPU figures of issue 56 (engine.vectorize) on a machine with a CUDA device, in one go:
#   1. tests/test_vectorized.py on that machine (its runs use device auto, so the cuda device):
#      the vectorised path equals the per-client path there too (TF32 off: full fp32);
#   2. the anchor config (benchmarks/bench_fedavg.py: FedAvg, Fashion-MNIST, 20 clients,
#      cnn4, batch 10) on cuda, interleaved round by round: in-process, 8 workers sharing the
#      GPU, in-process vectorised, 8 vectorised workers, and both vectorised ones with CUDA
#      graphs (engine.cuda_graphs); seconds per round (median of ROUNDS) and peak GPU memory
#      (nvidia-smi, per process, summed);
#   3. with PFLLIB set (a PFLlib checkout; REFPY: the interpreter with its dependencies),
#      benchmarks/vs_libraries.py --device cuda: PFLlib against pflkit's default engine,
#      8 workers, vectorised in-process and 8 vectorised workers, with and without CUDA graphs,
#      for the ratios to PFLlib.
# Goals (issue 56): an anchor round at least 3x faster than 8 workers, and at least 25x
# PFLlib's, on an H100. engine.vectorize: auto picks the vectorised path on CUDA only once
# these figures show it faster (pflkit.engine.vectorized.AUTO_ON_CUDA).
#
# On a lent machine, carry the folder of benchmarks/gpu_kit.sh (.gpukit: the wheels, the data and
# PFLlib that the machine lacks; benchmarks/gpu_env.sh uses it) and run this with OUT under the
# tool's $OUT: OUT gets the small files alone (at most 8 come back), vs_libraries.py's runs go
# to VS_OUT (default OUT/vs). DEVICE=cpu SUBSET=2000 ROUNDS=1 rehearses the whole script here.
#
#   benchmarks/gpu_vectorize.sh [OUT]   # OUT: where the logs go (default runs/gpu-vectorize)
#   PFLLIB=~/refs/PFLlib REFPY=~/refenv/bin/python benchmarks/gpu_vectorize.sh
set -uo pipefail
OUT=${1:-runs/gpu-vectorize}
PY=${PYTHON:-python3}
ROUNDS=${ROUNDS:-3}
DEVICE=${DEVICE:-cuda}
VS_OUT=${VS_OUT:-$OUT/vs}
subset=()
[ -n "${SUBSET:-}" ] && subset=(--subset "$SUBSET")
source "$(dirname "$0")/gpu_env.sh"
mkdir -p "$OUT"
date -u +%Y-%m-%dT%H:%MZ | tee "$OUT/gpu.txt"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee -a "$OUT/gpu.txt"
$PY -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)" | tee -a "$OUT/gpu.txt"
# the equality tests at full fp32: TF32, cuDNN's default for convolutions on this card, rounds
# their inputs to 10 mantissa bits (about 5e-4 relative), more than the tests' 1e-4 tolerance
NVIDIA_TF32_OVERRIDE=0 $PY -m pytest -q -p no:cacheprovider -p no:xdist tests/test_vectorized.py 2>&1 \
    | tee "$OUT/test_vectorized.log" | tail -n 5
$PY benchmarks/bench_fedavg.py --device "$DEVICE" --rounds "$ROUNDS" --workers 8 --vectorize --graphs "${subset[@]}" 2>&1 \
    | tee "$OUT/bench_fedavg_vectorize_$DEVICE.log"
if [ -n "${PFLLIB:-}" ]; then
    rm -rf "$VS_OUT"
    graphs=()  # CUDA graphs need a CUDA device (the CPU rehearsal runs without them)
    [ "$DEVICE" = cuda ] && graphs=(--pflkit-graphs 1,8)
    $PY benchmarks/vs_libraries.py --pfllib "$PFLLIB" --python "${REFPY:-$PY}" --device "$DEVICE" \
        --rounds "$ROUNDS" --pflkit-workers 8 --pflkit-vectorize 1,8 "${graphs[@]}" --out "$VS_OUT" "${subset[@]}" 2>&1 \
        | tee "$OUT/vs_libraries_$DEVICE.log"
    cp "$VS_OUT/vs_libraries.json" "$OUT/" 2>/dev/null
else
    echo "PFLLIB not set: vs_libraries.py skipped (give a PFLlib checkout for the ratio)" \
        | tee "$OUT/vs_libraries_$DEVICE.log"
fi
