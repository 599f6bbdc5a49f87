"""The whole GRPO loop (`moetrain grpo`) with Python's reward function and environment, in-process.

    def reward(prompts, responses, metadata):        # batched: one reward per sample
        return [float(r.strip() == m["answer"]) for r, m in zip(responses, metadata)]
    moetrain.rl.GRPO(model="MODEL_DIR", prompts="train.jsonl", steps=100).run(reward_fn=reward)

The config is `moetrain grpo`'s options (docs/rl.md), with "_" for "-": GRPO(n=8, lr=2e-4, run_dir="runs/x").
The environment is any object with init(episodes) -> [observations or None] and step(turns) -> [{"reward",
"done", "observations", "metadata"}] (docs/rl.md "Environments": the same fields as the JSON protocol), called
batched from the loop's thread; close(ids) when it has one.
"""
from __future__ import annotations

import json
import os

from ._moetrain import _run_grpo

__all__ = ["GRPO"]


class GRPO:
    def __init__(self, config: dict | None = None, **options):
        self.options = dict(config or {})
        self.options.update(options)
        for k in ("reward", "env"):
            if k in self.options:
                raise ValueError(f"GRPO: give the {k} to run() ({k}_fn= / env=), or its command-line form "
                                 f"as a string option only without run()'s")
        self.run_dir = str(self.options.get("run_dir", self.options.get("out_dir", "runs/grpo")))

    def args(self, reward_fn=None, env=None) -> list:
        a = []
        for k, v in self.options.items():
            flag = "--" + k.replace("_", "-")
            if isinstance(v, bool):
                a.append(f"{flag}={'on' if v else 'off'}")
            elif isinstance(v, (list, tuple)):
                a.append(f"{flag}={','.join(str(x) for x in v)}")
            else:
                a.append(f"{flag}={v}")
        if reward_fn is not None:
            a.append("--reward=python")
        if env is not None:
            a.append("--env=python")
        return a

    def run(self, reward_fn=None, env=None) -> list:
        """Runs the loop; returns its per-step metrics (run_dir/metrics.jsonl's records). reward_fn(prompts,
        responses, metadata) -> rewards, one per sample (texts; metadata: each prompt line's other fields)."""
        if reward_fn is not None and not callable(reward_fn):
            raise TypeError("reward_fn must be callable: reward_fn(prompts, responses, metadata) -> rewards")
        if env is not None and not (hasattr(env, "init") and hasattr(env, "step")):
            raise TypeError("env must have init(episodes) and step(turns)")
        rc = _run_grpo(self.args(reward_fn, env), reward_fn, env)
        if rc >= 128:
            raise KeyboardInterrupt(f"grpo stopped by a signal after a saved step (exit {rc})")
        if rc != 0:
            raise RuntimeError(f"grpo ended with status {rc} (see its log)")
        path = os.path.join(self.run_dir, "metrics.jsonl")
        out = []
        if os.path.exists(path):
            with open(path) as f:
                for line in f:
                    r = json.loads(line)
                    if "step" in r and "reward_mean" in r:
                        out.append(r)
        return out
