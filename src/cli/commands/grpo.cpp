// moetrain grpo: GRPO (rl/grpo.h) on the built-in addition task or on the user's prompt files
// (docs/rl.md "moetrain grpo", "Prompt files"), with checkpoints a run can resume from exactly
// ("Checkpoints and resume").
//
// The built-in tasks (--task, rl/addition_task.h) each name a starting model, made when absent, and a recipe:
// sharpen (the default) the demo's own problems from the demo stopped early, with the standard recipe (an
// exact-answer reward, GRPO's outcome advantages); extend a fourth digit from the full demo, each answer
// token rewarded and credited against the group's samples at the same position. Both evaluate greedy exact
// match on held-out problems before and after and end with `grpo: exact-match <before>% -> <after>% on <n>
// held-out problems`. `--baseline sft` spends the same wall time on supervised fine-tuning instead (the right
// answers of problems from the same distribution, cross-entropy through the same train_step): the
// comparison the docs quote.
//
// `--prompts FILE.jsonl` trains on the user's prompts instead (rl/prompt_file.h; rollout/prompts.h reads them:
// prompt_ids, prompt or messages, plus answer and free metadata), drawn by a seeded sampler in shuffled epochs, with an
// exact-match, math or external-program reward (rl/rewards.h) on the decoded responses; with
// `--eval-prompts` it ends `grpo: <reward> <before> -> <after> on <n> held-out prompts`.
//
// Checkpoints (train/checkpoint.h): RUN_DIR/checkpoint-N holds the HF weights, the policy's f32 masters
// and AdamW moments, the critic's (PPO) in critic/, and train_state.json (step, optimizer counters, the
// prompt sampler's position or the task's draw count, the reference model's directory and fingerprint,
// the evaluation before training), under a manifest; `--resume` continues from the newest one that
// verifies, and on the CPU equals the run that never stopped, bit for bit. Every option (declared once:
// cli/options.h) and every prompt is checked before any work starts; under `moetrain launch` every rank runs it.
#include "rl/grpo.h"

#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>

#include "cli/commands.h"
#include "cli/common_options.h"
#include "cli/options.h"
#include "comm/dist_env.h"
#include "core/cli_args.h"
#include "core/determinism.h"
#include "core/error.h"
#include "core/interrupt.h"
#include "core/log.h"
#include "data/char_tokenizer.h"
#include "data/synthetic.h"
#include "data/tokenizer.h"
#include "io/manifest.h"
#include "model/hf_checkpoint.h"
#include "ops/threads.h"
#include "rl/addition_task.h"
#include "rl/prompt_file.h"
#include "rl/rewards.h"
#include "rollout/prompts.h"
#include "train/checkpoint.h"
#include "train/metrics.h"
#include "train/session.h"
#include "train/trainer.h"

namespace mt {

namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;
using rl::RewardProgram;
using rl::RewardProgramOptions;

// PPO's policy takes smaller steps than GRPO's by default: its whitened GAE advantages carry the critic's
// error too (docs/rl.md "PPO with a critic").
constexpr double kPpoLr = 1e-4;
using rl::FileReward;
using rl::FileRewarder;
using rl::PromptFile;
using rl::PromptSampler;
using rl::addition::answer_reward;
using rl::addition::answer_token_rewards;
using rl::addition::ensure_task_start;
using rl::addition::exact_match;
using rl::addition::ids32;
using rl::addition::kDemoModel;
using rl::addition::Reward;
using rl::addition::sft_batch;
using rl::addition::Task;
using rl::addition::task_preset;
using rl::addition::TaskPreset;

// ---- Checkpoints ---------------------------------------------------------------------------------

// The reference model's files as they were: name, size and modification time of every regular file in
// its directory (cheap at any model size; a file rewritten in place changes its mtime).
json model_fingerprint(const std::string& dir) {
  json files = json::array();
  std::vector<fs::path> paths;
  std::error_code ec;
  for (auto it = fs::directory_iterator(dir, ec); !ec && it != fs::directory_iterator(); it.increment(ec))
    if (it->is_regular_file()) paths.push_back(it->path());
  if (ec) MT_THROW("grpo: cannot list the model directory ", dir, ": ", ec.message());
  std::sort(paths.begin(), paths.end());
  for (const fs::path& p : paths) {
    struct stat sb {};
    if (::stat(p.c_str(), &sb) != 0) MT_THROW("grpo: cannot stat ", p.string(), ": ", std::strerror(errno));
    files.push_back({{"name", p.filename().string()},
                     {"size", int64_t(sb.st_size)},
                     {"mtime_ns", int64_t(sb.st_mtim.tv_sec) * 1000000000 + int64_t(sb.st_mtim.tv_nsec)}});
  }
  return files;
}

// "" when `now` equals `saved`, else what changed (the first difference).
std::string fingerprint_change(const json& saved, const json& now) {
  std::map<std::string, json> a, b;
  for (const json& e : saved) a[e.at("name").get<std::string>()] = e;
  for (const json& e : now) b[e.at("name").get<std::string>()] = e;
  for (const auto& [name, e] : a) {
    auto it = b.find(name);
    if (it == b.end()) return name + " is gone";
    if (it->second.at("size") != e.at("size"))
      return str(name, " has ", it->second.at("size").get<int64_t>(), " bytes, it had ", e.at("size").get<int64_t>());
    if (it->second.at("mtime_ns") != e.at("mtime_ns")) return name + " was modified (its mtime changed)";
  }
  for (const auto& [name, e] : b)
    if (!a.count(name)) return name + " is new";
  return "";
}

// The command line a checkpoint records (less the options that may change between a save and its resume:
// the layout too, since the state is resharded on resume).
json recorded_args(const std::vector<std::string>& args) {
  static const std::set<std::string> kFree = {"--max-steps", "--save-every", "--keep-last",     "--device",
                                              "--threads",   "--dp-shard",   "--dp-replicate",  "--ep",
                                              "--tp",        "--sp",         "--comm-timeout-s"};
  json out = json::array();
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& a = args[i];
    const bool inline_value = a.find('=') != std::string::npos;  // --key=value: one argument
    const std::string key = a.substr(0, a.find('='));
    if (kFree.count(key)) {
      if (!inline_value) ++i;
      continue;
    }
    if (key == "--resume") {
      if (!inline_value && i + 1 < args.size() && args[i + 1].rfind("--", 0) != 0) ++i;
      continue;
    }
    out.push_back(a);
  }
  return out;
}

}  // namespace

int grpo_main(const std::vector<std::string>& args) {
  // The built-in task's preset first: the options below override its values (and the help shows them).
  std::string task_name = "sharpen";
  for (size_t i = 0; i < args.size(); ++i) {
    if (args[i] == "--task" && i + 1 < args.size()) task_name = args[i + 1];
    if (args[i].rfind("--task=", 0) == 0) task_name = args[i].substr(7);
  }
  const TaskPreset preset = task_preset(task_name);
  std::string model_dir, run_dir = "runs/grpo", baseline, reward_spec = preset.reward;
  std::string prompts_path, eval_prompts_path, resume;
  int64_t steps = preset.steps, per_step = 16, eval_n = 200, seed = cli::kDefaultSeed, warmup = 5, max_new_tokens = -1;
  std::optional<double> min_lr;  // --min-lr: a cosine decay to it; unset: constant after the warm-up
  int64_t save_every = 0, keep_last = 2, max_steps = 0;
  MeshSpec mesh;  // under moetrain launch
  cli::DeviceOptions dev;
  double sft_seconds = 0, reward_timeout = 60, comm_timeout_s = 300;
  bool reward_stop = false, deterministic = false;
  Task task;
  task.lo = preset.lo;
  task.hi = preset.hi;
  task.longest = preset.longest;
  bool use_reference = true;
  Reward reward_kind = Reward::Digits;
  std::string advantage_given;
  std::string aggregation_name;  // --aggregation as given ("": the loss's own, below)
  bool process = preset.process, per_position = preset.per_position;
  bool ppo = false;
  rl::GrpoOptions o;
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
  cli::add_mesh_options(opt, mesh);
  opt.add("comm-timeout-s", &comm_timeout_s, "seconds before a stuck collective is an error naming it").at_least(1);
  if (!opt.parse(args)) {
    std::printf("%s", opt.help().c_str());
    return 0;
  }
  opt.check();
  install_stop_signals();
  const std::string device_name = dev.device;
  const bool model_given = opt.given("model");
  if (deterministic) set_deterministic(true);
  if (dev.threads > 0) ops::set_cpu_threads(int(dev.threads));
  std::vector<std::string> task_flags;  // built-in task options given (refused with --prompts)
  for (const char* f : {"task", "min-digits", "max-digits", "longest", "eval-problems"})
    if (opt.given(f)) task_flags.push_back(str("--", f));
  const bool reward_given = opt.given("reward");
  // Every check before any work.
  const bool from_file = !prompts_path.empty();
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
  FileReward file_reward = FileReward::Exact;
  std::string program_cmd;
  if (from_file) {
    if (!task_flags.empty())
      MT_THROW("grpo: ", task_flags.front(), " sets the built-in addition task; with --prompts the prompts come from ",
               prompts_path);
    if (!baseline.empty()) MT_THROW("grpo: --baseline sft compares on the built-in task; drop --prompts");
    if (!reward_given) reward_spec = "exact";  // the task's reward is not a prompt file's
    if (reward_spec == "exact")
      file_reward = FileReward::Exact;
    else if (reward_spec == "math")
      file_reward = FileReward::Math;
    else if (reward_spec.rfind("program:", 0) == 0) {
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
    refines(f, file_reward == FileReward::Program && from_file,
            "sets the reward program's deadline or failure handling; there is no program without --prompts FILE "
            "--reward program:CMD");
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
  if (!from_file && eval_n > max_eval_problems(task.hi))
    MT_THROW("grpo: --eval-problems ", eval_n, " > the ", max_eval_problems(task.hi), " held-out pairs of the task");
  const Device device = resolve_device(device_name);

  // Resume: the newest checkpoint of the run dir that verifies (train/checkpoint.h).
  std::string resume_dir;
  json state;
  if (!resume.empty()) {
    const ResumePoint rp = find_resume_checkpoint(run_dir, resume);
    for (const std::string& r : rp.rejected) log_info("resume: not using ", r);
    if (rp.dir.empty() && !rp.rejected.empty()) {
      std::string all;
      for (const std::string& r : rp.rejected) all += "; " + r;
      MT_THROW("grpo: resume: no checkpoint in ", run_dir, " can be resumed from", all,
               " (remove them or drop --resume to start over)");
    }
    if (rp.dir.empty())
      log_info("grpo: resume: no checkpoint in ", run_dir, " yet; starting from step 0");
    else {
      resume_dir = rp.dir;
      state = read_train_state(resume_dir);
      if (state.value("format", std::string()) != "moetrain-grpo-state-1")
        MT_THROW("grpo: resume: ", resume_dir, " holds a '", state.value("format", std::string("?")),
                 "' state, not a grpo run's (moetrain-grpo-state-1)");
      const std::string saved_model = state.at("model_dir").get<std::string>();
      if (!model_given)
        model_dir = saved_model;
      else if (fs::weakly_canonical(model_dir) != fs::weakly_canonical(saved_model))
        MT_THROW("grpo: resume: --model ", model_dir, ", but the run being resumed started from ", saved_model,
                 " (its reference model); drop --model or give that directory");
      if (state.at("mode").get<std::string>() != (from_file ? "prompts" : "task"))
        MT_THROW("grpo: resume: ", resume_dir, " is a ",
                 state.at("mode").get<std::string>() == "prompts" ? "run on --prompts; give the same --prompts"
                                                                  : "run on the built-in task; drop --prompts");
      if (state.contains("critic") != ppo)
        MT_THROW("grpo: resume: ", resume_dir,
                 ppo ? " has no critic: it was not an --algorithm ppo run"
                     : " holds a critic: resume it with --algorithm ppo");
      // --model is checked above on its own (a resume may leave it out): the other options are compared.
      auto without_model = [](json a) {
        for (size_t k = 0; k + 1 < a.size(); ++k)
          if (a[k] == "--model") a.erase(a.begin() + std::ptrdiff_t(k), a.begin() + std::ptrdiff_t(k) + 2);
        return a;
      };
      if (without_model(state.value("args", json::array())) != without_model(recorded_args(args)))
        log_info("grpo: resume: warning: the options differ from the saved run's (", state["args"].dump(), " -> ",
                 recorded_args(args).dump(), ")");
    }
  }
  const bool resuming = !resume_dir.empty();
  const int64_t start_step = resuming ? state.at("step").get<int64_t>() : 0;
  const int64_t stop = max_steps > 0 ? max_steps : steps;
  if (start_step >= stop)
    MT_THROW("grpo: resume: checkpoint ", resume_dir, " is at step ", start_step,
             ", which is not before the end of this run (", max_steps > 0 ? "--max-steps " : "--steps ", stop,
             "); raise --steps or --max-steps");

  if (model_dir.empty()) {
    model_dir = from_file ? std::string(kDemoModel) : ensure_task_start(preset, device_name);
  }
  if (!fs::exists(model_dir + "/config.json")) MT_THROW("grpo: --model ", model_dir, " has no config.json");
  // The reference is the frozen initial model: a resumed run reads it again and it must be unchanged.
  const json fingerprint = resuming ? state.at("model_fingerprint") : model_fingerprint(model_dir);
  if (resuming) {
    const std::string why = fingerprint_change(fingerprint, model_fingerprint(model_dir));
    if (!why.empty())
      MT_THROW("grpo: resume: the initial model ", model_dir, " changed since the run started (", why,
               "); it is the reference and the start of the run, so it must stay as it was");
  }
  const ModelConfig cfg = load_model_config(model_dir);
  if (o.aux_loss_coef > 0 && !cfg.output_router_logits)
    MT_THROW("grpo: --aux-loss-coef ", o.aux_loss_coef, " needs the load-balancing loss, which ", model_dir,
             "/config.json turns off (output_router_logits false); set it true there or drop the option");
  if (cfg.num_sparse_layers() == 0 && (o.freeze_router || o.router_z_loss_coef > 0))
    MT_THROW("grpo: ",
             o.freeze_router ? std::string("--freeze-router on") : str("--router-z-loss-coef ", o.router_z_loss_coef),
             ": ", model_dir, " has no MoE layers, so no routers (num_experts ", cfg.num_experts, "); drop it");
  if (!from_file && cfg.vocab_size < CharTokenizer().vocab_size())
    MT_THROW("grpo: ", model_dir, " has a vocabulary of ", cfg.vocab_size, "; the addition task's tokenizer needs ",
             CharTokenizer().vocab_size());
  // Prompt files, their answers and the reward program: checked before any weight is read.
  std::optional<Tokenizer> tokenizer;
  const std::string tokenizer_path = model_dir + "/tokenizer.json";
  PromptFile train_file, eval_file;
  std::unique_ptr<RewardProgram> program;
  FileRewarder rewarder;
  if (from_file) {
    if (fs::exists(tokenizer_path)) tokenizer = Tokenizer::from_file(tokenizer_path);
    const Tokenizer* tok = tokenizer ? &*tokenizer : nullptr;
    if (!tok && file_reward == FileReward::Math)
      MT_THROW("grpo: --reward math reads the response's text, and ", model_dir,
               " has no tokenizer.json to decode it; add the tokenizer or use exact (token ids)");
    train_file = load_prompt_file(prompts_path, cfg, o.max_new_tokens, tok, file_reward);
    if (resuming && state.contains("prompts") &&
        state["prompts"].value("count", int64_t(-1)) != int64_t(train_file.prompts.size()))
      log_info("grpo: resume: warning: ", prompts_path, " has ", train_file.prompts.size(),
               " prompts, the saved run's file had ", state["prompts"].value("count", int64_t(-1)),
               ": the sampler's order from here differs from the run that stopped");
    if (!eval_prompts_path.empty())
      eval_file = load_prompt_file(eval_prompts_path, cfg, o.max_new_tokens, tok, file_reward);
    if (file_reward == FileReward::Program) {
      RewardProgramOptions po;
      po.command = program_cmd;
      po.timeout_s = reward_timeout;
      po.stop_on_error = reward_stop;
      program = std::make_unique<RewardProgram>(po);  // an error naming a missing or non-executable program
    }
    rewarder.kind = file_reward;
    rewarder.tok = tok;
    rewarder.program = program.get();
    // Stops: the model's EOS (the engine's own), and the chat template's ends when the tokenizer has them.
    if (tok)
      for (const char* s : {"<|im_end|>", "<|endoftext|>"}) {
        const int64_t id = tok->token_to_id(s);
        if (id >= 0 && id < cfg.vocab_size && id != cfg.eos_token_id) o.stop_token_ids.push_back(int32_t(id));
      }
    log_info("grpo: ", train_file.prompts.size(), " prompts from ", prompts_path,
             eval_file.prompts.empty() ? std::string()
                                       : str(", ", eval_file.prompts.size(), " held-out from ", eval_prompts_path),
             "; reward ",
             file_reward == FileReward::Exact  ? (tok ? "exact match (text)" : "exact match (token ids)")
             : file_reward == FileReward::Math ? "math"
                                               : "program: " + program_cmd,
             tok ? "; tokenizer " + tokenizer_path : std::string("; no tokenizer"));
  }

  SessionOptions so;
  so.device = device;
  so.dist.mesh = mesh;
  so.dist.comm.timeout = std::chrono::milliseconds(int64_t(comm_timeout_s * 1000));
  TrainSession session(cfg, so);
  DistContext& dist = session.dist();
  const bool lead = dist.rank() == 0;
  if (per_step % dist.dp_size() != 0)
    MT_THROW("grpo: --prompts-per-step ", per_step, " cannot be split evenly over ", dist.dp_size(),
             " data-parallel ranks (dp_replicate x dp_shard); use a multiple of ", dist.dp_size());
  // The reference and the critic run on the policy's distributed context, laid out like it.
  so.shared_dist = &dist;
  AdamWConfig ac;
  ac.weight_decay = 0;
  // load reads the model's routing bias too; a resume takes it from the initial model (frozen in grpo;
  // the fingerprint holds its file unchanged).
  if (!resuming)
    session.load(model_dir);
  else
    session.load_router_bias(model_dir);
  session.make_optimizer(ac, false);
  std::unique_ptr<TrainSession> reference;
  if (use_reference && baseline.empty()) {
    SessionOptions ro = so;
    ro.weights = Weights::Frozen;
    reference = std::make_unique<TrainSession>(cfg, ro);
    reference->load(model_dir);
  }
  // PPO's critic: the policy's architecture with a scalar head (score.weight [1, D], zero) on the same body.
  std::unique_ptr<TrainSession> critic;
  if (ppo && baseline.empty()) {
    ModelConfig cc = cfg;
    cc.value_head = true;
    cc.tie_word_embeddings = false;  // its own copy of the embedding
    critic = std::make_unique<TrainSession>(cc, so);
    critic->make_optimizer(ac, false);
    if (!resuming) {
      critic->init_weights(uint64_t(seed));
      rl::init_critic_from_policy(*critic, session);
    }
    critic->load_router_bias(model_dir);  // the policy's body routes as the policy does
  }
  if (resuming) {
    // The policy's masters and moments, the critic's, the counters: the state the run stopped with.
    const auto t = std::chrono::steady_clock::now();
    AdamW& opt = session.optimizer();
    load_train_state_shards(resume_dir, session.table().total(), session.parallel().pieces(session.table()),
                            session.master(), opt.exp_avg(), opt.exp_avg_sq());
    session.refresh_compute_weights();
    opt.set_state(state.at("optimizer_steps").get<int64_t>(), state.at("skipped_steps").get<int64_t>());
    session.set_steps_done(state.value("session_steps", start_step));
    if (critic) {
      const json& cs = state.at("critic");
      const std::string cdir = (fs::path(resume_dir) / cs.at("dir").get<std::string>()).string();
      AdamW& copt = critic->optimizer();
      load_train_state_shards(cdir, critic->table().total(), critic->parallel().pieces(critic->table()),
                              critic->master(), copt.exp_avg(), copt.exp_avg_sq());
      critic->refresh_compute_weights();
      copt.set_state(cs.at("optimizer_steps").get<int64_t>(), cs.at("skipped_steps").get<int64_t>());
      critic->set_steps_done(cs.value("session_steps", start_step));
    }
    log_info("grpo: resume: step ", start_step, " from ", resume_dir, "; policy", critic ? " and critic" : "",
             " weights, AdamW moments and counters, ",
             from_file ? str("prompt sampler position ", state.at("prompt_position").get<int64_t>())
                       : str(state.at("problems_drawn").get<int64_t>(), " task problems drawn"),
             " restored in ", std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count(), " s");
  }

  // The KV cache: what the larger of a step's rollouts and the evaluation can hold.
  int64_t longest_prompt = max_problem_tokens(task.hi), eval_count = eval_n;
  if (from_file) {
    longest_prompt = 1;
    for (const PromptFile* f : {&train_file, &eval_file})
      for (const Prompt& p : f->prompts) longest_prompt = std::max<int64_t>(longest_prompt, int64_t(p.ids.size()));
    eval_count = std::max<int64_t>(1, std::min<int64_t>(int64_t(eval_file.prompts.size()), 256));
  }
  GenerateRequest sizing;
  sizing.prompt.assign(size_t(longest_prompt), 0);
  sizing.max_new_tokens = o.max_new_tokens;
  sizing.n = o.n;
  EngineOptions eo;
  eo.record_routing = true;
  // Under tp or sp the engine runs on a one-device copy of the weights, refreshed before each round and
  // each evaluation (rl::TpGenerator; under tp without routing replay); else on the policy, ep ranks in
  // lockstep.
  std::unique_ptr<rl::TpGenerator> tp_copy;
  if (dist.mesh().size(Axis::Tp) > 1 || dist.mesh().size(Axis::Sp) > 1) {
    tp_copy = std::make_unique<rl::TpGenerator>(session);
    if (const Tensor& b = session.model().router_bias(); b.defined()) {  // the copy routes as the policy
      tp_copy->model().enable_router_bias();
      tp_copy->model().router_bias().copy_from(b);
    }
    o.before_generate = [&tp_copy] { return tp_copy->refresh(); };
    if (dist.mesh().size(Axis::Tp) > 1) {
      o.replay_routing = false;
      eo.record_routing = false;
    }
  } else {
    eo.lockstep = dist.ep();
  }
  Qwen3MoeModel& gen_model = tp_copy ? tp_copy->model() : session.model();
  eo.max_running = std::max<int64_t>(per_step * o.n, eval_count);
  GenerateRequest eval_sizing = sizing;
  eval_sizing.n = 1;
  eo.kv_cache_bytes = std::max(
      RolloutEngine::kv_bytes_needed(gen_model, std::vector<GenerateRequest>(size_t(per_step), sizing), eo.block_size),
      RolloutEngine::kv_bytes_needed(gen_model, std::vector<GenerateRequest>(size_t(eval_count), eval_sizing),
                                     eo.block_size));
  RolloutEngine engine(gen_model, eo);

  // Evaluation: greedy, on the held-out problems of the task or the --eval-prompts file.
  const std::vector<Problem> eval = from_file ? std::vector<Problem>() : task.eval(eval_n, uint64_t(seed) + 7);
  const bool file_accuracy = file_reward != FileReward::Program;
  auto evaluate = [&]() -> double {
    if (tp_copy) tp_copy->refresh();  // every rank evaluates every problem (the same collectives)
    if (!from_file) return exact_match(engine, eval, task.hi);
    std::vector<GenerateRequest> reqs;
    std::vector<int64_t> which;
    for (size_t k = 0; k < eval_file.prompts.size(); ++k) {
      GenerateRequest r;
      r.prompt = eval_file.prompts[k].ids;
      r.sampling.temperature = 0;
      r.max_new_tokens = o.max_new_tokens;
      r.stop_token_ids = o.stop_token_ids;
      reqs.push_back(std::move(r));
      which.push_back(int64_t(k));
    }
    const std::vector<double> r = rewarder(eval_file, which, engine.generate(reqs));
    double sum = 0;
    for (double x : r) sum += file_accuracy ? (x >= 1.0 ? 1.0 : 0.0) : x;
    return (file_accuracy ? 100.0 : 1.0) * sum / double(r.size());
  };
  const bool has_eval = !from_file || !eval_file.prompts.empty();
  double before = 0;
  if (resuming && state.contains("eval_before"))
    before = state["eval_before"].get<double>();  // of the initial model, measured when the run started
  else if (has_eval) {
    if (resuming)
      log_info(
          "grpo: resume: warning: the saved run recorded no evaluation before training; \"before\" is "
          "measured now, at step ",
          start_step);
    before = evaluate();
  }
  const std::string task_text = from_file ? prompts_path
                                          : "addition, operands of " + std::to_string(task.lo) + ".." +
                                                std::to_string(task.hi) + " digits" +
                                                (task.longest ? ", at least one of " + std::to_string(task.hi) : "");
  const std::string eval_name = !from_file                         ? "exact-match"
                                : file_reward == FileReward::Exact ? "exact-match"
                                : file_reward == FileReward::Math  ? "math"
                                                                   : "program-reward";
  auto shown = [&](double v) {
    char b[64];
    std::snprintf(b, sizeof b, !from_file || file_accuracy ? "%.1f%%" : "%.4f", v);
    return std::string(b);
  };
  std::filesystem::create_directories(run_dir);
  MetricsWriter metrics(run_dir + "/metrics.jsonl", lead, true,
                        resuming ? start_step : -1);  // and a TensorBoard event file beside it
  Rng rng{uint64_t(seed)};
  PromptSampler sampler(std::max<int64_t>(1, int64_t(train_file.prompts.size())), mix64(uint64_t(seed)));
  int64_t problems_drawn = 0;  // the task's draws from rng: a resumed run replays them
  if (resuming) {
    if (from_file)
      sampler.set_position(state.at("prompt_position").get<int64_t>());
    else
      for (const int64_t n = state.at("problems_drawn").get<int64_t>(); problems_drawn < n; ++problems_drawn)
        task.train(rng);
  }
  const auto t0 = std::chrono::steady_clock::now();
  auto elapsed = [&] { return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(); };
  // Linear warm-up over steps 1..warmup, then constant at --lr, or a cosine from --lr down to --min-lr at the
  // last step.
  auto lr_at = [&](int64_t step) {
    if (warmup > 0 && step <= warmup) return o.lr * double(step) / double(warmup);
    if (!min_lr || steps <= warmup) return o.lr;
    const double progress = std::clamp(double(step - warmup) / double(steps - warmup), 0.0, 1.0);
    return *min_lr + (o.lr - *min_lr) * 0.5 * (1.0 + std::cos(M_PI * progress));
  };

  // A checkpoint: the HF weights (a model directory: config, safetensors, tokenizer.json), the policy's and
  // the critic's training state and train_state.json, committed by manifest and rename.
  auto save = [&](int64_t step) {
    const auto t = std::chrono::steady_clock::now();
    const std::string final_dir = checkpoint_dir(run_dir, step), dir = final_dir + ".tmp";
    if (lead) begin_checkpoint(dir);
    if (dist.distributed()) dist.world()->barrier();  // the directory exists before any rank writes into it
    if (session.fsdp())
      save_sharded_hf_checkpoint(
          dir, cfg, session.table(),
          [&session](const ParamEntry& e) { return session.parallel().gather_param_host(e, false); }, lead);
    else
      save_hf_checkpoint(dir, cfg, session.table(), session.model().params());
    if (lead && fs::exists(tokenizer_path))
      fs::copy_file(tokenizer_path, fs::path(dir) / "tokenizer.json", fs::copy_options::overwrite_existing);
    if (lead && session.model().router_bias().defined())  // the routing bias it ran with: a complete model
      save_router_bias(dir, cfg, session.model().router_bias());
    debug_kill_while_saving(step);
    AdamW& opt = session.optimizer();
    save_train_state_shard(dir, dist.rank(), session.master(), opt.exp_avg(), opt.exp_avg_sq(),
                           session.parallel().pieces(session.table()));
    const DeviceMesh& dm = dist.mesh();
    const json layout = {{"world_size", dist.world_size()},
                         {"dp_replicate", dm.size(Axis::DpReplicate)},
                         {"dp_shard", dm.size(Axis::DpShard)},
                         {"ep", dm.size(Axis::Ep)},
                         {"tp", dm.size(Axis::Tp)}};
    json st;
    st["format"] = "moetrain-grpo-state-1";
    st["step"] = step;
    st["session_steps"] = session.steps_done();
    st["optimizer_steps"] = opt.steps_taken();
    st["skipped_steps"] = opt.steps_skipped();
    st["flat_numel"] = session.table().total();
    st["layout"] = layout;
    st["mode"] = from_file ? "prompts" : baseline.empty() ? "task" : "sft-baseline";
    if (from_file) {
      st["prompt_position"] = sampler.position();
      st["prompts"] = {{"file", prompts_path}, {"count", train_file.prompts.size()}};
    } else {
      st["problems_drawn"] = problems_drawn;
    }
    st["rng"] = "none besides: sampling seeds are functions of (seed, step, prompt index)";
    st["lr_schedule"] = {
        {"lr", o.lr}, {"warmup_steps", warmup}, {"min_lr", min_lr.value_or(o.lr)}, {"next_lr", lr_at(step + 1)}};
    st["model_dir"] = model_dir;
    st["model_fingerprint"] = fingerprint;
    if (has_eval) st["eval_before"] = before;
    if (critic) {
      const std::string cdir = (fs::path(dir) / "critic").string();
      AdamW& copt = critic->optimizer();
      save_train_state_shard(cdir, dist.rank(), critic->master(), copt.exp_avg(), copt.exp_avg_sq(),
                             critic->parallel().pieces(critic->table()));
      if (lead)
        write_file_atomic(
            (fs::path(cdir) / kTrainStateFile).string(),
            json{{"format", "moetrain-grpo-critic-1"}, {"flat_numel", critic->table().total()}, {"layout", layout}}
                    .dump(2) +
                "\n");
      st["critic"] = {{"dir", "critic"},
                      {"optimizer_steps", copt.steps_taken()},
                      {"skipped_steps", copt.steps_skipped()},
                      {"session_steps", critic->steps_done()}};
    }
    st["args"] = recorded_args(args);
    if (lead) write_file_atomic((fs::path(dir) / kTrainStateFile).string(), st.dump(2) + "\n");
    if (dist.distributed()) dist.world()->barrier();  // every shard is on disk
    if (lead) {
      commit_checkpoint(dir, final_dir);
      for (const std::string& r : retain_checkpoints(run_dir, keep_last)) log_info("grpo: ", r);
    }
    log_info("grpo: saved checkpoint ", final_dir, " (HF weights + training state", critic ? " + critic" : "",
             ", manifest) in ", std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count(), " s");
  };

  int64_t steps_done = stop;
  int stop_sig = 0;  // a stop signal every rank agreed on after a step
  if (!baseline.empty()) {
    // The comparison: SFT for the wall time of the GRPO run it is compared with.
    const double budget = sft_seconds;
    log_info("grpo: baseline sft: ", model_dir, ", task: ", task_text, "; held-out exact match before: ", before,
             "%; supervised fine-tuning for ", budget, " s, ", per_step * o.n, " problems a step, lr ", o.lr);
    int64_t step = 0;
    while (elapsed() < budget) {
      ++step;
      StepOptions st;
      st.lr = lr_at(step);
      const StepResult r = session.train_step({sft_batch(task, rng, per_step * o.n)}, st);
      nlohmann::json j = step_json(r, session.dist());
      j["step"] = step;
      j["lr"] = st.lr;
      j["elapsed_s"] = elapsed();
      metrics.write(j);
      if (step % 10 == 0) log_info("grpo: sft step ", step, " loss ", r.loss, " | ", std::round(elapsed()), " s");
    }
    steps_done = step;
  } else {
    log_info("grpo: ", model_dir, ", ", from_file ? "prompts: " : "task: ", task_text,
             has_eval ? "; held-out " + eval_name + " before: " + shown(before) : std::string("; no evaluation"), "; ",
             resuming ? str("steps ", start_step + 1, "..", stop, " of ") : std::string(), steps, " steps of ",
             per_step, " prompts x ", o.n, " samples, lr ", o.lr, ", temperature ", o.sampling.temperature,
             ", advantages: ",
             ppo            ? (process ? "GAE on per-token rewards" : "GAE on the outcome reward")
             : !process     ? "outcome"
             : per_position ? "position"
                            : "process",
             ", aggregation ", aggregation_name, o.dynamic_sampling ? ", dynamic sampling" : "",
             reference ? ", reference model" : "",
             critic ? ", PPO: critic lr " + std::to_string(o.critic_lr) + ", gamma " + std::to_string(o.gamma) +
                          ", lam " + std::to_string(o.lam) + ", value clip " + std::to_string(o.value_clip)
                    : std::string());
    // One round's prompts at a time: the reward's answer key, by the round's prompt index.
    std::vector<Problem> round_problems;
    std::vector<int64_t> round_prompts;
    const rl::PromptFn draw = [&](int64_t count) {
      std::vector<std::vector<int32_t>> prompts;
      round_problems.clear();
      round_prompts.clear();
      for (int64_t i = 0; i < count; ++i) {
        if (from_file) {
          round_prompts.push_back(sampler.next());
          prompts.push_back(train_file.prompts[size_t(round_prompts.back())].ids);
        } else {
          round_problems.push_back(task.train(rng));
          ++problems_drawn;
          prompts.push_back(ids32(round_problems.back().prompt_ids));
        }
      }
      return prompts;
    };
    const rl::RewardFn reward_fn = [&](const std::vector<GenerateRequest>&, const std::vector<GeneratedSample>& g) {
      if (from_file) return rewarder(train_file, round_prompts, g);
      std::vector<double> r;
      for (const GeneratedSample& x : g)
        r.push_back(answer_reward(round_problems.at(size_t(x.prompt_index)), x.tokens, reward_kind));
      return r;
    };
    if (process)
      o.token_reward = [&](const std::vector<GenerateRequest>&, const std::vector<GeneratedSample>& g) {
        std::vector<std::vector<double>> r;
        for (const GeneratedSample& x : g)
          r.push_back(answer_token_rewards(round_problems.at(size_t(x.prompt_index)), x.tokens));
        return r;
      };
    o.per_position = per_position;
    o.seed = uint64_t(seed);
    for (int64_t step = start_step + 1; step <= stop; ++step) {
      rl::GrpoOptions os = o;
      os.lr = lr_at(step);
      const rl::GrpoMetrics m =
          rl::grpo_step(session, engine, draw, per_step, reward_fn, os, step, reference.get(), critic.get());
      const double eta = elapsed() / double(step - start_step) * double(stop - step);
      log_info(rl::step_line(m, step, steps, reference != nullptr, critic != nullptr), " | ETA ", std::round(eta),
               " s");
      nlohmann::json rec = rl::to_json(m);
      rec["step"] = step;
      rec["lr"] = os.lr;
      rec["elapsed_s"] = elapsed();
      metrics.write(rec);
      // The checkpoint first: whatever the evaluation meets, the weights are on disk.
      if (save_every > 0 && step % save_every == 0 && step < stop) save(step);
      // Ctrl-C or SIGTERM (core/interrupt.h): this step is done; save it and stop, every rank here.
      if (const int sig = dist.agreed_stop_signal(device)) {
        stop_sig = sig;
        steps_done = step;
        break;
      }
    }
  }
  save(steps_done);
  if (stop_sig != 0) {
    if (lead)
      log_info("grpo: stopped by ", stop_signal_name(stop_sig), " after step ", steps_done, "; saved ",
               checkpoint_dir(run_dir, steps_done), "; resume with the same command and --resume",
               steps_done < stop ? "" : " (the final evaluation was skipped)");
    return 128 + stop_sig;
  }
  log_info("grpo: ", std::round(elapsed()), " s of ", baseline.empty() ? "GRPO" : "SFT");
  if (!has_eval) {
    if (lead) std::printf("grpo: %lld steps done; evaluation skipped (no --eval-prompts)\n", (long long)steps_done);
    return 0;
  }
  const double after = evaluate();
  if (!lead) return 0;
  if (from_file)
    std::printf("grpo: %s %s -> %s on %lld held-out prompts\n", eval_name.c_str(), shown(before).c_str(),
                shown(after).c_str(), (long long)eval_file.prompts.size());
  else
    std::printf("grpo: exact-match %.1f%% -> %.1f%% on %lld held-out problems\n", before, after, (long long)eval_n);
  return 0;
}

}  // namespace mt
