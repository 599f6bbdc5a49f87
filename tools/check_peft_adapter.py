#!/usr/bin/env python3
"""Checks that a LoRA adapter directory (adapter_config.json + adapter_model.safetensors, e.g. one written by
`moetrain convert --adapter`) loads in PEFT and gives the expected logits.

Loads the base model with transformers (CPU, fp32, eager attention and experts), applies the adapter with
PeftModel.from_pretrained, runs the batch and compares the logits with the expected ones. Also checks that PEFT
used every tensor of adapter_model.safetensors, bit for bit, and that no adapter parameter it created is missing
from the file: PEFT only warns about unexpected keys, and with transformers 5 it rewrites some targets of MoE
models (a dense MLP named in target_modules is moved to the experts), so a load can "succeed" without the
adapter that was written.

Prints one JSON line; exits 1 if a check fails or max |logits - expected| is above --tol.

Usage: python tools/check_peft_adapter.py --base tests/assets/goldens/tiny \
           --adapter tests/assets/goldens/lora/moe/adapter --batch tests/assets/goldens/lora/moe/batch.safetensors \
           --expected tests/assets/goldens/lora/moe/expected.safetensors [--key logits] [--tol 1e-4]
Without --expected it only loads, runs and reports the loss and how far the adapter moves the logits.
Needs torch, transformers, peft and safetensors.
"""

import os

os.environ["CUDA_VISIBLE_DEVICES"] = ""

import argparse  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402

import peft  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from peft import PeftModel  # noqa: E402
from peft.utils import get_peft_model_state_dict  # noqa: E402
from safetensors.torch import load_file  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402


def load_base(path):
    kwargs = dict(dtype=torch.float32, attn_implementation="eager", experts_implementation="eager")
    try:
        model = AutoModelForCausalLM.from_pretrained(path, **kwargs)
    except TypeError:  # a model without experts
        kwargs.pop("experts_implementation")
        model = AutoModelForCausalLM.from_pretrained(path, **kwargs)
    return model.eval()


def targets(value):
    """A target list as a sorted list (a regex string stays as it is)."""
    return value if isinstance(value, str) else sorted(value or [])


def forward(model, batch):
    with torch.no_grad():
        out = model(input_ids=batch["input_ids"], labels=batch.get("labels"))
    return out.logits.float(), (out.loss.item() if out.loss is not None else None)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", required=True, help="base model directory (Hugging Face layout)")
    ap.add_argument("--adapter", required=True, help="directory with adapter_config.json, adapter_model.safetensors")
    ap.add_argument("--batch", required=True, help="safetensors with input_ids [B, T] (and optionally labels)")
    ap.add_argument("--expected", help="safetensors holding the expected logits [B, T, V]")
    ap.add_argument("--key", default="logits", help="name of the logits tensor in --expected (default: logits)")
    ap.add_argument("--tol", type=float, default=1e-4, help="largest allowed max |logits - expected| (default 1e-4)")
    a = ap.parse_args()

    torch.set_num_threads(1)
    transformers.logging.set_verbosity_error()
    batch = load_file(a.batch)
    with open(os.path.join(a.adapter, "adapter_config.json")) as f:
        written_config = json.load(f)
    written = load_file(os.path.join(a.adapter, "adapter_model.safetensors"))

    base = load_base(a.base)
    logits_base, loss_base = forward(base, batch)
    line = {"adapter": a.adapter, "base": a.base, "tensors": len(written), "loss_base": loss_base}
    versions = {"peft": peft.__version__, "transformers": transformers.__version__, "torch": torch.__version__}
    try:
        model = PeftModel.from_pretrained(base, a.adapter).eval()
    except Exception as e:  # noqa: BLE001 - reported as the check's result
        line.update(ok=False, problems=[f"PeftModel.from_pretrained failed: {type(e).__name__}: {e}"], **versions)
        print(json.dumps(line))
        sys.exit(1)
    logits, loss = forward(model, batch)

    problems = []
    loaded = get_peft_model_state_dict(model)
    not_loaded = sorted(set(written) - set(loaded))
    not_in_file = sorted(set(loaded) - set(written))
    if not_loaded:
        problems.append(f"{len(not_loaded)} tensors of the file were not loaded, e.g. {not_loaded[:3]}")
    if not_in_file:
        problems.append(f"{len(not_in_file)} adapter parameters have no tensor in the file, e.g. {not_in_file[:3]}")
    both = sorted(set(written) & set(loaded))
    differ = [k for k in both if not torch.equal(written[k].to(loaded[k].dtype), loaded[k])]
    if differ:
        problems.append(f"{len(differ)} loaded tensors differ from the file, e.g. {differ[:3]}")
    config = model.peft_config["default"]
    for field in ("target_modules", "target_parameters"):
        before, after = targets(written_config.get(field)), targets(getattr(config, field, None))
        if before != after:
            problems.append(f"PEFT rewrote {field} from {before} to {after}")

    line.update(loss=loss, max_abs_logits_minus_base=(logits - logits_base).abs().max().item(), **versions)
    if a.expected:
        tensors = load_file(a.expected)
        if a.key not in tensors:
            sys.exit(f"--expected {a.expected} has no tensor {a.key!r}; it has {sorted(tensors)[:10]}")
        expected = tensors[a.key].float()
        if expected.shape != logits.shape:
            problems.append(f"--expected {a.key} has shape {list(expected.shape)}, the logits {list(logits.shape)}")
        else:
            err = (logits - expected).abs().max().item()
            line.update({"max_abs_logits_minus_expected": err, "tol": a.tol})
            if not err <= a.tol:
                problems.append(f"max |logits - {a.key}| = {err} is above --tol {a.tol}")
    line["ok"] = not problems
    line["problems"] = problems
    print(json.dumps(line))
    sys.exit(0 if not problems else 1)


if __name__ == "__main__":
    main()
