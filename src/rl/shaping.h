// Reward shaping and batch filtering for RL (docs/rl.md "Shaping and filtering").
//   soft overlong penalty (DAPO): 0 for responses up to max_length - buffer tokens, then a linear
//     ramp to -factor at max_length: ((max_length - buffer) - length) / buffer x factor; -factor beyond;
//   overlong filtering: samples cut at the length limit (finish "length") are left out of the loss
//     (token weight 0) instead of being punished for a truncation;
//   dynamic sampling (DAPO): only groups whose rewards are not all equal carry a group-relative
//     gradient; the loop keeps those and draws more prompts until the batch is full;
//   KL in the reward (PPO / REINFORCE++ style, instead of a KL loss term): token rewards
//     r_t = -beta (logp_t - ref_t), plus the outcome reward on the last token.
#pragma once
#include <cstdint>
#include <span>
#include <vector>

namespace mt::rl {

double soft_overlong_penalty(int64_t length, int64_t max_length, int64_t buffer, double factor);
// Indices of the groups (of G consecutive rewards) whose rewards are not all equal.
std::vector<int64_t> informative_groups(std::span<const double> rewards, int64_t group_size);
std::vector<double> token_rewards_with_kl(double outcome, std::span<const double> logp, std::span<const double> ref,
                                          double beta);

}  // namespace mt::rl
