// `moetrain grpo`'s options and their rules (grpo_args.h).
#include "cli/commands/grpo_args.h"

#include <algorithm>
#include <cstdio>

#include "core/cli_args.h"
#include "core/error.h"
#include "core/log.h"
#include "core/options.h"
#include "data/synthetic.h"
#include "model/lora.h"
#include "rl/env/builtin_envs.h"
#include "rl/policy_loss.h"

namespace mt {

using rl::FileReward;
using rl::addition::Reward;
using rl::addition::task_preset;

bool parse_grpo_args(const std::vector<std::string>& args, GrpoArgs& a, std::string* help) {
  // The fields by their short names, as the declarations and the rules below read them.
  auto& task_name = a.task_name;
  auto& preset = a.preset;
  auto& model_dir = a.model_dir;
  auto& run_dir = a.run_dir;
  auto& baseline = a.baseline;
  auto& reward_spec = a.reward_spec;
  auto& prompts_path = a.prompts_path;
  auto& eval_prompts_path = a.eval_prompts_path;
  auto& resume = a.resume;
  auto& steps = a.steps;
  auto& per_step = a.per_step;
  auto& eval_n = a.eval_n;
  auto& seed = a.seed;
  auto& warmup = a.warmup;
  auto& max_new_tokens = a.max_new_tokens;
  auto& min_lr = a.min_lr;
  auto& save_every = a.save_every;
  auto& keep_last = a.keep_last;
  auto& max_steps = a.max_steps;
  auto& mesh = a.mesh;
  auto& dev = a.dev;
  auto& sft_seconds = a.sft_seconds;
  auto& reward_timeout = a.reward_timeout;
  auto& comm_timeout_s = a.comm_timeout_s;
  auto& reward_stop = a.reward_stop;
  auto& deterministic = a.deterministic;
  auto& task = a.task;
  auto& use_reference = a.use_reference;
  auto& reward_kind = a.reward_kind;
  auto& advantage_given = a.advantage_given;
  auto& aggregation_name = a.aggregation_name;
  auto& process = a.process;
  auto& per_position = a.per_position;
  auto& ppo = a.ppo;
  auto& o = a.o;
  auto& device_name = a.device_name;
  auto& model_given = a.model_given;
  auto& task_flags = a.task_flags;
  auto& reward_given = a.reward_given;
  auto& from_file = a.from_file;
  auto& file_reward = a.file_reward;
  auto& program_cmd = a.program_cmd;
  // The built-in task's preset first: the options below override its values (and the help shows them).
  task_name = "sharpen";
  for (size_t i = 0; i < args.size(); ++i) {
    if (args[i] == "--task" && i + 1 < args.size()) task_name = args[i + 1];
    if (args[i].rfind("--task=", 0) == 0) task_name = args[i].substr(7);
  }
  preset = task_preset(task_name);
  reward_spec = preset.reward;
  steps = preset.steps;
  task.lo = preset.lo;
  task.hi = preset.hi;
  task.longest = preset.longest;
  process = preset.process;
  per_position = preset.per_position;
  o.sampling.temperature = preset.temperature;
  o.loss.clip_high = 0.28;
  o.progress_every_s = 10;
  const double critic_lr_default = o.critic_lr;

  cli::Options opt("grpo", "[--task sharpen|extend | --prompts FILE.jsonl] [options]",
                   "GRPO or PPO on a built-in task (a start made when absent, the task's recipe) or on a prompt "
                   "file;\nthe defaults shown are the task's (--task before --help shows another's). docs/rl.md has "
                   "the recipes and what they measured.");
  opt.group("task and data");
  opt.add("task", &task_name,
          "the built-in task and its recipe: sharpen, the demo's 1..3-digit addition from the demo stopped early "
          "(runs/grpo-start, trained when absent); extend, a fourth digit from the full demo (runs/demo)")
      .one_of({"sharpen", "extend"});
  opt.add("model", &model_dir, "start from this HF checkpoint instead of the task's start").var("DIR");
  opt.add("prompts", &prompts_path,
          "train on these prompts instead of the built-in task: lines with prompt_ids, prompt (text) or messages "
          "(chat), plus answer and any metadata (text needs DIR/tokenizer.json); drawn in shuffled epochs")
      .var("FILE.jsonl");
  opt.add("eval-prompts", &eval_prompts_path, "held-out prompts: the greedy reward before and after (with --prompts)")
      .var("FILE.jsonl");
  opt.custom(
         "max-new-tokens", cli::Kind::Int, "the response length limit with --prompts",
         [&](const std::string& v) { max_new_tokens = parse_flag_number<int64_t>("--max-new-tokens", v); },
         [] { return std::string("256"); })
      .at_least(1);
  opt.add("reward", &reward_spec,
          "built-in task: digits | prefix | exact (the share of answer positions right, of the answer right before "
          "the first mistake, or 1/0 for an exact answer; the advantages use it under --advantage outcome only, "
          "else it is a metric); "
          "--prompts: exact | math | program:\"CMD ARGS\" (JSON lines {prompt, response, metadata} in, a number or "
          "{\"reward\": x} out)");
  opt.add("reward-timeout", &reward_timeout, "a reward program's deadline per batch, seconds").above(0);
  opt.custom(
         "reward-on-error", cli::Kind::Text,
         "what a failed sample of a reward program does: zero (reward 0, logged) or stop",
         [&](const std::string& v) { reward_stop = v == "stop"; },
         [&] { return std::string(reward_stop ? "stop" : "zero"); })
      .one_of({"zero", "stop"});
  opt.add("min-digits", &task.lo, "built-in task: operands have min..max digits").at_least(1);
  opt.add("max-digits", &task.hi, "(the demo is trained on 1..3)").at_least(1).at_most(kMaxAdditionDigits);
  opt.add("longest", &task.longest, "built-in task: at least one operand has max digits");
  opt.add("eval-problems", &eval_n, "built-in task: held-out problems").at_least(1);

  opt.group("multi-turn environments");
  opt.add("env", &a.env_spec,
          "episodes of several turns against an environment, which gives the rewards: builtin:retry (a wrong answer "
          "is asked again: 1 right at once, 0.5 at the second try), builtin:calculator (a '?' answer calls a tool "
          "that shows the sum; from its own start, runs/calculator-start, made when absent, on 4-digit operands, "
          "150 steps unless told), both on the built-in task's problems; or program:\"CMD ARGS\" (a JSON-lines "
          "process, docs/rl.md \"Environments\") on --prompts")
      .var("builtin:NAME|program:CMD");
  opt.add("max-turns", &o.multi_turn.max_turns, "--env: model turns per episode").at_least(1);
  opt.add("max-turn-tokens", &o.multi_turn.max_turn_tokens,
          "--env: tokens per model turn (built-in environments: the answer's length)")
      .at_least(0)
      .says("0: the response limit only");
  opt.add("max-observation-tokens", &o.multi_turn.max_observation_tokens,
          "--env: tokens of one step's observations; a longer one is an environment error (built-in: 6 x "
          "max-digits + 8)")
      .at_least(1);
  opt.custom(
         "turn-credit", cli::Kind::Text,
         "--env: final, the episode's last reward for every turn's tokens; per-turn, each turn's tokens the sum "
         "of the rewards from that turn on, normalised over the group's turns; per-turn-index, the same sums "
         "normalised over the group's turns of the same index (a second try against the other second tries)",
         [&](const std::string& v) { o.multi_turn.credit = rl::parse_turn_credit(v); },
         [&] { return std::string(rl::turn_credit_name(o.multi_turn.credit)); })
      .one_of({"final", "per-turn", "per-turn-index"});

  opt.group("algorithm");
  opt.custom(
         "algorithm", cli::Kind::Text,
         "grpo, dr-grpo (no std division) or ppo (a critic: GAE advantages; its policy lr defaults to 1e-4)",
         [&](const std::string& v) {
           ppo = v == "ppo";  // the last one given runs
           o.normalize_std = v != "dr-grpo";
         },
         [&] {
           return std::string(ppo ? "ppo" : o.normalize_std ? "grpo" : "dr-grpo");
         })
      .one_of({"grpo", "dr-grpo", "ppo"});
  opt.custom(
         "advantage", cli::Kind::Text,
         "outcome: one reward per sample (GRPO); process: one per answer token (right digit: 1) with DeepSeekMath's "
         "process-supervised advantages; position: each token against the group's same position. Under ppo GAE "
         "gets the per-token rewards, or the sample's with outcome",
         [&](const std::string& v) {
           advantage_given = v;
           process = v != "outcome";
           per_position = v == "position";
         },
         [&] {
           return std::string(!process ? "outcome" : per_position ? "position" : "process");
         })
      .one_of({"outcome", "process", "position"});
  opt.custom(
         "loss", cli::Kind::Text, "the policy loss: PPO's clip, GSPO's sequence ratio, or plain policy gradient",
         [&](const std::string& v) { o.loss.kind = rl::parse_policy_loss(v); },
         [&] {
           return std::string(o.loss.kind == rl::PolicyLoss::Gspo             ? "gspo"
                              : o.loss.kind == rl::PolicyLoss::PolicyGradient ? "pg"
                                                                              : "ppo");
         })
      .one_of({"ppo", "gspo", "pg"});
  opt.add("n", &o.n, "samples per prompt (a group)").at_least(2);
  opt.add("prompts-per-step", &per_step, "groups per step").at_least(1);
  opt.add("steps", &steps, "RL steps").at_least(1);
  opt.add("temperature", &o.sampling.temperature, "sampling temperature; the trainer's log-probs use it too").above(0);
  opt.add("clip-low", &o.loss.clip_low, "the ratio's lower clip, 1 - eps").at_least(0).below(1);
  opt.add("clip-high", &o.loss.clip_high, "the ratio's upper clip, 1 + eps (clip-higher: above clip-low)").at_least(0);
  opt.add("dual-clip", &o.loss.dual_clip, "dual clip c > 1 for negative advantages").at_least(0).says("0: off");
  opt.add("kl-coef", &o.loss.kl_coef, "KL-to-reference loss weight").at_least(0);
  opt.custom(
         "kl-estimator", cli::Kind::Text, "the KL estimator of the loss term, the reward term and the metric",
         [&](const std::string& v) { o.loss.kl = rl::parse_kl_estimator(v); },
         [&] {
           return std::string(o.loss.kl == rl::KlEstimator::K1 ? "k1" : o.loss.kl == rl::KlEstimator::K2 ? "k2" : "k3");
         })
      .one_of({"k1", "k2", "k3"});
  opt.add("kl-reward-coef", &o.kl_reward_coef,
          "KL to the reference subtracted from the reward: -B k(old, ref) per token")
      .at_least(0);
  opt.add("reference", &use_reference,
          "keep a frozen copy of the initial policy (the KL metric, loss and reward term)");
  opt.add("entropy-coef", &o.loss.entropy_coef, "entropy bonus weight");
  opt.add("critic-lr", &o.critic_lr, "ppo: the critic's AdamW learning rate").above(0);
  opt.add("gamma", &o.gamma, "ppo: GAE's discount").at_least(0).at_most(1);
  opt.add("lam", &o.lam, "ppo: GAE's lambda").at_least(0).at_most(1);
  opt.add("value-clip", &o.value_clip, "ppo: the value loss's clip").at_least(0).says("0: off");

  opt.group("optimizer and schedule");
  opt.add("lr", &o.lr, "the policy's AdamW learning rate (ppo: 1e-4 unless given)").above(0);
  opt.add("warmup-steps", &warmup, "linear warm-up steps").at_least(0);
  opt.add("min-lr", &min_lr, "a cosine decay from --lr after the warm-up to this at the last step", "constant")
      .at_least(0);

  opt.group("update");
  opt.add("dynamic-sampling", &o.dynamic_sampling, "drop groups of equal rewards and draw more prompts to refill");
  opt.add("max-generate-rounds", &o.max_generate_rounds, "dynamic sampling's generate rounds per step at most")
      .at_least(1);
  opt.add("overlong-filter", &o.overlong_filter, "weight 0 for samples cut at the length limit");
  opt.add("overlong-penalty", &o.overlong_penalty,
          "DAPO's soft overlong penalty on the sample's reward (with "
          "--advantage outcome)")
      .at_least(0)
      .says("0: off");
  opt.add("overlong-buffer", &o.overlong_buffer, "the soft overlong penalty's buffer, tokens").at_least(0);
  opt.add("epochs", &o.epochs, "passes over the step's samples").at_least(1);
  opt.add("mini-batches", &o.mini_batches, "optimizer steps per epoch, each on whole groups").at_least(1);
  opt.add("micro-batch-samples", &o.micro_batch_samples, "samples per micro-batch (gradient accumulation)")
      .at_least(0)
      .says("0: one micro-batch");
  opt.add("recompute", &a.recompute, "the update's activation recompute per block (docs/model.md): memory for time")
      .one_of({"none", "full", "selective", "moe"});
  opt.add("old-logprob-forward", &o.old_logprob_forward,
          "a forward for the old log-probs even on-policy (off: one epoch of one mini-batch takes the update's own, "
          "detached; the same values)");
  opt.custom(
         "aggregation", cli::Kind::Text,
         "the loss's normaliser (default token-mean; seq-mean-token-mean under --loss gspo)",
         [&](const std::string& v) {
           aggregation_name = v;
           o.aggregation = rl::parse_loss_aggregation(v);
         },
         [&] { return aggregation_name.empty() ? std::string("token-mean") : aggregation_name; })
      .one_of({"token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "constant"});
  opt.add("aux-loss-coef", &o.aux_loss_coef, "MoE load-balancing loss in the update (needs output_router_logits)")
      .at_least(0);
  opt.add("router-z-loss-coef", &o.router_z_loss_coef, "router z-loss in the update").at_least(0);
  opt.add("freeze-router", &o.freeze_router, "keep the routers' weights fixed during RL");

  opt.group("rollout/trainer mismatch");
  opt.add("mismatch-every", &o.mismatch_every,
          "with routing replay, every N steps also measure the log-prob mismatch without it")
      .at_least(0)
      .says("0: never");
  opt.add("tis-cap", &o.mismatch.tis_cap, "truncated importance sampling of the rollout/trainer ratio, capped at C")
      .at_least(0)
      .says("0: off");
  opt.custom(
         "tis-level", cli::Kind::Text, "truncated importance sampling per token or per sequence",
         [&](const std::string& v) { o.mismatch.tis_sequence = v == "sequence"; },
         [&] { return std::string(o.mismatch.tis_sequence ? "sequence" : "token"); })
      .one_of({"token", "sequence"});
  for (const char* mask : {"token-mask", "seq-mask"}) {
    const bool tok = std::string(mask) == "token-mask";
    double& lo = tok ? o.mismatch.token_mask_low : o.mismatch.seq_mask_low;
    double& hi = tok ? o.mismatch.token_mask_high : o.mismatch.seq_mask_high;
    opt.custom(
           mask, cli::Kind::Text,
           tok ? "weight 0 for tokens whose ratio is outside the band"
               : "weight 0 for samples whose geometric-mean "
                 "ratio is outside the band",
           [&lo, &hi, mask](const std::string& v) {
             const std::string flag = std::string("--") + mask;
             const size_t comma = v.find(',');
             if (comma == std::string::npos) MT_THROW(flag, " '", v, "'; use LOW,HIGH (e.g. 0.5,2)");
             const double l = parse_flag_number<double>(flag, v.substr(0, comma)),
                          h = parse_flag_number<double>(flag, v.substr(comma + 1));
             if (!(l >= 0 && l < h))  // the loop reads HIGH <= 0 as "no mask"
               MT_THROW(flag, " '", v, "'; need 0 <= LOW < HIGH (e.g. 0.5,2)");
             lo = l;
             hi = h;
           },
           [] { return std::string("off"); })
        .var("LOW,HIGH");
  }

  opt.group("LoRA adapters");
  std::string lora_targets = kDefaultLoraTargets;
  opt.add("lora-rank", &a.lora.rank,
          "train low-rank adapters of this rank on the frozen initial model, which is then the reference too "
          "(docs/lora.md); checkpoints hold the adapters (a PEFT adapter directory) and their optimizer state")
      .at_least(0)
      .says("0: train every weight");
  opt.add("lora-alpha", &a.lora.alpha, "the adapters' scale is alpha / rank").at_least(0).says("0: 2 × rank");
  opt.add("lora-targets", &lora_targets,
          "what gets adapters: attn, mlp (dense layers), experts (each routed expert), router, or single names "
          "(q_proj, ..., experts.gate_up_proj)")
      .var("LIST");
  opt.rule([&] {
    if (a.lora.rank == 0) return;
    a.lora.targets = parse_lora_targets(lora_targets);
    if (ppo) MT_THROW("grpo: --lora-rank with --algorithm ppo: the critic has no LoRA form; use grpo or dr-grpo");
  });

  opt.group("comparison");
  opt.add("baseline", &baseline, "instead of GRPO, --sft-seconds of SFT on the task's problems").one_of({"sft"});
  opt.add("sft-seconds", &sft_seconds, "the baseline's wall time (that of the run it is compared with)").above(0);

  opt.group("run directory and checkpoints");
  opt.add("run-dir|out-dir", &run_dir, "checkpoints and metrics").var("DIR");
  opt.add("save-every", &save_every, "a checkpoint every N steps").at_least(0).says("0: only at the end");
  opt.add("keep-last", &keep_last, "keep the newest K checkpoints")
      .at_least(0)
      .says("0: all, those older than the newest two reduced to their weights");
  opt.add("max-steps", &max_steps, "stop after step N (<= --steps), saving, as train does")
      .at_least(0)
      .says("0: --steps");
  opt.add("resume", &resume,
          "continue from the newest checkpoint of the run dir whose manifest verifies, or from CKPT_DIR; the same "
          "options as the run that saved it")
      .var("[CKPT_DIR]")
      .bare_means("latest");
  opt.add("seed", &seed, "the run's seed (prompts, sampling)").at_least(0);

  cli::add_device_options(opt, dev);
  opt.add("deterministic", &deterministic,
          "CUDA: the training kernels without float atomics (docs/cuda.md; the sampler's top-p is not covered)");
  opt.add("true-on-policy", &a.true_on_policy,
          "batch-invariant kernels, so the rollout's log-probs equal the trainer's bit for bit (docs/rl.md; "
          "slower; needs --temperature 1)");
  cli::add_mesh_options(opt, mesh);
  opt.add("comm-timeout-s", &comm_timeout_s, "seconds before a stuck collective is an error naming it").at_least(1);
  if (!opt.parse(args)) {
    *help = opt.help();
    return false;
  }
  opt.check();
  device_name = dev.device;
  model_given = opt.given("model");
  for (const char* f : {"task", "min-digits", "max-digits", "longest", "eval-problems"})
    if (opt.given(f)) task_flags.push_back(str("--", f));
  reward_given = opt.given("reward");
  // Every check before any work.
  from_file = !prompts_path.empty();
  const bool env = !a.env_spec.empty();
  if (env) {
    if (a.env_spec.rfind("builtin:", 0) == 0) {
      a.env_builtin = a.env_spec.substr(8);
      const std::vector<std::string> names = rl::builtin_env_names();
      if (std::find(names.begin(), names.end(), a.env_builtin) == names.end())
        rl::make_builtin_env(a.env_builtin);  // its error names the value and the built-in environments
      if (from_file)
        MT_THROW("grpo: --env ", a.env_spec,
                 " draws the built-in task's addition problems; drop --prompts (or use "
                 "--env program:CMD with it)");
      // The calculator's own recipe (docs/rl.md): operands where a direct answer fails and the tool pays, from
      // its own start (rl::addition::ensure_calculator_start, made when absent), 150 steps.
      if (a.env_builtin == "calculator" && !opt.given("model")) {
        if (!opt.given("min-digits") && !opt.given("max-digits")) task.lo = task.hi = rl::addition::kCalculatorDigits;
        if (!opt.given("steps")) steps = rl::addition::kCalculatorSteps;
      }
    } else if (a.env_spec == "python") {
      if (!a.python_env)
        MT_THROW("grpo: --env python is the Python API's (moetrain.rl.GRPO(...).run(env=...)); on the command line "
                 "use builtin:NAME or program:CMD");
      if (!from_file) MT_THROW("grpo: an environment object runs on the prompts of a prompt file; give prompts=FILE");
    } else if (a.env_spec.rfind("program:", 0) == 0) {
      a.env_program = a.env_spec.substr(8);
      if (a.env_program.find_first_not_of(" \t") == std::string::npos)
        MT_THROW("grpo: --env program: needs a command, e.g. --env program:\"python3 env.py\"");
      if (!from_file) MT_THROW("grpo: --env ", a.env_spec, " runs on the prompts of --prompts FILE.jsonl; give them");
    } else {
      MT_THROW("grpo: --env '", a.env_spec, "' is unknown; use builtin:NAME (", rl::builtin_env_names().front(), ", ",
               rl::builtin_env_names().back(), ") or program:CMD");
    }
    if (opt.given("reward"))
      MT_THROW("grpo: --reward ", reward_spec, " with --env ", a.env_spec, ": the environment gives the rewards");
    if (ppo) MT_THROW("grpo: --env with --algorithm ppo is not supported; use grpo or dr-grpo");
    if (!advantage_given.empty() && advantage_given != "outcome")
      MT_THROW("grpo: --advantage ", advantage_given,
               " with --env: the advantages come from the environment's "
               "rewards (--turn-credit final, per-turn or per-turn-index)");
    if (!baseline.empty()) MT_THROW("grpo: --baseline sft compares single-turn runs; drop --env");
    process = per_position = false;
  } else {
    for (const char* f : {"max-turns", "max-turn-tokens", "max-observation-tokens", "turn-credit"})
      if (opt.given(f))
        MT_THROW("grpo: --", f, " sets a multi-turn episode; there is none without --env builtin:NAME or program:CMD");
  }
  // GSPO's objective is a mean over sequences (seq-mean-token-mean); the others' default is token-mean.
  if (aggregation_name.empty()) {
    aggregation_name = o.loss.kind == rl::PolicyLoss::Gspo ? "seq-mean-token-mean" : "token-mean";
    o.aggregation = rl::parse_loss_aggregation(aggregation_name);
  }
  // Under tp or sp a rank holds part of each sample's tokens, and GSPO's ratio is over the whole sample.
  if (o.loss.kind == rl::PolicyLoss::Gspo && (mesh.tp > 1 || mesh.sp > 1))
    MT_THROW("grpo: --loss gspo under --tp ", mesh.tp, " --sp ", mesh.sp,
             ": its sequence ratio needs each sample's tokens on one rank; use --dp-shard, --dp-replicate or --ep");
  if (min_lr && !(*min_lr >= 0 && *min_lr <= o.lr))
    MT_THROW("grpo: --min-lr ", *min_lr, "; need 0 <= min-lr <= --lr (", o.lr, ")");
  if (max_steps < 0 || max_steps > steps)
    MT_THROW("grpo: --max-steps ", max_steps, "; need 1..--steps (", steps, "), or 0 for --steps");
  if (task.lo < 1 || task.hi > kMaxAdditionDigits || task.lo > task.hi)
    MT_THROW("grpo: --min-digits ", task.lo, " and --max-digits ", task.hi,
             "; need 1 <= min <= max <= ", kMaxAdditionDigits);
  if (o.mini_batches > per_step)
    MT_THROW("grpo: --mini-batches ", o.mini_batches, " > --prompts-per-step ", per_step,
             "; a mini-batch holds whole groups");
  if (!baseline.empty() && !(sft_seconds > 0))
    MT_THROW("grpo: --baseline sft needs --sft-seconds S > 0 (the wall time of the run it is compared with)");
  if (baseline.empty() && sft_seconds != 0) MT_THROW("grpo: --sft-seconds ", sft_seconds, " without --baseline sft");
  if (!baseline.empty() && (!resume.empty() || save_every > 0 || max_steps > 0))
    MT_THROW("grpo: --baseline sft runs for a wall time; --resume, --save-every and --max-steps are for GRPO runs");
  if (o.loss.kl_coef > 0 && !use_reference)
    MT_THROW("grpo: --kl-coef ", o.loss.kl_coef, " needs the reference model; drop --reference off");
  if (o.kl_reward_coef > 0 && !use_reference)
    MT_THROW("grpo: --kl-reward-coef ", o.kl_reward_coef, " needs the reference model; drop --reference off");
  // PPO has no group baseline: a group of equal rewards still trains the critic and has GAE advantages.
  // PPO's policy takes smaller steps than GRPO's by default: its whitened GAE advantages carry the critic's
  // error too (measured: lr 2e-4 loses the reward the task starts with, 1e-4 gains; docs/rl.md).
  if (ppo && !opt.given("lr")) o.lr = kPpoLr;
  if (!ppo && (o.critic_lr != critic_lr_default || o.gamma != 1.0 || o.lam != rl::GrpoOptions{}.lam ||
               o.value_clip != rl::GrpoOptions{}.value_clip))
    MT_THROW(
        "grpo: --critic-lr, --gamma, --lam and --value-clip set the critic of --algorithm ppo; the algorithm "
        "here has none");
  if (ppo && !advantage_given.empty() && advantage_given != "outcome")
    MT_THROW("grpo: --advantage ", advantage_given,
             " is a group estimator; under --algorithm ppo the advantages are GAE's over the critic's values, on "
             "the per-token rewards (the default) or, with --advantage outcome, on the sample's reward at its last "
             "token");
  // The reward: the built-in task's kinds, or a prompt file's.
  if (from_file) {
    if (!task_flags.empty())
      MT_THROW("grpo: ", task_flags.front(), " sets the built-in addition task; with --prompts the prompts come from ",
               prompts_path);
    if (!baseline.empty()) MT_THROW("grpo: --baseline sft compares on the built-in task; drop --prompts");
    if (!reward_given) reward_spec = "exact";  // the task's reward is not a prompt file's
    if (env)
      file_reward = FileReward::Environment;  // the environment's steps give the rewards: no "answer" needed
    else if (reward_spec == "exact")
      file_reward = FileReward::Exact;
    else if (reward_spec == "math")
      file_reward = FileReward::Math;
    else if (reward_spec == "python") {
      if (!a.python_reward)
        MT_THROW("grpo: --reward python is the Python API's (moetrain.rl.GRPO(...).run(reward_fn=...)); on the "
                 "command line use exact, math or program:CMD");
      file_reward = FileReward::Program;
      program_cmd = "python";
    } else if (reward_spec.rfind("program:", 0) == 0) {
      file_reward = FileReward::Program;
      program_cmd = reward_spec.substr(8);
      if (program_cmd.find_first_not_of(" \t") == std::string::npos)
        MT_THROW("grpo: --reward program: needs a command, e.g. --reward program:\"python3 score.py\"");
    } else
      MT_THROW("grpo: --reward '", reward_spec, "' is unknown with --prompts; use exact, math or program:CMD");
    if (!advantage_given.empty() && advantage_given != "outcome")
      MT_THROW("grpo: --advantage ", advantage_given,
               " needs per-token rewards, which only the built-in task has; with --prompts use outcome");
    process = false;
    // 1.5 suits the built-in task's small model; a user's model samples at its usual temperature.
    if (!opt.given("temperature")) o.sampling.temperature = 1.0f;
    if (max_new_tokens == -1) max_new_tokens = 256;
    if (max_new_tokens < 1) MT_THROW("grpo: --max-new-tokens ", max_new_tokens, "; need >= 1");
  } else {
    if (!eval_prompts_path.empty()) MT_THROW("grpo: --eval-prompts needs --prompts (the training prompts)");
    if (max_new_tokens != -1)
      MT_THROW(
          "grpo: --max-new-tokens sets the response length of --prompts; the built-in task's comes from "
          "--max-digits");
    if (reward_spec.empty()) reward_spec = preset.reward;
    if (reward_spec == "digits")
      reward_kind = Reward::Digits;
    else if (reward_spec == "exact")
      reward_kind = Reward::Exact;
    else if (reward_spec == "prefix")
      reward_kind = Reward::Prefix;
    else if (reward_spec == "math" || reward_spec.rfind("program:", 0) == 0)
      MT_THROW("grpo: --reward ", reward_spec, " scores the responses to a prompt file; give it with --prompts FILE");
    else
      MT_THROW("grpo: --reward '", reward_spec, "' is unknown; use digits, prefix or exact");
  }
  o.max_new_tokens = from_file ? max_new_tokens : max_answer_tokens(task.hi);
  if (env && !from_file) {
    // The built-in environments: each turn an answer's length, each observation a problem or a tool's answer
    // (builtin_envs.h), the response room for every turn and observation.
    if (!opt.given("max-turn-tokens")) o.multi_turn.max_turn_tokens = max_answer_tokens(task.hi);
    if (!opt.given("max-observation-tokens")) o.multi_turn.max_observation_tokens = 6 * task.hi + 8;
    const int64_t turn = o.multi_turn.max_turn_tokens > 0 ? o.multi_turn.max_turn_tokens : max_answer_tokens(task.hi);
    o.max_new_tokens =
        o.multi_turn.max_turns * turn + (o.multi_turn.max_turns - 1) * o.multi_turn.max_observation_tokens;
  }
  if (env) {
    o.multi_turn.stop_on_error = reward_stop;
    o.env = nullptr;  // the command makes it (a process, or a built-in); the options are checked here
  }
  rl::validate(o);
  // The soft overlong penalty is added to the sample's reward; per-token rewards replace that reward in the
  // advantages (and in PPO's returns), so the penalty would only change the reward metrics.
  if (process && o.overlong_penalty > 0)
    MT_THROW("grpo: --overlong-penalty ", o.overlong_penalty, " shapes the sample's reward, which --advantage ",
             advantage_given.empty() ? "position (the task's default)" : advantage_given,
             " does not train on (its advantages come from the per-token rewards); add --advantage outcome or drop "
             "--overlong-penalty");
  // Options that refine another one: without it they would do nothing.
  auto refines = [&](const char* flag, bool applies, const std::string& why) {
    if (opt.given(flag) && !applies) MT_THROW("grpo: ", flag, " ", why);
  };
  for (const char* f : {"--reward-timeout", "--reward-on-error"})
    refines(f, (file_reward == FileReward::Program && from_file) || env,
            "sets the reward program's (or --env's) deadline or failure handling; there is neither without "
            "--prompts FILE --reward program:CMD or --env");
  refines("--tis-level", o.mismatch.tis_cap > 0,
          "chooses the level of truncated importance sampling, which is off without --tis-cap C");
  refines("--overlong-buffer", o.overlong_penalty > 0,
          "is the soft overlong penalty's buffer, which is off without --overlong-penalty F");
  refines("--max-generate-rounds", o.dynamic_sampling,
          "caps dynamic sampling's generate rounds, which --dynamic-sampling off turns off");
  refines("--kl-estimator", use_reference,
          "measures the KL to the reference model, which --reference off drops (no KL metric, loss or reward term)");
  for (const char* f : {"--clip-low", "--clip-high", "--dual-clip"})
    refines(f, o.loss.kind != rl::PolicyLoss::PolicyGradient,
            "clips the policy ratio; --loss pg has no ratio to clip (use --loss ppo or gspo, or drop it)");
  if (a.true_on_policy) {
    o.rollout_logprobs_exact = true;
    if (o.sampling.temperature != 1.0f)
      MT_THROW("grpo: --true-on-policy needs --temperature 1 (got ", o.sampling.temperature,
               "): the trainer divides the hidden state by T before the LM head and the sampler divides the logits, "
               "which round differently, so the log-probs could not be equal");
    // The rollout's log-probs are the trainer's: every ratio is 1, there is nothing for these to correct.
    if (o.mismatch.tis_cap > 0 || o.mismatch.token_mask_high > 0 || o.mismatch.seq_mask_high > 0) {
      log_info("grpo: --true-on-policy: the rollout's log-probs equal the trainer's bit for bit, so --tis-cap, "
               "--token-mask and --seq-mask have nothing to correct; they are off");
      o.mismatch.tis_cap = 0;
      o.mismatch.token_mask_high = o.mismatch.seq_mask_high = 0;
    }
  }
  if (!from_file && eval_n > max_eval_problems(task.hi))
    MT_THROW("grpo: --eval-problems ", eval_n, " > the ", max_eval_problems(task.hi), " held-out pairs of the task");
  return true;
}

}  // namespace mt
