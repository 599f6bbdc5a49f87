#!/usr/bin/env bash
# One GPU run: moetrain's train_step and the transformers peer on the same shape, then the ratios.
# usage: bench/compare.sh BUILD_DIR [batch] [seq] [grad_accum]    (writes JSON lines to stdout)
# grad_accum: micro-batches of `batch` rows per optimizer step on both sides (tokens/s over whole steps).
# OURS_ARGS adds train_step flags (e.g. "--recompute full"), PEER_ARGS peer flags.
# PEER_TIMEOUT (seconds, default 300) bounds each peer; a peer that fails or times out is named on
# stderr and left out of the ratios. PEERS (default all four) picks variants by index: "1 2" = the
# two bf16 ones. PEER_BATCH / PEER_ACCUM give the peers another micro-batch x accumulation with the same
# tokens per optimizer step (each side at its best micro-batch that fits: P13), e.g.
#   OURS_ARGS="--recompute none" PEER_BATCH=2 PEER_ACCUM=8 bench/compare.sh build-gpu 4 4096 4
set -uo pipefail
build=${1:-build-gpu}
batch=${2:-1}
seq=${3:-4096}
accum=${4:-1}
peer_batch=${PEER_BATCH:-$batch}
peer_accum=${PEER_ACCUM:-$accum}
if (( peer_batch * peer_accum != batch * accum )); then
  echo "compare.sh: the peers' PEER_BATCH x PEER_ACCUM ($peer_batch x $peer_accum) must give the same rows per optimizer step as ours ($batch x $accum)" >&2
  exit 2
fi
ours=$("$build/train_step" --model bench-4L --batch "$batch" --seq "$seq" --grad-accum "$accum" ${OURS_ARGS:-} | tail -1)
echo "$ours"
gemm=$(python3 -c "import json,sys; print(json.loads(sys.argv[1])['gemm_bf16_tflops_measured'])" "$ours")
peers=()
variants=("--variant bf16" "--variant bf16 --compile" "--variant fp32master" "--variant fp32master --compile")
for i in ${PEERS:-1 2 3 4}; do
  v=${variants[$((i - 1))]}
  line=$(timeout "${PEER_TIMEOUT:-300}" python3 "$(dirname "$0")/peer_transformers.py" --batch "$peer_batch" --seq "$seq" \
           --grad-accum "$peer_accum" --gemm-tflops "$gemm" ${PEER_ARGS:-} $v 2>/tmp/peer_err.$$ | tail -1)
  rc=${PIPESTATUS[0]}
  if [ -n "$line" ]; then echo "$line"; peers+=("$line")
  else echo "peer $v failed (exit $rc): $(tail -3 /tmp/peer_err.$$)" >&2; fi
done
rm -f /tmp/peer_err.$$
python3 - "$ours" "${peers[@]}" <<'PY'
import json, sys
ours = json.loads(sys.argv[1])
for p in map(json.loads, sys.argv[2:]):
    print(json.dumps({"bench": "ratio", "peer": f"{p['variant']}{'+compile' if p['compile'] else ''}",
                      "moetrain_micro_batch": ours["batch_per_gpu"], "moetrain_grad_accum": ours["grad_accum"],
                      "peer_micro_batch": p["batch"], "peer_grad_accum": p["grad_accum"],
                      "moetrain_tokens_per_s": ours["tokens_per_s"], "peer_tokens_per_s": p["tokens_per_s"],
                      "ratio": ours["tokens_per_s"] / p["tokens_per_s"]}))
PY
