// What a model needs under a parallel layout, built in one place for the trainer, `moetrain grads`
// and the benchmark: the FSDP parameter source (experts sharded per ep group under expert
// parallelism), the expert dispatcher, and the hooks that make batch-wide statistics global.
#pragma once
#include <memory>

#include "model/qwen3_moe.h"
#include "moe/dispatcher.h"
#include "parallel/dist.h"
#include "parallel/fsdp.h"
#include "parallel/tensor_parallel.h"
#include "moe/ulysses.h"

namespace mt {

struct ParallelModel {
  std::unique_ptr<FsdpParams> fsdp;                // null in a single process
  std::unique_ptr<moe::ExpertDispatcher> dispatcher;  // null without expert parallelism and capacity
  std::unique_ptr<UlyssesExchange> ulysses;           // null without sequence parallelism
  // A capacity factor without expert parallelism: the dispatcher runs over a one-rank group of its own.
  std::unique_ptr<comm::Store> self_store;
  std::unique_ptr<comm::Communicator> self_comm;
  // Tensor parallelism (tp > 1): the tp-local layout and the tp communicators. The model is then built
  // on model_config() (the tp-local config) while init, loading, saving and gathered gradients speak
  // the global layout: pieces() are global flat ranges, gather_param_host() global tensors.
  std::shared_ptr<TpLayout> tp;
  TpComms tp_comms;
  // The config to build the Qwen3MoeModel with: the tp-local one under tensor parallelism.
  const ModelConfig& model_config(const ModelConfig& global) const { return tp ? tp->local_config() : global; }
  // Connects a model built on `fsdp` to the dispatcher, the Ulysses exchange and to the data-parallel
  // statistics (aux-loss counts summed over the ranks that hold other samples or other tokens).
  void attach(Qwen3MoeModel& model, DistContext& dist) const;

  // This rank's parameter buffers, whether the model holds them all (one process) or FSDP shards
  // them: f32 masters, f32 gradients, the compute copy (null when the masters are read directly),
  // and the pieces of the flat layout they hold (for init and loading).
  Tensor& master(Qwen3MoeModel& m) const { return fsdp ? fsdp->params() : m.params(); }
  Tensor& grads(Qwen3MoeModel& m) const { return fsdp ? fsdp->grads() : m.grads(); }
  Tensor* compute(Qwen3MoeModel& m) const { return fsdp ? fsdp->compute_params() : m.compute_params(); }
  std::vector<FlatRange> pieces(const ParamTable& t) const {
    if (tp) return tp->to_global(tp_comms.tp_rank, fsdp->owned_pieces());
    return fsdp ? fsdp->owned_pieces() : std::vector<FlatRange>{{0, t.total(), 0}};
  }
  // One parameter of the global table (values or gradient), host f32 in its global shape, on every
  // rank. Collective over the ranks that hold its pieces (FSDP shards, ep groups, tp ranks).
  Tensor gather_param_host(const ParamEntry& global, bool grads) const;
  void refresh_compute_weights(Qwen3MoeModel& m) const {
    if (fsdp) fsdp->refresh_compute_weights();
    else m.refresh_compute_weights();
  }
  // HF-style random init of this rank's pieces (the values of the full init_weights); the caller
  // then refreshes the compute copy once, as after loading.
  // (t: the global table.)
  void init_weights(Qwen3MoeModel& m, const ParamTable& t, uint64_t seed) const;
  // The global squared gradient norm for AdamW::step (empty in one process: the local sum).
  std::function<double()> global_grad_sq() const;
};

// Validates the layout against the model (experts divisible by ep, ...) and builds the parts.
// capacity_factor > 0: each expert takes at most ceil(T K / E × cf) assignments per source rank
// (Megatron's rule; the lowest-weight ones are dropped); 0 = dropless.
ParallelModel make_parallel_model(DistContext& dist, const ModelConfig& c, const ParamTable& t, Device device,
                                  FsdpOptions opt = {}, double capacity_factor = 0);

}  // namespace mt
