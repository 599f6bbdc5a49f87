#include "train/session.h"

#include <sys/resource.h>

#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <cstdlib>

#include "comm/communicator.h"
#include "core/clock.h"
#include "data/batch.h"
#include "model/micro_batch.h"
#include "model/objective.h"
#include "ops/ops.h"

namespace mt {

namespace {

// Fault injection for the multi-rank tests: "RANK:STEP" (1-based step) from the environment.
bool debug_hit(const char* var, int rank, int64_t step) {
  const char* v = std::getenv(var);
  if (!v) return false;
  int r = -1;
  long long s = -1;
  if (std::sscanf(v, "%d:%lld", &r, &s) != 2) MT_THROW(var, "='", v, "' must be RANK:STEP");
  return r == rank && s == step;
}

}  // namespace

size_t peak_rss_bytes() {
  struct rusage ru {};
  getrusage(RUSAGE_SELF, &ru);
  return size_t(ru.ru_maxrss) * 1024;
}

namespace {
FsdpOptions with_weights(FsdpOptions f, Weights w) {
  f.weights = w;
  return f;
}
}  // namespace

TrainSession::TrainSession(const ModelConfig& global, const SessionOptions& opt)
    : config_(global),
      device_(opt.device),
      recompute_(opt.recompute),
      own_dist_(opt.shared_dist ? nullptr : DistContext::create(opt.device, opt.dist)),
      dist_(opt.shared_dist ? opt.shared_dist : own_dist_.get()),
      table_(global),
      pm_(make_parallel_model(*dist_, global, table_, opt.device,
                              with_weights(opt.fsdp, opt.lora.rank > 0 ? Weights::Frozen : opt.weights),
                              opt.moe_capacity_factor)) {
  if (const int etp = dist_->mesh().size(Axis::Etp);
      opt.lora.rank > 0 && etp > 1 && global.num_sparse_layers() > 0 &&
      opt.lora.targets_any({LoraTarget::ExpertsGateUp, LoraTarget::ExpertsDown}))
    MT_THROW("LoRA adapters on the routed experts (", lora_targets_text(opt.lora),
             ") under expert tensor parallelism (--etp ", etp,
             ") are not supported; use --etp 1 (each tp rank runs the experts whole) or --lora-targets without "
             "experts (e.g. attn,mlp)");
  const Weights base = opt.lora.rank > 0 ? Weights::Frozen : opt.weights;
  // With an FSDP source the source holds (or not) the gradients; the model's own choice is for its own params.
  // A LoRA base on one GPU keeps no f32 masters anywhere (init and load write its bf16 copy chunk by chunk).
  ModelOptions mo = opt.model;
  if (opt.lora.rank > 0 && !pm_.fsdp && opt.device == Device::CUDA) mo.frozen_host_masters = false;
  model_ = std::make_unique<Qwen3MoeModel>(pm_.model_config(global), opt.device, pm_.fsdp.get(),
                                           pm_.fsdp ? Weights::Trainable : base, mo);
  pm_.attach(*model_, *dist_);
  if (opt.lora.rank > 0) {
    // The global config: under tp every rank holds the adapters whole and uses its slice (lora.h).
    lora_ = std::make_unique<LoraAdapters>(global, opt.lora, opt.device, opt.lora_seed);
    model_->attach_lora(lora_.get());
  }
  grad_sync_ = opt.fsdp.grad_sync;
  n_sparse_ = global.num_sparse_layers();
}

void TrainSession::make_optimizer(const AdamWConfig& oc, bool overlap) {
  if (opt_) MT_THROW("TrainSession::make_optimizer: the session already has an optimizer");
  if (lora_) {  // the adapters: small, updated in line
    opt_ = std::make_unique<AdamW>(lora_->params().numel(), device_, oc);
    return;
  }
  if (!model_->param_source().trainable())
    MT_THROW("TrainSession::make_optimizer: the session's weights are frozen (SessionOptions::weights)");
  opt_ = std::make_unique<AdamW>(master().numel(), device_, oc);
  if (overlap && !fsdp() && device_ == Device::CUDA) {
    opt_->overlap_units(model_->local().unit_ranges());
    model_->local().wait_for(&opt_->ready());
  }
}

AdamW& TrainSession::optimizer() {
  if (!opt_) MT_THROW("TrainSession: no optimizer yet (make_optimizer first)");
  return *opt_;
}

StepResult TrainSession::train_step(const std::vector<MicroBatch>& global, const StepOptions& so) {
  if (grads_pending_)
    MT_THROW("train_step: forward_backward left gradients that no optimizer_step applied; a step starts afresh");
  // One collective for the step's metrics: the loss sums travel with the optimizer's (as before the split).
  StepResult r = forward_backward(global, so, /*reduce_sums=*/false);
  optimizer_step(so, r, /*reduce_sums=*/true);
  return r;
}

StepResult TrainSession::forward_backward(const std::vector<MicroBatch>& global, const StepOptions& so) {
  return forward_backward(global, so, /*reduce_sums=*/true);
}

void TrainSession::optimizer_step(const StepOptions& so, StepResult& r) {
  optimizer_step(so, r, /*reduce_sums=*/false);
}

void TrainSession::set_loss(StepResult& r, const StepOptions& so) const {
  r.ce = r.ce_sum / double(r.targets);
  r.z = n_sparse_ > 0 ? r.z_sum / double(r.real_tokens * n_sparse_) : 0.0;
  r.loss = (so.objective ? r.objective_sum : r.ce) + (model_->aux_enabled() ? so.aux_loss_coef * r.aux : 0.0) +
           so.router_z_loss_coef * r.z;
}

StepResult TrainSession::forward_backward(const std::vector<MicroBatch>& global, const StepOptions& so,
                                          bool reduce_sums) {
  Qwen3MoeModel& model = *model_;
  FsdpParams* fs = fsdp();
  const int rank = dist_->rank();
  const bool first = !grads_pending_;  // the first pass of a step writes the gradients; later ones add
  const int64_t step = steps_ + 1;     // 1-based
  if (first && debug_hit("MOETRAIN_DEBUG_KILL", rank, step)) std::raise(SIGKILL);
  if (global.empty()) MT_THROW("train_step: no micro-batches");
  if (so.router_bias_update_rate > 0 && !model.router_bias().defined())
    MT_THROW("train_step: router_bias_update_rate ", so.router_bias_update_rate,
             " needs the model's router bias (Qwen3MoeModel::enable_router_bias)");
  StepResult r;
  // The loss is normalised by the target tokens of the whole step, counted before any forward.
  std::vector<MicroBatch> local;
  for (const MicroBatch& mb : global) {
    r.targets += count_target_tokens(mb.labels, mb.segments);
    r.tokens += mb.input_ids.numel();
    r.real_tokens += count_real_tokens(mb.input_ids, mb.segments);
    local.push_back(local_micro_batch(mb));  // this rank's rows (and sp chunk)
  }
  if (r.targets == 0) MT_THROW("step ", step, ": no target tokens in any micro-batch (every label is -100)");
  const int64_t n = int64_t(local.size());
  if (so.zero_grads && !fs && first) {
    if (opt_) opt_->join();  // the last overlapped update still reads the gradients
    if (lora_)
      lora_->grads().zero_();
    else
      model.zero_grads();
  }
  if (fs && first) fs->zero_grads();  // the local shards: the reduced unit gradients are added into them
  PassOptions po;
  po.objective = so.objective;
  po.temperature = so.temperature;
  po.token_logprobs = so.token_entropy;  // the entropy comes with the log-probs (PassOptions)
  po.token_entropy = so.token_entropy;
  if (!so.objective) po.ce_scale = 1.0 / double(r.targets);
  po.aux_scale = model.aux_enabled() ? so.aux_loss_coef / double(n) : 0.0;
  // z-loss: the mean over the router rows of the whole step (every micro-batch, every rank).
  po.z_loss_scale = n_sparse_ > 0 ? so.router_z_loss_coef / double(r.real_tokens * n_sparse_) : 0.0;
  po.recompute = recompute_;
  if (first) model.reset_expert_load();
  double ce_sum = 0, obj_sum = 0, aux_sum = 0, z_sum = 0;
  for (int64_t m = 0; m < n; ++m) {
    // The first micro-batch writes the gradients (=): no zeroing pass. Under FSDP every micro-batch
    // gets fresh unit gradient buffers unless they stay unreduced until the last one.
    po.overwrite_grads = !so.zero_grads && ((first && m == 0) || (fs && grad_sync_ == GradSync::EveryMicroBatch));
    if (fs) fs->set_last_micro_batch(m + 1 == n);
    LossParts lp = model.forward_backward(local[size_t(m)], po);
    ce_sum += lp.ce_sum;
    obj_sum += lp.objective;
    aux_sum += lp.aux;
    z_sum += lp.z;
    r.dropped_rank0 += lp.dropped_assignments;
    r.forward_s += model.last_forward_seconds();
    r.backward_s += model.last_backward_seconds();
    grads_pending_ = true;
    if (so.on_micro_batch) so.on_micro_batch(m, n, lp);
  }
  // Metrics: the sums add up over ranks (dp, tp and sp ranks hold rows or tokens of their own); reduced here,
  // or (train_step) in optimizer_step's collective.
  if (reduce_sums && dist_->distributed()) {
    const std::vector<double> all = comm::all_gather_doubles(*dist_->world(), {ce_sum, obj_sum, z_sum});
    ce_sum = obj_sum = z_sum = 0;
    for (int k = 0; k < dist_->world_size(); ++k) {
      ce_sum += all[3 * size_t(k)];
      obj_sum += all[3 * size_t(k) + 1];
      z_sum += all[3 * size_t(k) + 2];
    }
  }
  r.ce_sum = ce_sum;
  r.objective_sum = obj_sum;
  r.z_sum = z_sum;
  r.aux = aux_sum / double(n);
  set_loss(r, so);
  return r;
}

void TrainSession::optimizer_step(const StepOptions& so, StepResult& r, bool reduce_sums) {
  if (!grads_pending_) MT_THROW("optimizer_step: no gradients; run forward_backward first");
  AdamW& opt = optimizer();
  Qwen3MoeModel& model = *model_;
  FsdpParams* fs = fsdp();
  const int rank = dist_->rank();
  const int64_t step = ++steps_;  // 1-based
  grads_pending_ = false;
  auto to = Clock::now();
  if (debug_hit("MOETRAIN_DEBUG_INF_GRAD", rank, step)) {
    Tensor inf = Tensor::empty({1});
    inf.data<float>()[0] = INFINITY;
    trainable_grads().rows(0, 1).copy_from(inf.to(device_));
  }
  // Frozen parameters: this rank's pieces of them, gradients zeroed, values kept across the update.
  struct Kept {
    int64_t begin, n;
    Tensor saved;
  };
  std::vector<Kept> kept;
  if (so.frozen && !lora_) {  // (with adapters the whole base is frozen; the adapters named train)
    const std::vector<FlatRange> pieces = pm_.pieces(table_);
    for (const ParamEntry& e : table_.entries()) {
      if (!so.frozen(e.name)) continue;
      for (const FlatRange& p : pieces) {
        const int64_t lo = std::max(p.begin, e.offset), hi = std::min(p.end, e.offset + e.numel);
        if (lo >= hi) continue;
        const int64_t local = p.dst_offset + (lo - p.begin);
        grads().rows(local, hi - lo).zero_();
        kept.push_back({local, hi - lo, master().rows(local, hi - lo).clone()});
      }
    }
  }
  // The adapters are whole on every rank (replicated): their gradients, each rank's share of the step's samples
  // and tokens, are summed over the ranks that hold other rows (dp) or other tokens (sp), and under tp over the
  // tp ranks too (the world), which hold other rows of the norms and router and partial sums of the adapters
  // beside the sliced GEMMs (lora.h), so every rank takes the same update.
  if (lora_ && dist_->distributed()) {
    (pm_.tp ? dist_->world() : dist_->dp_sp())->all_reduce(lora_->grads())->wait();
    device_mem::synchronize(device_);
  }
  r.opt = lora_ ? opt.step(lora_->params(), lora_->grads(), so.lr)
                : opt.step(master(), grads(), so.lr, compute(), pm_.global_grad_sq());
  if (!kept.empty()) device_mem::synchronize(device_);  // an overlapped step's side stream done too
  for (Kept& k : kept) {
    master().rows(k.begin, k.n).copy_from(k.saved);
    if (Tensor* c = compute(); c && c->raw() != master().raw()) {
      Tensor dst = c->rows(k.begin, k.n);
      ops::copy_cast(k.saved, dst);
    }
  }
  r.optimizer_s = seconds_since(to);
  // The step's per-expert load over all micro-batches and data-parallel ranks: one all-reduce after
  // the optimizer. It feeds the metrics and the balancing bias, which changes only here, between
  // steps, and identically on every rank (a skipped step leaves it as it was, like the weights).
  if (n_sparse_ > 0) {
    Tensor& load = model.expert_load();
    // (Under tp every rank routes rows of its own: the world; under sp the ranks with other samples
    // or tokens.)
    if (dist_->distributed()) (pm_.tp ? dist_->world() : dist_->dp_sp())->all_reduce(load)->wait();
    if (so.router_bias_update_rate > 0 && !r.opt.skipped)
      ops::router_bias_update(load, float(so.router_bias_update_rate), model.router_bias());
    r.has_load = true;
    r.load = expert_load_stats(load);
  }
  // Metrics: one collective per step, after the optimizer: every rank's communication time and memory, and with
  // reduce_sums its loss sums (which forward_backward left local); the sums add up, the slowest rank's wait and
  // the largest peak are reported.
  const double peak = double(device_ == Device::CUDA ? device_mem::cuda_peak_bytes() : peak_rss_bytes());
  r.peak_bytes_max_rank = peak;
  if (dist_->distributed()) {
    r.comm_wait_s = fs ? fs->take_comm_seconds() : 0;
    std::vector<double> mine{r.comm_wait_s, peak};
    if (reduce_sums) mine.insert(mine.end(), {r.ce_sum, r.objective_sum, r.z_sum});
    const size_t kv = mine.size();
    const std::vector<double> all = comm::all_gather_doubles(*dist_->world(), mine);
    if (reduce_sums) r.ce_sum = r.objective_sum = r.z_sum = 0;
    for (int k = 0; k < dist_->world_size(); ++k) {
      const double* v = all.data() + kv * size_t(k);
      r.comm_wait_max_s = std::max(r.comm_wait_max_s, v[0]);
      r.peak_bytes_max_rank = std::max(r.peak_bytes_max_rank, v[1]);
      if (reduce_sums) {
        r.ce_sum += v[2];
        r.objective_sum += v[3];
        r.z_sum += v[4];
      }
    }
    if (reduce_sums) set_loss(r, so);
    if (so.schedule_check_every > 0 && step % so.schedule_check_every == 0) {
      dist_->check_schedules();
      // HSDP drift detection at the same cadence: the replicas of every master-weight shard must still
      // hold the same bits (same reduced gradients, same AdamW arithmetic). One digest pass over the
      // shard (~7 GB/s on one CPU core; on CUDA plus the copy to the host) and two small all-gathers.
      if (so.check_replicas && fs && dist_->mesh().size(Axis::DpReplicate) > 1) {
        r.replicas = fs->check_replicas(/*grads=*/false, rank, dist_->world());
        r.replicas_checked = true;
      }
    }
  }
}

void TrainSession::init_weights(uint64_t seed) {
  if (!pm_.fsdp && !model_->local().has_masters()) {  // a LoRA base on one GPU: straight into its bf16 copy
    model_->local().fill_from_host([&](int64_t begin, Tensor& chunk) {
      init_weights_ranges(config_, table_, {FlatRange{begin, begin + chunk.numel(), 0}}, chunk, seed);
    });
    return;
  }
  pm_.init_weights(*model_, table_, seed);
  refresh_compute_weights();
}

LoadReport TrainSession::load(const std::string& dir) {
  if (!pm_.fsdp && !model_->local().has_masters()) {  // as init_weights: chunk by chunk into the bf16 copy
    const auto t = Clock::now();
    const CheckpointReader reader(dir);
    LoadReport rep;
    model_->local().fill_from_host([&](int64_t begin, Tensor& chunk) {
      const LoadReport r =
          load_hf_weights_ranges(reader, config_, table_, {FlatRange{begin, begin + chunk.numel(), 0}}, chunk);
      rep.layout = r.layout;
      rep.bytes_read += r.bytes_read;
      rep.files = std::max(rep.files, r.files);
    });
    rep.tensors = table_.entries().size();
    rep.seconds = seconds_since(t);
    rep.router_bias = load_router_bias(dir);
    return rep;
  }
  LoadReport rep = load_hf_weights_ranges(dir, config_, table_, pm_.pieces(table_), master());
  refresh_compute_weights();
  rep.router_bias = load_router_bias(dir);
  return rep;
}

bool TrainSession::load_router_bias(const std::string& dir) {
  if (n_sparse_ == 0) return false;
  const bool lead = dist_->rank() == 0;
  // Rank 0 reads before it tells the others anything, so a bad file stops every rank with its reason
  // instead of leaving them in a broadcast: 1 read, 0 no file, -1 an error.
  Tensor bias_host = Tensor::zeros({n_sparse_, config_.num_experts});
  std::string why;
  float state = 0;
  if (lead) {
    try {
      state = mt::load_router_bias(dir, config_, bias_host) ? 1.0f : 0.0f;
    } catch (const Error& e) {
      state = -1;
      why = e.what();
    }
  }
  if (dist_->distributed()) {
    Tensor f = Tensor::zeros({1});
    f.data<float>()[0] = state;
    Tensor fd = f.to(device_);
    dist_->world()->broadcast(fd, 0)->wait();
    device_mem::synchronize(device_);
    state = fd.to(Device::CPU).data<float>()[0];
  }
  if (state < 0) {
    if (lead) MT_THROW(why);
    MT_THROW("rank 0 could not read ", dir, "/", kRouterBiasFile, " (rank 0 logs why)");
  }
  if (state == 0) return false;
  model_->enable_router_bias();
  Tensor& bias = model_->router_bias();
  if (lead) bias.copy_from(bias_host.to(device_));
  if (dist_->distributed()) {
    dist_->world()->broadcast(bias, 0)->wait();
    device_mem::synchronize(device_);
  }
  return true;
}

MicroBatch TrainSession::local_micro_batch(const MicroBatch& global) {
  const int dp = dist_->dp_size();
  const int64_t B = global.input_ids.size(0);
  if (B % dp != 0)
    MT_THROW("micro-batch of ", B, " sequences cannot be split evenly over ", dp,
             " data-parallel ranks (dp_replicate × dp_shard); use a multiple of ", dp);
  MicroBatch mine = global;
  if (dp > 1) {
    auto [r0, n] = dp_rows(B, dist_->dp_rank(), dp);
    mine = micro_batch_rows(global, r0, n);
  }
  return plan_micro_batch(mine, dist_->mesh().size(Axis::Sp), dist_->sp_rank(), dist_->mesh().size(Axis::Tp));
}

}  // namespace mt
