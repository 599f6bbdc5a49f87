// The critic's loss for PPO: clipped value regression, as in PPO implementations (OpenAI baselines'
// ppo2, veRL's compute_value_loss, TRL's PPOTrainer):
//   L = 0.5 sum_t w_t max((v_t - R_t)^2, (v_old_t + clip(v_t - v_old_t, -eps, eps) - R_t)^2)
// over target rows, with R_t the GAE return, v_old_t the critic's value at rollout and w_t a per-token
// weight the caller fixed (e.g. 1 / response tokens of the mini-batch): a sum of per-token terms
// (objective.h's contract). eps <= 0: no clipping, L = 0.5 sum_t w_t (v_t - R_t)^2.
// dL/dv_t = w_t (v_t - R_t) where the unclipped side is the larger (ties: unclipped), else
// w_t (v_clip_t - R_t) when v_t - v_old_t lies strictly inside (-eps, eps), and 0 where the clipped
// value is at its bound (the clipped side does not depend on v_t there).
#pragma once
#include <cstdint>

#include "model/objective.h"

namespace mt::rl {

struct ValueMetrics {
  double loss = 0;       // the weighted sum, as in the loss
  double sq_err = 0;     // sum of (v - R)^2 over the tokens (unweighted)
  double value_sum = 0;  // sum of v_t
  int64_t tokens = 0;    // target rows with w != 0
  int64_t clipped = 0;   // tokens whose clipped side was the larger and at its bound (zero gradient)
};

// MicroBatch::token_values, shifted with the labels: [0] return R_t, [1] old value v_old_t, [2] weight w_t.
class ValueLossObjective : public ValueObjective {
 public:
  explicit ValueLossObjective(double clip_eps) : eps_(clip_eps) {}
  double value_coefficients(const TokenRows& rows, Tensor& dv) const override;
  const ValueMetrics& metrics() const { return metrics_; }
  static constexpr int kReturn = 0, kOldValue = 1, kWeight = 2;

 private:
  double eps_;
  mutable ValueMetrics metrics_;
};

// One token's term and its dL/dv (value_loss.cpp; the objective's arithmetic, exposed for tests).
struct ValueTerm {
  double loss = 0, grad = 0;
  bool clipped = false;
};
ValueTerm value_term(double v, double ret, double v_old, double w, double clip_eps);

}  // namespace mt::rl
