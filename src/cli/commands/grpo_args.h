// `moetrain grpo`'s command line (core/options.h): every option declared once into GrpoArgs, the task
// preset's values as their defaults, and every rule over several options; parse_grpo_args runs them all
// and touches nothing else (no file, no device), so the whole option surface is testable without a run.
#pragma once
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "cli/common_options.h"
#include "parallel/mesh.h"
#include "rl/env/environment.h"
#include "rl/grpo.h"
#include "rl/rewards/rewards.h"
#include "rl/prompt_file.h"
#include "rl/tasks/addition.h"

namespace mt {

// PPO's policy takes smaller steps than GRPO's by default: its whitened GAE advantages carry the critic's
// error too (docs/rl.md "PPO with a critic").
constexpr double kPpoLr = 1e-4;

struct GrpoArgs {
  std::string task_name = "sharpen";
  rl::addition::TaskPreset preset;  // --task's: the defaults of the options below
  std::string model_dir, run_dir = "runs/grpo", baseline, reward_spec;
  std::string prompts_path, eval_prompts_path, resume;
  int64_t steps = 0, per_step = 16, eval_n = 200, seed = cli::kDefaultSeed, warmup = 5, max_new_tokens = -1;
  std::optional<double> min_lr;  // --min-lr: a cosine decay to it; unset: constant after the warm-up
  int64_t save_every = 0, keep_last = 2, max_steps = 0;
  MeshSpec mesh;  // under moetrain launch
  cli::DeviceOptions dev;
  double sft_seconds = 0, reward_timeout = 60, comm_timeout_s = 300;
  bool reward_stop = false, deterministic = false;
  bool true_on_policy = false;  // the CPU's batch-invariant mode (core/determinism.h)
  rl::addition::Task task;
  bool use_reference = true;
  rl::addition::Reward reward_kind = rl::addition::Reward::Digits;
  std::string advantage_given;   // --advantage as given
  std::string aggregation_name;  // --aggregation as given ("": the loss's own)
  bool process = false, per_position = false, ppo = false;
  rl::GrpoOptions o;
  LoraSpec lora;  // --lora-rank > 0: the policy trains adapters on its frozen base, which is also the reference
  std::string recompute = "none";
  // What the parse found: the device's name, whether --model and --reward were given, the built-in task's
  // options given (refused with --prompts), a prompt-file run, its reward and program.
  std::string device_name;
  bool model_given = false, reward_given = false, from_file = false;
  std::vector<std::string> task_flags;
  rl::FileReward file_reward = rl::FileReward::Exact;
  std::string program_cmd;
  // Multi-turn (--env): "builtin:NAME" or "program:CMD" as given, split into its kind and the rest.
  std::string env_spec, env_builtin, env_program;
  // Set by the caller before parsing (the Python API, moetrain.rl.GRPO): `--reward python` and `--env python`
  // name its in-process reward function and environment (GrpoHooks); the command line refuses them.
  bool python_reward = false, python_env = false;
};

// What the Python API hands `grpo` in-process: a reward function over a prompt file's samples (--reward
// python) and an environment (--env python), called from the run's own thread.
struct GrpoHooks {
  std::function<std::vector<double>(const std::vector<rl::RewardRequest>&)> reward;
  rl::Environment* env = nullptr;
};

// Parses and checks the command line into `a`; false (and the long help in *help) when --help was asked.
// Errors name the option, the value and what is allowed.
bool parse_grpo_args(const std::vector<std::string>& args, GrpoArgs& a, std::string* help);

}  // namespace mt
