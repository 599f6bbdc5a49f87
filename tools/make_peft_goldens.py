#!/usr/bin/env python3
"""Generates LoRA goldens for moetrain from transformers + PEFT: a LoRA adapter on an existing golden model, as
PEFT's save_pretrained writes it, and what PEFT computes with it.

For each case it writes, under <out>/<case>/ (the base model is not copied: meta.json names the golden directory
whose config.json and model.safetensors it is):
  adapter/                 adapter_config.json + adapter_model.safetensors from PeftModel.save_pretrained
  batch.safetensors        input_ids (the base golden's) and labels = input_ids, int64 [2, 16]
  expected.safetensors     logits, logits_base, logits_merged, loss, loss_base, grad.<adapter key>,
                           merged.<parameter name> (fp32)
  meta.json                LoRA settings, versions, base directory, adapter keys, the expert layout, the checks
See tools/README.md. Usage: python tools/make_peft_goldens.py --goldens tests/assets/goldens

Everything runs on the CPU in fp32 with eager attention and eager experts, one thread, like make_goldens.py.
"""

import os
import sys

# Hide any GPU before torch is imported. PEFT keeps target_modules / target_parameters as sets and writes them to
# adapter_config.json in set order, which follows Python's per-process string hash: fix the hash seed so that a
# second run writes identical bytes.
os.environ["CUDA_VISIBLE_DEVICES"] = ""
if os.environ.get("PYTHONHASHSEED") != "0":
    os.environ["PYTHONHASHSEED"] = "0"
    os.execv(sys.executable, [sys.executable] + sys.argv)

import argparse  # noqa: E402
import json  # noqa: E402
import shutil  # noqa: E402

import peft  # noqa: E402
import safetensors  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from peft import LoraConfig, PeftModel, get_peft_model  # noqa: E402
from peft.tuners.lora.layer import LoraLayer, ParamWrapper  # noqa: E402
from peft.utils import get_peft_model_state_dict  # noqa: E402
from transformers import Qwen3MoeForCausalLM  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import make_goldens as mg  # noqa: E402

kRepoRoot = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
kRank, kAlpha = 4, 8
kLoraStd = 0.1  # A and B ~ N(0, kLoraStd^2): both non-zero, and large enough to move the logits visibly
kAttention = ["q_proj", "k_proj", "v_proj", "o_proj"]
kExperts = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
# The dense MLP is targeted through target_parameters, not target_modules. PEFT 0.21 on transformers 5 rewrites the
# config of a qwen3_moe model as if it were a v4 adapter (peft/utils/transformers_weight_conversion.py,
# _convert_peft_config_moe): every target_modules entry equal to or ending in ".gate_proj", ".up_proj" or
# ".down_proj" is moved to target_parameters as the routed experts' gate_up_proj / down_proj (with r and alpha
# doubled for gate_up_proj), so a dense MLP named there gets no adapter, on save and on load alike
# (huggingface/peft#3711). Targeting the 2-D weights directly gives the same maths and the same key names as
# lora.Linear (ParamWrapper with one "expert": lora_A [r, in], lora_B [out, r]).
kDenseMlp = ["mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight"]

# name -> (base golden directory under --goldens, target_modules, target_parameters, seed of the LoRA init). Seeds
# were picked so that no routing decision with the adapter is near a tie (make_goldens.kMinRouterMargin).
kCases = {
    "moe": ("tiny", kAttention, kExperts, 2101),
    "dense": ("dense_layer", kAttention, kExperts + kDenseMlp, 2104),
}


def load_base(base_dir):
    model = Qwen3MoeForCausalLM.from_pretrained(
        base_dir, dtype=torch.float32, attn_implementation="eager", experts_implementation="eager"
    )
    assert model.config._experts_implementation == "eager", model.config._experts_implementation
    model.train()  # as in a training step; dropout is 0 everywhere, so train and eval compute the same
    return model


def lora_config(target_modules, target_parameters):
    return LoraConfig(
        r=kRank,
        lora_alpha=kAlpha,
        lora_dropout=0.0,
        bias="none",
        init_lora_weights=False,  # overwritten below from a seeded generator
        target_modules=list(target_modules),
        target_parameters=list(target_parameters),
    )


def init_lora(model, seed):
    """Overwrites every lora_A / lora_B from one seeded generator in sorted-name order."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if p.requires_grad:
                assert ".lora_A." in name or ".lora_B." in name, f"unexpected trainable parameter {name}"
                p.copy_(kLoraStd * torch.randn(p.shape, generator=gen))


def strip_base_layer(name):
    while ".base_layer" in name:
        prefix, _, suffix = name.rpartition(".base_layer")
        name = prefix + suffix
    return name


def adapted_parameters(peft_model):
    """{adapter key prefix (as in adapter_model.safetensors): description of the base parameter it adapts}, taken
    from PEFT's own modules. Nested ParamWrappers (two parameters of one module) are told apart by base_layer."""
    out = {}
    for name, module in peft_model.named_modules():
        if not isinstance(module, LoraLayer):
            continue
        if isinstance(module, ParamWrapper):
            param_name = f"{strip_base_layer(name)}.{module.parameter_name}"
            experts, kind = module.num_experts, "ParamWrapper"
        else:
            param_name, experts, kind = f"{name}.weight", 1, type(module).__name__
        param_name = param_name.removeprefix("base_model.model.")
        out[name] = {
            "parameter": param_name,
            "peft_layer": kind,
            "experts": experts,
            "in": module.in_features,
            "out": module.out_features,
            "r": module.r["default"],
            "scaling": module.scaling["default"],
        }
    return out


def delta_weight(lora_a, lora_b, experts, r, scaling):
    """The documented layout (meta.json "expert_layout"): for expert e, A_e = lora_A.reshape(E, r, in)[e] and
    B_e = lora_B.reshape(out, r, E)[:, :, e]; the parameter gains scaling * B_e @ A_e, in its own [E, out, in]
    (or [out, in]) layout. Written independently of PEFT so that it checks PEFT."""
    if experts == 1:
        return scaling * lora_b @ lora_a
    a_erI = lora_a.reshape(experts, r, lora_a.shape[1])
    b_eOr = lora_b.reshape(lora_b.shape[0], r, experts).permute(2, 0, 1)
    return scaling * b_eOr @ a_erI


def reference_lora(base_params, adapter, adapted, cfg_json, input_ids, labels):
    """make_goldens.reference_forward on base + delta_weight(adapter), differentiable in the adapter tensors.
    Returns (logits, loss, {adapter key: gradient}, smallest router top-k margin)."""
    leaves = {k: v.detach().clone().requires_grad_(True) for k, v in adapter.items()}
    w = dict(base_params)
    for prefix, info in adapted.items():
        a, b = leaves[f"{prefix}.lora_A.weight"], leaves[f"{prefix}.lora_B.weight"]
        w[info["parameter"]] = w[info["parameter"]] + delta_weight(a, b, info["experts"], info["r"], info["scaling"])
    logits, ce, _, margin = mg.reference_forward(w, cfg_json, input_ids, labels)
    grads = torch.autograd.grad(ce, list(leaves.values()))
    return logits.detach(), ce.detach(), dict(zip(leaves, grads)), margin


class RouterMargins:
    """Smallest gap between the k-th and (k+1)-th router probability of any token in the forwards it watches."""

    def __init__(self, model, top_k):
        self.top_k, self.value, self.handles = top_k, float("inf"), []
        for module in model.modules():
            if type(module).__name__ == "Qwen3MoeTopKRouter":
                self.handles.append(module.register_forward_hook(self.hook))

    def hook(self, module, args, output):
        probs = torch.softmax(output[0].detach().float(), -1).sort(-1, descending=True).values
        self.value = min(self.value, (probs[:, self.top_k - 1] - probs[:, self.top_k]).min().item())

    def close(self):
        for h in self.handles:
            h.remove()
        return self.value if self.value != float("inf") else None


def max_abs(a, b):
    return (a - b).abs().max().item()


def run_case(name, goldens, out_root):
    base_name, target_modules, target_parameters, seed = kCases[name]
    base_dir = os.path.join(goldens, base_name)
    case_dir = os.path.join(out_root, name)
    adapter_dir = os.path.join(case_dir, "adapter")
    shutil.rmtree(case_dir, ignore_errors=True)
    os.makedirs(case_dir)
    with open(os.path.join(base_dir, "config.json")) as f:
        cfg_json = json.load(f)
    top_k = cfg_json["num_experts_per_tok"]

    base_batch = mg.read_safetensors(os.path.join(base_dir, "batch.safetensors"))
    input_ids = base_batch["input_ids"]
    labels = input_ids.clone()
    mg.save_tensors({"input_ids": input_ids, "labels": labels}, os.path.join(case_dir, "batch.safetensors"))

    # The base alone. Its logits do not depend on the labels, so they must equal the base golden's.
    base = load_base(base_dir)
    margins = RouterMargins(base, top_k)
    with torch.no_grad():
        out_base = base(input_ids=input_ids, labels=labels)
    margin_base = margins.close()
    base_golden_logits = mg.read_safetensors(os.path.join(base_dir, "expected.safetensors"))["logits"]
    err_base_golden = max_abs(out_base.logits, base_golden_logits)
    assert err_base_golden < 1e-5, f"{name}: the base model's logits moved from its golden by {err_base_golden}"
    base_params = {k: v.detach().clone() for k, v in base.named_parameters()}

    # Base + adapter: forward, loss, backward with respect to the adapter alone.
    model = get_peft_model(load_base(base_dir), lora_config(target_modules, target_parameters))
    cfg = model.peft_config["default"]
    assert set(cfg.target_modules) == set(target_modules), f"{name}: PEFT rewrote target_modules: {cfg.target_modules}"
    assert set(cfg.target_parameters) == set(target_parameters), f"{name}: PEFT rewrote target_parameters"
    assert not cfg.rank_pattern and not cfg.alpha_pattern, f"{name}: PEFT added rank/alpha patterns"
    init_lora(model, seed)
    model.train()
    margins = RouterMargins(model, top_k)
    out = model(input_ids=input_ids, labels=labels)
    margin_lora = margins.close()
    assert margin_lora >= mg.kMinRouterMargin, f"{name}: routing is near a tie ({margin_lora}); pick another seed"
    out.loss.backward()
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    for n, p in trainable.items():
        assert p.grad is not None, f"{name}: {n} got no gradient"
    grads = get_peft_model_state_dict(model, state_dict={n: p.grad.detach().clone() for n, p in trainable.items()})

    # The adapter exactly as PEFT writes it, with the base named relative to the repository (not this machine).
    cfg.base_model_name_or_path = os.path.relpath(os.path.abspath(base_dir), kRepoRoot)
    model.save_pretrained(adapter_dir)
    os.remove(os.path.join(adapter_dir, "README.md"))  # PEFT's empty model-card template
    adapter = mg.read_safetensors(os.path.join(adapter_dir, "adapter_model.safetensors"))
    live = get_peft_model_state_dict(model)
    assert sorted(adapter) == sorted(live) == sorted(grads), f"{name}: adapter, parameter and gradient keys differ"
    for k in adapter:
        assert torch.equal(adapter[k], live[k]), f"{name}: saved {k} differs from the parameter"
    adapted = adapted_parameters(model)
    assert sorted(adapter) == sorted(f"{p}.lora_{ab}.weight" for p in adapted for ab in "AB"), f"{name}: key set"

    # Reload through PEFT as a user would, then merge.
    reloaded = PeftModel.from_pretrained(load_base(base_dir), adapter_dir)
    reloaded.train()
    with torch.no_grad():
        logits_reload = reloaded(input_ids=input_ids).logits
        err_reload = max_abs(logits_reload, out.logits)
        assert err_reload == 0.0, f"{name}: reloading the adapter changed the logits by {err_reload}"
        merged_model = reloaded.merge_and_unload()
        out_merged = merged_model(input_ids=input_ids, labels=labels)
    merged_params = dict(merged_model.named_parameters())
    err_merged = max_abs(out_merged.logits, out.logits)
    assert err_merged < 1e-5, f"{name}: merged logits differ by {err_merged}"

    # The layout, checked against PEFT: our formula's merge equals merge_and_unload's, and reference maths with it
    # reproduce PEFT's logits, loss and gradients.
    merged, err_formula, err_alternative = {}, 0.0, 0.0
    for prefix, info in adapted.items():
        a, b = adapter[f"{prefix}.lora_A.weight"], adapter[f"{prefix}.lora_B.weight"]
        p = info["parameter"]
        ours = base_params[p] + delta_weight(a, b, info["experts"], info["r"], info["scaling"])
        merged[p] = merged_params[p].detach().clone()
        err_formula = max(err_formula, max_abs(ours, merged[p]))
        if info["experts"] > 1:  # the other natural reading of lora_B, [out, E, r], must not fit
            e, r = info["experts"], info["r"]
            b_eOr = b.reshape(b.shape[0], e, r).permute(1, 0, 2)
            wrong = base_params[p] + info["scaling"] * b_eOr @ a.reshape(e, r, a.shape[1])
            err_alternative = max(err_alternative, max_abs(wrong, merged[p]))
    assert err_formula < 1e-6, f"{name}: the documented layout does not reproduce PEFT's merge ({err_formula})"
    untouched = [k for k in merged_params if k not in merged]
    for k in untouched:
        assert torch.equal(merged_params[k], base_params[k]), f"{name}: merge changed unadapted {k}"
    ref_logits, ref_loss, ref_grads, _ = reference_lora(base_params, adapter, adapted, cfg_json, input_ids, labels)
    ref_err = {
        "logits": max_abs(ref_logits, out.logits),
        "loss": abs(ref_loss.item() - out.loss.item()),
        "grad_max_abs": max(max_abs(ref_grads[k], grads[k]) for k in grads),
        "grad_max_rel": max((ref_grads[k] - grads[k]).norm().item() / grads[k].norm().item() for k in grads),
    }
    assert ref_err["logits"] < 1e-4 and ref_err["loss"] < 1e-4, f"{name}: reference maths disagree: {ref_err}"
    assert ref_err["grad_max_rel"] < 1e-4, f"{name}: reference gradients disagree: {ref_err}"

    expected = {
        "logits": out.logits.detach().clone(),
        "logits_base": out_base.logits.detach().clone(),
        "logits_merged": out_merged.logits.detach().clone(),
        "loss": out.loss.detach().reshape(1).clone(),
        "loss_base": out_base.loss.detach().reshape(1).clone(),
    }
    expected.update({f"grad.{k}": v for k, v in grads.items()})
    expected.update({f"merged.{k}": v for k, v in merged.items()})
    mg.save_tensors(expected, os.path.join(case_dir, "expected.safetensors"))

    with open(os.path.join(adapter_dir, "adapter_config.json")) as f:
        adapter_config = json.load(f)
    sparse = next(i for i in range(cfg_json["num_hidden_layers"]) if f"model.layers.{i}.mlp.gate.weight" in base_params)
    E, D, F = cfg_json["num_local_experts"], cfg_json["hidden_size"], cfg_json["moe_intermediate_size"]
    meta = {
        "case": name,
        "base_dir": os.path.relpath(os.path.abspath(base_dir), kRepoRoot),
        "base_dir_from_case": os.path.relpath(os.path.abspath(base_dir), os.path.abspath(case_dir)),
        "base_note": "the base model is that directory's config.json + model.safetensors (per-expert on disk; "
        "transformers fuses the experts on load); batch input_ids are its batch's, labels = input_ids",
        "r": kRank,
        "lora_alpha": kAlpha,
        "scaling": kAlpha / kRank,
        "use_rslora": False,
        "lora_dropout": 0.0,
        "bias": "none",
        "init": f"init_lora_weights=False, then every lora_A and lora_B ~ {kLoraStd} * randn from "
        f"torch.Generator().manual_seed({seed}), sorted parameter names",
        "target_modules": sorted(target_modules),
        "target_parameters": sorted(target_parameters),
        "router_adapted": False,
        "dense_mlp_note": "dense MLP weights are targeted via target_parameters (mlp.{gate,up,down}_proj.weight): "
        "PEFT 0.21 + transformers 5 moves target_modules entries gate_proj/up_proj/down_proj of a qwen3_moe "
        "model to the routed experts (v4-adapter conversion), leaving the dense MLP unadapted. The saved keys are "
        "lora.Linear's: ...mlp.gate_proj.lora_A.weight [r, in], ...lora_B.weight [out, r]",
        "adapter_files": sorted(os.listdir(adapter_dir)),
        "adapter_files_note": "what PeftModel.save_pretrained writes, less its README.md model-card template; "
        "base_model_name_or_path set to base_dir before saving",
        "adapter_config": adapter_config,
        "adapter_keys": {k: list(v.shape) for k, v in sorted(adapter.items())},
        "adapted_parameters": {f"{p}.lora_{{A,B}}.weight": info for p, info in sorted(adapted.items())},
        "expert_layout": {
            "parameters": {
                "mlp.experts.gate_up_proj": f"[E, 2F, D] = [{E}, {2 * F}, {D}]; rows 0..F-1 of each expert are "
                "gate_proj, F..2F-1 up_proj (transformers: gate, up = linear(x, gate_up_proj[e]).chunk(2))",
                "mlp.experts.down_proj": f"[E, D, F] = [{E}, {D}, {F}]",
            },
            "in_out": "ParamWrapper reads a 3-D parameter [E, d1, d2] as in = d1, out = d2, then swaps them because "
            "Qwen3MoeExperts is not is_transposed: in = d2, out = d1, i.e. each expert's slice is [out, in] as in "
            "nn.Linear. gate_up_proj: in = D, out = 2F; down_proj: in = F, out = D",
            "shapes": {
                "gate_up_proj": {"lora_A": [kRank * E, D], "lora_B": [2 * F, kRank * E]},
                "down_proj": {"lora_A": [kRank * E, F], "lora_B": [D, kRank * E]},
            },
            "per_expert": "A_e = lora_A.reshape(E, r, in)[e] (rows e*r .. e*r+r-1, a block); "
            "B_e = lora_B.reshape(out, r, E)[:, :, e] (columns j*E + e for j = 0..r-1: interleaved, not a block); "
            "W_e += scaling * B_e @ A_e, W_e = param[e] of shape [out, in]. For gate_up_proj, rows 0..F-1 of "
            "B_e are the gate's B and F..2F-1 the up's; gate and up share A_e",
            "forward": "PEFT registers W + scaling * B_e @ A_e as a parametrization of the whole [E, out, in] "
            "parameter (torch.baddbmm) and runs the experts' own forward on it; experts no token chose get zero "
            "gradients",
            "keys": "both expert parameters live on one module, so PEFT nests two ParamWrappers; gate_up_proj is "
            "registered first in Qwen3MoeExperts, so it is the inner one: "
            f"base_model.model.model.layers.{sparse}.mlp.experts.base_layer.lora_{{A,B}}.weight is gate_up_proj's, "
            f"base_model.model.model.layers.{sparse}.mlp.experts.lora_{{A,B}}.weight is down_proj's",
            "evidence": {
                "formula_vs_merge_and_unload_max_abs": err_formula,
                "lora_B_read_as_[out,E,r]_vs_merge_max_abs": err_alternative,
                "peft_source": "peft/tuners/lora/layer.py ParamWrapper: _get_in_out_features, update_layer "
                "(swap_in_out_features), get_delta_weight einsum 'o r e, e r i -> e o i'",
            },
        },
        "results": {
            "loss": out.loss.item(),
            "loss_base": out_base.loss.item(),
            "max_abs_logits_minus_logits_base": max_abs(out.logits, out_base.logits),
            "max_abs_logits_merged_minus_logits": err_merged,
            "max_abs_reloaded_adapter_logits_minus_logits": err_reload,
            "max_abs_logits_base_minus_base_golden": err_base_golden,
            "reference_forward_err": ref_err,
            "min_router_topk_margin": {"base": margin_base, "lora": margin_lora},
            "grad_norm": torch.sqrt(sum((g.double() ** 2).sum() for g in grads.values())).item(),
        },
        "ce_positions": int((labels[:, 1:] != -100).sum()),
        "expected_keys": "logits, logits_base, logits_merged [B,T,V]; loss, loss_base [1] (transformers' causal LM "
        "loss: mean cross-entropy over the shifted labels); grad.<adapter key> (d loss / d that adapter tensor, "
        "keys exactly those of adapter/adapter_model.safetensors); merged.<parameter name> (the adapted base "
        "parameters after merge_and_unload, in transformers' parameter layout: experts fused as in "
        "tiny/model_fused)",
        "versions": {
            "peft": peft.__version__,
            "transformers": transformers.__version__,
            "torch": torch.__version__,
            "safetensors": safetensors.__version__,
        },
        "attn_implementation": "eager",
        "experts_implementation": "eager",
    }
    with open(os.path.join(case_dir, "meta.json"), "w") as f:
        json.dump(meta, f, indent=2, sort_keys=True)
        f.write("\n")
    r = meta["results"]
    print(
        f"{name:6s} loss={r['loss']:.6f} loss_base={r['loss_base']:.6f} "
        f"max|dlogits|={r['max_abs_logits_minus_logits_base']:.4f} merged_err={err_merged:.2e} "
        f"layout_err={err_formula:.2e} ref={ref_err} margin={margin_lora:.2e} keys={len(adapter)}"
    )


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--goldens", default="tests/assets/goldens", help="directory holding the base goldens")
    parser.add_argument("--out", default=None, help="output directory (default <goldens>/lora; cases are replaced)")
    parser.add_argument("--cases", nargs="*", default=list(kCases), help="subset of cases to write")
    args = parser.parse_args()
    out = args.out or os.path.join(args.goldens, "lora")
    mg.setup_torch()
    os.makedirs(out, exist_ok=True)
    print(f"peft {peft.__version__}, transformers {transformers.__version__}, torch {torch.__version__}, cpu fp32")
    for name in args.cases:
        run_case(name, args.goldens, out)


if __name__ == "__main__":
    main()
