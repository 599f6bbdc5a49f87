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
  const int tp = m.size(Axis::Tp), etp = m.size(Axis::Etp);
  TpGroups tg;
  comm::Communicator* shard = dist.dense_shard();
  ReduceComms rc{dist.dense_shard_reduce(), dist.expert_shard_reduce()};
  if (tp > 1) {
    // Every tp rank holds the tp-local layout; tp-replicated units are sharded over the dense ranks.
    pm.tp = std::make_shared<TpLayout>(c, tp, etp);
    pm.tp_comms = make_tp_comms(dist, *pm.tp);
    tg = TpGroups{pm.tp->placement(), pm.tp_comms.split, pm.tp_comms.kv, pm.tp_comms.split_reduce,
                  pm.tp_comms.kv_reduce};
    shard = pm.tp_comms.dense;
    rc.shard = pm.tp_comms.dense_reduce;
  }
  const ModelConfig& lc = pm.model_config(c);
  const ParamTable& lt = pm.tp ? pm.tp->local_table() : t;
  if (m.size(Axis::Sp) > 1) {
    // Ulysses: dense parameters see different tokens on every sp rank, so they are sharded (and their
    // gradients summed) over dp_shard × sp (dist.dense_shard(), or the tp groups, which include sp).
    // Under tp the exchange moves this tp rank's heads (the tp-local config): attention heads are
    // split over tp first, then over sp.
    if (tp > 1 && lc.num_attention_heads % m.size(Axis::Sp) != 0)
      MT_THROW("num_attention_heads (", c.num_attention_heads, ") must be divisible by tp × sp (", tp, " × ",
               m.size(Axis::Sp), "): each tp rank's ", lc.num_attention_heads, " heads are split over the sp ranks");
    check_sp_heads(lc.num_attention_heads, lc.num_key_value_heads, m.size(Axis::Sp));
    pm.ulysses =
        std::make_unique<UlyssesExchange>(*dist.sp(), lc.num_attention_heads, lc.num_key_value_heads, lc.head_dim);
  }
  ExpertGroups eg;
  if (m.size(Axis::Ep) > 1) {
    m.check_experts(int(c.num_experts));
    eg.ep = dist.ep();
    eg.expert_shard = dist.expert_shard();
    pm.dispatcher = std::make_unique<moe::ExpertDispatcher>(*dist.ep(), c.num_experts, dopt);
  }
  pm.fsdp = std::make_unique<FsdpParams>(lc, lt, device, *shard, dist.dp_replicate(), opt, eg, rc, tg);
  return pm;
}

void ParallelModel::init_weights(Qwen3MoeModel& m, const ParamTable& t, uint64_t seed) const {
  Tensor& dst = master(m);
  // Host masters (the CPU, or a frozen CUDA model's) are written in place: no second full-size buffer.
  Tensor host = dst.is_cpu() ? dst : Tensor::zeros({dst.numel()});
  if (dst.is_cpu()) dst.zero_();
  init_weights_ranges(tp ? tp->global_config() : m.config(), t, pieces(t), host, seed);
  if (!dst.is_cpu()) dst.copy_from(host);
}

std::function<double()> ParallelModel::global_grad_sq() const {
  if (!fsdp) return {};
  FsdpParams* f = fsdp.get();
  return [f] { return f->global_grad_sq(); };
}

Tensor ParallelModel::gather_param_host(const ParamEntry& e, bool grads) const {
  MT_CHECK(fsdp, "gather_param_host needs a sharded model");
  if (!tp) return fsdp->gather_param_host(e, grads);
  FsdpParams* f = fsdp.get();
  return tp->gather_global(e, tp_comms.tp,
                           [f, grads](const ParamEntry& le) { return f->gather_param_host(le, grads); });
}

void ParallelModel::attach(Qwen3MoeModel& model, DistContext& dist) const {
  ModelWiring w;
  w.dispatcher = dispatcher.get();
  w.tp = tp ? tp_comms.tp : nullptr;
  w.expert_tp = tp && tp->etp() > 1;
  w.ulysses = ulysses.get();
  if (dist.distributed() && model.aux_enabled()) {
    // Under tp every rank routes rows of its own: the statistics are summed over the world. Under sp the
    // counts and sums come from every rank with other samples or other tokens (dp × sp, and × tp with
    // tp). The model's row count covers the real tokens of its whole sequences (all sp and tp ranks of
    // its data-parallel rank together, padding excluded): the same on the group's size / dp ranks that
    // share a data-parallel rank, so the group's sum divided by that is the sum over data-parallel
    // ranks (packed rows give each data-parallel rank its own count).
    const int n = dist.dp_size();
    comm::Communicator* dp = tp ? dist.world() : dist.dp_sp();
    w.reduce_aux_stats = [dp, n](Tensor& counts, Tensor& sums, int64_t& rows) {
      dp->all_reduce(counts)->wait();
      dp->all_reduce(sums)->wait();
      Tensor r = Tensor::empty({1}, DType::I64);
      r.data<int64_t>()[0] = rows;
      Tensor rd = r.to(counts.device());
      dp->all_reduce(rd)->wait();
      device_mem::synchronize(counts.device());
      rows = rd.to(Device::CPU).data<int64_t>()[0] / (dp->size() / n);
    };
  }
  model.attach(std::move(w));
}

}  // namespace mt
