#!/usr/bin/env python3
"""Goldens of TRL's GRPO loss: what TRL's `GRPOTrainer` computes, for moetrain's RL objective to equal.

Writes <out>/ (default tests/assets/goldens/trl):
  config.json, generation_config.json, model.safetensors   a small random Qwen3-MoE (save_pretrained)
  batch.safetensors        the shared batch: prompt_ids [8, P], completion_ids [8, C] (0-padded),
                           completion_mask [8, C], rewards [8] (2 groups of 4 completions)
  cases/<case>.safetensors per case: what TRL's loss saw and gave (see tools/README.md)
  meta.json                versions, the case list and each case's GRPOConfig settings

Each case builds a real `trl.GRPOTrainer` on the checkpoint and runs one optimizer step's worth of its own code:
`_generate_and_score_completions` (generation replaced by a `rollout_func` that returns the fixed completions;
the rewards come from a reward function, so the advantages, the token count and the importance-sampling ratio
are TRL's own), split into `gradient_accumulation_steps` micro-batches with TRL's `split_tensor_dict`, then
`compute_loss(...).backward()` per micro-batch, as `Trainer.training_step` does (GRPO's loss is already scaled for
gradient accumulation, so the Trainer divides by nothing). The gradient is the sum over the micro-batches: one
optimizer step's gradient.

What is designed instead of sampled: the old log-probs (`current - delta`, delta chosen per sample so that the
clip is active on both sides, or none: on-policy), the reference log-probs (`current - kappa`) and the rollout
engine's log-probs (`old - eps`, for the importance-sampling correction). They are fed through TRL's own
`_get_per_token_logps_and_entropies` call sites (wrapped while `_generate_and_score_completions` runs), so
TRL's code computes everything from them. The importance-sampling correction runs only with vLLM in TRL: the
trainer's `use_vllm` flag is set after construction (no vLLM is imported or called; generation is the
rollout_func). Every perturbation keeps a margin of >= 0.02 in log space from every clip, cap and mask bound, so a
log-prob that differs in the 6th digit cannot flip a decision.

CPU, fp32, eager attention and experts, one thread, deterministic; needs torch, transformers, trl (>= 1.16),
datasets, safetensors. Usage: python tools/make_trl_goldens.py [--out tests/assets/goldens/trl]
"""

import os

os.environ["CUDA_VISIBLE_DEVICES"] = ""
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

import argparse  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import shutil  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402

import datasets  # noqa: E402
import safetensors  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
import trl  # noqa: E402
from tokenizers import Tokenizer, models, pre_tokenizers  # noqa: E402
from transformers import PreTrainedTokenizerFast, Qwen3MoeForCausalLM  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402
from trl.trainer.utils import split_tensor_dict  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import make_goldens as mg  # noqa: E402

# The model: smaller than goldens/tiny so that ~30 cases of every gradient stay under 2 MB (tiny's gradients are
# 760 KB a case). Still Qwen3-MoE with grouped KV heads, q/k norms, 2 sparse layers, 4 experts top-2.
kModel = dict(
    vocab_size=48,
    hidden_size=32,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=16,
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=8,
    intermediate_size=64,
)
kSeed = 2024
kPad, kEos = 0, 1

# The batch: 2 prompts (groups) x 4 completions, prompts of 4 tokens (no left padding: TRL's forward takes
# positions 0.. whatever the mask, so padded prompts would shift positions), completions of these lengths,
# right-padded. Micro-batches of 4 (one group each) hold 21 and 16 tokens, so BNPO's per-micro-batch mean
# differs from the global one.
kPromptLen = 4
kLengths = [6, 3, 7, 5, 2, 4, 7, 3]
kGroup = 4
kRewards = [1.0, 0.0, 0.5, 0.2, 0.3, 0.9, 0.1, 0.6]  # advantage signs + - + -, - + - +
kMaxCompletion = 8  # GRPOConfig.max_completion_length: Dr. GRPO's constant
kMicro = 4  # per_device_train_batch_size; gradient_accumulation_steps = 8 / 4 = 2

# log(logp / old) per sample: the clip bounds are log 0.8 = -0.223 and log 1.28 = +0.247 (epsilon 0.2, epsilon_high
# 0.28), the two-sided clip's delta log 1.5 = 0.405. Samples: 0 (A>0) clipped high; 1 (A<0) clipped low; 2 inside;
# 3 (A<0) ratio 2 (over delta: capped by the two-sided clip); 4 inside; 5 (A>0) below the range, unclipped;
# 6 inside; 7 (A>0) clipped high. Tokens alternate +-0.05 around the sample's value.
kDeltaBase = [0.55, -0.45, 0.10, 0.70, 0.10, -0.35, -0.10, 0.33]
kEpsilon, kEpsilonHigh, kTwoSided = 0.2, 0.28, 1.5
kBeta = 0.04
# log(old / rollout) per token for the importance-sampling correction, cycled over the completion tokens.
kIsPattern = [-0.3, 0.2, -0.9, 0.5, 0.0, -0.5, 0.9]
kIsCap, kIsMin, kIsMaskMax = 2.0, 0.5, 2.0


def case_list():
    """name -> settings. policy: 'on' (no old log-probs: TRL uses the current ones, detached) or 'off'."""
    cases = {}
    for loss in ["grpo", "bnpo", "dr_grpo", "dapo"]:
        for policy in ["on", "off"]:
            for beta in [0.0, kBeta]:
                name = f"{loss}_{policy}policy_beta{'0' if beta == 0 else '004'}"
                cases[name] = dict(loss_type=loss, policy=policy, beta=beta)
    cases["dapo_onpolicy_beta004_biaskl"] = dict(loss_type="dapo", policy="on", beta=kBeta, use_bias_correction_kl=True)
    cases["dapo_is_token_truncate"] = dict(loss_type="dapo", policy="off", beta=0.0, is_mode="token_truncate")
    cases["grpo_is_sequence_truncate"] = dict(loss_type="grpo", policy="off", beta=0.0, is_mode="sequence_truncate")
    cases["dapo_is_token_truncate_beta004"] = dict(loss_type="dapo", policy="off", beta=kBeta, is_mode="token_truncate")
    cases["dapo_is_token_mask"] = dict(loss_type="dapo", policy="off", beta=0.0, is_mode="token_mask")
    cases["dapo_is_sequence_mask"] = dict(loss_type="dapo", policy="off", beta=0.0, is_mode="sequence_mask")
    cases["gspo_offpolicy"] = dict(loss_type="grpo", policy="off", beta=0.0, importance_sampling_level="sequence")
    cases["luspo_offpolicy"] = dict(loss_type="luspo", policy="off", beta=0.0, importance_sampling_level="sequence")
    cases["dapo_offpolicy_delta"] = dict(loss_type="dapo", policy="off", beta=0.0, delta=kTwoSided)
    cases["dapo_offpolicy_beta004_t07"] = dict(loss_type="dapo", policy="off", beta=kBeta, temperature=0.7)
    cases["dapo_offpolicy_entropy"] = dict(loss_type="dapo", policy="off", beta=0.0, entropy_coef=0.01)
    for s in cases.values():
        s.setdefault("use_bias_correction_kl", False)
        s.setdefault("importance_sampling_level", "token")
        s.setdefault("temperature", 1.0)
        s.setdefault("delta", None)
        s.setdefault("entropy_coef", 0.0)
        s.setdefault("is_mode", None)
        # Dr. GRPO's paper drops the std normalisation; the others keep TRL's default.
        s["scale_rewards"] = "none" if s["loss_type"] == "dr_grpo" else "group"
    return cases


def make_tokenizer(vocab):
    words = {"<pad>": kPad, "<eos>": kEos, **{f"t{i}": i for i in range(2, vocab)}}
    tk = Tokenizer(models.WordLevel(words, unk_token="<pad>"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="<pad>", eos_token="<eos>")


def make_batch(vocab):
    gen = torch.Generator().manual_seed(kSeed + 1)
    prompts = torch.randint(2, vocab, (len(kRewards) // kGroup, kPromptLen), generator=gen)
    prompt_ids = prompts.repeat_interleave(kGroup, 0)
    C = max(kLengths)
    completion_ids = torch.full((len(kLengths), C), kPad, dtype=torch.int64)
    completion_mask = torch.zeros((len(kLengths), C), dtype=torch.int64)
    for i, n in enumerate(kLengths):
        completion_ids[i, :n] = torch.randint(2, vocab, (n,), generator=gen)
        completion_mask[i, :n] = 1
    return prompt_ids, completion_ids, completion_mask


def designed(mask):
    """delta (log ratio current/old), kappa (current - ref) and eps (old - rollout) per token, 0 on padding."""
    B, C = mask.shape
    delta, kappa, eps = torch.zeros(B, C), torch.zeros(B, C), torch.zeros(B, C)
    k = 0
    for i in range(B):
        for t in range(C):
            if not mask[i, t]:
                continue
            delta[i, t] = kDeltaBase[i] + (0.05 if t % 2 == 0 else -0.05)
            kappa[i, t] = 0.4 * math.sin(1.3 * k + 0.5)
            eps[i, t] = kIsPattern[k % len(kIsPattern)]
            k += 1
    return delta, kappa, eps


def check_margins(delta, eps, mask):
    """Every designed log-ratio keeps >= 0.02 from every bound it is compared with (in log space)."""
    m = mask.bool()
    bounds = [math.log(1 - kEpsilon), math.log(1 + kEpsilonHigh), math.log(kTwoSided)]
    for name, values, bs in [
        ("token log ratio", delta[m], bounds),
        ("sequence mean log ratio", (delta * mask).sum(1) / mask.sum(1), bounds),
        ("IS token log ratio", eps[m], [math.log(kIsCap), math.log(kIsMin), math.log(kIsMaskMax)]),
        ("IS sequence log ratio", (eps * mask).sum(1), [math.log(kIsCap), math.log(kIsMin), math.log(3.0)]),
    ]:
        gap = min(abs(v - b) for v in values.tolist() for b in bs)
        assert gap >= 0.02, f"{name}: a value is within {gap} of a bound"


def model_kwargs():
    return dict(dtype=torch.float32, attn_implementation="eager", experts_implementation="eager")


def build_trainer(model_dir, settings, rollout, tmp):
    cfg = GRPOConfig(
        output_dir=tmp,
        per_device_train_batch_size=kMicro,
        gradient_accumulation_steps=len(kLengths) // kMicro,
        num_generations=kGroup,
        max_completion_length=kMaxCompletion,
        # Off-policy: two iterations per generation make TRL compute the old log-probs (else it uses the current
        # ones, detached).
        num_iterations=2 if settings["policy"] == "off" else 1,
        loss_type=settings["loss_type"],
        beta=settings["beta"],
        epsilon=kEpsilon,
        epsilon_high=kEpsilonHigh,
        delta=settings["delta"],
        importance_sampling_level=settings["importance_sampling_level"],
        temperature=settings["temperature"],
        use_bias_correction_kl=settings["use_bias_correction_kl"],
        scale_rewards=settings["scale_rewards"],
        entropy_coef=settings["entropy_coef"],
        # TRL adds the MoE load-balancing loss whenever the config has `output_router_logits` (even false) and a
        # router_aux_loss_coef (Qwen3-MoE's 0.001); these goldens are of the policy loss alone (docs/rl.md).
        router_aux_loss_coef=0.0,
        vllm_importance_sampling_correction=settings["is_mode"] is not None,
        vllm_importance_sampling_mode=settings["is_mode"] or "sequence_mask",
        vllm_importance_sampling_clip_max={
            None: 3.0,
            "token_truncate": kIsCap,
            "sequence_truncate": kIsCap,
            "token_mask": kIsMaskMax,
            "sequence_mask": 3.0,
        }[settings["is_mode"]],
        vllm_importance_sampling_clip_min=kIsMin if settings["is_mode"] in ("token_mask", "sequence_mask") else None,
        report_to="none",
        use_cpu=True,
        bf16=False,
        fp16=False,
        seed=0,
        save_strategy="no",
        logging_steps=1,
        dataloader_num_workers=0,
    )
    model = Qwen3MoeForCausalLM.from_pretrained(model_dir, **model_kwargs())
    model.set_experts_implementation("eager")
    train = datasets.Dataset.from_dict({"prompt": ["a", "b"], "reward": [0.0, 0.0]})

    def fixed_reward(completions, reward, **kwargs):
        return list(reward)

    trainer = GRPOTrainer(
        model=model,
        reward_funcs=fixed_reward,
        args=cfg,
        train_dataset=train,
        processing_class=make_tokenizer(model.config.vocab_size),
        rollout_func=rollout,
    )
    if settings["is_mode"] is not None:
        # TRL applies its importance-sampling correction only with vLLM; generation is the rollout_func here.
        trainer.use_vllm = True
        trainer._last_loaded_step = trainer.state.global_step
    trainer.current_gradient_accumulation_steps = cfg.gradient_accumulation_steps
    trainer.model.train()
    return trainer


def run_case(model_dir, name, settings, batch, tmp):
    prompt_ids, completion_ids, completion_mask = batch
    state = {}

    def rollout(prompts, trainer):
        return {
            "prompt_ids": [r.tolist() for r in prompt_ids],
            "completion_ids": [r[: n].tolist() for r, n in zip(completion_ids, kLengths, strict=True)],
            "logprobs": [r[: n].tolist() for r, n in zip(state["rollout"], kLengths, strict=True)],
        }

    trainer = build_trainer(model_dir, settings, rollout, tmp)
    model = trainer.model
    input_ids = torch.cat([prompt_ids, completion_ids], 1)
    attention_mask = torch.cat([torch.ones_like(prompt_ids), completion_mask], 1)
    C = completion_ids.size(1)
    with torch.no_grad():
        current, _, _ = trainer._get_per_token_logps_and_entropies(model, input_ids, attention_mask, C)
    delta, kappa, eps = designed(completion_mask)
    on = settings["policy"] == "on"
    old = current if on else current - delta
    ref = current - kappa
    state["rollout"] = old - eps

    # TRL's call sites of the old and reference forwards get the designed log-probs.
    real = trainer._get_per_token_logps_and_entropies

    def designed_logps(m, *args, **kwargs):
        return (old if m is trainer.model else ref).clone(), None, None

    trainer._get_per_token_logps_and_entropies = designed_logps
    inputs = [{"prompt": f"p{i // kGroup}", "reward": r} for i, r in enumerate(kRewards)]
    gen = trainer._generate_and_score_completions(inputs)
    trainer._get_per_token_logps_and_entropies = real
    assert torch.equal(gen["completion_ids"], completion_ids) and torch.equal(gen["completion_mask"], completion_mask)
    assert on == ("old_per_token_logps" not in gen) or settings["is_mode"] is not None

    # One optimizer step: compute_loss + backward per micro-batch; the loss log-probs are captured.
    seen = []

    def capture(*args, **kwargs):
        out = real(*args, **kwargs)
        seen.append(out[0].detach().clone())
        return out

    trainer._get_per_token_logps_and_entropies = capture
    model.zero_grad(set_to_none=True)
    loss = 0.0
    for mb in split_tensor_dict(gen, len(kLengths) // kMicro):
        step_loss = trainer.compute_loss(model, mb)
        step_loss.backward()
        loss += step_loss.item()
    trainer._get_per_token_logps_and_entropies = real
    logps = torch.cat(seen, 0)

    out = {
        "advantages": gen["advantages"].float(),
        "num_items_in_batch": gen["num_items_in_batch"].reshape(1).float(),
        "logps": logps * completion_mask,
        "old_logps": (gen["old_per_token_logps"] if "old_per_token_logps" in gen else logps) * completion_mask,
        "loss": torch.tensor([loss], dtype=torch.float32),
    }
    if settings["beta"] != 0:
        out["ref_logps"] = gen["ref_per_token_logps"] * completion_mask
    if settings["is_mode"] is not None:
        out["rollout_logps"] = gen["sampling_per_token_logps"] * completion_mask
        out["is_ratio"] = gen["importance_sampling_ratio"].float()
    named = dict(model.named_parameters())
    grads = {k: p.grad if p.grad is not None else torch.zeros_like(p) for k, p in named.items()}
    disk_names = sorted(mg.read_safetensors(os.path.join(model_dir, "model.safetensors")))
    for k, v in mg.to_layout(grads, "disk", disk_names).items():
        out[f"grad.{k}"] = v.detach().float()
    for k, v in out.items():
        assert torch.isfinite(v).all(), f"{name}: {k} is not finite"
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="tests/assets/goldens/trl", help="output directory (replaced)")
    args = parser.parse_args()
    mg.setup_torch()
    shutil.rmtree(args.out, ignore_errors=True)
    os.makedirs(os.path.join(args.out, "cases"))
    print(f"trl {trl.__version__}, transformers {transformers.__version__}, torch {torch.__version__}, cpu fp32")

    torch.manual_seed(kSeed)
    model = mg.build_model("moe", kModel)
    mg.init_params(model, kSeed)
    model.save_pretrained(args.out)
    with open(os.path.join(args.out, "config.json")) as f:
        cfg_json = json.load(f)
    disk = mg.read_safetensors(os.path.join(args.out, "model.safetensors"))
    named = mg.params_by_name(model)
    mapped = mg.to_layout({k: v.detach() for k, v in named.items()}, "disk", sorted(disk))
    for k in disk:
        assert torch.equal(mapped[k], disk[k]), f"on-disk {k} does not match its parameter"

    prompt_ids, completion_ids, completion_mask = make_batch(cfg_json["vocab_size"])
    input_ids = torch.cat([prompt_ids, completion_ids], 1)
    labels = torch.cat([torch.full_like(prompt_ids, -100), completion_ids.masked_fill(completion_mask == 0, -100)], 1)
    with torch.no_grad():
        ref_logits, _, _, margin = mg.reference_forward(disk, cfg_json, input_ids, labels)
        hf_logits = model(input_ids=input_ids).logits
    ref_err = (ref_logits - hf_logits).abs().max().item()
    assert ref_err < 1e-4, f"reference maths disagrees with transformers: {ref_err}"
    assert margin >= mg.kMinRouterMargin, f"routing is near a tie ({margin}); pick another seed"
    rewards = torch.tensor(kRewards, dtype=torch.float32)
    mg.save_tensors(
        {
            "prompt_ids": prompt_ids,
            "completion_ids": completion_ids,
            "completion_mask": completion_mask,
            "rewards": rewards,
        },
        os.path.join(args.out, "batch.safetensors"),
    )
    delta, _, eps = designed(completion_mask)
    check_margins(delta, eps, completion_mask)

    cases = case_list()
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, settings in cases.items():
            out = run_case(args.out, name, settings, (prompt_ids, completion_ids, completion_mask), tmp)
            mg.save_tensors(out, os.path.join(args.out, "cases", f"{name}.safetensors"))
            gnorm = math.sqrt(sum(float(v.pow(2).sum()) for k, v in out.items() if k.startswith("grad.")))
            results[name] = {"loss": out["loss"].item(), "grad_norm": gnorm}
            print(f"{name:34s} loss={out['loss'].item():+.8f} grad_norm={gnorm:.6f}")

    meta = {
        "trl_version": trl.__version__,
        "transformers_version": transformers.__version__,
        "torch_version": torch.__version__,
        "safetensors_version": safetensors.__version__,
        "datasets_version": datasets.__version__,
        "seed": kSeed,
        "model": kModel,
        "min_router_topk_margin": margin,
        "reference_forward_max_abs_err": ref_err,
        "batch": {
            "prompt_len": kPromptLen,
            "lengths": kLengths,
            "group_size": kGroup,
            "rewards": kRewards,
            "per_device_train_batch_size": kMicro,
            "gradient_accumulation_steps": len(kLengths) // kMicro,
            "micro_batches": "rows [0, 4) and [4, 8), in order (TRL's split_tensor_dict, no shuffle)",
            "max_completion_length": kMaxCompletion,
            "pad_token_id": kPad,
        },
        "common": {"epsilon": kEpsilon, "epsilon_high": kEpsilonHigh, "is_cap": kIsCap, "is_min": kIsMin},
        "designed": {
            "old": "current - delta, delta = base[sample] +- 0.05 alternating over the tokens (off-policy); "
            "on-policy cases pass no old log-probs (TRL uses the current ones, detached)",
            "delta_base": kDeltaBase,
            "ref": "current - 0.4 sin(1.3 k + 0.5), k the completion token's index in the batch",
            "rollout": "old - eps, eps cycling over the batch's completion tokens",
            "eps_pattern": kIsPattern,
        },
        "case_keys": "advantages [8], num_items_in_batch [1], logps [8, C] (TRL's, in the loss's forward), "
        "old_logps [8, C], ref_logps (beta > 0), rollout_logps and is_ratio ([8, C] or [8, 1]; IS cases), "
        "loss [1] (sum over the micro-batches), grad.<on-disk name>",
        "cases": {name: {**cases[name], **results[name]} for name in cases},
    }
    with open(os.path.join(args.out, "meta.json"), "w") as f:
        json.dump(meta, f, indent=2, sort_keys=True)
        f.write("\n")


if __name__ == "__main__":
    main()
