#!/usr/bin/env python3
"""The `tokenizers` peer of `moetrain tokenize --bench`: the same file, one document per line, one thread, the same
passes (the first on a fresh tokenizer: cold cache; then the best of the others). Prints one JSON line.
With --check IDS_FILE (the output of `moetrain tokenize` on the same file) it first checks every line's ids.
Run with RAYON_NUM_THREADS=1 TOKENIZERS_PARALLELISM=false (bench/tokenize_compare.sh does)."""
import argparse
import json
import os
import time

import tokenizers
from tokenizers import Tokenizer

ap = argparse.ArgumentParser()
ap.add_argument("--tokenizer", required=True)
ap.add_argument("--file", required=True)
ap.add_argument("--passes", type=int, default=3)
ap.add_argument("--check")
args = ap.parse_args()
with open(args.file, "rb") as f:
    data = f.read()
text = data.decode("utf-8", "replace")
lines = text.split("\n")
if text.endswith("\n"):
    lines = lines[:-1]
if args.check:
    tok = Tokenizer.from_file(args.tokenizer)
    with open(args.check) as f:
        ours = [l.rstrip("\n") for l in f]
    assert len(ours) == len(lines), (len(ours), len(lines))
    bad = sum(1 for l, o in zip(lines, ours) if " ".join(map(str, tok.encode(l).ids)) != o)
    print(json.dumps({"check": "ids", "lines": len(lines), "mismatched_lines": bad}))
for api in ("encode_batch", "encode_batch_fast"):
    tok = Tokenizer.from_file(args.tokenizer)
    fn = getattr(tok, api)
    times, tokens = [], 0
    for p in range(args.passes):
        t0 = time.perf_counter()
        enc = fn(lines, add_special_tokens=False)
        times.append(time.perf_counter() - t0)
        tokens = sum(len(e.ids) for e in enc)
    warm = min(times[1:]) if len(times) > 1 else times[0]
    mb = len(data) / 1e6
    print(json.dumps({"bench": "tokenize_peer", "library": "tokenizers " + tokenizers.__version__, "api": api,
                      "file": args.file, "bytes": len(data), "lines": len(lines), "tokens": tokens, "threads": 1,
                      "rayon_num_threads": os.environ.get("RAYON_NUM_THREADS"), "cold_s": times[0],
                      "cold_mb_per_s": mb / times[0], "warm_s": warm, "mb_per_s": mb / warm,
                      "tokens_per_s": tokens / warm}))
