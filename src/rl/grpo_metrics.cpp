// The step record of GRPO / PPO (grpo.h GrpoMetrics) as metrics.jsonl's object and as the log's line: the
// names compared against TRL and veRL (docs/rl.md "Metric names against TRL and veRL").
#include <cmath>
#include <nlohmann/json.hpp>
#include <string>

#include "core/error.h"
#include "rl/grpo.h"

namespace mt::rl {

nlohmann::json to_json(const GrpoMetrics& m) {
  nlohmann::json j;
  j["reward_mean"] = m.reward_mean;
  j["reward_std"] = m.reward_std;
  j["reward_max"] = m.reward_max;
  j["groups_with_reward"] = m.groups_with_reward;
  j["groups_correct"] = m.groups_correct;
  j["groups_zero_variance"] = m.groups_zero_variance;
  j["generate_rounds"] = m.generate_rounds;
  j["groups_generated"] = m.groups_generated;
  j["groups_kept"] = m.groups_kept;
  j["response_len_mean"] = m.response_len_mean;
  j["response_len_min"] = m.response_len_min;
  j["response_len_max"] = m.response_len_max;
  j["response_len_terminated_mean"] = m.response_len_terminated_mean;
  j["overlong_fraction"] = m.overlong_fraction;
  j["updates"] = m.updates;
  j["micro_batches"] = m.micro_batches;
  j["loss"] = m.loss;
  j["policy_loss"] = m.policy_loss;
  j["kl_loss"] = m.kl_loss;
  j["grad_norm"] = m.grad_norm;
  j["grad_norm_max"] = m.grad_norm_max;
  j["clip_low"] = m.clip_low;
  j["clip_high"] = m.clip_high;
  j["clip_region"] = m.clip_region;
  j["clip_dual"] = m.clip_dual;
  j["approx_kl"] = m.approx_kl;
  j["ref_kl"] = m.ref_kl;
  j["ref_kl_update"] = m.ref_kl_update;
  j["entropy"] = m.entropy;
  j["advantage_mean"] = m.advantage_mean;
  j["advantage_std"] = m.advantage_std;
  j["logprob_diff_mean"] = m.logprob_diff_mean;
  j["logprob_diff_max"] = m.logprob_diff_max;
  j["logprob_diff_mean_no_replay"] = m.logprob_diff_mean_no_replay;
  j["logprob_diff_max_no_replay"] = m.logprob_diff_max_no_replay;
  j["importance_weight_mean"] = m.importance_weight_mean;
  j["importance_weight_min"] = m.importance_weight_min;
  j["importance_weight_max"] = m.importance_weight_max;
  j["masked_fraction"] = m.masked_fraction;
  j["kl_reward"] = m.kl_reward;
  j["value_loss"] = m.value_loss;
  j["value_mean"] = m.value_mean;
  j["explained_variance"] = m.explained_variance;
  j["value_clip_frac"] = m.value_clip_frac;
  j["critic_grad_norm"] = m.critic_grad_norm;
  j["rollout_tokens_per_s"] = m.rollout_tokens_per_s;
  j["logprob_tokens_per_s"] = m.logprob_tokens_per_s;
  j["ref_logprob_tokens_per_s"] = m.ref_logprob_tokens_per_s;
  j["train_tokens_per_s"] = m.train_tokens_per_s;
  j["critic_values_tokens_per_s"] = m.critic_values_tokens_per_s;
  j["critic_update_tokens_per_s"] = m.critic_update_tokens_per_s;
  j["time_s"] = {
      {"generate", m.generate_s},           {"reward", m.reward_s},          {"logprob", m.logprob_s},
      {"ref_logprob", m.ref_logprob_s},     {"update", m.update_s},          {"critic_values", m.critic_value_s},
      {"critic_update", m.critic_update_s}, {"weight_sync", m.weight_sync_s}};
  if (m.turns_mean > 0) {  // multi-turn
    j["turns_mean"] = m.turns_mean;
    j["observation_tokens_mean"] = m.observation_tokens_mean;
    j["env_errors"] = m.env_errors;
    j["env_error_fraction"] = m.env_error_fraction;
    j["episodes_cut_fraction"] = m.episodes_cut_fraction;
    j["env"] = nlohmann::json::object();
    for (const auto& [k, v] : m.env_metrics) j["env"][k] = v;
  }
  return j;
}

namespace {
// The environment's metadata means, " name value" each.
std::string env_text(const GrpoMetrics& m) {
  std::string s;
  for (const auto& [k, v] : m.env_metrics) s += str(" ", k, " ", v);
  return s;
}
}  // namespace

std::string step_line(const GrpoMetrics& m, int64_t step, int64_t steps, bool with_reference, bool with_critic) {
  return str(
      "grpo: step ", step, "/", steps, " reward ", m.reward_mean, " (zero-std groups ", m.groups_zero_variance,
      ", correct ", m.groups_correct, "; kept ", m.groups_kept, "/", m.groups_generated, " in ", m.generate_rounds,
      " rounds) loss ", m.loss, " grad norm ", m.grad_norm, " | clip ", m.clip_region, " entropy ", m.entropy, " len ",
      m.response_len_mean, "/", m.response_len_max, " clipped ", m.overlong_fraction, " kl(ref) ", m.ref_kl,
      " | rollout/trainer |dlogp| ", m.logprob_diff_mean,
      m.logprob_diff_mean_no_replay >= 0 ? str(" (own routing: ", m.logprob_diff_mean_no_replay, ")") : std::string(),
      " ratio ", m.importance_weight_mean, " [", m.importance_weight_min, ", ", m.importance_weight_max, "]",
      with_critic ? str(" | value loss ", m.value_loss, " explained variance ", m.explained_variance) : std::string(),
      m.turns_mean > 0 ? str(" | turns ", m.turns_mean, " obs tokens ", m.observation_tokens_mean, " env errors ",
                             m.env_errors, env_text(m))
                       : std::string(),
      " | tokens/s generate ", std::lround(m.rollout_tokens_per_s), " logprob ", std::lround(m.logprob_tokens_per_s),
      with_reference ? str(" ref ", std::lround(m.ref_logprob_tokens_per_s)) : std::string(), " update ",
      std::lround(m.train_tokens_per_s),
      with_critic ? str(" critic values ", std::lround(m.critic_values_tokens_per_s), " update ",
                        std::lround(m.critic_update_tokens_per_s))
                  : std::string());
}

std::string recipe_text(const GrpoOptions& o, bool ppo, bool process, bool per_position, const std::string& aggregation,
                        bool with_reference, bool with_critic) {
  return str("lr ", o.lr, ", temperature ", o.sampling.temperature, ", advantages: ",
             ppo            ? (process ? "GAE on per-token rewards" : "GAE on the outcome reward")
             : !process     ? "outcome"
             : per_position ? "position"
                            : "process",
             ", aggregation ", aggregation, o.dynamic_sampling ? ", dynamic sampling" : "",
             with_reference ? ", reference model" : "",
             o.rollout_logprobs_exact ? ", true on-policy (batch-invariant kernels)" : "",
             with_critic ? ", PPO: critic lr " + std::to_string(o.critic_lr) + ", gamma " + std::to_string(o.gamma) +
                               ", lam " + std::to_string(o.lam) + ", value clip " + std::to_string(o.value_clip)
                         : std::string());
}

}  // namespace mt::rl
