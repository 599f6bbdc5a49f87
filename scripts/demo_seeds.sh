#!/usr/bin/env bash
# Runs the demo (`moetrain train`) once per seed, JOBS at a time, and prints one JSON line per run and
# a summary line: how robust the default recipe is (the README quotes the range this measures).
# usage: scripts/demo_seeds.sh [BUILD_DIR] [SEEDS] [-- extra train arguments]
#   BUILD_DIR defaults to build, SEEDS to "1 2 3 4 5"; JOBS (default 1) runs that many at once (a GPU
#   holds several demo runs; on 2 CPU cores keep 1); OUT (default /tmp/demo_seeds) keeps each run's
#   log and metrics; TAG names the recipe in the output.
set -euo pipefail
build=${1:-build}
seeds=${2:-1 2 3 4 5}
shift $(( $# < 2 ? $# : 2 ))
[ "${1:-}" = "--" ] && shift
extra=("$@")
jobs=${JOBS:-1}
out=${OUT:-/tmp/demo_seeds}
tag=${TAG:-default}
mkdir -p "$out"
run_one() {
  local seed=$1 dir="$out/$tag-seed$1"
  shift
  "$build/moetrain" train --seed "$seed" --out-dir "$dir" --log-every 500 "$@" > "$dir.log" 2>&1 || {
    echo "{\"tag\": \"$tag\", \"seed\": $seed, \"error\": \"moetrain train failed, see $dir.log\"}"
    return 0
  }
  # "demo: loss 3.5322 -> 0.0364, exact-match 89% on 200 held-out problems" (the loss: mean of the last
  # 10 steps, aux and z terms included); last_ce: the cross-entropy alone, mean of the last 10 steps.
  local ce
  ce=$(python3 -c 'import json,sys; v=[json.loads(l)["ce"] for l in open(sys.argv[1]) if "\"ce\"" in l][-10:]; print(round(sum(v)/len(v),5))' \
    "$dir/metrics.jsonl" 2>/dev/null || echo null)
  sed -n 's/^demo: loss \([0-9.e+-]*\) -> \([0-9.e+-]*\), exact-match \([0-9.]*\)% .*/\1 \2 \3/p' "$dir.log" |
    while read -r first last em; do
      echo "{\"tag\": \"$tag\", \"seed\": $seed, \"first_loss\": $first, \"last_loss\": $last, \"last_ce\": $ce, \"exact_match\": $em}"
    done
}
export -f run_one
export build out tag
results=$(printf '%s\n' $seeds | xargs -P "$jobs" -I{} bash -c 'run_one "$@"' _ {} "${extra[@]}")
echo "$results"
echo "$results" | python3 -c '
import json, sys
rows = [json.loads(l) for l in sys.stdin if l.strip()]
ok = [r for r in rows if "exact_match" in r]
em = sorted(r["exact_match"] for r in ok)
summary = {"tag": rows[0]["tag"] if rows else "", "runs": len(rows), "failed": len(rows) - len(ok)}
if em:
    summary.update(exact_match_min=em[0], exact_match_median=em[len(em) // 2], exact_match_max=em[-1],
                   last_loss_max=max(r["last_loss"] for r in ok))
print(json.dumps(summary))'
