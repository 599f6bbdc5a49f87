// `moetrain grpo --env`'s parts (docs/rl.md "Multi-turn GRPO"), so the command only composes them: the
// environment (a built-in one on the addition task, or an EnvProgram on a prompt file), its codec and
// prompt metadata set into GrpoOptions, the held-out prompts its greedy episodes are measured on, and the
// run's final line.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "model/config.h"
#include "rl/env/environment.h"
#include "rl/grpo.h"
#include "rl/multiturn.h"
#include "rl/prompt_file.h"
#include "rl/prompt_source.h"
#include "rl/tasks/addition.h"

namespace mt::rl {

struct GrpoEnvSpec {
  std::string spec;       // as given: builtin:NAME or program:CMD
  std::string builtin;    // NAME, or "" for a program
  std::string program;    // CMD, or "" for a built-in
  double timeout_s = 60;  // the program's deadline per call
  bool stop_on_error = false;
  Environment* given = nullptr;  // spec "python": the caller's environment (not owned), spoken to like a program
};

struct GrpoEnvRun {
  std::unique_ptr<Environment> owned;  // a built-in or a program; null for a given environment
  Environment* env = nullptr;
  std::vector<std::vector<int32_t>> eval;  // held-out prompts (empty: no greedy episodes)
};

// Opens the environment and sets o.env, o.codec (the demo's for a built-in; the tokenizer's chat codec with
// the EOS and o.stop_token_ids ending turns for a program) and o.episode_metadata (from `source`, which must
// outlive the run). Built-ins: the held-out problems of addition_source(task, eval_n, seed); programs: the
// first 256 of run->eval. Errors: a program without a tokenizer, and what EnvProgram refuses.
GrpoEnvRun open_grpo_env(const GrpoEnvSpec& spec, const addition::Task& task, int64_t eval_n, uint64_t seed,
                         const PromptRun* run, const ModelConfig& cfg, const std::string& model_dir,
                         PromptSource& source, GrpoOptions& o);

// "grpo: env SPEC success B% -> A% on N held-out WHAT (greedy episodes; mean reward b -> a, KEY b -> a, ...)".
std::string env_eval_line(const std::string& spec, const EpisodeEval& before, const EpisodeEval& after,
                          const std::string& what);

}  // namespace mt::rl
