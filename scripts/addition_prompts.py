#!/usr/bin/env python3
"""A prompt file for `moetrain grpo --prompts`: additions of 0..999 + 0..999 in the demo's token ids.

Writes OUT_DIR/train_prompts.jsonl (N distinct problems, default 50,000) and OUT_DIR/eval_prompts.jsonl (200 others),
one line each: {"prompt_ids": [<bos>, a, '+', b, '='], "answer": the sum's digits reversed (as the demo writes
them), "a": a, "b": b}. The same seed gives the same files.

Many distinct problems matter: with 2,000 the model sees each ~60 times over a 1,000-step run and learns the
training answers (29.5% greedy exact match on training prompts against 11.5% held out); with 50,000 it must learn
to add (docs/rl.md "Prompt files").

usage: python3 scripts/addition_prompts.py OUT_DIR [--train N] [--eval M] [--seed S]
"""
import argparse
import json
import os
import random


def ids(s):
    return [3 + int(c) if c.isdigit() else {"+": 13, "=": 14}[c] for c in s]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out_dir")
    ap.add_argument("--train", type=int, default=50000)
    ap.add_argument("--eval", type=int, default=200)
    ap.add_argument("--seed", type=int, default=1)
    a = ap.parse_args()
    if a.train < 1 or a.eval < 1 or a.train + a.eval > 1000 * 1000:
        ap.error(f"--train {a.train} and --eval {a.eval}: need >= 1 each and at most 1,000,000 together")
    rng = random.Random(a.seed)
    pairs = set()
    while len(pairs) < a.train + a.eval:
        pairs.add((rng.randint(0, 999), rng.randint(0, 999)))
    pairs = sorted(pairs)
    rng.shuffle(pairs)
    os.makedirs(a.out_dir, exist_ok=True)
    for name, part in (("train", pairs[:a.train]), ("eval", pairs[a.train:])):
        with open(os.path.join(a.out_dir, f"{name}_prompts.jsonl"), "w") as f:
            for x, y in part:
                f.write(json.dumps({"prompt_ids": [1] + ids(f"{x}+{y}="), "answer": ids(str(x + y)[::-1]),
                                    "a": x, "b": y}) + "\n")
    print(f"{a.train} training and {a.eval} held-out prompts in {a.out_dir}")


if __name__ == "__main__":
    main()
