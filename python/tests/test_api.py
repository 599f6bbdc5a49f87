"""The Python API over the engine (docs/python.md): models, the sampler, the trainer, state, errors."""
import json
import os

import numpy as np
import pytest

import moetrain as mt


@pytest.fixture(scope="module")
def tiny():
    return mt.Model("tiny", device="cpu", seed=1)


def test_bad_model_path_names_the_presets():
    with pytest.raises(ValueError, match="neither a model directory with config.json nor a preset.*tiny"):
        mt.Model("/no/such/dir", device="cpu")


def test_bad_mesh_and_lora_are_refused_before_any_work():
    with pytest.raises(ValueError, match="mesh key 'dp' is unknown"):
        mt.Model("tiny", device="cpu", mesh={"dp": 2})
    with pytest.raises(mt.Error, match="world size 1 is not divisible by .* tp 2"):
        mt.Model("tiny", device="cpu", mesh={"tp": 2})  # one process: the mesh needs two ranks
    with pytest.raises(TypeError, match="LoraConfig"):
        mt.Model("tiny", device="cpu", lora=16)


def test_sample_shapes_determinism_and_routing(tiny):
    out = tiny.sampler.sample([[1, 2, 3], [4, 5]], n=3, max_new_tokens=6, seed=7, routing=True)
    assert [len(o) for o in out] == [3, 3]
    for p, group in zip([[1, 2, 3], [4, 5]], out):
        for j, s in enumerate(group):
            assert s.sample_index == j
            assert s.tokens.dtype == np.int32 and 1 <= len(s.tokens) <= 6
            assert s.logprobs.dtype == np.float32 and s.logprobs.shape == s.tokens.shape
            assert np.all(np.isfinite(s.logprobs)) and np.all(s.logprobs <= 0)
            assert s.finish_reason in ("stop", "length")
            assert s.routing.shape == (tiny.num_layers, len(p) + len(s.tokens) - 1, tiny.experts_per_token)
            assert s.routing.min() >= 0 and s.routing.max() < tiny.num_experts
    again = tiny.sampler.sample([[1, 2, 3], [4, 5]], n=3, max_new_tokens=6, seed=7)
    assert all(np.array_equal(a.tokens, b.tokens) for x, y in zip(out, again) for a, b in zip(x, y))
    other = tiny.sampler.sample([[1, 2, 3], [4, 5]], n=3, max_new_tokens=6, seed=8)
    assert any(not np.array_equal(a.tokens, b.tokens) for x, y in zip(out, other) for a, b in zip(x, y))


def test_sample_refuses_bad_arguments(tiny):
    with pytest.raises(ValueError, match="temperature = -1"):
        tiny.sampler.sample([[1, 2]], temperature=-1)
    with pytest.raises(ValueError, match="top_p = 0"):
        tiny.sampler.sample([[1, 2]], top_p=0)
    with pytest.raises(TypeError, match="not one string"):
        tiny.sampler.sample("hello")
    # The engine's own checks arrive as moetrain.Error with its message.
    with pytest.raises(mt.Error, match="outside the vocabulary"):
        tiny.sampler.sample([[1, 99999]])


def test_forward_gives_the_samplers_log_probs(tiny):
    prompts = [[1, 2, 3], [7, 8, 9, 10]]
    out = tiny.sampler.sample(prompts, n=2, max_new_tokens=8, seed=3, temperature=1.0)
    batch = [mt.Datum(prompts[s.prompt_index], s.tokens) for g in out for s in g]
    fwd = tiny.trainer.forward(batch, entropy=True)
    for d, r, s in zip(batch, fwd, [s for g in out for s in g]):
        np.testing.assert_allclose(r["logprobs"], s.logprobs, atol=2e-5)
        assert r["entropy"].shape == s.logprobs.shape and np.all(r["entropy"] >= 0)


def rel_l2(a, b):
    """||a - b|| / ||b||: the comparison of gradients that differ only in the rounding of their summation order."""
    return float(np.linalg.norm(np.asarray(a, np.float64) - b) / np.linalg.norm(np.asarray(b, np.float64)))


def datum_batch():
    rng = np.random.default_rng(0)
    return [mt.Datum(rng.integers(1, 500, 4).tolist(), rng.integers(1, 500, n).tolist()) for n in (5, 3, 6, 2)]


def test_cross_entropy_steps_lower_the_loss():
    m = mt.Model("tiny", device="cpu", seed=2)
    batch = datum_batch()
    losses = []
    for _ in range(8):
        losses.append(m.trainer.forward_backward(batch)["loss"])
        r = m.trainer.optim_step(mt.AdamParams(learning_rate=3e-3))
        assert r["grad_norm"] > 0 and not r["skipped"]
    assert losses[-1] < losses[0] - 0.5, losses
    assert m.step == 8


def test_gradients_accumulate_over_calls_until_optim_step():
    batch = datum_batch()
    tokens = sum(len(d["response"]) for d in batch)
    w = [np.full(len(d["response"]), 1.0 / tokens, np.float32) for d in batch]
    weighted = [dict(d, weights=x) for d, x in zip(batch, w)]
    a = mt.Model("tiny", device="cpu", seed=4)
    b = mt.Model("tiny", device="cpu", seed=4)
    la = a.trainer.forward_backward(weighted)["loss"]
    lb = b.trainer.forward_backward(weighted[:2])["loss"] + b.trainer.forward_backward(weighted[2:])["loss"]
    assert la == pytest.approx(lb, rel=1e-5)
    assert rel_l2(a._m.gradients(), b._m.gradients()) < 1e-5
    # The default weights are the mean over the call's tokens: the same gradients as the explicit ones.
    c = mt.Model("tiny", device="cpu", seed=4)
    c.trainer.forward_backward(batch)
    assert rel_l2(a._m.gradients(), c._m.gradients()) < 1e-6
    a.trainer.optim_step(mt.AdamParams(learning_rate=1e-3))
    b.trainer.optim_step(mt.AdamParams(learning_rate=1e-3))
    assert rel_l2(a._m.parameters(), b._m.parameters()) < 1e-5
    with pytest.raises(ValueError, match="no gradients"):
        a.trainer.optim_step(mt.AdamParams(learning_rate=1e-3))
    with pytest.raises(ValueError, match="AdamParams other than the first step's"):
        b.trainer.forward_backward(batch)
        b.trainer.optim_step(mt.AdamParams(learning_rate=1e-3, beta2=0.99))


def test_custom_loss_equal_to_cross_entropy_gives_its_gradients():
    batch = datum_batch()
    tokens = sum(len(d["response"]) for d in batch)

    def ce(logprobs, data):
        loss = -sum(float(lp.sum()) for lp in logprobs) / tokens
        return loss, [np.full(lp.shape, -1.0 / tokens, np.float32) for lp in logprobs]

    a = mt.Model("tiny", device="cpu", seed=5)
    b = mt.Model("tiny", device="cpu", seed=5)
    ra = a.trainer.forward_backward(batch)
    rb = b.trainer.forward_backward(batch, loss=ce)
    assert ra["loss"] == pytest.approx(rb["loss"], rel=1e-5)
    assert rel_l2(a._m.gradients(), b._m.gradients()) < 1e-6


def test_policy_losses_need_their_inputs(tiny):
    batch = datum_batch()
    with pytest.raises(ValueError, match="needs 'advantages' in datum 0"):
        tiny.trainer.forward_backward(batch, loss="ppo")
    with pytest.raises(ValueError, match="loss 'dpo' is unknown"):
        tiny.trainer.forward_backward(batch, loss="dpo")
    with pytest.raises(ValueError, match="unknown option 'clip'"):
        tiny.trainer.forward_backward(batch, loss="ppo", clip=0.2)
    with pytest.raises(ValueError, match="temperature = 0; need > 0"):
        tiny.trainer.forward_backward(batch, temperature=0)
    with pytest.raises(ValueError, match="datum 0: unknown field 'advantage'"):
        tiny.trainer.forward([dict(batch[0], advantage=[0] * 5)])
    with pytest.raises(ValueError, match="'advantages' has 2 values for 5 response tokens"):
        tiny.trainer.forward_backward([dict(batch[0], advantages=[1, 2], logprobs=[0] * 5)], loss="ppo")


def test_ppo_on_policy_gradient_is_minus_advantage_times_grad_logp():
    """On-policy (old = current log-probs) PPO's gradient is -sum w A grad logp: a linear loss with c = -w A."""
    batch = datum_batch()
    a = mt.Model("tiny", device="cpu", seed=6)
    old = [r["logprobs"] for r in a.trainer.forward(batch)]
    rng = np.random.default_rng(1)
    adv = [rng.normal(size=len(d["response"])).astype(np.float32) for d in batch]
    tokens = sum(len(d["response"]) for d in batch)
    a.trainer.forward_backward([dict(d, advantages=x, logprobs=o) for d, x, o in zip(batch, adv, old)], loss="ppo")
    b = mt.Model("tiny", device="cpu", seed=6)
    b.trainer.forward_backward(batch, loss=lambda lp, data: (0.0, [-x / tokens for x in adv]))
    assert rel_l2(a._m.gradients(), b._m.gradients()) < 1e-5


def test_state_round_trip(tmp_path):
    batch = datum_batch()
    a = mt.Model("tiny", device="cpu", seed=7)
    a.trainer.forward_backward(batch)
    a.trainer.optim_step(mt.AdamParams(learning_rate=1e-3))
    ckpt = a.trainer.save_state(str(tmp_path / "run"))
    assert os.path.basename(ckpt) == "checkpoint-1"
    b = mt.Model("tiny", device="cpu", seed=8)
    b.trainer.load_state(ckpt)
    assert b.step == 1
    np.testing.assert_array_equal(a._m.parameters(), b._m.parameters())
    # The optimizer state came too: the next step is the same.
    for m in (a, b):
        m.trainer.forward_backward(batch)
        m.trainer.optim_step(mt.AdamParams(learning_rate=1e-3))
    np.testing.assert_array_equal(a._m.parameters(), b._m.parameters())
    with pytest.raises(ValueError, match="has no train_state.json"):
        b.trainer.load_state(str(tmp_path))


def test_export_hf_loads_back(tmp_path):
    a = mt.Model("tiny", device="cpu", seed=9)
    a.trainer.forward_backward(datum_batch())
    a.trainer.optim_step(mt.AdamParams(learning_rate=1e-3))
    d = a.trainer.export_hf(str(tmp_path / "hf"), dtype="f32")
    assert json.load(open(os.path.join(d, "config.json")))["model_type"] == "qwen3_moe"
    b = mt.Model(d, device="cpu")
    batch = datum_batch()
    for x, y in zip(a.trainer.forward(batch), b.trainer.forward(batch)):
        np.testing.assert_allclose(x["logprobs"], y["logprobs"], atol=1e-5)


def test_lora_trains_only_the_adapters():
    m = mt.Model("tiny", device="cpu", seed=1, lora=mt.LoraConfig(rank=4))
    assert m.lora
    n = m._m.parameters().shape[0]
    assert n < 20000  # the adapters, not the model
    before = m._m.parameters().copy()
    m.trainer.forward_backward(datum_batch())
    m.trainer.optim_step(mt.AdamParams(learning_rate=1e-2))
    assert not np.array_equal(before, m._m.parameters())


def test_text_in_and_out(text_model_dir):
    m = mt.Model(text_model_dir, device="cpu")
    ids = m.encode("What is 2 + 2?")
    assert m.decode(ids) == "What is 2 + 2?"
    out = m.sampler.sample(["What is 2 + 2?"], n=2, max_new_tokens=5, seed=1)
    assert all(isinstance(s.text, str) for s in out[0])


def test_demo_vocabulary_text():
    """The demo's character vocabulary (no tokenizer.json): encode, decode, and ids beyond its characters (the
    vocabulary is padded to 32) decode as U+FFFD instead of failing the sample."""
    m = mt.Model("demo", device="cpu", seed=1)
    ids = m.encode("12+34=")
    assert m.decode(ids) == "12+34="
    assert m.decode([ids[0], 30]) == "1\ufffd"
    out = m.sampler.sample([[1] + ids], n=4, max_new_tokens=8, seed=2)
    assert all(isinstance(s.text, str) for s in out[0])
