"""A start for `moetrain grpo --env builtin:calculator` that sometimes calls the tool: the sharpen task's start
(the early-stopped demo, which never writes "?" after "=") after a few supervised steps on a mixture of calls
(a quarter of each batch: "?" then <eos> after "<bos>A+B=", the tool's result as builtin:calculator appends it,
"<bos>A+B=" + the answer + <eos> + "<bos>A+B=", masked out of the loss, then the answer read from it) and plain
answers (the rest: the demo's own data, so it keeps answering; calls alone push the first token's mass off the
digits), stopped once a sampled first answer at T = 1 is a call `--rate` of the time. GRPO then has to learn
when calling pays. Written with the Python API; prints one JSON line.

    python scripts/calculator_start.py --out runs/calculator-start [--rate 0.2] [--device auto]
    moetrain grpo --env builtin:calculator --model runs/calculator-start/checkpoint-N ...
"""
import argparse, json

import numpy as np

import moetrain as mt

ap = argparse.ArgumentParser()
ap.add_argument("--out", required=True)
ap.add_argument("--rate", type=float, default=0.2)
ap.add_argument("--device", default="auto")
ap.add_argument("--lr", type=float, default=1e-4)
ap.add_argument("--seed", type=int, default=99)
ap.add_argument("--min-digits", type=int, default=1)
ap.add_argument("--max-digits", type=int, default=3)
ap.add_argument("--copy-steps", type=int, default=0,
                help="steps first that teach reading the answer from the tool's result, with the call itself out of "
                     "the loss (the call rate stays where it was)")
a = ap.parse_args()

model = mt.Model(mt.tasks.task_start("sharpen", a.device), device=a.device)
task = mt.tasks.Addition(lo=a.min_digits, hi=a.max_digits, seed=a.seed)
call = model.encode("?") + [model.eos_token_id]


def rates():
    """The sampled answers' call rate, and the share right among the others."""
    out = model.sampler.sample(probe, n=4, max_new_tokens=5, temperature=1.0, seed=1)
    calls = [s.tokens.tolist()[:2] == call for g in out for s in g]
    right = [s.tokens.tolist() == list(ans) for (_, ans), g in zip(probe_answers, out) for s in g]
    direct = [r for r, c in zip(right, calls) if not c]
    return float(np.mean(calls)), float(np.mean(direct)) if direct else 0.0


def copy_rate():
    """After a call and the tool's result: the share of sampled answers (T = 1) that read it right."""
    ctx = [list(p) + call + list(p) + list(ans) + list(p) for p, ans in probe_answers]
    out = model.sampler.sample(ctx, n=4, max_new_tokens=5, temperature=1.0, seed=2)
    return float(np.mean([s.tokens.tolist() == list(ans) for (_, ans), g in zip(probe_answers, out) for s in g]))


def mixture(call_loss):
    """A quarter of the batch the call, the tool's result (no loss on it) and the answer read from it, the rest
    plain answers; without call_loss, the call's own tokens are out of the loss and every row is a call."""
    batch = []
    for k, (p, ans, _) in enumerate(task.train(32)):
        if k % 4 and call_loss:
            batch.append(mt.Datum(p, list(ans)))
        else:
            obs = list(p) + list(ans) + list(p)
            batch.append(mt.Datum(p, call + obs + list(ans),
                                  mask=[int(call_loss)] * len(call) + [0] * len(obs) + [1] * len(ans)))
    return batch


probe_problems = task.train(64)
probe = [p for p, _, _ in probe_problems]
probe_answers = [(p, a) for p, a, _ in probe_problems]
history = [rates()]
copy_before = copy_rate()
for _ in range(a.copy_steps):
    model.trainer.forward_backward(mixture(call_loss=False))
    model.trainer.optim_step(mt.AdamParams(learning_rate=a.lr, weight_decay=0.0))
copy_mid = copy_rate()
steps = 0
while history[-1][0] < a.rate and steps < 300:
    model.trainer.forward_backward(mixture(call_loss=True))
    model.trainer.optim_step(mt.AdamParams(learning_rate=a.lr, weight_decay=0.0))
    steps += 1
    history.append(rates())
# A checkpoint directory (HF weights and the routing bias the demo's aux-loss-free balancing keeps beside them;
# an HF export would drop the bias and route otherwise): `--model` takes it.
ckpt = model.trainer.save_state(a.out)
print(json.dumps({"script": "calculator_start", "model": ckpt, "copy_steps": a.copy_steps, "steps": steps,
                  "call_rate_before": history[0][0], "call_rate_after": history[-1][0],
                  "direct_right_before": history[0][1], "direct_right_after": history[-1][1],
                  "copy_right_before": copy_before, "copy_right_after_copy_steps": copy_mid,
                  "copy_right_after": copy_rate()}))
