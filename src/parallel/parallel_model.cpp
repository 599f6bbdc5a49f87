#include "parallel/parallel_model.h"

namespace mt {

ParallelModel make_parallel_model(DistContext& dist, const ModelConfig& c, const ParamTable& t, Device device,
                                  FsdpOptions opt, double capacity_factor) {
  ParallelModel pm;
  if (capacity_factor < 0) MT_THROW("capacity factor ", capacity_factor, " must be >= 0 (0 = dropless)");
  moe::DispatcherOptions dopt;
  dopt.capacity_factor = capacity_factor;
  const bool ep = dist.distributed() && dist.mesh().size(Axis::Ep) > 1;
  if (capacity_factor > 0 && !ep) {
    pm.self_store = comm::make_memory_store();
    pm.self_comm = comm::make_world(device, 0, 1, *pm.self_store, comm::CommOptions{});
    pm.dispatcher = std::make_unique<moe::ExpertDispatcher>(*pm.self_comm, c.num_experts, dopt);
  }
  if (!dist.distributed()) return pm;
  const DeviceMesh& m = dist.mesh();
  if (m.size(Axis::Tp) > 1) MT_THROW("tp ", m.size(Axis::Tp), ": tensor parallelism is not implemented yet");
  if (m.size(Axis::Sp) > 1) {
    // Ulysses: dense parameters see different tokens on every sp rank, so they are sharded (and their
    // gradients summed) over dp_shard × sp (dist.dense_shard()).
    check_sp_heads(c, m.size(Axis::Sp));
    pm.ulysses =
        std::make_unique<UlyssesExchange>(*dist.sp(), c.num_attention_heads, c.num_key_value_heads, c.head_dim);
  }
  ExpertGroups eg;
  if (m.size(Axis::Ep) > 1) {
    m.check_experts(int(c.num_experts));
    eg.ep = dist.ep();
    eg.expert_shard = dist.expert_dp();
    pm.dispatcher = std::make_unique<moe::ExpertDispatcher>(*dist.ep(), c.num_experts, dopt);
  }
  ReduceComms rc{dist.dense_shard_reduce(), dist.expert_dp_reduce()};
  pm.fsdp = std::make_unique<FsdpParams>(c, t, device, *dist.dense_shard(), dist.dp_replicate(), opt, eg, rc);
  return pm;
}

void ParallelModel::init_weights(Qwen3MoeModel& m, const ParamTable& t, uint64_t seed) const {
  Tensor& dst = master(m);
  Tensor host = Tensor::zeros({dst.numel()});
  init_weights_ranges(m.config(), t, pieces(t), host, seed);
  dst.copy_from(host.to(dst.device()));
}

std::function<double()> ParallelModel::global_grad_sq() const {
  if (!fsdp) return {};
  FsdpParams* f = fsdp.get();
  return [f] { return f->global_grad_sq(); };
}

void ParallelModel::attach(Qwen3MoeModel& model, DistContext& dist) const {
  model.dispatcher = dispatcher.get();
  model.ulysses = ulysses.get();
  if (!dist.distributed() || !model.aux_enabled()) return;
  // Counts and sums over every rank with other samples or other tokens (dp × sp); the model's row
  // count already covers its whole sequences, so only the data-parallel ranks multiply it.
  const int n = dist.dp_size();
  comm::Communicator* dp = dist.dp_sp();
  model.reduce_aux_stats = [dp, n](Tensor& counts, Tensor& sums, int64_t& rows) {
    dp->all_reduce(counts)->wait();
    dp->all_reduce(sums)->wait();
    rows *= n;
  };
}

}  // namespace mt
