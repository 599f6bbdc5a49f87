#!/usr/bin/env bash
# The Qwen3-30B-A3B run on all GPUs of one machine: the real shape with random weights
# (or cut to fewer layers for a rehearsal on fewer GPUs), seq 4096, batch 1 per GPU, through
# train_step under `moetrain launch`:
#   fsdp_ep_all   dense FSDP over all N GPUs, experts split N ways (EP N, no expert data parallelism)
#   fsdp_ep_half  dense FSDP over all N GPUs, experts split N/2 ways, each FSDP-sharded over 2
#   sp2_ep_all    Ulysses SP 2 at seq 16384 (4 × the tokens per sequence), EP N
# Each prints train_step's JSON line (tokens/s per GPU, MFU, peak memory, time split: forward,
# backward, optimizer, and by op category from one profiled step; init_s = start-up). The first two
# have the same global batch, so their loss curves are compared (DESIGN's bf16 tolerance: relative
# L2 error <= 1e-2; the per-step differences are printed as well). Assumes the build exists
# (gpu_test.sh or multi_gpu_check.sh made it).
# usage: scripts/p7_30b.sh [BUILD_DIR] [layers (48 = the real model)] [steps] [OUT_DIR]
#   RECOMPUTE=none|full|selective (default selective: no all-to-all in the recompute), BATCH (per-GPU
#   batch, default 1), LAYOUTS (default "fsdp_ep_all fsdp_ep_half sp2_ep_all"), TIMEOUT (seconds per
#   layout, default 420) and EXTRA="..." (more train_step flags) from the environment. Each layout's
#   whole log is kept in OUT/NAME.log.
set -uo pipefail
cd "$(dirname "$0")/.."
build=${1:-build-gpu}
layers=${2:-48}
steps=${3:-20}
out=${4:-/tmp/p7_30b}
rc=${RECOMPUTE:-selective}
batch=${BATCH:-1}
layouts=${LAYOUTS:-fsdp_ep_all fsdp_ep_half sp2_ep_all}
export NCCL_NVLS_ENABLE=0  # NVLink multicast stays off on the shared machines
mkdir -p "$out"
n=$(nvidia-smi -L | wc -l)
if ((n < 2 || n % 2 != 0)); then echo "needs an even number of GPUs (have $n)"; exit 1; fi
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | head -1
# After the timed steps train_step profiles one more step op by op (the time split by category);
# PROFILE=0 skips it.
prof=$([[ ${PROFILE:-1} == 0 ]] && echo --no-profile)
base="--model qwen3-30b-a3b --layers $layers --steps $steps --warmup 2 $prof --recompute $rc ${EXTRA:-}"
run() {  # name, then train_step flags
  local name=$1
  shift
  [[ " $layouts " == *" $name "* ]] || return 0
  echo "== $name: $base $*"
  timeout "${TIMEOUT:-420}" "$build/moetrain" launch --nproc-per-node "$n" --exe "$build/train_step" -- $base "$@" \
    > "$out/$name.log" 2>&1
  local code=$?
  grep -E '^\[rank 0\] \{' "$out/$name.log" | sed 's/^\[rank 0\] //' | tail -1 > "$out/$name.json"
  if [[ ! -s "$out/$name.json" ]]; then
    echo "$name failed (exit $code):"
    grep -iE 'error|out of memory|what\(\)|terminate|timed out' "$out/$name.log" | head -8
    tail -5 "$out/$name.log"
  fi
}
run fsdp_ep_all --seq 4096 --batch "$batch" --ep "$n"
run fsdp_ep_half --seq 4096 --batch "$batch" --ep $((n / 2))
run sp2_ep_all --seq 16384 --batch "$batch" --sp 2 --ep "$n"
python3 - "$out" <<'PY'
import json, sys
out = sys.argv[1]
def load(name):
    try:
        return json.loads(open(f"{out}/{name}.json").read())
    except Exception as e:
        return {"error": f"no result ({e})"}
rows = {k: load(k) for k in ("fsdp_ep_all", "fsdp_ep_half", "sp2_ep_all")}
for k, r in rows.items():
    keys = ("tokens_per_s_per_gpu", "batch_per_gpu", "step_s", "mfu", "model_tflops", "peak_mem_gib",
            "peak_reserved_gib", "init_s", "time_s", "split_s", "mesh")
    print(json.dumps({"layout": k, **{x: r.get(x) for x in keys}} if "losses" in r else {"layout": k, **r}))
a, b = rows["fsdp_ep_all"], rows["fsdp_ep_half"]
if "losses" in a and "losses" in b:
    # DESIGN's bf16 tolerance for layouts: relative L2 error <= 1e-2, here over the per-step loss curve.
    # The per-step differences are printed too: train_step trains on one batch, the loss falls fast
    # and bf16 run-to-run noise (float atomics) grows over the steps.
    la, lb = a["losses"], b["losses"]
    d = [abs(x - y) / abs(y) for x, y in zip(la, lb)]
    rel_l2 = (sum((x - y) ** 2 for x, y in zip(la, lb)) / sum(y * y for y in lb)) ** 0.5
    print(json.dumps({"check": "loss_fsdp_ep_all_vs_half", "steps": len(d), "rel_l2": rel_l2,
                      "max_step_rel_diff": max(d), "within_bf16_tol": rel_l2 <= 1e-2,
                      "step_rel_diffs": [float(f"{x:.2e}") for x in d], "losses_all": la, "losses_half": lb}))
PY
