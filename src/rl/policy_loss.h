// Policy losses for RL post-training, per token, and the objective that feeds them to the model's head
// (model/objective.h). docs/rl.md has the formulas; the forms follow veRL's core_algos (PPO clip with
// separate low/high ranges, dual clip, GSPO's sequence ratio) so that runs can be compared.
//
// Per response token t of sample i, with logp the current log-probability, old the behaviour policy's
// (the trainer's before this update), A the advantage, r = exp(logp - old):
//   PPO clip:  l = max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high)); with dual clip c > 1 and A < 0,
//              l = min(l, -c A). dl/dlogp = -A r where the unclipped term is taken, else 0.
//   GSPO:      the sequence ratio s_i = exp(mean over i's tokens of (logp - old)) replaces r (tokens of
//              weight 0, those a mismatch mask took, left out of the mean, as of every denominator), with the
//              gradient flowing per token (veRL's form: each token's ratio is sg(s_i) exp(logp - sg(logp)),
//              so dl/dlogp = -A s_i unclipped); clipped as PPO. Needs all of a sample's tokens in one
//              micro-batch on one rank (not under tp or sp: grpo and grads refuse them).
//   plain PG:  l = -A r (REINFORCE with the importance weight; on-policy its gradient is -A).
// KL to a frozen reference (ref = log p_ref), a loss term beta k(logp, ref):
//   k1 = logp - ref (dk/dlogp = 1); k2 = (logp - ref)^2 / 2 (logp - ref); k3 = e^(ref - logp) - (ref - logp) - 1
//   (1 - e^(ref - logp)). Entropy bonus: - entropy_coef H_t.
// Every term is weighted by the token's weight w_t, fixed before the update (minibatch_weights below): the
// aggregation's normaliser times the mismatch corrections. The loss is sum_t w_t (l_t + beta k_t -
// entropy_coef H_t), a sum of per-token terms as the objective contract requires.
#pragma once
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "model/objective.h"

namespace mt::rl {

enum class PolicyLoss { PpoClip, Gspo, PolicyGradient };
enum class KlEstimator { K1, K2, K3 };
// token-mean: 1 / (response tokens of the step); seq-mean-token-sum: 1 / samples; seq-mean-token-mean:
// 1 / (samples x the sample's length); constant (Dr. GRPO): 1 / (samples x a constant, e.g. max new tokens).
enum class LossAggregation { TokenMean, SeqMeanTokenSum, SeqMeanTokenMean, Constant };

PolicyLoss parse_policy_loss(const std::string& s);            // "ppo", "gspo", "pg"
KlEstimator parse_kl_estimator(const std::string& s);          // "k1", "k2", "k3"
LossAggregation parse_loss_aggregation(const std::string& s);  // "token-mean", "seq-mean-token-sum", ...

struct PolicyLossConfig {
  PolicyLoss kind = PolicyLoss::PpoClip;
  double clip_low = 0.2, clip_high = 0.2;  // eps_low, eps_high (clip-higher: eps_high > eps_low)
  double dual_clip = 0;                    // c > 1, or 0 = off
  double kl_coef = 0;                      // beta; 0 = no KL term
  KlEstimator kl = KlEstimator::K3;
  double entropy_coef = 0;
};
void validate(const PolicyLossConfig& c);  // errors name the field and its value

struct TokenTerm {
  double loss = 0, dlogp = 0;  // the policy term l and dl/dlogp (no KL, no weight)
  bool clipped_low = false, clipped_high = false, dual_clipped = false;
};
// One token of PPO clip / plain PG with ratio r = exp(log_ratio) (for GSPO pass the sequence's log ratio).
TokenTerm policy_term(const PolicyLossConfig& c, double log_ratio, double advantage);
double kl_value(KlEstimator k, double logp, double ref);
double kl_grad(KlEstimator k, double logp, double ref);  // d k / d logp

// The rollout/trainer mismatch corrections, from the trainer's log-probs before the update (old) and the
// engine's (rollout), per response token of one sample: truncated importance sampling min(w, cap) at
// token level (w = e^(old - rollout)) or sequence level (w = e^(sum of old - rollout)), and masks: tokens
// whose w is outside [token_mask_low, token_mask_high], samples whose geometric-mean ratio
// e^(mean of old - rollout) is outside [seq_mask_low, seq_mask_high]. Zero or negative caps/bands = off.
struct MismatchConfig {
  double tis_cap = 0;
  bool tis_sequence = false;
  double token_mask_low = 0, token_mask_high = 0;
  double seq_mask_low = 0, seq_mask_high = 0;
};
// w_t for one sample's response tokens: the aggregation's normaliser (`norm`, e.g. 1 / tokens of the step)
// times the TIS weight, 0 where masked. `masked` (optional) receives how many tokens were masked.
std::vector<double> token_weights(std::span<const double> old_logp, std::span<const double> rollout_logp, double norm,
                                  const MismatchConfig& m, int64_t* masked = nullptr);
// The normaliser of one sample of `length` response tokens under an aggregation, given the step's totals.
double aggregation_norm(LossAggregation a, int64_t length, int64_t step_tokens, int64_t step_samples, double constant);
// The token weights of one mini-batch (what the loop gives PolicyObjective): the mismatch masks first, then
// the aggregation's normaliser over what is left, times the TIS weight. A masked token and every token of a
// `filtered` sample (overlong filtering) get weight 0 and count in no denominator: `tokens` is the
// mini-batch's unmasked tokens of unfiltered samples, `samples` its unfiltered samples with at least one of
// them, and a sample's length (seq-mean-token-mean) its unmasked tokens; so masking a sample's every token
// trains the same update as filtering it. old_logp / rollout_logp: per sample, per response token.
// model_mask (multi-turn, rl/multiturn.h): empty, or per sample per response token 1 for the model's tokens
// and 0 for the observations an environment appended (a sample's row may be empty: all the model's). An
// observation token is treated as a prompt token: weight 0, in no denominator and no mismatch correction
// (the masks, TIS and the geometric mean see the model's tokens only), not counted as masked.
struct MiniBatchWeights {
  std::vector<std::vector<double>> w;  // per sample, per response token
  int64_t tokens = 0, samples = 0;     // the normaliser's counts
  int64_t masked = 0;                  // tokens of unfiltered samples the masks gave weight 0
};
MiniBatchWeights minibatch_weights(const std::vector<std::vector<double>>& old_logp,
                                   const std::vector<std::vector<double>>& rollout_logp,
                                   const std::vector<bool>& filtered, LossAggregation a, double constant,
                                   const MismatchConfig& m, const std::vector<std::vector<uint8_t>>& model_mask = {});

// Metrics of the last coefficients() calls (sums; the loop divides by the token counts it knows), over the
// trained tokens: target rows of weight w_t != 0.
struct PolicyMetrics {
  double pg_loss = 0, kl_loss = 0, entropy_loss = 0;  // weighted sums, as in the loss
  // Clipped tokens: low (A < 0), high (A > 0), region (either, counted on its own: TRL's clip_ratio/region),
  // and the dual clip's (A < 0, ratio above c; in none of the other three).
  int64_t tokens = 0, clipped_low = 0, clipped_high = 0, clipped_region = 0, dual_clipped = 0;
  double approx_kl = 0;  // sum of (old - logp) over the tokens: PPO's approximate KL to the behaviour policy
  double ref_kl = 0;     // sum of k(logp, ref) over the tokens
  double entropy = 0;    // sum of H_t
  // On-policy mode only, over every target row (trained or not): the rollout/trainer mismatch of the update's
  // own log-probs against the engine's (|d| and w = e^d with d = logp - rollout), the entropy (when the rows
  // carry it) and k(logp, ref) (when they carry the reference's log-probs): what the separate forward before
  // the update measures otherwise.
  int64_t rows = 0;
  double diff_sum = 0, diff_max = 0, weight_sum = 0, weight_min = 0, weight_max = 0, row_entropy = 0, row_ref_kl = 0;
};

// The objective of an RL update. MicroBatch::token_values, shifted with the labels: [0] advantage,
// [1] old log-prob, [2] token weight w_t, [3] reference log-prob (when kl_coef > 0, or for the on-policy
// metrics), [4] the sample's id within the micro-batch (GSPO). Rows with label -100 (prompt, padding, a
// multi-turn observation) contribute nothing.
// on_policy (one epoch of one mini-batch): the old log-prob is the current one, detached (the ratio is 1),
// as when the trainer's forward before the update gave it; slot [1] then carries the rollout engine's
// log-probs, for the mismatch metrics only. No forward before the update is needed.
// measure_rows (default: on_policy): the row metrics of PolicyMetrics (the mismatch of the update's own
// log-probs against slot [1], the entropy, the reference KL), also off-policy (the batch-invariant mode, where
// slot [1] holds the rollout's log-probs, which are the trainer's: rl/grpo.cpp).
class PolicyObjective : public TokenObjective {
 public:
  explicit PolicyObjective(const PolicyLossConfig& c, bool on_policy = false);
  PolicyObjective(const PolicyLossConfig& c, bool on_policy, bool measure_rows);
  bool needs_entropy() const override { return cfg_.entropy_coef != 0; }
  double coefficients(const TokenRows& rows, Tensor& dlogp, Tensor* dentropy) const override;
  const PolicyMetrics& metrics() const { return metrics_; }
  void reset_metrics() { metrics_ = {}; }

  static constexpr int kAdvantage = 0, kOldLogp = 1, kWeight = 2, kRefLogp = 3, kSample = 4;

 private:
  PolicyLossConfig cfg_;
  bool on_policy_ = false, measure_rows_ = false;
  mutable PolicyMetrics metrics_;
};

}  // namespace mt::rl
