#!/usr/bin/env bash
# train_step of two commits on one GPU, built and run side by side (alternating runs, so drift hits both).
#   bench/ab_train_step.sh pack REV_A REV_B   here: git archives of both into runs/ab/ (no test assets)
#   bench/ab_train_step.sh run [ARGS...]      on the GPU machine (carry: .deps/device runs/ab): builds both
#                                             for sm_90a, runs train_step three times each, JSON lines tagged
#                                             "v": "a" | "b" into $OUT/ab.jsonl
# ARGS default to bench-4L at 4,096 tokens, batch 1, 10 steps, no profile.
set -uo pipefail
cd "$(dirname "$0")/.."
case "${1:-}" in
  pack)
    mkdir -p runs/ab
    git archive --format=tar.gz "${2:?REV_A}" -- . ':!tests/assets' > runs/ab/a.tar.gz
    git archive --format=tar.gz "${3:?REV_B}" -- . ':!tests/assets' > runs/ab/b.tar.gz
    echo "$2 $3" > runs/ab/revs
    ls -la runs/ab ;;
  run)
    shift
    args=("$@")
    [ ${#args[@]} -eq 0 ] && args=(--model bench-4L --batch 1 --seq 4096 --steps 10 --no-profile)
    out=${OUT:-runs/ab/out}
    mkdir -p "$out"
    root=$PWD t0=$SECONDS
    for v in a b; do
      mkdir -p /tmp/ab-$v && tar xzf runs/ab/$v.tar.gz -C /tmp/ab-$v
      ln -sfn "$root/.deps" /tmp/ab-$v/.deps && ln -sfn "$root/tests/assets" /tmp/ab-$v/tests/assets
      ( cmake -S /tmp/ab-$v -B /tmp/ab-$v/b -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES=90a \
          > "$out/${v}_cfg.log" 2>&1 &&
        cmake --build /tmp/ab-$v/b --target train_step -j "$(( $(nproc) / 2 ))" > "$out/${v}_build.log" 2>&1
        echo "$v: build rc $? at $((SECONDS - t0)) s" ) &
    done
    wait
    for i in 1 2 3; do for v in a b; do
      /tmp/ab-$v/b/train_step "${args[@]}" 2>> "$out/$v.err" | grep '^{' |
        sed "s/^{/{\"v\":\"$v\",\"rep\":$i,/" | tee -a "$out/ab.jsonl" |
        python3 -c "import sys, json; [print(d['v'], d['rep'], 'tokens/s', round(d['tokens_per_s'])) for d in map(json.loads, sys.stdin)]"
    done; done ;;
  *) echo "usage: bench/ab_train_step.sh pack REV_A REV_B | run [train_step args]" >&2; exit 2 ;;
esac
