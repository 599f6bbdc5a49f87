// Where the model's weights come from and where its gradients go, one unit at a time. Units are the
// grain of parameter sharding: unit 0 is the embedding, unit 1 + l is transformer block l, and the
// last unit (L + 1) is the head (final norm, and lm_head when untied). Each unit is one contiguous
// range of the flat ParamTable layout, so a unit is one all-gather and one reduce-scatter under FSDP.
//
// The model calls, in its fixed order: acquire_weights(u) before it reads unit u, release_weights(u)
// after; unit_grads(u) before it accumulates (+=) into unit u's gradient in a micro-batch, and
// grads_done(u) once no more contributions to that gradient come in the micro-batch. prefetch(u) is a
// hint that acquire_weights(u) comes next. The order of these calls is the same on every rank and in
// recompute (recompute happens between acquire and release of the same unit), which is what keeps
// the collectives behind them in step.
//
// LocalParams holds every unit in full (one device, or plain data parallelism): acquiring is a view,
// grads accumulate across micro-batches until zero_grads().
#pragma once
#include <vector>

#include "core/tensor.h"
#include "model/config.h"
#include "model/params.h"

namespace mt {

struct ParamUnit {
  int64_t begin = 0, end = 0;  // elements [begin, end) of the flat layout
  int64_t numel() const { return end - begin; }
};
// The units of a model: embedding, each block, head.
std::vector<ParamUnit> param_units(const ModelConfig& c, const ParamTable& t);

class ParamSource {
 public:
  virtual ~ParamSource() = default;
  // Compute-dtype weights of unit u (numel() elements of the flat layout from its begin). Valid until
  // release_weights(u). Acquiring a unit that is already held returns the same memory.
  virtual Tensor acquire_weights(int u) = 0;
  virtual void release_weights(int u) = 0;
  virtual void prefetch(int u) { (void)u; }
  // f32 gradient of unit u for the current micro-batch, to accumulate into. Requesting it again
  // before grads_done(u) returns the same memory.
  virtual Tensor unit_grads(int u) = 0;
  virtual void grads_done(int u) = 0;
};

// Every unit held in full on one device: the master weights, the gradients and (on CUDA) the bf16
// compute copy are flat buffers over the whole model.
class LocalParams final : public ParamSource {
 public:
  LocalParams(const ModelConfig& c, const ParamTable& t, Device device);
  Tensor acquire_weights(int u) override;
  void release_weights(int) override {}
  Tensor unit_grads(int u) override;
  void grads_done(int) override {}

  Tensor& params() { return params_; }  // f32 master weights
  Tensor& grads() { return grads_; }    // f32
  // bf16 on CUDA; on the CPU the master weights themselves.
  Tensor& compute() { return compute_; }
  bool has_compute_copy() const { return compute_.raw() != params_.raw(); }
  void refresh_compute_weights();

 private:
  std::vector<ParamUnit> units_;
  Tensor params_, grads_, compute_;
};

}  // namespace mt
