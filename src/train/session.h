// The set-up every entry point that runs the model shares (the trainer, `moetrain grads`, the
// train_step benchmark; the RL loop next): the distributed context, the global parameter table, the
// parallel parts (FSDP, expert dispatcher, Ulysses exchange, tensor parallelism) and the model built
// on them, its weights initialised or loaded, and each rank's share of a global micro-batch.
//
// What stays with the caller: the data source, the optimizer and the step loop (P8b's next part moves
// the step machinery here as train_step(micro_batches, objective)).
#pragma once
#include <cstdint>
#include <memory>
#include <string>

#include "model/hf_checkpoint.h"
#include "model/qwen3_moe.h"
#include "parallel/dist.h"
#include "parallel/fsdp.h"
#include "parallel/parallel_model.h"

namespace mt {

struct SessionOptions {
  Device device = Device::CPU;
  DistOptions dist;                  // mesh degrees and communicator options
  FsdpOptions fsdp;                  // used when there is more than one rank
  double moe_capacity_factor = 0;    // 0: dropless
  Recompute recompute = Recompute::None;
  bool score_before_experts = false;
};

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

  // This rank's parameter buffers (see ParallelModel): f32 masters, f32 gradients, the compute copy.
  Tensor& master() { return pm_.master(*model_); }
  Tensor& grads() { return pm_.grads(*model_); }
  Tensor* compute() { return pm_.compute(*model_); }

  // HF-style random init of this rank's pieces, then the compute copy.
  void init_weights(uint64_t seed);
  // This rank's slices of an HF checkpoint, read from the files (every rank must see them), then the
  // compute copy.
  LoadReport load(const std::string& dir);
  void refresh_compute_weights() { pm_.refresh_compute_weights(*model_); }

  // This rank's part of a global micro-batch [B, S] (the same on every rank): its data-parallel rows,
  // then, under sequence parallelism, its chunk of every sequence (planned from the whole rows,
  // padded for tp). B must divide by the data-parallel size (the error names both).
  MicroBatch local_micro_batch(const Tensor& ids_BS, const Tensor& labels_BS);

 private:
  ModelConfig config_;
  Device device_;
  std::unique_ptr<DistContext> dist_;
  ParamTable table_;
  ParallelModel pm_;
  std::unique_ptr<Qwen3MoeModel> model_;
};

}  // namespace mt
