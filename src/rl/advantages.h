// Advantage estimators for RL post-training (docs/rl.md has each formula and where it comes from).
//
// Outcome estimators take one scalar reward per sample, samples of one prompt consecutive (group-major:
// prompt p's G samples are [p G, (p + 1) G)), and return one advantage per sample, which the loss
// broadcasts to the sample's response tokens:
//   GRPO          A_i = (r_i - mean_g) / (std_g + eps), std unbiased (n - 1, as torch.std, veRL, TRL);
//   Dr. GRPO      A_i = r_i - mean_g (no std normalisation: GRPO with normalize_std = false);
//   RLOO          A_i = r_i - mean of the other G - 1 rewards of the group = G / (G - 1) (r_i - mean_g);
//   REINFORCE++   A_i = (r_i - mean_batch) / (std_batch + eps) over the whole batch (no groups).
// Process supervision (DeepSeekMath, Shao et al. 2024, section 4.1.3): a reward per step (here per response
// token) r_{i,t}; the group's step rewards, pooled over all its samples and steps, are normalised
// r~ = (r - mean) / (std + eps) (std unbiased; Dr.-GRPO style without the division when normalize_std is
// false), and a token's advantage is the sum of the normalised rewards of its step and the later ones:
// A_{i,t} = sum_{s >= t} r~_{i,s}.
// GAE(gamma, lambda) with a critic works per token of one response: delta_t = r_t + gamma V_{t+1} - V_t
// (V after the last token is 0: the response ended), A_t = delta_t + gamma lambda A_{t+1}, returns
// R_t = A_t + V_t (the critic's targets).
// Errors name the value: a group size below 2 (no baseline), rewards not a whole number of groups,
// gamma or lambda outside [0, 1], lengths that differ.
#pragma once
#include <cstdint>
#include <span>
#include <vector>

namespace mt::rl {

std::vector<double> grpo_advantages(std::span<const double> rewards, int64_t group_size, bool normalize_std,
                                    double eps = 1e-6);
std::vector<double> rloo_advantages(std::span<const double> rewards, int64_t group_size);
std::vector<double> batch_normalized_advantages(std::span<const double> rewards, double eps = 1e-6);

std::vector<std::vector<double>> process_advantages(const std::vector<std::vector<double>>& step_rewards,
                                                    int64_t group_size, bool normalize_std, double eps = 1e-6);
// Per-position group baseline (for step rewards that line up by position, e.g. one per answer digit):
// A_{i,t} = (r_{i,t} - mean_t) / (std_t + eps), mean and unbiased std over the group's samples that have a
// step t (no division when normalize_std is false); 0 where fewer than two samples have one. Each token
// is credited with its own step's reward only, against the other samples' rewards at the same step.
std::vector<std::vector<double>> position_advantages(const std::vector<std::vector<double>>& step_rewards,
                                                     int64_t group_size, bool normalize_std, double eps = 1e-6);
// Multi-turn per-turn credit (rl/multiturn.h, --turn-credit per-turn): r_{i,k} the reward environment step k
// of sample i gave; the turn's return R_{i,k} = sum_{k' >= k} r_{i,k'} (what the turn's tokens led to);
// A_{i,k} = (R_{i,k} - mean_g) / (std_g + eps), mean and unbiased std over the group's returns pooled (every
// turn of every sample counted once, whatever its length; no division when normalize_std is false or the
// group has a single turn in all). One advantage per turn, which the caller gives every token of the turn.
// by_turn (--turn-credit per-turn-index): turn k's return against the group's turns k alone (the samples that
// reached turn k: a second try against the other second tries), as position_advantages does per position;
// a turn that no other sample of the group reached gets 0.
std::vector<std::vector<double>> turn_advantages(const std::vector<std::vector<double>>& turn_rewards,
                                                 int64_t group_size, bool normalize_std, double eps = 1e-6,
                                                 bool by_turn = false);
// Per group: whether every step reward of every sample is the same value (all normalised rewards 0).
std::vector<bool> constant_step_groups(const std::vector<std::vector<double>>& step_rewards, int64_t group_size);

struct Gae {
  std::vector<double> advantages, returns;
};
Gae gae(std::span<const double> token_rewards, std::span<const double> values, double gamma, double lambda);

// Per group: whether all its rewards are equal (GRPO's zero-variance groups, which dynamic sampling
// drops: their advantages are all 0, so they carry no gradient).
std::vector<bool> constant_groups(std::span<const double> rewards, int64_t group_size);

}  // namespace mt::rl
