#!/usr/bin/env bash
# The multi-GPU check (a machine with 2+ GPUs; dependencies from .deps/device as for gpu_test.sh):
# builds; runs the communicator / FSDP tests; checks every NCCL collective across the GPUs and
# measures their bandwidth; trains the demo model with FSDP on the GPUs and on one GPU (same global
# batch: the loss curves must agree in bf16 tolerance); then bench-4L with train_step: 1 GPU at the
# per-GPU batch, 1 GPU at the global batch, and FSDP over all GPUs (tokens/s per GPU, per-step losses).
# usage: scripts/multi_gpu_check.sh [BUILD_DIR] [per-GPU batch] [seq] [OUT_DIR]
set -uo pipefail
cd "$(dirname "$0")/.."
build=${1:-build-gpu}
batch=${2:-1}
seq=${3:-4096}
out=${4:-/tmp/multi_gpu_check}
mkdir -p "$out"
ngpu=$(nvidia-smi -L | wc -l)
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
cmake -S . -B "$build" -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES=90a > "$build.configure.log" 2>&1 \
  || { cat "$build.configure.log"; exit 1; }
grep "moetrain:" "$build.configure.log" || true
cmake --build "$build" -j "$(nproc)" 2>&1 | grep -E "error" || true
test -x "$build/train_step" || { echo "build failed"; cmake --build "$build" -j "$(nproc)" 2>&1 | tail -30; exit 1; }
echo "== tests"
(cd "$build" && ctest -j 4 -R "Nccl|Comm|Gloo|Fsdp|Mesh|Store|Launch|Schedule|PerOp|Watchdog|ShardedIo" --timeout 300 \
  > "$out/ctest.txt" 2>&1; grep -E "tests passed|tests failed|\(Failed\)|Timeout" "$out/ctest.txt")
echo "== NCCL collectives over $ngpu GPUs"
"$build/moetrain" launch --nproc-per-node "$ngpu" -- _selftest comm --device cuda 2>&1 | tail -8 | tee "$out/nccl.txt"
echo "== demo, 1 GPU vs $ngpu GPUs FSDP, 40 steps, same global batch"
demo="train --device cuda --steps 40 --eval-problems 0 --log-every 10 --micro-batch-size 16"
CUDA_VISIBLE_DEVICES=0 "$build/moetrain" $demo --out-dir "$out/demo1" 2>&1 | tail -2
"$build/moetrain" launch --nproc-per-node "$ngpu" -- $demo --out-dir "$out/demoN" 2>&1 | grep -E "step (1|40)/|error|loss" | tail -4
python3 - "$out/demo1/metrics.jsonl" "$out/demoN/metrics.jsonl" <<'PY'
import json, sys
a = [json.loads(l) for l in open(sys.argv[1]) if '"loss"' in l]
b = [json.loads(l) for l in open(sys.argv[2]) if '"loss"' in l]
d = [abs(x["loss"] - y["loss"]) / abs(x["loss"]) for x, y in zip(a, b)]
print(json.dumps({"check": "demo_fsdp_vs_1gpu", "steps": len(d), "max_rel_loss_diff": max(d),
                  "mean_rel_loss_diff": sum(d) / len(d), "loss_1gpu_last": a[-1]["loss"], "loss_fsdp_last": b[-1]["loss"]}))
PY
ts="$build/train_step --model bench-4L --seq $seq"
echo "== bench-4L: 1 GPU, batch $batch"
CUDA_VISIBLE_DEVICES=0 $ts --batch "$batch" | tail -1 | tee "$out/bench_1gpu.json"
echo "== bench-4L: $ngpu GPUs FSDP, batch $batch per GPU"
"$build/moetrain" launch --nproc-per-node "$ngpu" --exe "$build/train_step" -- --model bench-4L --seq "$seq" \
  --batch "$batch" 2>&1 | grep -E '^\[rank 0\] \{|error' | sed 's/^\[rank 0\] //' | tee "$out/bench_fsdp.json"
echo "== bench-4L: 1 GPU, batch $((batch * ngpu)) (the global batch of the FSDP run)"
CUDA_VISIBLE_DEVICES=0 $ts --batch $((batch * ngpu)) --no-profile | tail -1 | tee "$out/bench_1gpu_global.json"
