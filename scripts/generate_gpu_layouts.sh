#!/usr/bin/env bash
# `moetrain generate` on the GPUs of one machine (2+ GPUs) under the inference layouts (FSDP: weights
# gathered once; EP: experts sharded, tokens exchanged over NCCL), against one GPU: the same prompts,
# greedy and sampled (seeded). Prints one JSON line per layout and model: sequences whose tokens equal
# the one-GPU run's, the first differing position otherwise, and the largest |Δ logprob| over the shared
# prefix (bf16: the runs may part at a near-tie). Assumes the build exists (gpu_test.sh made it).
# usage: scripts/generate_gpu_layouts.sh [BUILD_DIR] [OUT_DIR]
set -uo pipefail
cd "$(dirname "$0")/.."
build=${1:-build-gpu}
out=${2:-/tmp/generate_gpu_layouts}
mkdir -p "$out"
n=$(nvidia-smi -L | wc -l)
((n >= 2)) || { echo "generate_gpu_layouts: needs 2+ GPUs, found $n"; exit 1; }
python3 - "$out/prompts.jsonl" <<'PY'
import json, random, sys
r = random.Random(5)
with open(sys.argv[1], "w") as f:
    for i in range(24):
        f.write(json.dumps({"prompt_ids": [r.randrange(1, 120) for _ in range(r.randrange(1, 40))]}) + "\n")
PY
for model in tiny dense_layer; do
  for mode in "greedy:--temperature 0" "sampled:--temperature 1 --top-p 0.9 --n 4 --seed 11"; do
    name=${mode%%:*}
    args="--device cuda --model tests/assets/goldens/$model --prompts $out/prompts.jsonl --max-new-tokens 48 --ignore-eos ${mode#*:}"
    CUDA_VISIBLE_DEVICES=0 "$build/moetrain" generate $args --out "$out/$model.$name.one.jsonl" 2>&1 | tail -1
    for layout in "--dp-shard $n" "--ep $n"; do
      tag=$(echo "$layout" | tr -d ' -')
      "$build/moetrain" launch --nproc-per-node "$n" -- generate $args $layout --out "$out/$model.$name.$tag.jsonl" 2>&1 \
        | grep -E "weight sync|generate:|rror" | tail -2
      python3 - "$out/$model.$name.one.jsonl" "$out/$model.$name.$tag.jsonl" "$model" "$name" "$layout" <<'PY'
import json, sys
a = [json.loads(l) for l in open(sys.argv[1])]
b = [json.loads(l) for l in open(sys.argv[2])]
assert len(a) == len(b), (len(a), len(b))
same, first, dmax = 0, [], 0.0
for x, y in zip(a, b):
    assert (x["prompt_index"], x["sample_index"]) == (y["prompt_index"], y["sample_index"])
    t, u = x["token_ids"], y["token_ids"]
    k = next((i for i, (p, q) in enumerate(zip(t, u)) if p != q), min(len(t), len(u)))
    if t == u: same += 1
    else: first.append(k)
    for i in range(k):
        dmax = max(dmax, abs(x["logprobs"][i] - y["logprobs"][i]))
print(json.dumps({"check": "generate_layout", "model": sys.argv[3], "mode": sys.argv[4], "layout": sys.argv[5],
                  "sequences": len(a), "identical": same, "first_difference_at": sorted(first)[:8],
                  "max_abs_dlogprob_shared_prefix": dmax}))
PY
    done
  done
done
