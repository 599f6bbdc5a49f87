#!/usr/bin/env bash
# The batch-invariant mode's cost and effect on one GPU (docs/rl.md "Bit-equal rollout and trainer log-probs"):
# decode (generate_bench, bench-4L, 256 prompts of 128 tokens, 512 new) and one RL step (rl_step, 64 prompts x 8
# samples x 512 new tokens, reference on), each in the default mode and with MOETRAIN_BATCH_INVARIANT=1. The
# benches' JSON lines with "mode" added; rl_step's carry the rollout/trainer mismatch (logprob_diff_max, 0 in the
# mode) and the phases' seconds.
# usage: bench/true_on_policy.sh [BUILD_DIR]
set -euo pipefail
b=${1:-build-gpu}
for mode in default invariant; do
  if [ "$mode" = invariant ]; then export MOETRAIN_BATCH_INVARIANT=1; else unset MOETRAIN_BATCH_INVARIANT; fi
  "$b/generate_bench" --prompts 256 --n 1 | grep '^{' | sed "s/^{/{\"mode\":\"$mode\",/"
  "$b/rl_step" --steps 2 --reference on --micro-batch-samples 8 | grep '^{' | sed "s/^{/{\"mode\":\"$mode\",/"
done
