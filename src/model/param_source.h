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
#include <functional>
#include <vector>

#include "core/streams.h"
#include "core/tensor.h"
#include "model/config.h"
#include "model/params.h"

namespace mt {

// A unit: pieces of the flat layout, concatenated in its buffer (piece i lands at dst_offset).
// Without expert parallelism every unit is one contiguous piece. With it, a sparse block is two
// units: the block without its experts (one piece), and this rank's experts (two pieces: its rows
// of gate_up_proj [E, 2F, D] and of down_proj [E, D, F]).
struct ParamUnit {
  std::vector<FlatRange> pieces;
  int64_t numel = 0;
  int64_t layer = -1;          // the block, or -1 for the embedding and the head
  bool local_experts = false;  // the experts [expert_begin, expert_end) of a sparse layer
  int64_t expert_begin = 0, expert_end = 0;
  // Tensor parallelism (parallel/tensor_parallel.h): 0 = the same on every tp rank (sharded over the
  // dense ranks, dp_shard × sp × tp), 1 = this tp rank's slices (sharded over the ranks with the same tp
  // coordinate), 2 = k/v slices of kv heads replicated over tp / G ranks (sharded over those too).
  int tp_group = 0;
  int64_t begin() const { return pieces.front().begin; }  // single-piece units
};

// The units of a model in the order the model uses them, for expert-parallel degree ep (rank
// ep_rank of its ep group owns experts [ep_rank E / ep, (ep_rank + 1) E / ep)).
struct UnitPlan {
  std::vector<ParamUnit> units;
  int embed = 0, head = 0;
  std::vector<int> block;    // per layer: the block's unit
  std::vector<int> experts;  // per layer: the unit of this rank's experts (ep > 1, sparse), else -1
  std::vector<int> tp_split, tp_kv;  // per layer, under tensor parallelism: tp_group 1 and 2 units, or -1
  int ep = 1, ep_rank = 0;
};
// Which parameters of a tp-local layout (c, t are then the tp-local config and table) are tp slices:
// q, o, k, v (kv_replicated: k, v go to a unit of their own), the dense MLPs, and with `experts`
// (etp = tp) the experts' F slices. Off: no tensor parallelism.
struct TpPlacement {
  bool on = false;
  bool experts = false;
  bool kv_replicated = false;
};
UnitPlan plan_units(const ModelConfig& c, const ParamTable& t, int ep = 1, int ep_rank = 0, const TpPlacement& tp = {});
// The single-piece units of ep = 1 (embedding, each block, head).
std::vector<ParamUnit> param_units(const ModelConfig& c, const ParamTable& t);

// Trainable: the source holds gradients (unit_grads) for a backward. Frozen: weights only (a reference
// model, a generator): no gradient memory, and asking for gradients is an error.
enum class Weights { Trainable, Frozen };

class ParamSource {
 public:
  virtual ~ParamSource() = default;
  virtual bool trainable() const { return true; }
  virtual const UnitPlan& plan() const = 0;
  // Compute-dtype weights of unit u (its pieces back to back, numel elements). Valid until
  // release_weights(u). Acquiring a unit that is already held returns the same memory.
  virtual Tensor acquire_weights(int u) = 0;
  virtual void release_weights(int u) = 0;
  virtual void prefetch(int u) { (void)u; }
  // f32 gradient of unit u for the current micro-batch, to accumulate into. Requesting it again
  // before grads_done(u) returns the same memory.
  virtual Tensor unit_grads(int u) = 0;
  virtual void grads_done(int u) = 0;
  // The model starts a forward (with its backward to follow when `backward`). Weights can change only
  // between passes, so a source that keeps gathered weights across calls drops them here.
  virtual void begin_pass(bool backward) { (void)backward; }
  // The f32 values of a parameter that the compute path reads in fp32 (fp32_compute_param(e.name):
  // the RMSNorm gains and the MoE routers), as a 1-D tensor of e.numel elements valid for the current
  // pass; undefined where the compute weights are the f32 masters themselves (the CPU), whose views
  // then already are fp32. On CUDA every source must give them: the kernels refuse a bf16 gain.
  virtual Tensor fp32_param(const ParamEntry& e) {
    (void)e;
    return {};
  }
};

// dst (bf16, on the device) = src (f32, host memory) element by element, in chunks of at most
// staging_elements values through one device staging buffer, converted on the device: a frozen source's
// refresh from host masters never holds a full-size f32 temporary on the device.
void cast_host_to_device(const Tensor& src, Tensor& dst, int64_t staging_elements);

// Every unit held in full on one device (no expert parallelism): the master weights, the gradients
// and (on CUDA) the bf16 compute copy are flat buffers over the whole model.
//
// A frozen source on CUDA (an RL reference model, a generator) never updates its masters on the device,
// so it keeps them in host memory: the device holds the bf16 compute copy and a small f32 buffer of the
// parameters the kernels read in fp32 (fp32_compute_param), 2 bytes a parameter instead of 6 (bench-4L:
// 6.2 GB instead of 18.7 GB). Whatever writes params() (loading, init, copying another model's weights)
// then calls refresh_compute_weights(), as on every other source.
class LocalParams final : public ParamSource {
 public:
  // keep_host_masters false (frozen on CUDA only): no f32 masters at all, only the device's bf16 copy and the
  // fp32 gains and routers: the frozen base of a LoRA run, whose f32 masters might not fit in host memory
  // (Qwen3-30B-A3B: 122 GB). fill_from_host writes it; params() is then undefined.
  LocalParams(const ModelConfig& c, const ParamTable& t, Device device, Weights weights = Weights::Trainable,
              bool keep_host_masters = true);
  bool trainable() const override { return grads_.defined(); }
  const UnitPlan& plan() const override { return plan_; }
  Tensor acquire_weights(int u) override;
  void release_weights(int) override {}
  Tensor unit_grads(int u) override;
  void grads_done(int) override {}
  // A view of the f32 masters; with host masters (frozen, CUDA) a view of the device buffer that
  // refresh_compute_weights() fills, and only for the fp32_compute_param entries (others: an error).
  Tensor fp32_param(const ParamEntry& e) override;

  // The optimizer's overlapped step (AdamW::step_overlapped): event u marks unit u's update, and
  // acquire_weights(u) makes the compute stream wait for it. Null: nothing to wait for.
  void wait_for(streams::EventSet* ready) { ready_ = ready; }
  // Each unit's [begin, end) in the flat buffers, in unit order (the order the forward uses them).
  std::vector<std::pair<int64_t, int64_t>> unit_ranges() const;

  // f32 master weights: on the source's device, or in host memory when host_masters().
  Tensor& params() { return params_; }
  Tensor& grads();  // f32; an error when frozen
  // bf16 on CUDA; on the CPU the master weights themselves.
  Tensor& compute() { return compute_; }
  bool has_compute_copy() const { return compute_.raw() != params_.raw(); }
  // Frozen on CUDA: params() is host memory while compute() is on the device.
  bool host_masters() const { return params_.device() != compute_.device(); }
  // The compute copy (and fp32_param's buffer) from params(). Host masters travel in chunks of at most
  // staging_elements f32 values through one device staging buffer and are converted to bf16 there, so
  // the device never holds a full-size f32 temporary (the default: 128 MB).
  static constexpr int64_t kStagingElements = int64_t(32) << 20;
  void refresh_compute_weights(int64_t staging_elements = kStagingElements);
  // Without masters: the compute copy (and the fp32 gains and routers) from host f32 values that produce(begin,
  // chunk) writes for the flat elements [begin, begin + chunk.numel()), one chunk of at most staging_elements
  // at a time (an init or a checkpoint's slices), so the host never holds more than one chunk.
  bool has_masters() const { return params_.defined(); }
  void fill_from_host(const std::function<void(int64_t, Tensor&)>& produce, int64_t staging_elements = kStagingElements);

 private:
  UnitPlan plan_;
  std::vector<ParamUnit>& units_ = plan_.units;
  Tensor params_, grads_, compute_;
  bool host_only_ = false;  // no f32 masters (keep_host_masters false)
  streams::EventSet* ready_ = nullptr;
  // Host masters only: the fp32_compute_param entries' values on the device, each placed at the same
  // offset modulo 64 elements (256 bytes) as in the flat layout, so that the kernels see the alignment
  // a trainable source's views of its masters have (the same GEMM algorithms, the same bits).
  struct Fp32Slot {
    int64_t flat = 0, at = 0, numel = 0;  // flat layout [flat, flat + numel) -> fp32_ [at, at + numel)
  };
  std::vector<Fp32Slot> fp32_slots_;  // in flat order
  Tensor fp32_;
};

}  // namespace mt
