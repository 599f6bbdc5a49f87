"""The Python API's overhead: the same GRPO work through `moetrain grpo` (a reward program), through
moetrain.rl.GRPO (the same loop, the reward a Python function in-process) and through a loop written against
the low-level calls (sampler.sample, trainer.forward_backward, trainer.optim_step). JSON lines, one per way:
seconds per step over the steps after the first (the first holds the start-up and the CUDA graph captures).

    python bench/python_overhead.py --moetrain build/moetrain [--model bench-4L] [--device cuda] [--steps 12]

Same work: 16 prompts of 32 random token ids x 8 samples of up to 128 tokens (a random model rarely ends one
early), on-policy PPO-clip with routing replay, no reference model, no dynamic sampling, no extra mismatch
forward; the reward is a function of the response's ids (so groups differ).
"""
import argparse, json, os, subprocess, sys, tempfile, time

import numpy as np

import moetrain as mt

ap = argparse.ArgumentParser()
ap.add_argument("--moetrain", required=True)
ap.add_argument("--model", default="bench-4L")
ap.add_argument("--device", default="cuda")
ap.add_argument("--steps", type=int, default=12)
ap.add_argument("--prompts", type=int, default=16)
ap.add_argument("--n", type=int, default=8)
ap.add_argument("--max-new-tokens", type=int, default=128)
ap.add_argument("--cli-s-per-step", type=float, default=0, help="the command's s/step measured before: skip its run")
a = ap.parse_args()

work = tempfile.mkdtemp(prefix="mt_overhead_")
rng = np.random.default_rng(0)
pfile = os.path.join(work, "prompts.jsonl")
with open(pfile, "w") as f:
    for _ in range(256):
        f.write(json.dumps({"prompt_ids": rng.integers(10, 30000, 32).tolist(), "answer_ids": [0]}) + "\n")
reward_py = os.path.join(work, "reward.py")
with open(reward_py, "w") as f:
    f.write("import json, sys\nfor line in sys.stdin:\n    r = json.loads(line)\n"
            "    print(json.dumps({'id': r['id'], 'reward': (sum(json.loads(r['response'])) % 7) / 6}), flush=True)\n")


def reward_of(ids):
    return (int(np.sum(ids)) % 7) / 6


common = dict(model=a.model, prompts=pfile, device=a.device, steps=a.steps, prompts_per_step=a.prompts, n=a.n,
              max_new_tokens=a.max_new_tokens, dynamic_sampling=False, reference=False, mismatch_every=0,
              warmup_steps=0)


def per_step(run_dir):
    rows = [json.loads(l) for l in open(os.path.join(run_dir, "metrics.jsonl")) if '"reward_mean"' in l]
    return (rows[-1]["elapsed_s"] - rows[0]["elapsed_s"]) / (len(rows) - 1)


# 1. the command, its reward a program
cli_dir = os.path.join(work, "cli")
if a.cli_s_per_step > 0:
    cli = {"bench": "python_overhead", "way": "moetrain grpo", "s_per_step": a.cli_s_per_step, "given": True}
else:
    cli = None
if cli is None:
    args = [a.moetrain, "grpo"] + mt.rl.GRPO(common, run_dir=cli_dir).args() + [f"--reward=program:python3 {reward_py}"]
    t0 = time.time()
    r = subprocess.run(args, capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"moetrain grpo failed ({r.returncode}):\n{r.stderr[-3000:]}")
    cli = {"bench": "python_overhead", "way": "moetrain grpo", "s_per_step": per_step(cli_dir),
           "wall_s": time.time() - t0}
print(json.dumps(cli), flush=True)

# 2. the same loop in-process, the reward a Python function
py_dir = os.path.join(work, "py")
t0 = time.time()
mt.rl.GRPO(common, run_dir=py_dir).run(reward_fn=lambda p, r, m: [reward_of(json.loads(x)) for x in r])
print(json.dumps({"bench": "python_overhead", "way": "moetrain.rl.GRPO", "s_per_step": per_step(py_dir),
                  "wall_s": time.time() - t0, "vs_cli": per_step(py_dir) / cli["s_per_step"] - 1}), flush=True)

# 3. the low-level calls
model = mt.Model(a.model, device=a.device, seed=1234)
prompts = [json.loads(l)["prompt_ids"] for l in open(pfile)]
times = []
for step in range(a.steps):
    t = time.time()
    batch_prompts = prompts[(step * a.prompts) % len(prompts):][:a.prompts]
    out = model.sampler.sample(batch_prompts, n=a.n, max_new_tokens=a.max_new_tokens, temperature=1.0,
                               seed=step, routing=True)
    batch = []
    for p, group in zip(batch_prompts, out):
        r = np.array([reward_of(s.tokens[:-1] if s.finish_reason == "stop" else s.tokens) for s in group])
        adv = (r - r.mean()) / (r.std(ddof=1) + 1e-6)
        batch += [mt.Datum(p, s.tokens, advantages=np.full(len(s.tokens), x, np.float32), logprobs=s.logprobs,
                           routing=s.routing) for s, x in zip(group, adv)]
    model.trainer.forward_backward(batch, loss="ppo", max_tokens=1 << 30)  # one micro-batch, as the command
    model.trainer.optim_step(mt.AdamParams(learning_rate=2e-4))
    times.append(time.time() - t)
low = float(np.mean(times[1:]))
print(json.dumps({"bench": "python_overhead", "way": "low-level calls", "s_per_step": low,
                  "vs_cli": low / cli["s_per_step"] - 1}), flush=True)
