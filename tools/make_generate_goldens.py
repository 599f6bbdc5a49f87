#!/usr/bin/env python3
"""Greedy-generation goldens for moetrain's rollout engine, from transformers.

For each golden case made by make_goldens.py (tests/assets/goldens/<case>/ with config.json and
model.safetensors) it loads the model with from_pretrained in fp32 (eager attention, eager experts, on the CPU,
one thread), generates greedily from three fixed prompts of different lengths with transformers' `generate`
(its KV cache) and writes <case>/generate.json:

  prompts       the prompt token ids (seeded, so regenerating gives the same prompts)
  tokens        the greedy tokens (max_new_tokens each; the test models have no EOS)
  logprobs      log_softmax(logits)[token] at each step (temperature 1: the greedy sampler's log-prob)
  margins       top-1 minus top-2 logit at each step: the C++ test compares tokens up to the first step
                whose margin is below its tolerance (a near-tie), and log-probs up to there too

The script checks itself: the logits `generate` returned equal those of a full forward (no cache) over the
prompt and the generated tokens. Usage: python tools/make_generate_goldens.py --goldens tests/assets/goldens
"""

import os

os.environ["CUDA_VISIBLE_DEVICES"] = ""

import argparse  # noqa: E402
import json  # noqa: E402

import torch  # noqa: E402
import transformers  # noqa: E402
from transformers import Qwen3ForCausalLM, Qwen3MoeForCausalLM  # noqa: E402

kPromptLens = [7, 3, 12]
kMaxNew = 16
kSeed = 20261126


def load(case_dir):
    with open(os.path.join(case_dir, "config.json")) as f:
        cfg = json.load(f)
    moe = cfg.get("model_type") == "qwen3_moe"
    cls = Qwen3MoeForCausalLM if moe else Qwen3ForCausalLM
    kwargs = dict(dtype=torch.float32, attn_implementation="eager")
    if moe:
        kwargs["experts_implementation"] = "eager"
    try:
        model = cls.from_pretrained(case_dir, **kwargs)
    except TypeError:
        kwargs.pop("experts_implementation", None)
        model = cls.from_pretrained(case_dir, **kwargs)
    model.eval()
    return model, cfg


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--goldens", default="tests/assets/goldens")
    ap.add_argument("--cases", nargs="*", default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)
    cases = args.cases or sorted(
        d for d in os.listdir(args.goldens) if os.path.exists(os.path.join(args.goldens, d, "model.safetensors")))
    for case in cases:
        case_dir = os.path.join(args.goldens, case)
        model, cfg = load(case_dir)
        gen = torch.Generator().manual_seed(kSeed)
        out = dict(case=case, max_new_tokens=kMaxNew, prompts=[], tokens=[], logprobs=[], margins=[],
                   versions=dict(torch=torch.__version__, transformers=transformers.__version__))
        worst = 0.0
        for n in kPromptLens:
            prompt = torch.randint(0, cfg["vocab_size"], (1, n), generator=gen)
            with torch.no_grad():
                res = model.generate(prompt, max_new_tokens=kMaxNew, min_new_tokens=kMaxNew, do_sample=False,
                                     output_logits=True, return_dict_in_generate=True, eos_token_id=None,
                                     pad_token_id=0, use_cache=True)
                toks = res.sequences[0, n:]
                step_logits = torch.stack([lg[0] for lg in res.logits]).double()  # [G, V]
                full = model(res.sequences[:, :-1]).logits[0, n - 1:].double()  # no cache
            worst = max(worst, (full - step_logits).abs().max().item())
            assert torch.equal(step_logits.argmax(-1), toks), f"{case}: generate's tokens are not its argmax"
            top2 = step_logits.topk(2, dim=-1).values
            out["prompts"].append(prompt[0].tolist())
            out["tokens"].append(toks.tolist())
            out["logprobs"].append(step_logits.log_softmax(-1).gather(1, toks[:, None])[:, 0].tolist())
            out["margins"].append((top2[:, 0] - top2[:, 1]).tolist())
        assert worst < 1e-4, f"{case}: cached and uncached logits differ by {worst}"
        out["cache_vs_full_max_abs"] = worst
        with open(os.path.join(case_dir, "generate.json"), "w") as f:
            json.dump(out, f, indent=1)
            f.write("\n")
        print(f"{case}: {len(kPromptLens)} prompts x {kMaxNew} tokens, cache vs full {worst:.2e}, "
              f"min margin {min(min(m) for m in out['margins']):.2e}")


if __name__ == "__main__":
    main()
