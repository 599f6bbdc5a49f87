// `moetrain grpo --env`'s parts (grpo_env.h).
#include "rl/grpo_env.h"

#include <cstdio>

#include "core/error.h"
#include "rl/env/builtin_envs.h"
#include "rl/env/env_program.h"
#include "rl/multiturn_codec.h"

namespace mt::rl {

GrpoEnvRun open_grpo_env(const GrpoEnvSpec& spec, const addition::Task& task, int64_t eval_n, uint64_t seed,
                         const PromptRun* run, const ModelConfig& cfg, const std::string& model_dir,
                         PromptSource& source, GrpoOptions& o) {
  GrpoEnvRun r;
  if (!spec.builtin.empty()) {
    r.owned = make_builtin_env(spec.builtin);
    o.codec = demo_codec();
    for (const Problem& p : task.eval(eval_n, seed + 7))  // addition_source's held-out set
      r.eval.push_back(addition::ids32(p.prompt_ids));
  } else {
    if (!run || !run->tokenizer)
      MT_THROW("grpo: --env ", spec.spec, " speaks text; ", model_dir, " has no tokenizer.json to decode turns");
    if (!spec.given) {
      EnvProgramOptions eo;
      eo.command = spec.program;
      eo.timeout_s = spec.timeout_s;
      eo.stop_on_error = spec.stop_on_error;
      r.owned = std::make_unique<EnvProgram>(eo);
    }
    std::vector<int32_t> stops = o.stop_token_ids;
    if (cfg.eos_token_id >= 0) stops.push_back(int32_t(cfg.eos_token_id));
    o.codec = chat_codec(*run->tokenizer, stops);
    for (size_t i = 0; i < run->eval.prompts.size() && i < 256; ++i) r.eval.push_back(run->eval.prompts[i].ids);
  }
  r.env = r.owned ? r.owned.get() : spec.given;
  o.env = r.env;
  o.episode_metadata = [&source](int64_t k) { return source.metadata(k); };
  return r;
}

std::string env_eval_line(const std::string& spec, const EpisodeEval& before, const EpisodeEval& after,
                          const std::string& what) {
  auto pct = [](double v) {
    char b[32];
    std::snprintf(b, sizeof b, "%.1f%%", 100 * v);
    return std::string(b);
  };
  auto num = [](double v) {
    char b[32];
    std::snprintf(b, sizeof b, "%.4g", v);
    return std::string(b);
  };
  std::string s = str("grpo: env ", spec, " success ", pct(before.success), " -> ", pct(after.success), " on ",
                      after.episodes, " held-out ", what, " (greedy episodes; mean reward ", num(before.reward_mean),
                      " -> ", num(after.reward_mean));
  for (const auto& [k, v] : after.env_metrics)
    s += str(", ", k, " ", num(before.env_metrics.count(k) ? before.env_metrics.at(k) : 0.0), " -> ", num(v));
  return s + ")";
}

}  // namespace mt::rl
