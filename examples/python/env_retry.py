"""A multi-turn environment in Python (docs/rl.md "Environments"): the model answers an arithmetic question; a
wrong answer hears "wrong, try again" and gets a second try (reward 1 on the first, 0.5 on the second), as
SkyRL-Gym's multiply example. moetrain.rl.GRPO calls init/step batched, in-process.

    python examples/python/env_retry.py --model QWEN3_DIR [--steps 100] [--device auto] [--run-dir DIR]
"""
import argparse, json, os, random, re, tempfile

import moetrain as mt


class Retry:
    def __init__(self):
        self.answer = {}

    def init(self, episodes):  # one per episode: observations to append before the first turn (None: none)
        for e in episodes:
            self.answer[e["id"]] = str(e["metadata"]["answer"])
        return [None for _ in episodes]

    def step(self, turns):  # one result per model turn
        out = []
        for t in turns:
            numbers = re.findall(r"-?\d+", t["text"])
            right = bool(numbers) and numbers[-1] == self.answer[t["id"]]
            if right or t["turn"] == 1:
                reward = (1.0 if t["turn"] == 0 else 0.5) if right else 0.0
                out.append({"reward": reward, "done": True, "metadata": {f"try{t['turn'] + 1}_correct": float(right)}})
            else:
                out.append({"reward": 0.0, "done": False, "metadata": {"try1_correct": 0.0},
                            "observations": [{"role": "user", "content": "wrong, try again"}]})
        return out

    def close(self, ids):
        for i in ids:
            self.answer.pop(i, None)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True, help="a model directory with tokenizer.json (a Qwen3 chat model)")
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--run-dir", default=os.path.join(tempfile.gettempdir(), "moetrain_env_retry"))
    a = ap.parse_args()
    rng = random.Random(0)
    prompts = a.run_dir + "_prompts.jsonl"
    os.makedirs(os.path.dirname(prompts) or ".", exist_ok=True)
    with open(prompts, "w") as f:
        for _ in range(500):
            x, y = rng.randint(2, 99), rng.randint(2, 99)
            f.write(json.dumps({"prompt": f"What is {x} * {y}? Answer with the number.", "answer": x * y}) + "\n")
    steps = mt.rl.GRPO(model=a.model, prompts=prompts, device=a.device, steps=a.steps, max_turns=2,
                       max_new_tokens=a.max_new_tokens, max_turn_tokens=a.max_new_tokens // 3,
                       run_dir=a.run_dir).run(env=Retry())
    print(json.dumps({"example": "env_retry", "steps": len(steps), "turns_mean_last": steps[-1]["turns_mean"],
                      "reward_first": steps[0]["reward_mean"], "reward_last": steps[-1]["reward_mean"]}))
