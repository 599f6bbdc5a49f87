#!/usr/bin/env bash
# Resume check on any device: the demo model trained N steps straight, and N/2 steps then `--resume` to
# N in a new process; prints one JSON line with the largest relative difference of the per-step losses
# after the resume point and whether the final weight files are byte-identical. On the CPU both are
# exact (tests/train cover it); on a GPU without --deterministic (float atomics) they are close, not equal.
# A second straight run checks determinism itself: repeat_* compare it with the first (the same bits
# with --deterministic, on any device; close otherwise on a GPU).
# EXTRA (5th argument, or the EXTRA environment variable) is added to every run, e.g. --deterministic:
#   scripts/resume_check.sh build-gpu cuda 10 /tmp/resume_check --deterministic
#   -> max_rel_loss_diff 0.0, final_weights_identical true, repeat_max_rel_loss_diff 0.0, repeat_identical true
# usage: scripts/resume_check.sh [BUILD_DIR] [DEVICE] [STEPS] [OUT_DIR] [EXTRA]
set -uo pipefail
cd "$(dirname "$0")/.."
build=${1:-build-gpu}
device=${2:-cuda}
steps=${3:-20}
out=${4:-/tmp/resume_check}
extra=${5:-${EXTRA:-}}
rm -rf "$out" && mkdir -p "$out"
common="train --device $device --steps $steps --warmup-steps 2 --eval-problems 0 --log-every 100 $extra"
"$build/moetrain" $common --out-dir "$out/straight" > "$out/straight.log" 2>&1 || { tail -5 "$out/straight.log"; exit 1; }
"$build/moetrain" $common --out-dir "$out/straight2" > "$out/straight2.log" 2>&1 || { tail -5 "$out/straight2.log"; exit 1; }
"$build/moetrain" $common --out-dir "$out/resumed" --max-steps $((steps / 2)) > "$out/first.log" 2>&1 || { tail -5 "$out/first.log"; exit 1; }
"$build/moetrain" $common --out-dir "$out/resumed" --resume > "$out/second.log" 2>&1 || { tail -5 "$out/second.log"; exit 1; }
python3 - "$out" "$steps" "$extra" <<'PY'
import filecmp, glob, json, os, sys
out, steps, extra = sys.argv[1], int(sys.argv[2]), sys.argv[3]
def losses(d):
    return {j["step"]: j["loss"] for j in map(json.loads, open(os.path.join(d, "metrics.jsonl"))) if "loss" in j and "step" in j}
def max_rel(a, b, steps_):
    return max(abs(a[s] - b[s]) / abs(a[s]) for s in steps_) if steps_ else None
def same_files(da, db):  # the final weights and training state, byte for byte
    fa = sorted(glob.glob(da + f"/checkpoint-{steps}/**/*.safetensors", recursive=True))
    fb = sorted(glob.glob(db + f"/checkpoint-{steps}/**/*.safetensors", recursive=True))
    rel = lambda fs, d: [os.path.relpath(f, d) for f in fs]
    return bool(fa) and rel(fa, da) == rel(fb, db) and all(filecmp.cmp(x, y, shallow=False) for x, y in zip(fa, fb))
a, b, c = losses(out + "/straight"), losses(out + "/resumed"), losses(out + "/straight2")
after = [s for s in a if s > steps // 2 and s in b]
print(json.dumps({"check": "resume", "steps": steps, "extra": extra, "compared_steps": len(after),
                  "max_rel_loss_diff": max_rel(a, b, after),
                  "final_weights_identical": same_files(out + "/straight", out + "/resumed"),
                  "repeat_max_rel_loss_diff": max_rel(a, c, [s for s in a if s in c]),
                  "repeat_identical": same_files(out + "/straight", out + "/straight2")}))
PY
