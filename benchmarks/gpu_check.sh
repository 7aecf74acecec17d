#!/usr/bin/env bash
# GPU checks of issue 15 on a machine with a CUDA device (docs/guide.md, "Devices"):
#   1. tests/test_device.py with its cuda tests (every algorithm on cuda, states on the device,
#      the same accuracies as on the CPU; an interrupted cuda run resumes);
#   2. the anchor benchmark on cuda (benchmarks/bench_fedavg.py --device cuda);
#   3. seconds per round of the MAP config (configs/map/fmnist_lenet.yaml) on cuda, 12 rounds
#      (rounds 10-12 evaluate: eval.every 10 and eval.last 10 of a 12-round run);
#   4. issue 38: the anchor config with several workers sharing the GPU (engine.workers N on
#      cuda): in-process against pools of 2, 4 and 8 workers, seconds per round and peak GPU
#      memory (goal: the best pool's round <= 1/4 of the in-process round).
#
#   benchmarks/gpu_check.sh [OUT]      # OUT: where the logs go (default runs/gpu-check)
set -uo pipefail
OUT=${1:-runs/gpu-check}
PY=${PYTHON:-python3}
source "$(dirname "$0")/gpu_env.sh"
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
$PY -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)" | tee -a "$OUT/gpu.txt"
$PY -m pytest -q -p no:cacheprovider tests/test_device.py 2>&1 | tee "$OUT/test_device.log" | tail -n 5
$PY benchmarks/bench_fedavg.py --device cuda --rounds 3 2>&1 | tee "$OUT/bench_fedavg_cuda.log"
$PY benchmarks/bench_fedavg.py --device cuda --rounds 3 --workers 2,4,8 2>&1 \
    | tee "$OUT/bench_fedavg_cuda_workers.log"
rm -rf "$OUT/map-cuda"
$PY -m pflkit run configs/map/fmnist_lenet.yaml -q --out "$OUT/map-cuda" --set device=cuda \
    --set train.rounds=12 --set engine.workers=1 >"$OUT/map-cuda.log" 2>&1
$PY - "$OUT/map-cuda/metrics.jsonl" <<'PY' | tee "$OUT/map-seconds.txt"
import json, statistics, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
train = [r["seconds_train"] for r in rows]
evals = [r["seconds_eval"] for r in rows if "pers_acc_mean" in r]
print(f"MAP fmnist_lenet on cuda, {len(rows)} rounds: training median {statistics.median(train):.2f} s/round "
      f"(min {min(train):.2f}, max {max(train):.2f}); evaluation median {statistics.median(evals):.2f} s "
      f"on the {len(evals)} evaluated rounds (all 100 clients + the 20 selected + the global model)")
PY
