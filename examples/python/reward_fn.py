"""A reward function in Python driving `moetrain grpo`'s loop in-process (moetrain.rl.GRPO).

    python examples/python/reward_fn.py [--steps 200] [--seed 1] [--device auto] [--model DIR] [--run-dir DIR]

The demo's addition problems as a prompt file (token ids, the demo model has no tokenizer.json), rewarded by a
Python function with partial credit: the share of the answer's digits right (the response and the answer as
token-id lists). Prints one JSON line: the mean reward of the first and the last steps.
"""
import argparse, json, os, tempfile

import moetrain as mt

ap = argparse.ArgumentParser()
ap.add_argument("--steps", type=int, default=200)
ap.add_argument("--seed", type=int, default=1)
ap.add_argument("--device", default="auto")
ap.add_argument("--model", default=None, help="default: the sharpen task's start")
ap.add_argument("--run-dir", default=os.path.join(tempfile.gettempdir(), "moetrain_reward_fn"))
a = ap.parse_args()

task = mt.tasks.Addition(lo=1, hi=3, seed=a.seed)
prompts = os.path.join(a.run_dir + "_prompts.jsonl")
os.makedirs(os.path.dirname(prompts) or ".", exist_ok=True)
with open(prompts, "w") as f:
    for prompt, answer, text in task.train(2000):
        f.write(json.dumps({"prompt_ids": prompt, "answer": answer, "text": text}) + "\n")


def digits_right(prompts, responses, metadata):
    """One reward per sample: the share of the answer's tokens (digits, then <eos>) the response has right."""
    out = []
    for response, meta in zip(responses, metadata):
        got, want = json.loads(response), meta["answer"][:-1]  # the response comes without its stop token
        right = sum(1 for x, y in zip(got, want) if x == y) + (len(got) == len(want))
        out.append(right / (len(want) + 1))
    return out


steps = mt.rl.GRPO(model=a.model or mt.tasks.task_start("sharpen", a.device), prompts=prompts, device=a.device,
                   steps=a.steps, seed=a.seed, max_new_tokens=task.hi + 2, run_dir=a.run_dir).run(reward_fn=digits_right)
k = max(1, len(steps) // 10)
first = sum(s["reward_mean"] for s in steps[:k]) / k
last = sum(s["reward_mean"] for s in steps[-k:]) / k
print(json.dumps({"example": "reward_fn", "seed": a.seed, "steps": len(steps), "reward_first": first,
                  "reward_last": last}))
