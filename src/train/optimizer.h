// AdamW over the model's flat fp32 buffers, with global gradient-norm clipping and the
// non-finite skip rule: the norm is computed once over all gradients (one all-reduce under data
// parallelism, later), and every decision (clip factor, skip) is made from that one value, so all
// ranks take the same branch. A skipped step leaves parameters, moments and the step count as
// they were, and is counted.
#pragma once
#include <cstdint>
#include <functional>

#include "core/tensor.h"
#include "ops/ops.h"

namespace mt {

struct AdamWConfig {
  double beta1 = 0.9, beta2 = 0.95, eps = 1e-8, weight_decay = 0.1;
  double max_grad_norm = 1.0;  // <= 0: no clipping
};

struct OptimStepResult {
  double grad_norm = 0;   // global L2 norm before clipping (may be inf/nan)
  double clip_scale = 1;  // factor the gradients were multiplied by
  bool skipped = false;   // the norm was not finite: nothing was updated
};

class AdamW {
 public:
  AdamW(int64_t numel, Device device, const AdamWConfig& cfg);
  // One update of params from grads with learning rate lr. grads are read, not modified. When
  // compute is given (bf16, the weights the forward uses), it receives the updated params. With
  // sharded gradients, global_grad_sq returns the squared norm over every shard (one collective that
  // every rank makes); by default it is the local sum of squares.
  OptimStepResult step(Tensor& params, const Tensor& grads, double lr, Tensor* compute = nullptr,
                       const std::function<double()>& global_grad_sq = {});
  int64_t steps_taken() const { return step_; }
  int64_t steps_skipped() const { return skipped_; }
  Tensor& exp_avg() { return m_; }
  Tensor& exp_avg_sq() { return v_; }
  void set_state(int64_t steps_taken, int64_t steps_skipped) {
    step_ = steps_taken;
    skipped_ = steps_skipped;
  }

 private:
  AdamWConfig cfg_;
  Tensor m_, v_;
  int64_t step_ = 0, skipped_ = 0;
};

// torch.nn.utils.clip_grad_norm_'s factor: min(1, max_norm / (norm + 1e-6)); 1 when max_norm <= 0.
double clip_factor(double grad_norm, double max_norm);

}  // namespace mt
