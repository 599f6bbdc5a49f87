#!/usr/bin/env bash
# The benchmark set behind bench/NOTES.md's P9 / P13 tables, on one GPU, JSON lines into OUT/bench.jsonl
# (and each program's stderr into OUT/<name>.err): generate (bench-4L, 256 prompts x 512 new tokens, and
# n = 8), the grouped GEMM at decode sizes, train_step at 65,536 tokens per optimizer step (recompute none
# with and without the experts' weight gradients on a side stream; batch 4 under recompute moe, none and full,
# batch 2 under none).
# usage: bench/run_h100.sh BUILD_DIR OUT [which...]   which: generate grouped train (default: all)
set -uo pipefail
build=${1:?build dir}
out=${2:?out dir}
shift 2
which=" ${*:-generate grouped train} "
mkdir -p "$out"
want() { [[ "$which" == *" $1 "* ]]; }
run() {  # run NAME LIMIT_S ENV... -- PROGRAM ARGS...: its JSON lines (tagged with NAME) into bench.jsonl
  local name=$1 limit=$2; shift 2
  local envs=()
  while [[ $1 != -- ]]; do envs+=("$1"); shift; done
  shift
  local t0=$SECONDS
  env "${envs[@]}" timeout "$limit" "$@" 2> "$out/$name.err" | grep '^{' | sed "s/^{/{\"run\":\"$name\",/" | tee -a "$out/bench.jsonl"
  echo "== $name: rc ${PIPESTATUS[0]}, $((SECONDS - t0)) s" >&2
}
if want generate; then
  run gen_256x1 90 -- "$build/generate_bench" --prompts 256 --n 1
  run gen_256x1_large_tile 90 MOETRAIN_GROUPED_SMALL=0 -- "$build/generate_bench" --prompts 256 --n 1
  run gen_64x8 90 -- "$build/generate_bench" --prompts 64 --n 8
fi
if want grouped; then
  run grouped_gemm 60 -- "$build/grouped_gemm_bench"
fi
if want train; then
  ts=("$build/train_step" --model bench-4L --seq 4096 --steps 3 --warmup 1 --no-profile)
  run train_b1x16_none 120 -- "${ts[@]}" --batch 1 --grad-accum 16 --recompute none
  run train_b1x16_none_wgrad_stream 120 MOETRAIN_WGRAD_STREAM=1 -- "${ts[@]}" --batch 1 --grad-accum 16 --recompute none
  run train_b4x4_moe 150 -- "${ts[@]}" --batch 4 --grad-accum 4 --recompute moe
  run train_b4x4_none 150 -- "${ts[@]}" --batch 4 --grad-accum 4 --recompute none
  run train_b4x4_full 150 -- "${ts[@]}" --batch 4 --grad-accum 4 --recompute full
  run train_b2x8_none 150 -- "${ts[@]}" --batch 2 --grad-accum 8 --recompute none
fi
