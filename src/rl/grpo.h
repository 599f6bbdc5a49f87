// One GRPO step on one process (P10's loop, first part): the session's model generates through the
// engine (its weights, no copy), the caller's reward function scores the samples, group-relative
// advantages, the trainer's old log-probs with the recorded routing replayed, and one update through
// TrainSession::train_step with PolicyObjective. docs/rl.md "One step".
// Not yet: several ranks (each would generate its own prompts), mini-batches and epochs, the
// reference model, the critic.
#pragma once
#include <functional>
#include <vector>

#include "rl/advantages.h"
#include "rl/policy_loss.h"
#include "rollout/engine.h"
#include "train/session.h"

namespace mt::rl {

struct GrpoOptions {
  int64_t n = 4;  // samples per prompt (>= 2)
  int64_t max_new_tokens = 16;
  SamplingParams sampling;  // temperature must be 1 until the trainer's log-probs take a temperature
  std::vector<int32_t> stop_token_ids;
  bool normalize_std = true;  // false: Dr. GRPO
  PolicyLossConfig loss;
  LossAggregation aggregation = LossAggregation::TokenMean;
  double lr = 1e-3;
  bool replay_routing = true;  // R3: the update uses the experts the engine chose
  uint64_t seed = 0;
};

struct GrpoMetrics {
  double reward_mean = 0, reward_std = 0, reward_max = 0;
  double groups_with_reward = 0, groups_zero_variance = 0;  // fractions of the step's groups
  double response_len_mean = 0, response_len_max = 0;
  double loss = 0, grad_norm = 0;
  double clip_low = 0, clip_high = 0, approx_kl = 0;  // fractions / mean over response tokens
  // Rollout vs trainer log-probs of the sampled tokens (the trainer's before the update).
  double logprob_diff_mean = 0, logprob_diff_max = 0, importance_weight_mean = 0;
  double generate_s = 0, logprob_s = 0, update_s = 0, weight_sync_s = 0;
};

// The rewards of every sample, in the engine's order (prompt, then sample).
using RewardFn = std::function<std::vector<double>(const std::vector<GenerateRequest>&,
                                                   const std::vector<GeneratedSample>&)>;

// `step` seeds the draws (each prompt's seed mixes it with the prompt's index). The session needs an
// optimizer; the engine must record routing when replay_routing.
GrpoMetrics grpo_step(TrainSession& session, RolloutEngine& engine, const std::vector<std::vector<int32_t>>& prompts,
                      const RewardFn& reward, const GrpoOptions& opt, int64_t step);

}  // namespace mt::rl
