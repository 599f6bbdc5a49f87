#!/usr/bin/env bash
# One GPU run: moetrain's train_step and the transformers peer on the same shape, then the ratios.
# usage: bench/compare.sh BUILD_DIR [batch] [seq]    (writes JSON lines to stdout)
set -uo pipefail
build=${1:-build-gpu}
batch=${2:-1}
seq=${3:-4096}
ours=$("$build/train_step" --model bench-4L --batch "$batch" --seq "$seq" | tail -1)
echo "$ours"
gemm=$(python3 -c "import json,sys; print(json.loads(sys.argv[1])['gemm_bf16_tflops_measured'])" "$ours")
peers=()
for v in "--variant bf16" "--variant bf16 --compile" "--variant fp32master" "--variant fp32master --compile"; do
  line=$(python3 "$(dirname "$0")/peer_transformers.py" --batch "$batch" --seq "$seq" --gemm-tflops "$gemm" $v 2>/dev/null | tail -1)
  [ -n "$line" ] && echo "$line" && peers+=("$line")
done
python3 - "$ours" "${peers[@]}" <<'PY'
import json, sys
ours = json.loads(sys.argv[1])
for p in map(json.loads, sys.argv[2:]):
    print(json.dumps({"bench": "ratio", "peer": f"{p['variant']}{'+compile' if p['compile'] else ''}",
                      "moetrain_tokens_per_s": ours["tokens_per_s"], "peer_tokens_per_s": p["tokens_per_s"],
                      "ratio": ours["tokens_per_s"] / p["tokens_per_s"]}))
PY
