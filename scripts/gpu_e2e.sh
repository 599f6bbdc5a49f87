#!/usr/bin/env bash
# The user's commands, end to end, on a GPU (what no unit test covers: a command can go wrong on a GPU
# while every unit test passes). Each runs with a time limit and its log's last lines are printed; logs
# go to OUT_DIR. Run after a build:
# usage: scripts/gpu_e2e.sh [BUILD_DIR] [OUT_DIR] [which: all|train|sft|generate|grpo|grpo_lora|ppo|grpo_resume|
#                                                  grpo_prompts|grpo_launch ...]   (grpo_launch: 2 GPUs)
# (GRPO_LIMIT_S, PPO_LIMIT_S: their time limits, 600 and 300 s by default; PROMPT_SEEDS, LORA_SEEDS: the seeds
# of grpo_prompts and grpo_lora, default 1)
set -uo pipefail
cd "$(dirname "$0")/.."
build=${1:-build-gpu}
out=${2:-/tmp/gpu_e2e}
shift 2 2>/dev/null || shift $#
which=" ${*:-all} "
mkdir -p "$out"
mt="$build/moetrain"
want() { [[ "$which" == *" all "* || "$which" == *" $1 "* ]]; }
step() {  # step NAME LIMIT_S ARGS...: run moetrain ARGS, print the wall time and the last lines
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  timeout "$limit" "$mt" "$@" > "$out/$name.log" 2>&1
  local rc=$?
  echo "== $name: rc $rc, $((SECONDS - t0)) s: moetrain $*"
  grep -v '^\s*$' "$out/$name.log" | tail -n 4 | sed 's/^/   /'
}
if want train; then
  step train 300 train --device cuda --out-dir runs/demo
fi
if want sft; then
  step sft 300 sft --device cuda --model tiny --tokenizer tests/assets/tokenizer/trained/tokenizer.json \
    --data examples/chat_small.jsonl --steps 40 --seq-len 256 --lr 3e-3 --min-lr 3e-4 --warmup-steps 5 \
    --run-dir "$out/sft"
  step sft_resume 300 sft --device cuda --model tiny --tokenizer tests/assets/tokenizer/trained/tokenizer.json \
    --data examples/chat_small.jsonl --steps 60 --seq-len 256 --lr 3e-3 --min-lr 3e-4 --warmup-steps 5 \
    --run-dir "$out/sft" --resume
fi
if want generate; then
  printf '{"prompt_ids": [1, 2, 3]}\n{"prompt_ids": [5, 6, 7, 8, 9]}\n' > "$out/prompts.jsonl"
  model=$(ls -d runs/demo/checkpoint-* 2>/dev/null | sort -t- -k2 -n | tail -1)
  [[ -n "$model" ]] && step generate 120 generate --device cuda --model "$model" --prompts "$out/prompts.jsonl" \
    --out "$out/samples.jsonl" --n 4 --temperature 1 --max-new-tokens 16 --seed 3
fi
if want grpo; then
  step grpo "${GRPO_LIMIT_S:-600}" grpo --device cuda --out-dir "$out/grpo"
fi
if want grpo_lora; then  # the default task with LoRA adapters (rank 16) on the frozen start, seeds LORA_SEEDS
  for s in ${LORA_SEEDS:-1}; do
    step "grpo_lora_$s" "${GRPO_LIMIT_S:-600}" grpo --device cuda --lora-rank 16 --seed "$s" --out-dir "$out/grpo_lora_$s"
  done
fi
if want ppo; then
  step ppo "${PPO_LIMIT_S:-300}" grpo --device cuda --algorithm ppo --out-dir "$out/ppo"
fi
if want grpo_resume; then  # 10 steps, stop, --resume to 20 (the demo model must exist: train first)
  common="grpo --device cuda --steps 20 --save-every 10 --eval-problems 50 --run-dir $out/grpo_resume"
  step grpo_first 300 $common --max-steps 10
  step grpo_resumed 300 $common --resume
fi
if want grpo_prompts; then  # a prompt file of 0..999 + 0..999 additions in the demo's ids (50,000 distinct problems:
  # scripts/addition_prompts.py), exact match, from the demo stopped early (grpo's default start: `grpo` makes it),
  # with the recipe for a start that solves few of them (docs/rl.md "Prompt files")
  python3 scripts/addition_prompts.py "$out" > /dev/null
  start=$(ls -d runs/grpo-start/checkpoint-* 2>/dev/null | sort -t- -k3 -n | tail -1)
  [[ -z "$start" ]] && { step grpo_start 300 grpo --device cuda --steps 1 --run-dir "$out/grpo_start"; \
    start=$(ls -d runs/grpo-start/checkpoint-* | sort -t- -k3 -n | tail -1); }
  for seed in ${PROMPT_SEEDS:-1}; do
    step "grpo_prompts_$seed" "${GRPO_LIMIT_S:-600}" grpo --device cuda --model "$start" --seed "$seed" \
      --prompts "$out/train_prompts.jsonl" --eval-prompts "$out/eval_prompts.jsonl" --max-new-tokens 8 \
      --steps 1000 --prompts-per-step 32 --max-generate-rounds 16 --lr 1e-4 --run-dir "$out/grpo_prompts_$seed"
  done
fi
if want grpo_launch; then  # two ranks, one GPU each
  # --comm-timeout-s 60: a stuck collective ends the run with the watchdog's report instead of the step's limit.
  layouts=("--dp-shard 2" "--ep 2" "--tp 2" "--sp 2")
  [[ -n "${GRPO_LAYOUTS:-}" ]] && IFS=, read -ra layouts <<< "$GRPO_LAYOUTS"  # e.g. GRPO_LAYOUTS="--ep 2,--tp 2"
  for layout in "${layouts[@]}"; do
    step "grpo_launch_${layout// /_}" 300 launch --nproc-per-node 2 -- grpo --device cuda $layout --steps 20 \
      --prompts-per-step 16 --eval-problems 50 --comm-timeout-s 60 --run-dir "$out/grpo_launch${layout// /_}"
  done
fi
