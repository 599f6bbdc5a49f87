#!/usr/bin/env python3
"""The GRPO peer: TRL's GRPOTrainer against `moetrain grpo` on the same run, for learning and wall time.

Both sides start from the same checkpoint (a moetrain model directory, which is an HF Qwen3-MoE directory:
config.json + model.safetensors), train on the same prompt file (the addition task as token ids) with the same
reward (1 for exactly the answer digits then <eos>), group size, prompts per step, steps, learning rate and
warm-up, AdamW betas (0.9/0.95, no weight decay, clip 1.0), temperature, clip range (0.2/0.28), max new tokens,
KL coefficient and token-mean aggregation, and are scored by greedy exact match on the same held-out prompt file
before and after. One JSON line per run ({"side", "seed", "before", "after", "gain", "wall_s", ...}), then a
summary per side and the ratio of wall times.

Subcommands:
  make-prompts --out-dir DIR [--train 4000] [--eval 200] [--seed 1]
      DIR/train.jsonl and DIR/eval.jsonl in moetrain's prompt format, one problem a line:
      {"prompt_ids": [1, a.., 13, b.., 14], "answer": [digits of a+b reversed]} (ids of src/data/char_tokenizer.h).
      Operands as the built-in task draws them (digit count uniform in 1..3, then uniform among the numbers with
      that many digits; 1 digit includes 0). Eval problems are distinct pairs of moetrain's held-out bucket
      (src/data/synthetic.cpp is_eval_pair, ported below), train problems never are: the checkpoint never saw an
      eval pair in pre-training either.
  trl --model DIR --train F --eval F --seed S [run options]     one TRL run, one JSON line
  moetrain --model DIR --train F --eval F --seed S [run options] one `moetrain grpo` run, one JSON line
  compare --model DIR --train F --eval F --seeds 1,2,3 [run options]   both sides, every seed, then the summary
      (each run is a child process, one at a time).
  summarize FILE...   the summary of JSON lines written by earlier runs.
  first-step --model DIR --train F --seed S [--check-steps K] [run options]
      the update itself: moetrain runs K steps with a reward program (reward-log) that records its samples, TRL's
      _compute_loss, clip, AdamW and schedule replay them; per step the loss and grad norm of both, then the
      weights after step K against moetrain's checkpoint-K (one JSON line per step, one for the check).
  reward-log --out F  that reward program (exact match on token ids; JSON lines on stdin and stdout).

wall_s: the whole run on each side (torch/TRL import, model load, both evaluations, training; moetrain: its
process); train_s (TRL): trainer.train() alone. The one known difference in the update: TRL divides by the group's
std + 1e-4, moetrain by std + 1e-6 (grad norms differ by ~3e-4 relative).

Run options (defaults = the issue's run): --n 8 --prompts-per-step 16 --steps 100 --lr 2e-4 --warmup 5
--temperature 1.0 --beta 0 --max-new-tokens 8 --clip-low 0.2 --clip-high 0.28 --threads 0 (torch's default).

The LR schedule: moetrain ramps linearly over optimizer steps 1..W (step k at k/W of the LR), then holds. HF's
"constant_with_warmup" evaluates its ramp at the 0-based step (step 1 at LR 0, one step behind), so the TRL side
gets a LambdaLR with moetrain's ramp instead; everything else is a stock GRPOConfig field.
"""
import argparse
import json
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time

# src/data/char_tokenizer.h
PAD, BOS, EOS, FIRST_DIGIT = 0, 1, 2, 3
CHARS = "0123456789+= -*\n.,?"
PLUS, EQUALS = FIRST_DIGIT + CHARS.index("+"), FIRST_DIGIT + CHARS.index("=")
MASK64 = (1 << 64) - 1
SPLIT_SALT = 0x73706C69745F6576  # synthetic.cpp kSplitSalt


def mix64(x):
    """core/rng.h mix64 (splitmix64's output function of x + the golden ratio)."""
    x = (x + 0x9E3779B97F4A7C15) & MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK64
    return x ^ (x >> 31)


def is_eval_pair(a, b):
    """synthetic.cpp is_eval_pair: b's last digit is the one held out for (a, b / 10)."""
    return b % 10 == mix64((mix64(a ^ SPLIT_SALT) + b // 10) & MASK64) % 10


def sample_operand(rng, max_digits=3):
    k = rng.randint(1, max_digits)
    lo = 0 if k == 1 else 10 ** (k - 1)
    return rng.randrange(lo, 10**k)


def digit_ids(s):
    return [FIRST_DIGIT + int(c) for c in s]


def problem(a, b):
    return {"prompt_ids": [BOS] + digit_ids(str(a)) + [PLUS] + digit_ids(str(b)) + [EQUALS],
            "answer": digit_ids(str(a + b)[::-1])}


def make_prompts(a):
    rng = random.Random(a.seed)
    eval_pairs, train_pairs = [], []
    seen = set()
    while len(eval_pairs) < a.eval:
        p = (sample_operand(rng), sample_operand(rng))
        if is_eval_pair(*p) and p not in seen:
            seen.add(p)
            eval_pairs.append(p)
    while len(train_pairs) < a.train:
        p = (sample_operand(rng), sample_operand(rng))
        if not is_eval_pair(*p) and p not in seen:
            seen.add(p)
            train_pairs.append(p)
    os.makedirs(a.out_dir, exist_ok=True)
    for name, pairs in (("train", train_pairs), ("eval", eval_pairs)):
        with open(os.path.join(a.out_dir, f"{name}.jsonl"), "w") as f:
            for p in pairs:
                f.write(json.dumps(problem(*p)) + "\n")
    print(json.dumps({"made": a.out_dir, "train": len(train_pairs), "eval": len(eval_pairs), "seed": a.seed}))


def read_prompts(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


# ---------------------------------------------------------------------------------------------- TRL side
def char_tokenizer():
    """An HF fast tokenizer with CharTokenizer's ids: one token per character, <pad>/<bos>/<eos> special."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": PAD, "<bos>": BOS, "<eos>": EOS}
    vocab.update({c: FIRST_DIGIT + i for i, c in enumerate(CHARS)})
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>",
                                   padding_side="left")
    return fast


def prompt_text(ids):
    assert ids[0] == BOS, ids
    return "<bos>" + "".join(CHARS[i - FIRST_DIGIT] for i in ids[1:])


def greedy_exact(model, prompts, max_new_tokens):
    """Greedy responses to every prompt, the share (percent) whose ids are the answer then <eos>. Prompts are
    batched by length, so no row is padded."""
    import torch

    by_len = {}
    for p in prompts:
        by_len.setdefault(len(p["prompt_ids"]), []).append(p)
    right = 0
    model.eval()
    with torch.no_grad():
        for _, group in sorted(by_len.items()):
            ids = torch.tensor([p["prompt_ids"] for p in group])
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=max_new_tokens, eos_token_id=EOS, pad_token_id=PAD,
                                 bos_token_id=BOS)
            for p, row in zip(group, out[:, ids.size(1):].tolist()):
                right += row[:len(p["answer"]) + 1] == p["answer"] + [EOS]
    return 100.0 * right / len(prompts)


def trl_trainer(a, model, tok, train):
    """TRL's GRPOTrainer with the run's options (every stock GRPOConfig field but the LR ramp, see above)."""
    from datasets import Dataset
    from torch.optim.lr_scheduler import LambdaLR
    from trl import GRPOConfig, GRPOTrainer

    def exact_reward(completion_ids, answer, **_):
        return [1.0 if ids == ans + [EOS] else 0.0 for ids, ans in zip(completion_ids, answer)]

    ds = Dataset.from_list([{"prompt": prompt_text(p["prompt_ids"]), "answer": p["answer"]} for p in train])
    cfg = GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="peer_trl_"), use_cpu=True, bf16=False, fp16=False,
        gradient_checkpointing=False, seed=a.seed, data_seed=a.seed, max_steps=a.steps, logging_steps=1,
        save_strategy="no", report_to="none", disable_tqdm=True,
        num_generations=a.n, per_device_train_batch_size=a.n * a.prompts_per_step, gradient_accumulation_steps=1,
        steps_per_generation=1, num_iterations=1,
        learning_rate=a.lr, warmup_steps=a.warmup, adam_beta1=0.9, adam_beta2=0.95, adam_epsilon=1e-8,
        weight_decay=0.0, max_grad_norm=1.0,
        temperature=a.temperature, top_p=1.0, top_k=0, max_completion_length=a.max_new_tokens,
        epsilon=a.clip_low, epsilon_high=a.clip_high, beta=a.beta, loss_type="dapo", scale_rewards="group",
        mask_truncated_completions=False, router_aux_loss_coef=0.0,
    )

    class Trainer(GRPOTrainer):
        def create_scheduler(self, num_training_steps, optimizer=None):
            # moetrain's ramp: optimizer step k (1-based) at min(1, k / W) of the LR.
            w = max(1, a.warmup)
            self.lr_scheduler = LambdaLR(optimizer or self.optimizer, lambda s: min(1.0, (s + 1) / w))
            return self.lr_scheduler

    return Trainer(model=model, args=cfg, reward_funcs=exact_reward, train_dataset=ds, processing_class=tok)


def load_hf(a):
    import torch
    from transformers import Qwen3MoeForCausalLM

    if a.threads > 0:
        torch.set_num_threads(a.threads)
    model = Qwen3MoeForCausalLM.from_pretrained(a.model, dtype=torch.float32)
    # moetrain grpo's --aux-loss-coef defaults to 0 (router_aux_loss_coef=0.0 in the config); no router logits.
    model.config.output_router_logits = False
    return model


def run_trl(a):
    t_start = time.time()
    import torch
    import transformers
    import trl

    tok = char_tokenizer()
    train, held_out = read_prompts(a.train), read_prompts(a.eval)
    for p in train[:50] + held_out:
        enc = tok(text=prompt_text(p["prompt_ids"]))["input_ids"]
        assert enc == p["prompt_ids"], (prompt_text(p["prompt_ids"]), enc, p["prompt_ids"])
    model = load_hf(a)
    before = greedy_exact(model, held_out, a.max_new_tokens)
    trainer = trl_trainer(a, model, tok, train)
    t_train = time.time()
    trainer.train()
    train_s = time.time() - t_train
    after = greedy_exact(trainer.model, held_out, a.max_new_tokens)
    logs = [h for h in trainer.state.log_history if "loss" in h]
    first = {k: logs[0].get(k) for k in ("loss", "grad_norm", "reward", "reward_std", "learning_rate",
                                         "frac_reward_zero_std", "completions/mean_length")} if logs else {}
    rewards = [h.get("reward", 0.0) for h in logs]
    if a.log:
        with open(a.log, "w") as f:
            for h in trainer.state.log_history:
                f.write(json.dumps(h) + "\n")
    res = {"side": "trl", "seed": a.seed, "before": round(before, 2), "after": round(after, 2),
           "gain": round(after - before, 2), "wall_s": round(time.time() - t_start, 1), "train_s": round(train_s, 1),
           "steps": a.steps, "n": a.n, "prompts_per_step": a.prompts_per_step, "lr": a.lr, "warmup": a.warmup,
           "temperature": a.temperature, "beta": a.beta, "max_new_tokens": a.max_new_tokens,
           "clip": [a.clip_low, a.clip_high], "threads": torch.get_num_threads(), "model": a.model,
           "eval_prompts": len(held_out), "reward_first10": round(statistics.mean(rewards[:10]), 4) if rewards else None,
           "reward_last10": round(statistics.mean(rewards[-10:]), 4) if rewards else None, "first_step": first,
           "versions": {"trl": trl.__version__, "transformers": transformers.__version__, "torch": torch.__version__}}
    print(json.dumps(res), flush=True)
    return res


# ---------------------------------------------------------------------------------------------- first step
def reward_log(a):
    """A `moetrain grpo --reward program:` that scores exact match on token ids and records every sample."""
    with open(a.out, "a") as log:
        for line in sys.stdin:
            req = json.loads(line)
            ids = [json.loads(req[k]) if isinstance(req[k], str) else req[k] for k in ("prompt", "response")]
            reward = 1.0 if ids[1] == req["metadata"]["answer"] else 0.0
            log.write(json.dumps({"prompt_ids": ids[0], "response": ids[1], "reward": reward}) + "\n")
            log.flush()
            print(json.dumps({"reward": reward}), flush=True)


def first_step(a):
    """moetrain's first GRPO steps against TRL's on the same samples: moetrain runs --check-steps K steps with a
    reward program that records its samples; TRL's own _compute_loss then takes those samples step by step (its
    advantages, its token-mean "dapo" normaliser), backward, its clip, its AdamW and LR schedule. Each step's loss
    and grad norm are compared with moetrain's metrics.jsonl, the weights after step K with checkpoint-K. The
    replay is exact when the two updates are the same computation: GRPO at one epoch is on-policy, so TRL's ratio
    is 1 whatever policy drew the samples, and moetrain drew them from the weights TRL holds at that step."""
    import torch

    K = a.check_steps
    work = tempfile.mkdtemp(prefix="peer_first_step_")
    samples_path, run_dir = os.path.join(work, "samples.jsonl"), os.path.join(work, "run")
    prog = f"{sys.executable} {os.path.abspath(__file__)} reward-log --out {samples_path}"
    cmd = [a.moetrain, "grpo", "--model", a.model, "--prompts", a.train, "--reward", "program:" + prog,
           "--max-new-tokens", str(a.max_new_tokens), "--n", str(a.n), "--prompts-per-step", str(a.prompts_per_step),
           "--steps", str(a.steps), "--max-steps", str(K), "--lr", str(a.lr), "--warmup-steps", str(a.warmup),
           "--temperature", str(a.temperature), "--clip-low", str(a.clip_low), "--clip-high", str(a.clip_high),
           "--dynamic-sampling", "off", "--aggregation", "token-mean", "--seed", str(a.seed), "--run-dir", run_dir,
           "--reference", "off"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"moetrain grpo failed (rc {proc.returncode}):\n{' '.join(cmd)}\n{(proc.stdout + proc.stderr)[-4000:]}")
    ours = read_prompts(os.path.join(run_dir, "metrics.jsonl"))
    samples = read_prompts(samples_path)
    G, B = a.n, a.n * a.prompts_per_step
    assert len(samples) == B * K, (len(samples), B * K)
    for g in range(0, len(samples), G):
        assert all(s["prompt_ids"] == samples[g]["prompt_ids"] for s in samples[g:g + G]), "groups are not contiguous"

    tok = char_tokenizer()
    model = load_hf(a)
    start = {k: v.clone() for k, v in model.state_dict().items()}
    trainer = trl_trainer(a, model, tok, read_prompts(a.train)[:a.prompts_per_step])
    trainer.create_optimizer_and_scheduler(num_training_steps=a.steps)
    trainer.current_gradient_accumulation_steps = 1
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    steps = []
    for k in range(K):
        batch = samples[k * B:(k + 1) * B]
        # The batch as TRL's _generate_and_score_completions builds it: prompts left-padded, completions
        # right-padded, a completion = the response then <eos> when it stopped (moetrain hands the program the
        # response less the stop token; a response of max_new_tokens tokens was cut).
        completions = [s["response"] + ([EOS] if len(s["response"]) < a.max_new_tokens else []) for s in batch]
        P, C = max(len(s["prompt_ids"]) for s in batch), max(len(c) for c in completions)
        rewards = torch.tensor([s["reward"] for s in batch], dtype=torch.float32).view(-1, G)
        # TRL's group scaling (sum_then_normalize, scale_rewards "group"): (r - mean) / (unbiased std + 1e-4)
        adv = ((rewards - rewards.mean(1, keepdim=True)) / (rewards.std(1, keepdim=True) + 1e-4)).view(-1)
        completion_mask = torch.tensor([[1] * len(c) + [0] * (C - len(c)) for c in completions])
        inputs = {"prompt_ids": torch.tensor([[PAD] * (P - len(s["prompt_ids"])) + s["prompt_ids"] for s in batch]),
                  "prompt_mask": torch.tensor([[0] * (P - len(s["prompt_ids"])) + [1] * len(s["prompt_ids"])
                                               for s in batch]),
                  "completion_ids": torch.tensor([c + [PAD] * (C - len(c)) for c in completions]),
                  "completion_mask": completion_mask, "advantages": adv, "num_items_in_batch": completion_mask.sum()}
        trainer.optimizer.zero_grad(set_to_none=True)
        loss = trainer._compute_loss(model, inputs)
        loss.backward()
        grad_norm = float(torch.nn.utils.clip_grad_norm_(params, 1.0))
        lr = trainer.optimizer.param_groups[0]["lr"]
        trainer.optimizer.step()
        trainer.lr_scheduler.step()
        steps.append({"step": k + 1, "lr": [lr, ours[k]["lr"]], "reward": float(rewards.mean()),
                      "loss": [float(loss.detach()), ours[k]["loss"]], "grad_norm": [grad_norm, ours[k]["grad_norm"]]})
        print(json.dumps(steps[-1]), flush=True)

    after = load_hf(argparse.Namespace(model=os.path.join(run_dir, f"checkpoint-{K}"), threads=a.threads))
    theirs = model.state_dict()
    worst = {"name": None, "max_abs_diff": 0.0}
    diff2 = upd2 = 0.0
    for name, w in after.state_dict().items():
        d = (w - theirs[name]).abs()
        diff2 += float((d * d).sum())
        upd2 += float(((theirs[name] - start[name]) ** 2).sum())
        if float(d.max()) > worst["max_abs_diff"]:
            worst = {"name": name, "max_abs_diff": float(d.max())}
    # Relative to the value, floored at 1e-6: a loss of exact zero (all groups of equal length) comes out as +-1e-9.
    rel = lambda i: max(abs(s[i][0] - s[i][1]) / max(abs(s[i][1]), 1e-6) for s in steps)  # noqa: E731
    res = {"check": "first_steps", "model": a.model, "seed": a.seed, "steps": K, "samples_per_step": B,
           "max_rel_diff": {"loss": rel("loss"), "grad_norm": rel("grad_norm"), "lr": rel("lr")},
           "weights_after": {"rel_l2_diff_over_update": (diff2 / max(upd2, 1e-30)) ** 0.5, **worst},
           "run_dir": run_dir}
    print(json.dumps(res), flush=True)
    return res


# ---------------------------------------------------------------------------------------------- our side
SUMMARY_RE = re.compile(r"grpo: exact-match ([0-9.]+)% -> ([0-9.]+)% on (\d+) held-out prompts")


def run_moetrain(a):
    run_dir = a.run_dir or tempfile.mkdtemp(prefix="peer_moetrain_")
    cmd = [a.moetrain, "grpo", "--model", a.model, "--prompts", a.train, "--eval-prompts", a.eval,
           "--reward", "exact", "--max-new-tokens", str(a.max_new_tokens), "--n", str(a.n),
           "--prompts-per-step", str(a.prompts_per_step), "--steps", str(a.steps), "--lr", str(a.lr),
           "--warmup-steps", str(a.warmup), "--temperature", str(a.temperature), "--clip-low", str(a.clip_low),
           "--clip-high", str(a.clip_high), "--kl-coef", str(a.beta), "--dynamic-sampling", a.dynamic_sampling,
           "--aggregation", "token-mean", "--seed", str(a.seed), "--run-dir", run_dir]
    if a.beta == 0:
        cmd += ["--reference", "off"]
        cmd.remove("--kl-coef")
        cmd.remove(str(a.beta))
    t0 = time.time()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.time() - t0
    out = proc.stdout + proc.stderr
    if a.log:
        with open(a.log, "w") as f:
            f.write(" ".join(cmd) + "\n" + out)
    m = None
    for line in out.splitlines():
        m = SUMMARY_RE.search(line) or m
    if proc.returncode != 0 or not m:
        sys.exit(f"moetrain grpo failed (rc {proc.returncode}):\n{' '.join(cmd)}\n{out[-4000:]}")
    before, after = float(m.group(1)), float(m.group(2))
    metrics = []
    mpath = os.path.join(run_dir, "metrics.jsonl")
    if os.path.exists(mpath):
        metrics = read_prompts(mpath)
    rewards = [r.get("reward_mean", 0.0) for r in metrics]
    keys = ("loss", "grad_norm", "reward_mean", "reward_std", "lr", "groups_zero_variance", "advantage_std", "entropy")
    res = {"side": "moetrain", "dynamic_sampling": a.dynamic_sampling, "seed": a.seed, "before": before, "after": after, "gain": round(after - before, 2),
           "wall_s": round(wall, 1), "steps": a.steps, "n": a.n, "prompts_per_step": a.prompts_per_step, "lr": a.lr,
           "warmup": a.warmup, "temperature": a.temperature, "beta": a.beta, "max_new_tokens": a.max_new_tokens,
           "clip": [a.clip_low, a.clip_high], "model": a.model, "eval_prompts": int(m.group(3)),
           "reward_first10": round(statistics.mean(rewards[:10]), 4) if rewards else None,
           "reward_last10": round(statistics.mean(rewards[-10:]), 4) if rewards else None,
           "first_step": {k: metrics[0].get(k) for k in keys if k in metrics[0]} if metrics else {},
           "run_dir": run_dir, "command": " ".join(cmd)}
    print(json.dumps(res), flush=True)
    return res


# ---------------------------------------------------------------------------------------------- both
def summarize(results):
    lines = []
    sides = {}
    for r in results:
        sides.setdefault(r["side"], []).append(r)
    for side, rs in sides.items():
        gains = [r["gain"] for r in rs]
        lines.append({"summary": side, "seeds": [r["seed"] for r in rs], "gains": gains, "min": min(gains),
                      "median": statistics.median(gains), "mean": round(statistics.mean(gains), 2),
                      "max": max(gains), "mean_wall_s": round(statistics.mean(r["wall_s"] for r in rs), 1)})
    if "trl" in sides and "moetrain" in sides:
        t, m = lines[list(sides).index("trl")], lines[list(sides).index("moetrain")]
        lines.append({"summary": "ratio", "trl_wall_over_moetrain_wall": round(t["mean_wall_s"] / m["mean_wall_s"], 1),
                      "mean_gain_ok": m["mean"] >= t["mean"], "worst_seed_ok": m["min"] >= t["min"]})
    for line in lines:
        print(json.dumps(line), flush=True)
    return lines


RUN_OPTIONS = ["model", "train", "eval", "n", "prompts_per_step", "steps", "lr", "warmup", "temperature", "beta",
               "max_new_tokens", "clip_low", "clip_high", "threads", "moetrain", "dynamic_sampling"]


def compare(a):
    results = []
    for side in a.sides.split(","):
        for seed in [int(s) for s in a.seeds.split(",")]:
            cmd = [sys.executable, os.path.abspath(__file__), side, "--seed", str(seed)]
            for k in RUN_OPTIONS:
                cmd += ["--" + k.replace("_", "-"), str(getattr(a, k))]
            if a.log_dir:
                os.makedirs(a.log_dir, exist_ok=True)
                cmd += ["--log", os.path.join(a.log_dir, f"{side}-seed{seed}.log")]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            last = [l for l in proc.stdout.splitlines() if l.startswith("{")]
            if proc.returncode != 0 or not last:
                sys.exit(f"{side} seed {seed} failed (rc {proc.returncode}):\n{proc.stderr[-4000:]}")
            print(last[-1], flush=True)
            results.append(json.loads(last[-1]))
            if a.out:
                with open(a.out, "a") as f:
                    f.write(last[-1] + "\n")
    summarize(results)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    mp = sub.add_parser("make-prompts")
    mp.add_argument("--out-dir", required=True)
    mp.add_argument("--train", type=int, default=4000)
    mp.add_argument("--eval", type=int, default=200)
    mp.add_argument("--seed", type=int, default=1)
    rl = sub.add_parser("reward-log")
    rl.add_argument("--out", required=True)
    sm = sub.add_parser("summarize")
    sm.add_argument("files", nargs="+")
    for name in ("trl", "moetrain", "compare", "first-step"):
        p = sub.add_parser(name)
        p.add_argument("--model", required=True)
        p.add_argument("--train", required=True)
        p.add_argument("--eval", required=name != "first-step")
        p.add_argument("--n", type=int, default=8)
        p.add_argument("--prompts-per-step", type=int, default=16)
        p.add_argument("--steps", type=int, default=100)
        p.add_argument("--lr", type=float, default=2e-4)
        p.add_argument("--warmup", type=int, default=5)
        p.add_argument("--temperature", type=float, default=1.0)
        p.add_argument("--beta", type=float, default=0.0)
        p.add_argument("--max-new-tokens", type=int, default=8)
        p.add_argument("--clip-low", type=float, default=0.2)
        p.add_argument("--clip-high", type=float, default=0.28)
        p.add_argument("--threads", type=int, default=0, help="torch threads on the TRL side (0: torch's default)")
        p.add_argument("--dynamic-sampling", choices=["on", "off"], default="off",
                       help="moetrain's side: DAPO's dynamic sampling (TRL has none; off matches TRL's loop, on is "
                            "moetrain grpo's default)")
        p.add_argument("--moetrain", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "..",
                                                          "build-cpu", "moetrain"))
        if name == "compare":
            p.add_argument("--seeds", default="1,2,3")
            p.add_argument("--sides", default="trl,moetrain")
            p.add_argument("--log-dir", default="")
            p.add_argument("--out", default="", help="append every run's JSON line here")
        else:
            p.add_argument("--seed", type=int, default=1)
            p.add_argument("--log", default="", help="write the run's log (TRL: log_history; moetrain: its output)")
            p.add_argument("--run-dir", default="")
            p.add_argument("--check-steps", type=int, default=1, help="first-step: how many steps to replay")
    a = ap.parse_args()
    if a.cmd == "make-prompts":
        make_prompts(a)
    elif a.cmd == "trl":
        run_trl(a)
    elif a.cmd == "moetrain":
        run_moetrain(a)
    elif a.cmd == "compare":
        compare(a)
    elif a.cmd == "first-step":
        first_step(a)
    elif a.cmd == "reward-log":
        reward_log(a)
    else:
        summarize([json.loads(l) for f in a.files for l in open(f) if l.strip().startswith('{"side"')])


if __name__ == "__main__":
    main()
