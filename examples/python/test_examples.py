"""The Python examples, run as a user runs them (small settings; their measured results: docs/python.md)."""
import json
import pathlib
import subprocess
import sys

import pytest

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parents[1]
TINY = str(ROOT / "tests" / "assets" / "goldens" / "tiny")


def run(script, *args):
    r = subprocess.run([sys.executable, str(HERE / script), *args], capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout + r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_dpo_loss_gradient_matches_finite_differences_and_the_loss_falls():
    out = run("dpo_loss.py", "--steps", "15")
    assert out["relative_error"] < 1e-2, out
    assert out["loss_last"] < out["loss_first"] - 0.05, out


def test_grpo_loop_runs(tmp_path):
    out = run("grpo_loop.py", "--model", TINY, "--steps", "2", "--device", "cpu")
    assert out["steps"] == 2 and 0 <= out["exact_match_after"] <= 100


def test_reward_fn_runs(tmp_path):
    out = run("reward_fn.py", "--model", TINY, "--steps", "2", "--device", "cpu", "--run-dir", str(tmp_path / "r"))
    assert out["steps"] == 2 and 0 <= out["reward_last"] <= 1


def test_env_retry_runs_two_turn_episodes(tmp_path):
    import moetrain as mt

    model = str(tmp_path / "model")
    tok = ROOT / "tests" / "assets" / "tokenizer" / "trained" / "tokenizer.json"
    mt.Model("tiny", device="cpu", seed=3, tokenizer=str(tok)).trainer.export_hf(model, dtype="f32")
    out = run("env_retry.py", "--model", model, "--steps", "2", "--device", "cpu", "--max-new-tokens", "60",
              "--run-dir", str(tmp_path / "e"))
    assert out["steps"] == 2 and 1.0 <= out["turns_mean_last"] <= 2.0
