"""The Python API's overhead: the same GRPO work through `moetrain grpo` (a reward program), through
moetrain.rl.GRPO (the same loop, the reward a Python function in-process) and through a loop written against
the low-level calls (sampler.sample, trainer.forward_backward, trainer.optim_step). JSON lines, one per way:
seconds per step over the steps after the first (the first holds the start-up and the CUDA graph captures).

    python bench/python_overhead.py --moetrain build/moetrain [--model bench-4L] [--device cuda] [--steps 12] [--rounds 3]

Same work: 16 prompts of 32 random token ids x 8 samples of up to 128 tokens (a random model rarely ends one
early), on-policy PPO-clip with routing replay, no reference model, no dynamic sampling, no extra mismatch
forward; the reward is a function of the response's ids (so groups differ). Each way runs --rounds times, in turn;
the last line is the summary (min / median / max s/step per way, each median against the command's). Every run is a
process of its own.
"""
import argparse, json, os, shutil, subprocess, sys, tempfile, time

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
ap.add_argument("--rounds", type=int, default=3, help="each way this many times, in turn; the summary gives the median")
ap.add_argument("--vocab-hi", type=int, default=30000, help="prompt ids are drawn from [10, this)")
ap.add_argument("--way", choices=["grpo", "low"], help=argparse.SUPPRESS)  # one in-process way, in a child
ap.add_argument("--round", type=int, default=0, help=argparse.SUPPRESS)
ap.add_argument("--work", help=argparse.SUPPRESS)
a = ap.parse_args()

work = a.work or tempfile.mkdtemp(prefix="mt_overhead_")
rng = np.random.default_rng(0)
pfile = os.path.join(work, "prompts.jsonl")
with open(pfile, "w") as f:
    for _ in range(256):
        f.write(json.dumps({"prompt_ids": rng.integers(10, a.vocab_hi, 32).tolist(), "answer_ids": [0]}) + "\n")
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
    """s/step after the first step; the run directory is removed after (each run ends with a checkpoint: a
    bench-4L one with its optimizer state is ~36 GB)."""
    rows = [json.loads(l) for l in open(os.path.join(run_dir, "metrics.jsonl")) if '"reward_mean"' in l]
    shutil.rmtree(run_dir, ignore_errors=True)
    return (rows[-1]["elapsed_s"] - rows[0]["elapsed_s"]) / (len(rows) - 1)


def run_cli(r):
    run_dir = os.path.join(work, f"cli{r}")
    args = [a.moetrain, "grpo"] + mt.rl.GRPO(common, run_dir=run_dir).args() + [f"--reward=program:python3 {reward_py}"]
    t0 = time.time()
    out = subprocess.run(args, capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit(f"moetrain grpo failed ({out.returncode}):\n{out.stderr[-3000:]}")
    return per_step(run_dir), time.time() - t0


def run_grpo(r):
    """The same loop in-process, the reward a Python function."""
    run_dir = os.path.join(work, f"py{r}")
    t0 = time.time()
    mt.rl.GRPO(common, run_dir=run_dir).run(reward_fn=lambda p, rs, m: [reward_of(json.loads(x)) for x in rs])
    return per_step(run_dir), time.time() - t0


def run_low(r):
    """The low-level calls."""
    t0 = time.time()
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
            rw = np.array([reward_of(s.tokens[:-1] if s.finish_reason == "stop" else s.tokens) for s in group])
            adv = (rw - rw.mean()) / (rw.std(ddof=1) + 1e-6)
            batch += [mt.Datum(p, s.tokens, advantages=np.full(len(s.tokens), x, np.float32), logprobs=s.logprobs,
                               routing=s.routing) for s, x in zip(group, adv)]
        model.trainer.forward_backward(batch, loss="ppo", max_tokens=1 << 30)  # one micro-batch, as the command
        model.trainer.optim_step(mt.AdamParams(learning_rate=2e-4))
        times.append(time.time() - t)
    return float(np.mean(times[1:])), time.time() - t0


def in_child(way, r):
    """Each in-process way runs in a process of its own: the engine keeps its GPU memory for reuse, so a second
    model in this process (or the command beside it) would find the first's memory taken."""
    args = [sys.executable, os.path.abspath(__file__), "--way", way, "--round", str(r), "--work", work]
    for k in ("moetrain", "model", "device", "steps", "prompts", "n", "max_new_tokens", "vocab_hi"):
        args += ["--" + k.replace("_", "-"), str(getattr(a, k))]
    out = subprocess.run(args, capture_output=True, text=True)
    lines = [l for l in out.stdout.splitlines() if l.startswith('{"child"')]
    if out.returncode != 0 or not lines:
        sys.exit(f"the {way} way failed ({out.returncode}):\n{out.stderr[-3000:]}")
    x = json.loads(lines[-1])
    return x["s_per_step"], x["wall_s"]


if a.way:
    s, wall = (run_grpo if a.way == "grpo" else run_low)(a.round)
    print(json.dumps({"child": a.way, "s_per_step": s, "wall_s": wall}), flush=True)
    sys.exit(0)

# The ways in turn, round after round, so that a drift of the machine falls on all of them alike.
ways = [("moetrain grpo", run_cli), ("moetrain.rl.GRPO", lambda r: in_child("grpo", r)),
        ("low-level calls", lambda r: in_child("low", r))]
if a.cli_s_per_step > 0:
    ways = ways[1:]
results = {name: [] for name, _ in ways}
for r in range(a.rounds):
    for name, fn in ways:
        s, wall = fn(r)
        results[name].append(s)
        print(json.dumps({"bench": "python_overhead", "way": name, "round": r, "s_per_step": s, "wall_s": wall}),
              flush=True)
cli_s = a.cli_s_per_step if a.cli_s_per_step > 0 else float(np.median(results["moetrain grpo"]))
summary = {"bench": "python_overhead", "summary": True, "rounds": a.rounds, "cli_median_s_per_step": cli_s}
for name, xs in results.items():
    summary[name] = {"min": min(xs), "median": float(np.median(xs)), "max": max(xs),
                     "median_vs_cli": float(np.median(xs)) / cli_s - 1}
print(json.dumps(summary), flush=True)
