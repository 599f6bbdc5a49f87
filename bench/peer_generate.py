#!/usr/bin/env python3
"""The PyTorch peer for bench/generate: transformers' `generate` on the same model (default bench-4L, random
weights), bf16, sdpa attention, grouped_mm experts, greedy, EOS ignored (min_new_tokens = max_new_tokens).
Prints one JSON line with generated tokens/s (prompts x new tokens / wall time of the generate call, after a
warm-up call). Usage:
  python3 bench/peer_generate.py --prompts 64 --prompt-len 128 --new-tokens 512 --cache dynamic|static"""
import argparse
import json
import time

import torch
import transformers
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

from peer_transformers import BENCH_4L


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=512)
    ap.add_argument("--cache", choices=["dynamic", "static"], default="dynamic")
    ap.add_argument("--experts", default="grouped_mm")
    a = ap.parse_args()
    torch.manual_seed(0)
    cfg = Qwen3MoeConfig(**BENCH_4L)
    with torch.device("cuda"):  # initialised on the GPU (a CPU init of 2.8 B parameters takes minutes)
        model = Qwen3MoeForCausalLM._from_config(cfg, dtype=torch.bfloat16, attn_implementation="sdpa",
                                                 experts_implementation=a.experts).eval()
    ids = torch.randint(0, cfg.vocab_size, (a.prompts, a.prompt_len), device="cuda")
    mask = torch.ones_like(ids)

    def run(new):
        with torch.no_grad():
            return model.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                                  eos_token_id=None, pad_token_id=0, cache_implementation=a.cache)

    run(8)  # warm-up (kernels, allocator)
    torch.cuda.synchronize()
    t = time.perf_counter()
    out = run(a.new_tokens)
    torch.cuda.synchronize()
    s = time.perf_counter() - t
    new = (out.shape[1] - a.prompt_len) * a.prompts
    print(json.dumps({"bench": "peer_generate", "transformers": transformers.__version__, "torch": torch.__version__,
                      "prompts": a.prompts, "prompt_len": a.prompt_len, "new_tokens": a.new_tokens,
                      "cache": a.cache, "experts": a.experts, "seconds": s, "generated_tokens": new,
                      "tokens_per_s": new / s}))


if __name__ == "__main__":
    main()
