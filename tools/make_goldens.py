#!/usr/bin/env python3
"""Generates the golden test data for moetrain's Qwen3-MoE implementation from PyTorch + transformers.

For each case (a small random model) it writes, under <out>/<case>/:
  config.json, model.safetensors   the model as transformers' save_pretrained writes it
  batch.safetensors                input_ids and labels (int64 [2, 16])
  expected.safetensors             loss, aux_loss, logits, grad.<name>, after3.<name> (fp32)
  meta.json                        optimizer settings, grad norms, losses, versions, on-disk expert layout
and for `tiny` also model_per_expert/, model_fused/, model_bf16/ and model_sharded/ (the same weights in other
on-disk forms). See tools/README.md. Usage: python tools/make_goldens.py --out tests/assets/goldens

Everything runs on the CPU in fp32 with eager attention and eager experts, so the numbers do not depend on
the accelerator, TF32 or fused kernels of the machine that regenerates them.
"""

import os

# Hide any GPU before torch is imported: the goldens must be computed on the CPU in fp32 everywhere.
os.environ["CUDA_VISIBLE_DEVICES"] = ""

import argparse  # noqa: E402
import copy  # noqa: E402
import json  # noqa: E402
import shutil  # noqa: E402

import safetensors  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from safetensors import safe_open  # noqa: E402
from safetensors.torch import save_file  # noqa: E402
from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM  # noqa: E402

kBatch, kSeq = 2, 16
kInitStd = 0.1  # larger than the default 0.02 so that mistakes move the numbers visibly
kNormStd = 0.1  # RMSNorm weights are 1 + kNormStd * randn, so norm gradients and scales are exercised
kMaxNorm = 1.0
kSteps = 3
# eps 1e-6, not torch's default 1e-8: some gradient elements here are ~1e-8 (SwiGLU gates that are off for
# every token, rarely routed experts), and for them Adam's direction g / (|g| + eps) turns fp32 summation-order
# noise into O(1) differences, so no two implementations (not even torch on two CPUs) agree after 3 steps.
# Measured with moetrain: gradients within 1.7e-6 of torch, one step from identical gradients within 2e-8, yet
# the 3-step parameters differ by up to 1.7e-4 per tensor at eps 1e-8 and by at most 6.4e-6 at eps 1e-6.
kAdamW = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-6, weight_decay=0.1)
# Positions (batch row, token) whose label is -100: two interior ones and a whole tail region of row 1.
# Smallest allowed gap between the k-th and (k+1)-th router probability of any token, at any of the steps: an
# implementation whose fp32 rounding differs slightly from torch's must still pick the same experts.
kMinRouterMargin = 2e-4
kIgnored = [(0, 2), (0, 9), (1, 13), (1, 14), (1, 15)]

kTinyMoe = dict(
    vocab_size=512,
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    num_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    intermediate_size=128,
    norm_topk_prob=True,
    tie_word_embeddings=False,
    output_router_logits=False,
    router_aux_loss_coef=0.001,
    decoder_sparse_step=1,
    mlp_only_layers=[],
    rms_norm_eps=1e-6,
    rope_parameters={"rope_type": "default", "rope_theta": 1e6},
    max_position_embeddings=256,
    initializer_range=kInitStd,
    hidden_act="silu",
    attention_bias=False,
    use_sliding_window=False,
)

kTinyDense = dict(
    vocab_size=128,
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    intermediate_size=96,
    tie_word_embeddings=False,
    rms_norm_eps=1e-6,
    rope_parameters={"rope_type": "default", "rope_theta": 1e6},
    max_position_embeddings=256,
    initializer_range=kInitStd,
    hidden_act="silu",
    attention_bias=False,
    use_sliding_window=False,
)

# name -> (family, config overrides on top of the family's tiny config, seed). Seeds were picked so that no
# routing decision is near a tie (see kMinRouterMargin).
kCases = {
    "tiny": ("moe", {}, 1041),
    "tied": ("moe", dict(vocab_size=128, tie_word_embeddings=True), 1002),
    "no_norm_topk": ("moe", dict(vocab_size=128, norm_topk_prob=False), 1031),
    "dense_layer": (
        "moe",
        dict(vocab_size=128, num_hidden_layers=3, mlp_only_layers=[0], intermediate_size=96, decoder_sparse_step=1),
        1024,
    ),
    "aux": (
        "moe",
        dict(vocab_size=128, num_hidden_layers=3, output_router_logits=True, router_aux_loss_coef=0.1),
        1028,
    ),
    "dense_qwen3": ("dense", {}, 1006),
}


def setup_torch():
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    torch.manual_seed(0)
    torch.use_deterministic_algorithms(True)
    torch.set_default_dtype(torch.float32)
    # One thread: CPU matmul blocking (and so rounding) can depend on the thread count.
    torch.set_num_threads(1)


def build_model(family, overrides):
    base = kTinyMoe if family == "moe" else kTinyDense
    cfg_kwargs = copy.deepcopy(base)
    cfg_kwargs.update(overrides)
    if family == "moe":
        config_cls, model_cls = Qwen3MoeConfig, Qwen3MoeForCausalLM
    else:
        config_cls, model_cls = Qwen3Config, Qwen3ForCausalLM
    config = config_cls(**cfg_kwargs)
    config.dtype = torch.float32
    # Eager attention and the eager (per-expert loop) experts forward: the plain reference maths.
    config._attn_implementation = "eager"
    if hasattr(config, "_experts_implementation"):
        config._experts_implementation = "eager"
    model = model_cls(config)
    model.to(device="cpu", dtype=torch.float32)
    if family == "moe" and hasattr(model, "set_experts_implementation"):
        model.set_experts_implementation("eager")
    model.train()  # as in a training step; attention dropout is 0, so train and eval compute the same
    return model


def init_params(model, seed):
    """Overwrites every parameter from one seeded generator, in sorted-name order, independent of how the
    installed transformers initialises (its init order and defaults change between versions)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if name.endswith("norm.weight"):
                p.copy_(1.0 + kNormStd * torch.randn(p.shape, generator=gen))
            else:
                assert p.dim() >= 2, f"unexpected non-norm 1-D parameter {name}"
                p.copy_(kInitStd * torch.randn(p.shape, generator=gen))


def make_batch(vocab, seed):
    gen = torch.Generator().manual_seed(seed + 7)
    input_ids = torch.randint(0, vocab, (kBatch, kSeq), generator=gen, dtype=torch.int64)
    labels = input_ids.clone()
    for b, t in kIgnored:
        labels[b, t] = -100
    return input_ids, labels


def per_expert_views(name, value):
    """For a fused expert parameter name, yields (per-expert on-disk name, tensor) pairs."""
    if name.endswith("mlp.experts.gate_up_proj"):
        prefix = name[: -len("gate_up_proj")]
        ff = value.shape[1] // 2
        for e in range(value.shape[0]):
            # gate rows come first: transformers' forward does `gate, up = linear(x, gate_up_proj[e]).chunk(2)`.
            yield f"{prefix}{e}.gate_proj.weight", value[e, :ff]
            yield f"{prefix}{e}.up_proj.weight", value[e, ff:]
    elif name.endswith("mlp.experts.down_proj"):
        prefix = name[: -len("down_proj")]
        for e in range(value.shape[0]):
            yield f"{prefix}{e}.down_proj.weight", value[e]


def candidates(named):
    """All tensors that may appear on disk, keyed by on-disk name, from {parameter name: tensor} (which has both
    the fused names and, via per_expert_views, the per-expert ones)."""
    out = {}
    for name, value in named.items():
        out[name] = value
        for n, v in per_expert_views(name, value):
            out[n] = v
    return out


def to_layout(named, layout, disk_names=None):
    """Converts {parameter name: tensor} to an on-disk dict. layout: 'fused' (the parameter names), 'per_expert'
    (fused experts split per expert) or 'disk' (exactly disk_names, which may include tied aliases)."""
    cand = candidates(named)
    if layout == "disk":
        keys = list(disk_names)
    elif layout == "fused":
        keys = list(named)
    else:
        keys = []
        for n in named:
            views = list(per_expert_views(n, named[n]))
            keys.extend([k for k, _ in views] if views else [n])
    missing = [k for k in keys if k not in cand]
    assert not missing, f"no source for on-disk tensors {missing[:5]}"
    return {k: cand[k].detach().clone().contiguous() for k in keys}


def params_by_name(model):
    """{name: parameter} including aliases of tied parameters (lm_head.weight -> embed_tokens.weight)."""
    return dict(model.named_parameters(remove_duplicate=False))


def read_safetensors(path):
    with safe_open(path, framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def save_tensors(tensors, path):
    save_file({k: v.detach().contiguous() for k, v in sorted(tensors.items())}, path, metadata={"format": "pt"})


def expert_layout(disk):
    if any(".mlp.experts.gate_up_proj" in k for k in disk):
        return "fused"
    if any(".mlp.experts." in k for k in disk):
        return "per_expert"
    return "none"


def layer_listing(disk, layer):
    prefix = f"model.layers.{layer}."
    return {k: list(v.shape) for k, v in sorted(disk.items()) if k.startswith(prefix)}


def forward_loss(model, input_ids, labels):
    out = model(input_ids=input_ids, labels=labels)
    aux = out.aux_loss if getattr(out, "aux_loss", None) is not None else torch.zeros(())
    return out, aux

def reference_forward(w, cfg, input_ids, labels):
    """Independent re-implementation of the maths in docs/design.md ("The model") from on-disk tensors `w` (either
    expert layout) and the config.json dict `cfg`. Returns (logits, cross-entropy, unscaled aux loss, smallest
    gap between the k-th and (k+1)-th router probability). Used to cross-check transformers and to make sure
    no token's routing sits on a near tie (which would make the goldens fragile for another implementation)."""
    hidden, heads, kv_heads = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd, eps = cfg["head_dim"], cfg["rms_norm_eps"]
    theta = cfg["rope_parameters"]["rope_theta"]
    top_k = cfg.get("num_experts_per_tok", 0)
    n_batch, n_seq = input_ids.shape

    def rms(x, weight):
        return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))

    def rot_half(x):
        return torch.cat((-x[..., hd // 2 :], x[..., : hd // 2]), dim=-1)

    def expert(prefix, e):
        if f"{prefix}mlp.experts.{e}.gate_proj.weight" in w:
            return tuple(w[f"{prefix}mlp.experts.{e}.{n}_proj.weight"] for n in ("gate", "up", "down"))
        gate_up = w[f"{prefix}mlp.experts.gate_up_proj"][e]
        ff = gate_up.shape[0] // 2
        return gate_up[:ff], gate_up[ff:], w[f"{prefix}mlp.experts.down_proj"][e]

    inv_freq = 1.0 / (theta ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd))
    angles = torch.arange(n_seq, dtype=torch.float32)[:, None] * inv_freq[None, :]
    cos, sin = torch.cat((angles, angles), -1).cos(), torch.cat((angles, angles), -1).sin()
    causal = torch.triu(torch.ones(n_seq, n_seq, dtype=torch.bool), 1)

    h = w["model.embed_tokens.weight"][input_ids]
    routed, margin = [], float("inf")
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        x = rms(h, w[p + "input_layernorm.weight"])
        q = (x @ w[p + "self_attn.q_proj.weight"].T).view(n_batch, n_seq, heads, hd)
        k = (x @ w[p + "self_attn.k_proj.weight"].T).view(n_batch, n_seq, kv_heads, hd)
        q, k = rms(q, w[p + "self_attn.q_norm.weight"]), rms(k, w[p + "self_attn.k_norm.weight"])
        v = (x @ w[p + "self_attn.v_proj.weight"].T).view(n_batch, n_seq, kv_heads, hd)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        q, k = q * cos + rot_half(q) * sin, k * cos + rot_half(k) * sin
        k, v = k.repeat_interleave(heads // kv_heads, 1), v.repeat_interleave(heads // kv_heads, 1)
        scores = (q @ k.transpose(-1, -2)) / hd**0.5
        attn = torch.softmax(scores.masked_fill(causal, float("-inf")), -1) @ v
        h = h + attn.transpose(1, 2).reshape(n_batch, n_seq, heads * hd) @ w[p + "self_attn.o_proj.weight"].T
        x = rms(h, w[p + "post_attention_layernorm.weight"]).reshape(-1, hidden)
        if p + "mlp.gate.weight" in w:
            probs = torch.softmax(x @ w[p + "mlp.gate.weight"].T, -1)
            ordered = probs.sort(-1, descending=True).values
            margin = min(margin, (ordered[:, top_k - 1] - ordered[:, top_k]).min().item())
            top_p, top_i = probs.topk(top_k, -1)
            if cfg["norm_topk_prob"]:
                top_p = top_p / top_p.sum(-1, keepdim=True)
            y = torch.zeros_like(x)
            for e in range(probs.shape[-1]):
                gate, up, down = expert(p, e)
                weight = (top_p * (top_i == e)).sum(-1, keepdim=True)
                y = y + weight * ((torch.nn.functional.silu(x @ gate.T) * (x @ up.T)) @ down.T)
            routed.append((probs, top_i))
        else:
            gate, up, down = (w[f"{p}mlp.{n}_proj.weight"] for n in ("gate", "up", "down"))
            y = (torch.nn.functional.silu(x @ gate.T) * (x @ up.T)) @ down.T
        h = h + y.view(n_batch, n_seq, hidden)
    h = rms(h, w["model.norm.weight"])
    logits = h @ w.get("lm_head.weight", w["model.embed_tokens.weight"]).T
    ce = torch.nn.functional.cross_entropy(
        logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1), ignore_index=-100
    )
    aux = torch.zeros(())
    if routed:
        n_experts = routed[0][0].shape[-1]
        probs = torch.cat([r[0] for r in routed])
        counts = torch.cat([r[1].reshape(-1) for r in routed]).bincount(minlength=n_experts).float()
        aux = n_experts * (counts / probs.shape[0] * probs.mean(0)).sum()
    return logits, ce, aux, margin


def run_case(name, family, overrides, seed, out_root):
    case_dir = os.path.join(out_root, name)
    shutil.rmtree(case_dir, ignore_errors=True)
    os.makedirs(case_dir)

    torch.manual_seed(seed)
    model = build_model(family, overrides)
    init_params(model, seed)
    config = model.config
    input_ids, labels = make_batch(config.vocab_size, seed)

    model.save_pretrained(case_dir)
    disk = read_safetensors(os.path.join(case_dir, "model.safetensors"))
    disk_names = sorted(disk)
    named = params_by_name(model)
    # The mapping from parameters to on-disk tensors is checked bit for bit against what save_pretrained wrote.
    mapped = to_layout({k: v.detach() for k, v in named.items()}, "disk", disk_names)
    for k in disk_names:
        assert torch.equal(mapped[k], disk[k]), f"{name}: on-disk {k} does not match its parameter"

    save_tensors({"input_ids": input_ids, "labels": labels}, os.path.join(case_dir, "batch.safetensors"))

    opt = torch.optim.AdamW(model.parameters(), foreach=False, **kAdamW)
    params = list(model.parameters())
    losses, auxes, norms = [], [], []
    expected = {}
    with open(os.path.join(case_dir, "config.json")) as f:
        cfg_json = json.load(f)
    margins, ref_err = [], {}
    for step in range(kSteps):
        with torch.no_grad():
            current = to_layout({k: v.detach() for k, v in named.items()}, "disk", disk_names)
            ref_logits, ref_ce, ref_aux, margin = reference_forward(current, cfg_json, input_ids, labels)
        margins.append(margin if margin != float("inf") else None)  # JSON has no Infinity: dense = null
        assert margin >= kMinRouterMargin, f"{name}: step {step} routing is near a tie ({margin}); pick another seed"
        opt.zero_grad(set_to_none=True)
        out, aux = forward_loss(model, input_ids, labels)
        out.loss.backward()
        if step == 0:
            # transformers adds (and returns) the aux loss only when output_router_logits is on.
            coef = cfg_json.get("router_aux_loss_coef", 0.0) if cfg_json.get("output_router_logits") else 0.0
            ref_err = {
                "logits": (ref_logits - out.logits).abs().max().item(),
                "loss": abs((ref_ce + coef * ref_aux).item() - out.loss.item()),
            }
            if coef:
                ref_err["aux"] = abs(ref_aux.item() - aux.item())
            assert max(ref_err.values()) < 1e-4, f"{name}: reference maths disagrees with transformers: {ref_err}"
        for p_name, p in model.named_parameters():
            assert p.grad is not None, f"{name}: {p_name} got no gradient"
        if step == 0:
            expected["loss"] = out.loss.detach().reshape(1).clone()
            expected["aux_loss"] = aux.detach().float().reshape(1).clone()
            expected["logits"] = out.logits.detach().float().clone()
            grads = {k: (p.grad if p.grad is not None else torch.zeros_like(p)) for k, p in named.items()}
            for k, v in to_layout(grads, "disk", disk_names).items():
                expected[f"grad.{k}"] = v
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm=kMaxNorm, foreach=False)
        opt.step()
        losses.append(out.loss.item())
        auxes.append(aux.item())
        norms.append(float(norm))
    for k, v in to_layout({k: p.detach() for k, p in named.items()}, "disk", disk_names).items():
        expected[f"after3.{k}"] = v
    save_tensors(expected, os.path.join(case_dir, "expected.safetensors"))

    # Reload through transformers to prove the written checkpoint reproduces the logits.
    check_reload(model.__class__, case_dir, initial_model_logits=expected["logits"], input_ids=input_ids)

    layout = expert_layout(disk)
    sparse_layer = next((i for i in range(config.num_hidden_layers) if f"model.layers.{i}.mlp.gate.weight" in disk), 0)
    meta = {
        "case": name,
        "model_class": model.__class__.__name__,
        "seed": seed,
        "init": {"std": kInitStd, "norm_weights": f"1 + {kNormStd} * randn", "order": "sorted parameter names"},
        "batch": {"shape": [kBatch, kSeq], "ignored_label_positions": kIgnored},
        "optimizer": {
            "type": "torch.optim.AdamW",
            "lr": kAdamW["lr"],
            "betas": list(kAdamW["betas"]),
            "eps": kAdamW["eps"],
            "weight_decay": kAdamW["weight_decay"],
            "weight_decay_applies_to": "all parameters (one param group, norms and embeddings included)",
            "foreach": False,
        },
        "max_norm": kMaxNorm,
        "steps": kSteps,
        "step_recipe": "zero_grad; loss = model(input_ids, labels).loss; loss.backward(); "
        "norm = clip_grad_norm_(params, max_norm); AdamW.step()",
        "grad_norms": norms,
        "losses": losses,
        "aux_losses": auxes,
        "loss_includes_aux": bool(getattr(config, "output_router_logits", False)),
        "router_aux_loss_coef": getattr(config, "router_aux_loss_coef", None),
        "min_router_topk_margin_per_step": margins,
        "reference_forward_max_abs_err": ref_err,
        "ce_positions": int((labels[:, 1:] != -100).sum()),
        "transformers_version": transformers.__version__,
        "torch_version": torch.__version__,
        "safetensors_version": safetensors.__version__,
        "attn_implementation": config._attn_implementation,
        "experts_implementation": getattr(config, "_experts_implementation", None),
        "on_disk": {
            "expert_layout": layout,
            "example_layer": sparse_layer,
            "example_layer_tensors": layer_listing(disk, sparse_layer),
            "has_lm_head_weight": "lm_head.weight" in disk,
            "tie_word_embeddings": bool(config.tie_word_embeddings),
            "num_tensors": len(disk),
        },
        "expected_keys": "loss [1], aux_loss [1] (unscaled, 0 when disabled), logits [B,T,V], "
        "grad.<on-disk name>, after3.<on-disk name>",
    }

    if name == "tiny":
        meta["variants"] = write_tiny_variants(model, named, case_dir, disk)

    with open(os.path.join(case_dir, "meta.json"), "w") as f:
        json.dump(meta, f, indent=2, sort_keys=True)
        f.write("\n")

    print(
        f"{name:13s} loss={losses[0]:.6f} aux={auxes[0]:.6f} losses={[round(x, 6) for x in losses]} "
        f"grad_norms={[round(x, 6) for x in norms]} layout={layout} lm_head_on_disk={'lm_head.weight' in disk}"
    )
    return meta


def check_reload(model_cls, path, initial_model_logits, input_ids, dtype=torch.float32, atol=0.0):
    """Loads `path` with from_pretrained and checks its logits against those of the initial weights."""
    kwargs = dict(dtype=dtype, attn_implementation="eager")
    if model_cls is Qwen3MoeForCausalLM:
        kwargs["experts_implementation"] = "eager"
    try:
        m = model_cls.from_pretrained(path, **kwargs)
    except TypeError:
        kwargs.pop("experts_implementation", None)
        m = model_cls.from_pretrained(path, **kwargs)
    m.eval()
    with torch.no_grad():
        logits = m(input_ids=input_ids).logits.float()
    err = (logits - initial_model_logits).abs().max().item()
    assert err <= atol, f"reloading {path} changed the logits by {err}"
    return err


def write_tiny_variants(model, named, case_dir, disk):
    """The tiny weights (initial, before the optimizer steps) in the other on-disk forms moetrain must read."""
    # The optimizer has moved the live parameters; rebuild the initial weights from the saved checkpoint.
    initial_disk = disk
    layout = expert_layout(disk)
    # Reconstruct {parameter name: initial tensor} by loading the checkpoint into a fresh model.
    fresh = Qwen3MoeForCausalLM.from_pretrained(case_dir, dtype=torch.float32, attn_implementation="eager")
    fresh_named = {k: v.detach() for k, v in fresh.named_parameters()}
    variants = {}
    input_ids = read_safetensors(os.path.join(case_dir, "batch.safetensors"))["input_ids"]
    ref_logits = read_safetensors(os.path.join(case_dir, "expected.safetensors"))["logits"]

    for form in ("per_expert", "fused"):
        d = os.path.join(case_dir, f"model_{form}")
        os.makedirs(d)
        shutil.copy(os.path.join(case_dir, "config.json"), d)
        tensors = to_layout(fresh_named, form)
        if form == layout:
            assert sorted(tensors) == sorted(initial_disk), f"{form} names differ from save_pretrained's"
        save_tensors(tensors, os.path.join(d, "model.safetensors"))
        try:
            err = check_reload(Qwen3MoeForCausalLM, d, ref_logits, input_ids)
            loads = f"transformers {transformers.__version__} from_pretrained loads it (max |dlogits| {err})"
        except Exception as e:  # noqa: BLE001 - recorded, not fatal: moetrain must still read the form
            loads = f"transformers {transformers.__version__} from_pretrained failed: {type(e).__name__}: {e}"
        variants[f"model_{form}"] = {
            "layout": form,
            "written_with": "safetensors.torch.save_file",
            "same_as_model.safetensors": form == layout,
            "example_layer_tensors": layer_listing(tensors, 0),
            "transformers_reload": loads,
        }

    d = os.path.join(case_dir, "model_bf16")
    os.makedirs(d)
    with open(os.path.join(case_dir, "config.json")) as f:
        cfg = json.load(f)
    cfg["dtype"] = "bfloat16"
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2, sort_keys=True)
        f.write("\n")
    save_tensors({k: v.to(torch.bfloat16) for k, v in initial_disk.items()}, os.path.join(d, "model.safetensors"))
    variants["model_bf16"] = {
        "layout": layout,
        "dtype": "bfloat16",
        "note": "model.safetensors cast to bf16 (round to nearest even); compare with the fp32 goldens only with "
        "a tolerance (logits differ by bf16 weight rounding)",
    }

    d = os.path.join(case_dir, "model_sharded")
    fresh.save_pretrained(d, max_shard_size="100KB")
    with open(os.path.join(d, "model.safetensors.index.json")) as f:
        index = json.load(f)
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1, "expected several shards"
    assert sorted(index["weight_map"]) == sorted(initial_disk), "sharded names differ from the single file's"
    for shard in shards:
        for k, v in read_safetensors(os.path.join(d, shard)).items():
            assert torch.equal(v, initial_disk[k]), f"sharded {k} differs"
    variants["model_sharded"] = {
        "layout": layout,
        "written_with": 'save_pretrained(max_shard_size="100KB")',
        "num_shards": len(shards),
        "shards": shards,
    }
    return variants


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="tests/assets/goldens", help="output directory (cases are replaced)")
    parser.add_argument("--cases", nargs="*", default=list(kCases), help="subset of cases to write")
    args = parser.parse_args()
    setup_torch()
    os.makedirs(args.out, exist_ok=True)
    print(f"transformers {transformers.__version__}, torch {torch.__version__}, device cpu, fp32")
    for name in args.cases:
        family, overrides, seed = kCases[name]
        run_case(name, family, overrides, seed, args.out)


if __name__ == "__main__":
    main()
