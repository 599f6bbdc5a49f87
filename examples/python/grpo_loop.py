"""GRPO written against the low-level calls: `moetrain grpo`'s default recipe (the sharpen task) as a Python loop.

    python examples/python/grpo_loop.py [--steps 1500] [--seed 1] [--device auto] [--model DIR]

Each step: 16 training problems x 8 samples at T = 1 (routing recorded), the exact reward, group-normalised
advantages, dynamic sampling (groups whose rewards are all equal are dropped, up to 4 rounds), one PPO-clip
update on the kept groups with routing replay, AdamW at 2e-4 after a 5-step warm-up. Prints one JSON line with
the held-out exact match (greedy, 200 problems) before and after.
"""
import argparse, json, time

import numpy as np

import moetrain as mt

ap = argparse.ArgumentParser()
ap.add_argument("--steps", type=int, default=1500)
ap.add_argument("--seed", type=int, default=1)
ap.add_argument("--device", default="auto")
ap.add_argument("--model", default=None, help="default: the task's start, as `moetrain grpo` makes it")
a = ap.parse_args()

model = mt.Model(a.model or mt.tasks.task_start("sharpen", a.device), device=a.device)
task = mt.tasks.Addition(lo=1, hi=3, seed=a.seed)
held = task.eval(200, seed=a.seed + 7)
T = task.hi + 2  # the answer's digits and <eos>


def exact_match():
    out = model.sampler.sample([p for p, _, _ in held], max_new_tokens=T, temperature=0)
    return 100 * np.mean([task.exact(ans, g[0].tokens) for (_, ans, _), g in zip(held, out)])


before, t0 = exact_match(), time.time()
for step in range(1, a.steps + 1):
    batch = []
    for rnd in range(4):  # dynamic sampling
        problems = task.train(16)
        out = model.sampler.sample([p for p, _, _ in problems], n=8, max_new_tokens=T, temperature=1.0,
                                   seed=a.seed * 1_000_003 + step * 16 + rnd, routing=True)
        for (prompt, answer, _), group in zip(problems, out):
            r = np.array([task.exact(answer, s.tokens) for s in group])
            if r.std() == 0 or len(batch) >= 16 * 8:
                continue
            adv = (r - r.mean()) / (r.std(ddof=1) + 1e-6)
            batch += [mt.Datum(prompt, s.tokens, advantages=np.full(len(s.tokens), x, np.float32),
                               logprobs=s.logprobs, routing=s.routing) for s, x in zip(group, adv)]
        if len(batch) >= 16 * 8:
            break
    if batch:
        model.trainer.forward_backward(batch, loss="ppo")
        model.trainer.optim_step(mt.AdamParams(learning_rate=2e-4 * min(1.0, step / 5), weight_decay=0.0))
print(json.dumps({"example": "grpo_loop", "seed": a.seed, "steps": a.steps, "exact_match_before": before,
                  "exact_match_after": exact_match(), "seconds": round(time.time() - t0, 1)}))
