#!/usr/bin/env bash
# bench-4L under every parallel layout on the GPUs of one machine (2+ GPUs), against one GPU with the
# same global batch: FSDP, EP, Ulysses SP, TP and TP + ETP over all GPUs. Prints one JSON line per run
# (train_step's) and a summary line per layout: tokens/s per GPU, and the worst relative difference of
# its per-step losses from the one-GPU run (bf16 tolerance 1e-2). Assumes the build exists (gpu_test.sh
# or multi_gpu_check.sh made it).
# usage: scripts/layouts_gpu_check.sh [BUILD_DIR] [global batch] [seq] [OUT_DIR] [layouts...]
#   layouts: any of fsdp ep sp tp tp_etp (default: all); EXTRA="..." (e.g. "--recompute selective") adds
#   train_step flags to every run, the one-GPU reference included.
set -uo pipefail
cd "$(dirname "$0")/.."
build=${1:-build-gpu}
global=${2:-2}
seq=${3:-4096}
out=${4:-/tmp/layouts_gpu_check}
shift $(($# < 4 ? $# : 4))
layouts=${*:-fsdp ep sp tp tp_etp}
mkdir -p "$out"
n=$(nvidia-smi -L | wc -l)
if ((global % n != 0)); then echo "global batch $global must be divisible by the $n GPUs"; exit 1; fi
ts="$build/train_step --model bench-4L --seq $seq --no-profile --steps 6 ${EXTRA:-}"
run() {  # name, then the command; keeps rank 0's JSON line
  local name=$1
  shift
  "$@" 2>&1 | grep -E '^(\[rank 0\] )?\{|error' | sed 's/^\[rank 0\] //' | tail -1 > "$out/$name.json"
  cat "$out/$name.json"
}
echo "== 1 GPU, batch $global"
run one env CUDA_VISIBLE_DEVICES=0 $ts --batch "$global"
launch="$build/moetrain launch --nproc-per-node $n --exe $build/train_step -- --model bench-4L --seq $seq --no-profile --steps 6 ${EXTRA:-}"
for l in $layouts; do
  case $l in
    fsdp) flags="--batch $((global / n))" ;;
    ep) flags="--batch $((global / n)) --ep $n" ;;
    sp) flags="--batch $global --sp $n" ;;
    tp) flags="--batch $global --tp $n" ;;
    tp_etp) flags="--batch $global --tp $n --etp $n" ;;
    *) echo "unknown layout '$l' (allowed: fsdp ep sp tp tp_etp)"; exit 1 ;;
  esac
  echo "== $l over $n GPUs: $flags"
  run "$l" $launch $flags
done
python3 - "$out" $layouts <<'PY'
import json, sys
out, layouts = sys.argv[1], sys.argv[2:]
def load(name):
    try:
        return json.loads(open(f"{out}/{name}.json").read())
    except Exception as e:
        return {"error": f"no result ({e})"}
one = load("one")
for l in layouts:
    r = load(l)
    if "losses" not in r or "losses" not in one:
        print(json.dumps({"layout": l, "error": r.get("error", "missing losses")}))
        continue
    d = [abs(a - b) / abs(b) for a, b in zip(r["losses"], one["losses"])]
    print(json.dumps({"layout": l, "tokens_per_s_per_gpu": r.get("tokens_per_s_per_gpu"),
                      "one_gpu_tokens_per_s": one.get("tokens_per_s"), "peak_mem_gib": r.get("peak_mem_gib"),
                      "steps_compared": len(d), "max_rel_loss_diff": max(d), "within_bf16_tol": max(d) <= 1e-2}))
PY
