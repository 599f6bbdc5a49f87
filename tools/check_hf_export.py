#!/usr/bin/env python3
"""Checks `moetrain convert` against transformers: trains a few steps of a small model with moetrain,
exports the checkpoint as bf16 and as f32, loads each export with AutoModelForCausalLM.from_pretrained
and compares its logits on a batch with the logits `moetrain grads` computes from the same export.

Prints one JSON line per export: relative L2 error ||ours - theirs|| / ||theirs|| of the logits (fp32
compute on both sides), the loss on each side, the files of the export. The f32 export is also compared
with our logits from the training checkpoint itself (the export must not change a single weight).

Usage: python tools/check_hf_export.py --moetrain build-cpu/moetrain [--work /tmp/hf_export_check]
       [--model tiny|demo] [--steps 20]
Needs torch, transformers and safetensors; runs on the CPU.
"""

import os

os.environ["CUDA_VISIBLE_DEVICES"] = ""

import argparse  # noqa: E402
import json  # noqa: E402
import shutil  # noqa: E402
import subprocess  # noqa: E402

import torch  # noqa: E402
import transformers  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402


def run(cmd):
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({p.returncode}):\n{p.stdout}\n{p.stderr}")
    return p.stdout + p.stderr


def rel(a, b):
    return float((a - b).norm() / b.norm())


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--moetrain", required=True)
    ap.add_argument("--work", default="/tmp/hf_export_check")
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--steps", type=int, default=20)
    a = ap.parse_args()
    shutil.rmtree(a.work, ignore_errors=True)
    os.makedirs(a.work)
    run_dir = os.path.join(a.work, "run")
    run([a.moetrain, "train", "--model", a.model, "--device", "cpu", "--steps", str(a.steps), "--warmup-steps", "2",
         "--eval-problems", "0", "--tensorboard", "0", "--run-dir", run_dir, "--micro-batch-size", "4",
         "--seq-len", "32", "--log-every", "100"])
    ckpt = os.path.join(run_dir, f"checkpoint-{a.steps}")
    cfg = json.load(open(os.path.join(ckpt, "config.json")))
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg["vocab_size"], (2, 24), generator=g, dtype=torch.int64)
    batch = os.path.join(a.work, "batch.safetensors")
    save_file({"input_ids": ids, "labels": ids.clone()}, batch)

    def ours(model_dir, tag):
        out = os.path.join(a.work, f"grads_{tag}.safetensors")
        run([a.moetrain, "grads", "--model", model_dir, "--batch", batch, "--out", out])
        t = load_file(out)
        return t["logits"].float(), float(t["loss"])

    ref_logits, _ = ours(ckpt, "checkpoint")
    for dtype in ("f32", "bf16"):
        export = os.path.join(a.work, f"export_{dtype}")
        run([a.moetrain, "convert", "--from", ckpt, "--to", export, "--dtype", dtype, "--max-shard-size", "200KB"])
        model = AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32, attn_implementation="eager")
        model.eval()
        with torch.no_grad():
            o = model(input_ids=ids, labels=ids)
        theirs = o.logits.float()
        mine, loss = ours(export, dtype)
        line = {"export": dtype, "files": sorted(os.listdir(export)), "logits_rel_l2": rel(mine, theirs),
                "loss_ours": loss, "loss_transformers": float(o.loss), "transformers": transformers.__version__,
                "torch": torch.__version__, "model": a.model, "steps": a.steps}
        if dtype == "f32":
            line["checkpoint_vs_export_rel_l2"] = rel(mine, ref_logits)
        print(json.dumps(line))


if __name__ == "__main__":
    main()
