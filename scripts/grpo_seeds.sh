#!/usr/bin/env bash
# Runs `moetrain grpo` once per seed, JOBS at a time, and prints one JSON line per run and a summary line:
# how robust a GRPO recipe is across seeds (docs/rl.md quotes what it measured): the gain in held-out exact
# match (min / median / max) and how many runs gained at least GAIN points; with --env, the gain in the greedy
# episodes' success (the env line), the single-turn exact match beside it, and the sampled episodes' environment
# metrics at step 1 and over the last 10 steps (env_sampled: the learning a high greedy start hides). The task's
# starting model is made by the first run that needs it (the others wait for it: a lock file beside it).
# usage: scripts/grpo_seeds.sh [BUILD_DIR] [SEEDS] [-- extra grpo arguments]
#   BUILD_DIR defaults to build, SEEDS to "1 2 3 4 5"; JOBS (default 1) runs that many at once (on 2 CPU
#   cores 2; on one GPU keep 1: processes sharing a GPU time-slice it and run slower than one after
#   another); OUT (default /tmp/grpo_seeds) keeps each run's log and run directory; TAG names the recipe
#   in the output; GAIN (default 25) the bar.
set -euo pipefail
build=${1:-build}
seeds=${2:-1 2 3 4 5}
shift $(( $# < 2 ? $# : 2 ))
[ "${1:-}" = "--" ] && shift
extra=("$@")
jobs=${JOBS:-1}
out=${OUT:-/tmp/grpo_seeds}
tag=${TAG:-default}
gain_bar=${GAIN:-25}
mkdir -p "$out"
run_one() {
  local seed=$1 dir="$out/$tag-seed$1" t0=$SECONDS
  shift
  "$build/moetrain" grpo --seed "$seed" --run-dir "$dir" "$@" > "$dir.log" 2>&1 || {
    echo "{\"tag\": \"$tag\", \"seed\": $seed, \"error\": \"moetrain grpo failed, see $dir.log\"}"
    return 0
  }
  # "grpo: exact-match 0.0% -> 47.5% on 200 held-out problems"; reward_last50: the mean reward of the last
  # 50 steps (metrics.jsonl).
  local reward
  reward=$(python3 -c 'import json,sys; v=[json.loads(l).get("reward_mean") for l in open(sys.argv[1])]; v=[x for x in v if x is not None][-50:]; print(round(sum(v)/len(v),4) if v else "null")' \
    "$dir/metrics.jsonl" 2>/dev/null || echo null)
  # With --env: "grpo: env builtin:retry success 25.0% -> 40.0% on 200 held-out problems (...)" as well; the
  # episodes' success is then the line's before/after, the single-turn exact match kept beside it, and
  # env_sampled gives each environment metric of the sampled episodes at step 1 and over the last 10 steps.
  local env_sampled
  env_sampled=$(python3 -c '
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if "\"reward_mean\"" in l]
rows = [r for r in rows if isinstance(r.get("env"), dict)]
if rows:
    keys = sorted({k for r in rows for k in r["env"]})
    def last10(k):
        v = [r["env"][k] for r in rows[-10:] if k in r["env"]]
        return round(sum(v) / len(v), 4) if v else None
    print(json.dumps({k: [rows[0]["env"].get(k), last10(k)] for k in keys}))' "$dir/metrics.jsonl" 2>/dev/null)
  local env_line
  env_line=$(sed -n 's/^grpo: env [^ ]* success \([0-9.]*\)% -> \([0-9.]*\)% on .*/\1 \2/p' "$dir.log")
  sed -n 's/^grpo: exact-match \([0-9.]*\)% -> \([0-9.]*\)% on .*/\1 \2/p' "$dir.log" |
    while read -r before after; do
      if [ -n "$env_line" ]; then
        read -r eb ea <<< "$env_line"
        echo "{\"tag\": \"$tag\", \"seed\": $seed, \"before\": $eb, \"after\": $ea, \"exact_match_before\": $before, \"exact_match_after\": $after, \"reward_last50\": $reward, \"env_sampled\": ${env_sampled:-null}, \"wall_s\": $((SECONDS - t0))}"
      else
        echo "{\"tag\": \"$tag\", \"seed\": $seed, \"before\": $before, \"after\": $after, \"reward_last50\": $reward, \"wall_s\": $((SECONDS - t0))}"
      fi
    done
}
export -f run_one
export build out tag gain_bar
results=$(printf '%s\n' $seeds | xargs -P "$jobs" -I{} bash -c 'run_one "$@"' _ {} "${extra[@]}")
echo "$results"
echo "$results" | GAIN="$gain_bar" python3 -c '
import json, os, sys
rows = [json.loads(l) for l in sys.stdin if l.strip()]
ok = [r for r in rows if "after" in r]
gain = sorted(r["after"] - r["before"] for r in ok)
summary = {"tag": rows[0]["tag"] if rows else "", "runs": len(rows), "failed": len(rows) - len(ok)}
if gain:
    summary.update(gain_min=round(gain[0], 1), gain_median=round(gain[len(gain) // 2], 1), gain_max=round(gain[-1], 1),
                   gain_bar=float(os.environ["GAIN"]), runs_meeting_bar=sum(g >= float(os.environ["GAIN"]) for g in gain))
print(json.dumps(summary))'
