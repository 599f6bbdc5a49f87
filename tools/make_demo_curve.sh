#!/usr/bin/env bash
# Regenerates tests/assets/curves/demo_cpu_100.json: the demo's 100-step CPU loss curve that the CPU
# and the GPU training tests must follow. lr 1e-3 (the curve predates the demo's 7e-4) with warm-up 20:
# at 3e-3 the run sat near a loss spike around step 27 that fp32 summation-order differences (another
# BLAS) could trigger, which would make the curve a test of luck. Run from the repository root after
# `make build`.
set -euo pipefail
out=$(mktemp -d)
"${MOETRAIN:-./build/moetrain}" train --device cpu --threads 1 --steps 100 --micro-batch-size 8 --lr 1e-3 --min-lr 1e-4 \
  --warmup-steps 20 --eval-problems 0 --out-dir "$out"
python3 - "$out/metrics.jsonl" <<'PY'
import json, sys
losses = [json.loads(l)["loss"] for l in open(sys.argv[1]) if '"loss"' in l]
json.dump({"what": "loss per step of `moetrain train --device cpu --threads 1 --steps 100 --micro-batch-size 8 "
                   "--lr 1e-3 --min-lr 1e-4 --warmup-steps 20 --eval-problems 0` (demo model, synthetic addition, seed 1234, "
                   "all other options default)",
           "made_with": "moetrain CPU backend, OpenBLAS, 1 thread; regenerate with tools/make_demo_curve.sh",
           "config": {"model": "demo", "steps": 100, "micro_batch_size": 8, "lr": 1e-3, "min_lr": 1e-4,
                      "warmup_steps": 20, "eval_problems": 0},
           "losses": losses}, open("tests/assets/curves/demo_cpu_100.json", "w"), indent=1)
PY
rm -rf "$out"
