// What a model needs under a parallel layout, built in one place for the trainer, `moetrain grads`
// and the benchmark: the FSDP parameter source (experts sharded per ep group under expert
// parallelism), the expert dispatcher, and the hooks that make batch-wide statistics global.
#pragma once
#include <memory>

#include "model/qwen3_moe.h"
#include "moe/dispatcher.h"
#include "parallel/dist.h"
#include "parallel/fsdp.h"

namespace mt {

struct ParallelModel {
  std::unique_ptr<FsdpParams> fsdp;                // null in a single process
  std::unique_ptr<moe::ExpertDispatcher> dispatcher;  // null without expert parallelism and capacity
  // A capacity factor without expert parallelism: the dispatcher runs over a one-rank group of its own.
  std::unique_ptr<comm::Store> self_store;
  std::unique_ptr<comm::Communicator> self_comm;
  // Connects a model built on `fsdp` to the dispatcher and to the data-parallel statistics
  // (aux-loss counts summed over the ranks that hold other samples).
  void attach(Qwen3MoeModel& model, DistContext& dist) const;
};

// Validates the layout against the model (experts divisible by ep, ...) and builds the parts.
// capacity_factor > 0: each expert takes at most ceil(T K / E × cf) assignments per source rank
// (Megatron's rule; the lowest-weight ones are dropped); 0 = dropless.
ParallelModel make_parallel_model(DistContext& dist, const ModelConfig& c, const ParamTable& t, Device device,
                                  FsdpOptions opt = {}, double capacity_factor = 0);

}  // namespace mt
