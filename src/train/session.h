// The set-up every entry point that runs the model shares (the trainer, `moetrain grads`, the
// train_step benchmark; the RL loop next): the distributed context, the global parameter table, the
// parallel parts (FSDP, expert dispatcher, Ulysses exchange, tensor parallelism) and the model built
// on them, its weights initialised or loaded, and each rank's share of a global micro-batch.
//
// And one training step, train_step: the micro-batches' forward and backward with the gradients
// accumulated, the objective normalised over the whole step, the optimizer (clipping, skip on a
// non-finite norm), the expert load and balancing bias, and the metrics reduced over the ranks. The
// trainer (pretraining, SFT) and the RL loop call it with their own objective.
//
// What stays with the caller: the data source, the learning-rate schedule, evaluation, checkpoints and
// what to log (train/metrics.h writes the per-step JSON lines).
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "model/hf_checkpoint.h"
#include "model/qwen3_moe.h"
#include "parallel/dist.h"
#include "parallel/fsdp.h"
#include "parallel/parallel_model.h"
#include "train/load_balance.h"
#include "train/optimizer.h"

namespace mt {

struct SessionOptions {
  Device device = Device::CPU;
  DistOptions dist;                       // mesh degrees and communicator options
  FsdpOptions fsdp;                       // used when there is more than one rank
  double moe_capacity_factor = 0;         // 0: dropless
  Recompute recompute = Recompute::None;  // what train passes use (PassOptions::recompute)
  ModelOptions model;                     // prefetch depth, EP overlap, fusions (score_before_experts: ModelConfig)
  // Frozen: weights only (a generator, a reference model): no gradients, and make_optimizer refuses.
  Weights weights = Weights::Trainable;
  // Run on another session's distributed context (its mesh and communicators; `dist` is then unused)
  // instead of creating one: a second model in the same ranks (RL's reference and critic), since a process
  // rendezvouses once. That session must outlive this one; every rank creates its sessions in one order.
  DistContext* shared_dist = nullptr;
  // Low-rank adapters (model/lora.h; rank 0: none): the base is then frozen whatever `weights` says, the
  // adapters (initialised from lora_seed) are what trains (trainable_params), and the optimizer, clipping
  // and checkpoints' training state cover them only. On one process, under FSDP / HSDP, expert, sequence and
  // tensor parallelism (the adapters whole on every rank, under tp each rank using its slice, their gradients
  // summed over the ranks with other rows, tokens or slices); adapted experts under etp > 1 are refused.
  LoraSpec lora;
  uint64_t lora_seed = 0;
};

class TokenObjective;  // model/objective.h

struct StepOptions {
  double lr = 0;
  // The objective of every micro-batch: cross-entropy averaged over the target tokens of the whole
  // step on all ranks (null), or a per-token objective whose normalisers the caller fixed beforehand.
  const TokenObjective* objective = nullptr;
  double temperature = 1.0;  // the head's logits / T (PassOptions::temperature): RL at the sampler's T
  // The head computes every row's entropy for the objective to read (PassOptions::token_entropy; its metrics),
  // besides any the objective asks for itself (TokenObjective::needs_entropy); no gradient flows through it.
  bool token_entropy = false;
  double aux_loss_coef = 0;            // the load-balancing loss (used only when the model's aux loss is on)
  double router_z_loss_coef = 0;       // averaged over the router rows of the step
  double router_bias_update_rate = 0;  // aux-loss-free balancing (the model's router bias must be enabled)
  // Zero the gradients before the first micro-batch instead of writing them (=) there: the A/B of
  // train_step --zero-grads; the results are the same.
  bool zero_grads = false;
  // Every this many steps (0: never), the communicators' schedules are compared across ranks and,
  // under HSDP, the replicas of the master weights checked bit for bit.
  int64_t schedule_check_every = 0;
  bool check_replicas = false;
  // Called on every rank after each micro-batch (index, count, its result): progress.
  std::function<void(int64_t, int64_t, const LossParts&)> on_micro_batch;
  // Frozen parameters (by HF name, e.g. the routers in RL): their gradients are zeroed before the norm and
  // the update, and their values put back after it (AdamW's weight decay would move them), on every rank's
  // shard. Null: every parameter trains.
  std::function<bool(const std::string&)> frozen;
};

// One step's results, the sums reduced over every rank (every rank gets the same values).
struct StepResult {
  int64_t tokens = 0, targets = 0;  // of the global micro-batches
  int64_t real_tokens = 0;          // tokens less the padding of packed rows (the z-loss's router rows)
  double ce_sum = 0;                // summed token cross-entropies (-logp on the objective path)
  double objective_sum = 0;         // the per-token objective's value (0 without one)
  double aux = 0;                   // the load-balancing loss, averaged over the micro-batches
  double z_sum = 0;                 // router z-loss summed over every router row of the step
  double ce = 0, z = 0;             // ce_sum / targets, z_sum / router rows
  double loss = 0;                  // ce (or objective) + aux_loss_coef aux + router_z_loss_coef z
  OptimStepResult opt;
  bool has_load = false;      // the model has sparse layers
  ExpertLoadStats load;       // the step's per-expert load over all ranks
  int64_t dropped_rank0 = 0;  // assignments this rank dropped at the experts' capacity
  double forward_s = 0, backward_s = 0, optimizer_s = 0;
  double comm_wait_s = 0, comm_wait_max_s = 0;  // this rank's / the slowest rank's (FSDP)
  double peak_bytes_max_rank = 0;               // the largest peak memory of any rank
  bool replicas_checked = false;
  FsdpParams::ReplicaReport replicas;
};

size_t peak_rss_bytes();  // this process's peak resident memory

class TrainSession {
 public:
  // Creates the distributed context (collective over the world when there is more than one rank),
  // the parallel parts and the model on `global` (the model itself gets the tp-local config).
  TrainSession(const ModelConfig& global, const SessionOptions& opt);
  TrainSession(const TrainSession&) = delete;
  TrainSession& operator=(const TrainSession&) = delete;

  DistContext& dist() { return *dist_; }
  const ModelConfig& config() const { return config_; }  // the global config
  const ParamTable& table() const { return table_; }     // the global table
  ParallelModel& parallel() { return pm_; }
  FsdpParams* fsdp() { return pm_.fsdp.get(); }
  Qwen3MoeModel& model() { return *model_; }
  Device device() const { return device_; }
  Recompute recompute() const { return recompute_; }

  // This rank's parameter buffers (see ParallelModel): f32 masters, f32 gradients, the compute copy.
  // (With adapters these are the frozen base's; master() is what loading and init write.)
  Tensor& master() { return pm_.master(*model_); }
  Tensor& grads() { return pm_.grads(*model_); }
  Tensor* compute() { return pm_.compute(*model_); }

  // HF-style random init of this rank's pieces, then the compute copy.
  void init_weights(uint64_t seed);
  // This rank's slices of an HF checkpoint, read from the files (every rank must see them), then the
  // compute copy; and the model's routing bias when the directory has one (load_router_bias; collective
  // over the world then, so every rank calls load).
  LoadReport load(const std::string& dir);
  // The aux-loss-free balancing bias saved beside a checkpoint (dir/router_bias.safetensors, train/
  // load_balance.h): part of the model's routing, so every command that runs a checkpoint routes with it.
  // When the file exists the model's bias is enabled and set to it on every rank (rank 0 reads it and
  // broadcasts it: some ranks may not see the files; the routing must be the same function on all of
  // them); it changes only in train_step with a router_bias_update_rate > 0. Returns whether there was one.
  // Collective over the world when distributed; a model without sparse layers has none (false, no collective).
  bool load_router_bias(const std::string& dir);
  void refresh_compute_weights() { pm_.refresh_compute_weights(*model_); }
  // What the optimizer updates: the adapters' f32 values and gradients with LoRA, else master() and grads().
  LoraAdapters* lora() { return lora_.get(); }
  Tensor& trainable_params() { return lora_ ? lora_->params() : master(); }
  Tensor& trainable_grads() { return lora_ ? lora_->grads() : grads(); }

  // This rank's part of a global micro-batch of whole sequences [B, S] (the same on every rank): its
  // data-parallel rows, planned (model/micro_batch.h): under sequence parallelism its chunk of every
  // sequence, padded for tp. B must divide by the data-parallel size (the error names both).
  MicroBatch local_micro_batch(const MicroBatch& global);

  // The optimizer over this rank's master weights; overlap (one device, CUDA): each unit's update runs
  // beside the next forward (train/optimizer.h). Once, before the first train_step.
  void make_optimizer(const AdamWConfig& oc, bool overlap);
  AdamW& optimizer();
  bool optimizer_ready() const { return opt_ != nullptr; }
  // One training step over global micro-batches of whole sequences (the same on every rank; each rank
  // takes its part): see the file comment. Collective over the world.
  StepResult train_step(const std::vector<MicroBatch>& global, const StepOptions& opt);
  // train_step in its two halves (the Python trainer's forward_backward and optim_step): the forward and
  // backward of global micro-batches, whose gradients add to those of the earlier calls since the last
  // optimizer_step (the first call writes them; the CE normaliser is each call's own target count), its loss
  // metrics reduced over the ranks; then the optimizer on the accumulated gradients (clipping, frozen
  // parameters, the expert load and balancing bias), filling r's optimizer fields. Both collective.
  StepResult forward_backward(const std::vector<MicroBatch>& global, const StepOptions& opt);
  void optimizer_step(const StepOptions& opt, StepResult& r);
  bool grads_pending() const { return grads_pending_; }
  // Drops the accumulated gradients (an interrupted forward_backward): the next forward_backward writes afresh.
  void discard_grads() { grads_pending_ = false; }
  int64_t steps_done() const { return steps_; }
  void set_steps_done(int64_t steps) { steps_ = steps; }  // a resumed run continues the count
  MicroBatch local_micro_batch(const Tensor& ids_BS, const Tensor& labels_BS) {
    return local_micro_batch(MicroBatch{ids_BS, labels_BS});
  }

 private:
  ModelConfig config_;
  Device device_;
  Recompute recompute_;
  std::unique_ptr<DistContext> own_dist_;  // null on a shared context (SessionOptions::shared_dist)
  DistContext* dist_ = nullptr;
  ParamTable table_;
  ParallelModel pm_;
  std::unique_ptr<Qwen3MoeModel> model_;
  std::unique_ptr<LoraAdapters> lora_;
  GradSync grad_sync_;
  std::unique_ptr<AdamW> opt_;
  int64_t steps_ = 0;
  int64_t n_sparse_ = 0;
  bool grads_pending_ = false;  // forward_backward ran since the last optimizer_step
  // The halves with the loss sums' reduction in either: forward_backward's own collective, or train_step's one
  // collective after the optimizer.
  StepResult forward_backward(const std::vector<MicroBatch>& global, const StepOptions& so, bool reduce_sums);
  void optimizer_step(const StepOptions& so, StepResult& r, bool reduce_sums);
  void set_loss(StepResult& r, const StepOptions& so) const;  // ce, z and loss from the sums
};

}  // namespace mt
