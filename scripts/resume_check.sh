#!/usr/bin/env bash
# Resume check on any device: the demo model trained N steps straight, and N/2 steps then `--resume` to
# N in a new process; prints one JSON line with the largest relative difference of the per-step losses
# after the resume point and whether the final weight files are byte-identical. On the CPU both are
# exact (tests/train cover it); on a GPU without --deterministic (P12 item 3) they are close, not equal.
# usage: scripts/resume_check.sh [BUILD_DIR] [DEVICE] [STEPS] [OUT_DIR]
set -uo pipefail
cd "$(dirname "$0")/.."
build=${1:-build-gpu}
device=${2:-cuda}
steps=${3:-20}
out=${4:-/tmp/resume_check}
rm -rf "$out" && mkdir -p "$out"
common="train --device $device --steps $steps --warmup-steps 2 --eval-problems 0 --log-every 100"
"$build/moetrain" $common --out-dir "$out/straight" > "$out/straight.log" 2>&1 || { tail -5 "$out/straight.log"; exit 1; }
"$build/moetrain" $common --out-dir "$out/resumed" --max-steps $((steps / 2)) > "$out/first.log" 2>&1 || { tail -5 "$out/first.log"; exit 1; }
"$build/moetrain" $common --out-dir "$out/resumed" --resume > "$out/second.log" 2>&1 || { tail -5 "$out/second.log"; exit 1; }
python3 - "$out" "$steps" <<'PY'
import filecmp, glob, json, os, sys
out, steps = sys.argv[1], int(sys.argv[2])
def losses(d):
    return {j["step"]: j["loss"] for j in map(json.loads, open(os.path.join(d, "metrics.jsonl"))) if "loss" in j and "step" in j}
a, b = losses(out + "/straight"), losses(out + "/resumed")
after = [s for s in a if s > steps // 2 and s in b]
rel = max(abs(a[s] - b[s]) / abs(a[s]) for s in after) if after else None
fa = sorted(glob.glob(out + f"/straight/checkpoint-{steps}/*.safetensors"))
fb = sorted(glob.glob(out + f"/resumed/checkpoint-{steps}/*.safetensors"))
same = bool(fa) and [os.path.basename(f) for f in fa] == [os.path.basename(f) for f in fb] and \
    all(filecmp.cmp(x, y, shallow=False) for x, y in zip(fa, fb))
print(json.dumps({"check": "resume", "steps": steps, "compared_steps": len(after), "max_rel_loss_diff": rel,
                  "final_weights_identical": same}))
PY
