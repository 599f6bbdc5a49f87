#!/usr/bin/env python3
"""The PyTorch peer for bench/train_step: Hugging Face transformers' Qwen3MoeForCausalLM on the same shape
(default bench-4L), random init, random tokens, one training step = forward + backward + AdamW.

Variants (--variant):
  bf16        bf16 weights and bf16 AdamW states (what the docs/design.md peer table measured)
  fp32master  fp32 weights and AdamW states with bf16 autocast (moetrain's precision policy)
and --compile wraps the model in torch.compile. Experts use transformers' "grouped_mm" implementation,
attention "sdpa". --grad-accum N: N micro-batches of --batch rows per optimizer step, each loss divided by
N and backward'ed (gradients accumulate), then one clip and AdamW step, as train_step --grad-accum does;
tokens/s counts whole optimizer steps. Prints one JSON line like train_step's. Usage:
  python3 bench/peer_transformers.py --batch 1 --seq 4096 --variant bf16 [--compile] [--grad-accum N]"""
import argparse
import json
import math
import time

import torch
import transformers
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

BENCH_4L = dict(vocab_size=151936, hidden_size=2048, num_hidden_layers=4, num_attention_heads=32,
                num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
                moe_intermediate_size=768, intermediate_size=6144, norm_topk_prob=True, tie_word_embeddings=False,
                rope_theta=1e6, rms_norm_eps=1e-6, max_position_embeddings=40960, output_router_logits=False)


def active_matmul_params(c):
    D, H, G, Hd, E, K, F, V = (c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"],
                               c["num_experts"], c["num_experts_per_tok"], c["moe_intermediate_size"], c["vocab_size"])
    per_layer = D * H * Hd * 2 + D * G * Hd * 2 + E * D + K * 3 * F * D
    return c["num_hidden_layers"] * per_layer + V * D


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--grad-accum", type=int, default=1)
    ap.add_argument("--variant", choices=["bf16", "fp32master"], default="bf16")
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--experts", default="grouped_mm")
    ap.add_argument("--gemm-tflops", type=float, default=0.0, help="bf16 GEMM rate for MFU (from train_step)")
    a = ap.parse_args()
    torch.manual_seed(0)
    dev = "cuda"
    cfg = Qwen3MoeConfig(**BENCH_4L)
    dtype = torch.bfloat16 if a.variant == "bf16" else torch.float32
    model = Qwen3MoeForCausalLM._from_config(cfg, dtype=dtype, attn_implementation="sdpa",
                                             experts_implementation=a.experts).to(dev)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
    fwd = torch.compile(model) if a.compile else model
    assert a.grad_accum >= 1, a.grad_accum
    micro = [torch.randint(0, cfg.vocab_size, (a.batch, a.seq), device=dev) for _ in range(a.grad_accum)]

    def step():
        opt.zero_grad(set_to_none=True)
        total = 0.0
        for ids in micro:
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=a.variant == "fp32master"):
                loss = fwd(input_ids=ids, labels=ids).loss / a.grad_accum
            loss.backward()
            total = total + loss.detach()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        return total

    loss0 = step().item()
    assert math.isfinite(loss0) and abs(loss0 - math.log(cfg.vocab_size)) < 1.5, loss0
    for _ in range(a.warmup):
        step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    t = time.perf_counter()
    for _ in range(a.steps):
        step()
    torch.cuda.synchronize()
    step_s = (time.perf_counter() - t) / a.steps
    tokens = a.batch * a.seq * a.grad_accum  # per optimizer step
    L, H, Hd = cfg.num_hidden_layers, cfg.num_attention_heads, cfg.head_dim
    flops = (6 * active_matmul_params(BENCH_4L) + 6 * L * a.seq * H * Hd) * tokens
    tflops = flops / step_s / 1e12
    print(json.dumps({"bench": "peer_transformers", "variant": a.variant, "compile": a.compile, "experts": a.experts,
                      "batch": a.batch, "seq": a.seq, "grad_accum": a.grad_accum, "step_s": step_s, "tokens_per_s": tokens / step_s,
                      "model_tflops": tflops, "mfu": tflops / a.gemm_tflops if a.gemm_tflops else None,
                      "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30, "initial_loss": loss0,
                      "torch": torch.__version__, "transformers": transformers.__version__}), flush=True)


if __name__ == "__main__":
    main()
