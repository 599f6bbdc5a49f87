"""moetrain.rl.GRPO: `moetrain grpo` with a Python reward function and a Python environment, in-process."""
import json

import pytest

import moetrain as mt

PROMPTS = ["What is 2 + 2?", "Say hi", "Name a color", "Count to three"]


@pytest.fixture()
def prompts_file(tmp_path):
    p = tmp_path / "p.jsonl"
    p.write_text("".join(json.dumps({"prompt": q, "answer": str(i)}) + "\n" for i, q in enumerate(PROMPTS)))
    return str(p)


def grpo(model_dir, prompts, run_dir, **kw):
    opts = dict(model=model_dir, prompts=prompts, device="cpu", steps=2, prompts_per_step=2, n=4, max_new_tokens=8,
                temperature=1.0, dynamic_sampling="off", run_dir=str(run_dir))
    opts.update(kw)
    return mt.rl.GRPO(**opts)


def test_python_reward_function_drives_the_loop(text_model_dir, prompts_file, tmp_path):
    calls = []

    def reward(prompts, responses, metadata):
        calls.append(len(responses))
        assert all(isinstance(p, str) for p in prompts) and all("answer" in m for m in metadata)
        return [len(r) % 3 for r in responses]

    steps = grpo(text_model_dir, prompts_file, tmp_path / "run").run(reward_fn=reward)
    assert [s["step"] for s in steps] == [1, 2]
    assert calls == [8, 8]  # one batched call a step: 2 prompts x 4 samples
    assert any(s["grad_norm"] > 0 for s in steps)


def test_a_raising_reward_function_zeroes_or_stops(text_model_dir, prompts_file, tmp_path):
    def bad(prompts, responses, metadata):
        raise ValueError("no reward today")

    # The default policy: reward 0 and a warning; every sample failed, so the run fails, naming the error.
    with pytest.raises(RuntimeError, match="status 1"):
        grpo(text_model_dir, prompts_file, tmp_path / "a").run(reward_fn=bad)
    with pytest.raises(mt.Error, match="no reward today"):
        grpo(text_model_dir, prompts_file, tmp_path / "b", reward_on_error="stop").run(reward_fn=bad)


class TwoTurns:
    """Answers the first turn with "again" (reward: its length mod 3) and ends the episode after the second."""

    def __init__(self):
        self.closed = 0

    def init(self, episodes):
        return [[{"role": "user", "content": "hello"}] for _ in episodes]

    def step(self, turns):
        out = []
        for t in turns:
            if t["turn"] == 0:
                out.append({"reward": len(t["text"]) % 3, "done": False,
                            "observations": [{"role": "user", "content": "again"}]})
            else:
                out.append({"reward": len(t["text"]) % 4, "done": True, "metadata": {"second": 1.0}})
        return out

    def close(self, ids):
        self.closed += len(ids)


def test_python_environment_runs_two_turn_episodes(text_model_dir, prompts_file, tmp_path):
    env = TwoTurns()
    steps = grpo(text_model_dir, prompts_file, tmp_path / "env", max_new_tokens=48, max_turn_tokens=8).run(env=env)
    assert [s["turns_mean"] for s in steps] == [2.0, 2.0]
    assert all(s["env"]["second"] == 1.0 for s in steps)
    assert env.closed >= 16  # every episode closed


def test_reward_and_env_options_belong_to_run():
    with pytest.raises(ValueError, match="give the reward to run"):
        mt.rl.GRPO(reward="exact")
    with pytest.raises(TypeError, match="reward_fn must be callable"):
        mt.rl.GRPO().run(reward_fn=3)
