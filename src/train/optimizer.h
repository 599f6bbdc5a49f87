// AdamW over the model's flat fp32 buffers, with global gradient-norm clipping and the
// non-finite skip rule: the norm is computed once over all gradients (one all-reduce under data
// parallelism, later), and every decision (clip factor, skip) is made from that one value, so all
// ranks take the same branch. A skipped step leaves parameters, moments and the step count as
// they were, and is counted.
#pragma once
#include <cstdint>
#include <functional>
#include <utility>
#include <vector>

#include "core/streams.h"
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
  ~AdamW() { join(); }  // the moments are freed on the compute stream: after the last update
  AdamW(const AdamW&) = delete;
  AdamW& operator=(const AdamW&) = delete;
  // One update of params from grads with learning rate lr. grads are read, not modified. When
  // compute is given (bf16, the weights the forward uses), it receives the updated params. With
  // sharded gradients, global_grad_sq returns the squared norm over every shard (one collective that
  // every rank makes); by default it is the local sum of squares. After overlap_units, the overlapped step.
  OptimStepResult step(Tensor& params, const Tensor& grads, double lr, Tensor* compute = nullptr,
                       const std::function<double()>& global_grad_sq = {});
  // The overlapped step (config optimizer_overlap; CUDA; on the CPU it runs in place, in order): the norm and the decision as in
  // step, then each unit's update on the side stream (core/streams.h), units in the given order
  // ([begin, end) ranges of the flat buffers that tile them), ready() event i marking unit i.
  // Nothing waits here: whoever reads unit i's weights next waits for ready() event i first
  // (LocalParams::acquire_weights does), and join() makes the compute stream wait for every update.
  // The result is bit-identical to step (the update is elementwise; the same kernel runs on slices).
  OptimStepResult step_overlapped(Tensor& params, const Tensor& grads, double lr, Tensor* compute,
                                  const std::vector<std::pair<int64_t, int64_t>>& units,
                                  const std::function<double()>& global_grad_sq = {});
  // From now on step() runs as step_overlapped over these units (the trainer's and train_step's
  // one-device optimizer_overlap; empty: in line again).
  void overlap_units(std::vector<std::pair<int64_t, int64_t>> units) { units_ = std::move(units); }
  streams::EventSet& ready() { return ready_; }
  // The compute stream waits for the last overlapped step's updates (before anything but the next
  // forward reads the weights or the optimizer state: a checkpoint, an evaluation, the end of training).
  void join() { ready_.compute_waits_all(); }
  int64_t steps_taken() const { return step_; }
  const AdamWConfig& config() const { return cfg_; }
  void set_config(const AdamWConfig& c) { cfg_ = c; }  // betas, eps, decay, clipping from the next step (moments kept)
  int64_t steps_skipped() const { return skipped_; }
  Tensor& exp_avg() { return m_; }
  Tensor& exp_avg_sq() { return v_; }
  void set_state(int64_t steps_taken, int64_t steps_skipped) {
    step_ = steps_taken;
    skipped_ = steps_skipped;
  }

 private:
  // The norm, the skip rule and the hyperparameters, shared by step and step_overlapped; false: skip.
  bool decide(const Tensor& params, const Tensor& grads, double lr, const std::function<double()>& global_grad_sq,
              OptimStepResult& r, ops::AdamWHyper& h);
  AdamWConfig cfg_;
  Device device_;
  Tensor m_, v_;
  streams::EventSet ready_;
  std::vector<std::pair<int64_t, int64_t>> units_;  // overlap_units
  int64_t step_ = 0, skipped_ = 0;
};

// torch.nn.utils.clip_grad_norm_'s factor: min(1, max_norm / (norm + 1e-6)); 1 when max_norm <= 0.
double clip_factor(double grad_norm, double max_norm);

}  // namespace mt
