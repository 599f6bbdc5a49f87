#!/usr/bin/env bash
# The multi-GPU check (a machine with 2+ GPUs, dependencies from .deps/device as for gpu_test.sh):
# builds, runs the GPU tests whose names match $2 (default: the communicator and FSDP ones), then
# bench-4L under FSDP: 1 GPU and N GPUs at the same per-GPU batch (tokens/s per GPU), and the 1-GPU
# run with the whole global batch (its per-step losses must match the N-GPU run's in bf16 tolerance).
# usage: scripts/multi_gpu_check.sh [BUILD_DIR] [ctest regex] [per-GPU batch] [seq]
set -uo pipefail
cd "$(dirname "$0")/.."
build=${1:-build-gpu}
regex=${2:-Nccl|Comm|Fsdp}
batch=${3:-1}
seq=${4:-4096}
ngpu=$(nvidia-smi -L | wc -l)
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
cmake -S . -B "$build" -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES=90a > "$build.configure.log" 2>&1 \
  || { cat "$build.configure.log"; exit 1; }
grep "moetrain:" "$build.configure.log" || true
cmake --build "$build" -j "$(nproc)" 2>&1 | grep -E "error" || true
test -x "$build/train_step" || { echo "build failed"; cmake --build "$build" -j "$(nproc)" 2>&1 | tail -30; exit 1; }
(cd "$build" && ctest --output-on-failure -j 2 -R "$regex" --timeout 300 2>&1 | tail -15)
ts="$build/train_step --model bench-4L --seq $seq"
echo "== 1 GPU, batch $batch"
CUDA_VISIBLE_DEVICES=0 $ts --batch "$batch" | tail -1
echo "== 1 GPU, batch $((batch * ngpu)) (the global batch of the $ngpu-GPU run)"
CUDA_VISIBLE_DEVICES=0 $ts --batch $((batch * ngpu)) --no-profile | tail -1
echo "== $ngpu GPUs FSDP, batch $batch per GPU"
"$build/moetrain" launch --nproc-per-node "$ngpu" --exe "$build/train_step" -- --model bench-4L --seq "$seq" \
  --batch "$batch" 2>&1 | grep -E '^\[rank 0\] \{|error' | sed 's/^\[rank 0\] //'
