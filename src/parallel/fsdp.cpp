#include "parallel/fsdp.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>

#include "ops/ops.h"
#include "ops/profile.h"

namespace mt {

namespace {
constexpr int64_t kChunkAlign = 64;  // elements: keeps every shard 256-byte aligned for vector loads

// Adds the host time of a scope to a counter (time spent issuing or waiting for collectives).
struct CommTimer {
  double& acc;
  std::chrono::steady_clock::time_point t0 = std::chrono::steady_clock::now();
  ~CommTimer() { acc += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(); }
};
// The flat-layout ranges of unit u's elements [lo, hi); dst_offset is the unit element offset.
std::vector<FlatRange> unit_to_flat(const ParamUnit& pu, int64_t lo, int64_t hi) {
  std::vector<FlatRange> r;
  for (const FlatRange& p : pu.pieces) {
    const int64_t len = p.end - p.begin, b = std::max(lo, p.dst_offset), e = std::min(hi, p.dst_offset + len);
    if (e > b) r.push_back({p.begin + (b - p.dst_offset), p.begin + (e - p.dst_offset), b});
  }
  return r;
}
}  // namespace

std::vector<FlatRange> FsdpParams::owned_pieces() const {
  std::vector<FlatRange> r;
  for (int u = 0; u < num_units(); ++u) {
    auto [lo, hi] = owned_elements(u);
    for (FlatRange f : unit_to_flat(units_[size_t(u)], lo, hi)) {
      f.dst_offset = offset_[size_t(u)] + (f.dst_offset - lo);
      r.push_back(f);
    }
  }
  return r;
}

double FsdpParams::take_comm_seconds() {
  double s = comm_s_;
  comm_s_ = 0;
  return s;
}

std::pair<int64_t, int64_t> dp_rows(int64_t batch_rows, int dp_rank, int dp_size) {
  if (batch_rows % dp_size != 0)
    MT_THROW("micro-batch of ", batch_rows, " sequences cannot be split evenly over ", dp_size,
             " data-parallel ranks (dp_replicate × dp_shard); use a multiple of ", dp_size);
  const int64_t n = batch_rows / dp_size;
  return {int64_t(dp_rank) * n, n};
}

FsdpParams::FsdpParams(const ModelConfig& c, const ParamTable& t, Device device, comm::Communicator& shard,
                       comm::Communicator* replicate, FsdpOptions opt, const ExpertGroups& eg, const ReduceComms& rc,
                       const TpGroups& tg)
    : device_(device),
      shard_(shard),
      replicate_(replicate && replicate->size() > 1 ? replicate : nullptr),
      expert_shard_(eg.expert_shard),
      ep_comm_(eg.ep),
      reduce_(rc),
      tp_(tg),
      opt_(opt),
      plan_(plan_units(c, t, eg.ep ? eg.ep->size() : 1, eg.ep ? eg.ep->rank() : 0, tg.placement)),
      compute_dt_(device == Device::CUDA ? DType::BF16 : DType::F32) {
  MT_CHECK(shard.device() == device, "dp_shard communicator is on ", device_name(shard.device()), ", the model on ",
           device_name(device));
  if (tg.placement.on)
    MT_CHECK(tg.split && (tg.kv || !tg.placement.kv_replicated),
             "tensor parallelism needs the tp-split (and kv) communicators");
  if (plan_.ep > 1) {
    MT_CHECK(expert_shard_, "expert parallelism needs the expert data-parallel communicator");
    // Every element of the experts is held once per replica (expert_shard × ep covers the experts of a
    // replica, whose ranks shard_ spans), so the grad norm's sum over shard_ counts each expert element
    // once and the all-reduce over dp_replicate reaches exactly the same shard in the other replicas.
    MT_CHECK(shard_.size() % (expert_shard_->size() * plan_.ep) == 0, "the expert shard group (", expert_shard_->size(),
             " ranks) × ep (", plan_.ep, ") must divide the dense shard group (", shard_.size(),
             " ranks): the experts of one replica are sharded within it");
  }
  for (size_t u = 0; u < units_.size(); ++u) {
    const int64_t W = comm_of(int(u)).size();
    const int64_t c_u = (units_[u].numel + W * kChunkAlign - 1) / (W * kChunkAlign) * kChunkAlign;
    offset_.push_back(local_numel_);
    chunk_.push_back(c_u);
    local_numel_ += c_u;
  }
  written_.assign(units_.size(), 0);
  in_backward_.assign(units_.size(), 0);
  // A frozen CUDA source never updates its masters on the device: they stay in host memory (as
  // LocalParams does); the device holds the bf16 shard and fp32_param's buffer.
  const bool host_masters = device == Device::CUDA && opt.weights == Weights::Frozen;
  params_ = Tensor::zeros({local_numel_}, DType::F32, host_masters ? Device::CPU : device);
  if (opt.weights == Weights::Trainable) grads_ = Tensor::zeros({local_numel_}, DType::F32, device);
  compute_ = device == Device::CUDA ? Tensor::zeros({local_numel_}, DType::BF16, device) : params_;
  if (compute_.raw() != params_.raw()) plan_fp32_params(t);
}

void FsdpParams::plan_fp32_params(const ParamTable& t) {
  std::vector<const ParamEntry*> entries;
  int64_t n = 0;
  for (const ParamEntry& e : t.entries())
    if (fp32_compute_param(e.name)) {
      entries.push_back(&e);
      fp32_offset_[e.name] = n;
      n += e.numel;
    }
  if (n == 0) return;
  fp32_ = Tensor::zeros({n}, DType::F32, device_);
  for (int u = 0; u < num_units(); ++u) {
    const ParamUnit& pu = units_[size_t(u)];
    if (pu.local_experts) continue;
    for (const FlatRange& p : pu.pieces)
      for (const ParamEntry* e : entries)
        MT_CHECK(e->offset >= p.end || e->offset + e->numel <= p.begin || &comm_of(u) == &shard_, e->name,
                 " is in unit ", u, ", which is not sharded over dp_shard: its fp32 copy would be summed wrongly");
    auto [lo, hi] = owned_elements(u);
    for (const FlatRange& f : unit_to_flat(pu, lo, hi))
      for (const ParamEntry* e : entries) {
        const int64_t b = std::max(f.begin, e->offset), end = std::min(f.end, e->offset + e->numel);
        if (end > b)
          fp32_copies_.push_back({offset_[size_t(u)] + (f.dst_offset - lo) + (b - f.begin),
                                  fp32_offset_.at(e->name) + (b - e->offset), end - b});
      }
  }
}

void FsdpParams::refresh_fp32_params() {
  if (!fp32_.defined()) return;
  fp32_.zero_();
  for (const Fp32Copy& c : fp32_copies_) {
    Tensor dst = fp32_.rows(c.dst, c.n);
    if (params_.is_cpu())
      dst.copy_from(params_.rows(c.src, c.n));  // host masters (frozen)
    else
      ops::copy_cast(params_.rows(c.src, c.n), dst);
  }
  CommTimer t{comm_s_};
  shard_.all_reduce(fp32_, comm::ReduceOp::Sum)->wait();
}

Tensor FsdpParams::fp32_param(const ParamEntry& e) {
  if (!fp32_.defined()) return {};
  auto it = fp32_offset_.find(e.name);
  MT_CHECK(it != fp32_offset_.end(), e.name, " has no fp32 copy (it is not an RMSNorm gain or a router)");
  return fp32_.rows(it->second, e.numel);
}

FsdpParams::~FsdpParams() = default;

comm::Communicator& FsdpParams::comm_of(int u) const {
  const ParamUnit& pu = units_[size_t(u)];
  if (pu.local_experts) return *expert_shard_;
  if (pu.tp_group == 1) return *tp_.split;
  if (pu.tp_group == 2) return *tp_.kv;
  return shard_;
}

comm::Communicator& FsdpParams::reduce_comm_of(int u) const {
  const ParamUnit& pu = units_[size_t(u)];
  comm::Communicator* c = pu.local_experts   ? reduce_.expert_shard
                          : pu.tp_group == 1 ? tp_.split_reduce
                          : pu.tp_group == 2 ? tp_.kv_reduce
                                             : reduce_.shard;
  if (!c) return comm_of(u);
  MT_CHECK(c->size() == comm_of(u).size() && c->rank() == comm_of(u).rank(), "unit ", u,
           ": the reduction communicator (rank ", c->rank(), " of ", c->size(), ") is not over the shard group (rank ",
           comm_of(u).rank(), " of ", comm_of(u).size(), ")");
  return *c;
}

std::pair<int64_t, int64_t> FsdpParams::owned_elements(int u) const {
  const int64_t n = units_[size_t(u)].numel, c = chunk_[size_t(u)];
  const int64_t lo = std::min(n, int64_t(comm_of(u).rank()) * c);
  return {lo, std::min(n, lo + c)};
}


Tensor FsdpParams::take(int64_t numel, DType dt) {
  auto it = pool_.find({numel, int(dt)});
  if (it == pool_.end()) return Tensor::empty({numel}, dt, device_);
  Tensor t = it->second;
  pool_.erase(it);
  return t;
}

// Reuse is safe without events: on CUDA a buffer comes back only after its last collective's
// Work::wait() (the compute stream waits for that collective), and every collective, on either the
// gather or the reduction communicator's stream, first waits for all compute work queued before it.
void FsdpParams::give(Tensor t) { pool_.emplace(std::make_pair(t.numel(), int(t.dtype())), std::move(t)); }

void FsdpParams::prefetch(int u) {
  if (u < 0 || u >= num_units() || gathered_.count(u)) return;
  Gather g;
  g.buf = take(comm_of(u).size() * chunk_[size_t(u)], compute_dt_);
  CommTimer t{comm_s_};
  g.work = comm_of(u).all_gather(compute_.rows(offset_[size_t(u)], chunk_[size_t(u)]), g.buf);  // NOLINT
  gathered_.emplace(u, std::move(g));
}

Tensor FsdpParams::acquire_weights(int u) {
  MT_CHECK(u >= 0 && u < num_units(), "unit ", u, " of ", num_units());
  prefetch(u);
  Gather& g = gathered_.at(u);
  if (g.users++ == 0) {
    CommTimer t{comm_s_};
    ops::OpScope scope("comm_all_gather_wait", device_ == Device::CUDA);  // exposed time, when profiling
    g.work->wait();
  }
  return g.buf.rows(0, units_[size_t(u)].numel);
}

void FsdpParams::release_weights(int u) {
  auto it = gathered_.find(u);
  MT_CHECK(it != gathered_.end() && it->second.users > 0, "release of unit ", u, " that is not acquired");
  if (--it->second.users == 0) {
    // Kept after the forward when the backward is to use it again; the backward's release (the
    // unit's gradient was requested in between) frees it.
    if (keep_after_forward_ && !in_backward_[size_t(u)]) return;
    in_backward_[size_t(u)] = 0;
    give(std::move(it->second.buf));
    gathered_.erase(it);
  }
}

void FsdpParams::begin_pass(bool backward) {
  drop_kept();
  refresh_fp32_params();  // the optimizer may have changed the masters since the last pass
  keep_after_forward_ = backward && !opt_.reshard_after_forward;
}

void FsdpParams::drop_kept() {
  for (auto it = gathered_.begin(); it != gathered_.end();) {
    if (it->second.users == 0) {
      give(std::move(it->second.buf));
      it = gathered_.erase(it);
    } else {
      ++it;
    }
  }
  std::fill(in_backward_.begin(), in_backward_.end(), char(0));
}

Tensor& FsdpParams::grads() {
  if (!grads_.defined())
    MT_THROW("these sharded parameters are frozen (FsdpOptions::weights = Frozen): they have no gradients");
  return grads_;
}

Tensor FsdpParams::unit_grads(int u) {
  MT_CHECK(u >= 0 && u < num_units(), "unit ", u, " of ", num_units());
  grads();  // frozen: the error, before any buffer is taken
  in_backward_[size_t(u)] = 1;
  auto it = unit_grads_.find(u);
  if (it == unit_grads_.end()) {
    Tensor full = take(comm_of(u).size() * chunk_[size_t(u)], DType::F32);
    full.zero_();
    it = unit_grads_.emplace(u, std::move(full)).first;
  }
  return it->second.rows(0, units_[size_t(u)].numel);
}

void FsdpParams::grads_done(int u) {
  auto it = unit_grads_.find(u);
  MT_CHECK(it != unit_grads_.end(), "grads_done for unit ", u, " without unit_grads");
  if (opt_.grad_sync == GradSync::LastMicroBatch && !last_micro_) return;  // keep accumulating, unreduced
  Pending p;
  p.unit = u;
  p.full = std::move(it->second);
  unit_grads_.erase(it);
  // The first reduction of a unit in a step writes the local shard directly (no zeroing pass, no
  // add); later ones (micro-batches after the first) go through a chunk buffer and are added.
  p.direct = !written_[size_t(u)] && opt_.reduce_dtype == DType::F32;
  p.fresh = !written_[size_t(u)];
  written_[size_t(u)] = 1;
  p.part = p.direct ? grads_.rows(offset_[size_t(u)], chunk_[size_t(u)]) : take(chunk_[size_t(u)], DType::F32);
  {
    CommTimer t{comm_s_};
    if (opt_.reduce_dtype == DType::BF16) {
      // Rank r's piece of every rank's gradient goes to rank r as bf16; the sum happens in fp32 at
      // the receiver (finish_pending).
      p.send = take(p.full.numel(), DType::BF16);
      ops::copy_cast(p.full, p.send);
      p.wire = take(p.full.numel(), DType::BF16);
      const std::vector<int64_t> counts(size_t(comm_of(u).size()), chunk_[size_t(u)]);
      p.work = reduce_comm_of(u).all_to_all_v(p.send, counts, p.wire, counts);
    } else {
      p.work = reduce_comm_of(u).reduce_scatter(p.full, p.part, comm::ReduceOp::Sum);
    }
  }
  pending_.push_back(std::move(p));
  // The embedding is the last unit of every backward: everything must land before the optimizer.
  finish_pending(/*all=*/u == 0);
  if (u == 0) drop_kept();  // the backward is over: the embedding (never re-acquired in it) goes too
}

void FsdpParams::finish_pending(bool all) {
  // Leave the newest layer's reductions (its block and, under EP, its experts) in flight so that they
  // overlap the next block's backward.
  auto layer_of = [&](const Pending& p) { return units_[size_t(p.unit)].layer; };
  while (!pending_.empty() && (all || layer_of(pending_.front()) != layer_of(pending_.back()) ||
                               layer_of(pending_.front()) < 0)) {
    if (!all && pending_.size() == 1) break;
    Pending p = std::move(pending_.front());
    pending_.erase(pending_.begin());
    {
      CommTimer t{comm_s_};
      ops::OpScope scope("comm_reduce_scatter_wait", device_ == Device::CUDA);
      p.work->wait();
    }
    if (p.wire.defined()) {
      const int64_t c = p.part.numel();
      for (int r = 0; r < comm_of(p.unit).size(); ++r) {
        Tensor piece = r == 0 ? p.part : p.full.rows(0, c);
        ops::copy_cast(p.wire.rows(r * c, c), piece);
        if (r > 0) ops::add_(p.part, piece);
      }
      give(std::move(p.wire));
      give(std::move(p.send));
    }
    if (replicate_) {
      CommTimer t{comm_s_};
      replicate_->all_reduce(p.part, comm::ReduceOp::Sum)->wait();
    }
    if (!p.direct) {
      Tensor dst = grads_.rows(offset_[size_t(p.unit)], chunk_[size_t(p.unit)]);
      if (p.fresh)
        dst.copy_from(p.part);
      else
        ops::add_(dst, p.part);
      give(std::move(p.part));
    }
    give(std::move(p.full));
  }
}

void FsdpParams::zero_grads() {
  MT_CHECK(pending_.empty(), "zero_grads with ", pending_.size(), " gradient reductions still pending");
  // No pass over the shard: the step's first reduction of each unit overwrites its chunk.
  std::fill(written_.begin(), written_.end(), char(0));
  for (auto& [u, t] : unit_grads_) give(std::move(t));
  unit_grads_.clear();
}

void FsdpParams::refresh_compute_weights() {
  if (compute_.raw() == params_.raw()) return;
  if (params_.is_cpu())
    cast_host_to_device(params_, compute_, LocalParams::kStagingElements);  // host masters (frozen)
  else
    ops::copy_cast(params_, compute_);
}

Tensor FsdpParams::gather_range_host(int64_t begin, int64_t end, bool grads) {
  // The unit (of this rank) and the unit elements [ub, ue) that hold the flat range.
  int u = -1;
  int64_t ub = 0;
  for (int i = 0; i < num_units() && u < 0; ++i)
    for (const FlatRange& p : units_[size_t(i)].pieces)
      if (begin >= p.begin && end <= p.end) {
        u = i;
        ub = p.dst_offset + (begin - p.begin);
        break;
      }
  MT_CHECK(u >= 0 && begin < end, "range [", begin, ", ", end, ") is not inside one piece of this rank's units");
  const int64_t ue = ub + (end - begin);
  comm::Communicator& cm = comm_of(u);
  const int64_t c = chunk_[size_t(u)], W = cm.size();
  // Rank r holds unit elements [r c, (r + 1) c); its part of the range travels padded to the longest
  // part, so one fixed-size all-gather serves any range.
  auto part = [&](int64_t r) {
    const int64_t b = std::max(ub, r * c), e = std::min(ue, (r + 1) * c);
    return std::make_pair(b, std::max(b, e));
  };
  int64_t longest = 0;
  for (int64_t r = 0; r < W; ++r) longest = std::max(longest, part(r).second - part(r).first);
  auto [mb, me] = part(cm.rank());
  Tensor mine = Tensor::zeros({longest}, DType::F32, device_);
  if (me > mb)
    mine.rows(0, me - mb).copy_from((grads ? this->grads() : params_).rows(offset_[size_t(u)] + (mb - cm.rank() * c), me - mb));
  Tensor all = Tensor::empty({W * longest}, DType::F32, device_);
  cm.all_gather(mine, all)->wait();
  device_mem::synchronize(device_);
  Tensor host = all.to(Device::CPU), out = Tensor::empty({end - begin});
  for (int64_t r = 0; r < W; ++r) {
    auto [b, e] = part(r);
    if (e > b) out.rows(b - ub, e - b).copy_from(host.rows(r * longest, e - b));
  }
  return out;
}

Tensor FsdpParams::gather_param_host(const ParamEntry& e, bool grads) {
  const bool experts = plan_.ep > 1 && e.layer >= 0 && plan_.experts[size_t(e.layer)] >= 0 &&
                       (e.name.ends_with("mlp.experts.gate_up_proj") || e.name.ends_with("mlp.experts.down_proj"));
  if (!experts) return gather_range_host(e.offset, e.offset + e.numel, grads).view(e.shape);
  // Expert parallelism: this ep group's experts from its expert-data-parallel shards, then the
  // groups' slices side by side (ep rank order is expert order).
  const int64_t per = e.numel / plan_.ep, b = e.offset + int64_t(plan_.ep_rank) * per;
  Tensor mine = gather_range_host(b, b + per, grads).to(device_);
  Tensor all = Tensor::empty({e.numel}, DType::F32, device_);
  ep_comm_->all_gather(mine, all)->wait();
  device_mem::synchronize(device_);
  return all.to(Device::CPU).view(e.shape);
}

void FsdpParams::check_grads_complete() const {
  for (int u = 0; u < num_units(); ++u)
    MT_CHECK(written_[size_t(u)], "unit ", u, " received no gradient since zero_grads(): its shard is stale");
}

double FsdpParams::global_grad_sq() {
  Tensor& g = grads();  // frozen: the error first
  check_grads_complete();
  // Every rank adds all ranks' sums in double in rank order: the same value on every rank. A NaN or
  // inf on any rank reaches every rank, so all of them skip the step together.
  double sum = 0;
  for (double v : comm::all_gather_doubles(shard_, {ops::sum_squares(g)})) sum += v;
  return sum;
}

}  // namespace mt

#include "model/hf_checkpoint.h"

namespace mt {

void save_sharded_hf_checkpoint(const std::string& dir, const ModelConfig& c, const ParamTable& t, FsdpParams& p,
                                bool writer) {
  save_sharded_hf_checkpoint(
      dir, c, t, [&p](const ParamEntry& e) { return p.gather_param_host(e, /*grads=*/false); }, writer);
}

void save_sharded_hf_checkpoint(const std::string& dir, const ModelConfig& c, const ParamTable& t,
                                const std::function<Tensor(const ParamEntry&)>& fetch, bool writer) {
  // One parameter at a time: every rank takes part in its gather, the writer streams it to disk.
  std::vector<PendingTensor> tensors = pending_hf_tensors(c, t, ExpertLayout::PerExpert, fetch);
  if (writer) {
    write_safetensors_sharded_lazy(dir, tensors, size_t(5) << 30);
    save_model_config(c, dir + "/config.json");
  } else {
    for (const PendingTensor& pt : tensors) pt.produce();  // the same gathers, in the same order
  }
}

uint64_t shard_digest(const Tensor& t) {
  const Tensor h = t.device() == Device::CPU ? t : t.to(Device::CPU);
  const auto* p = static_cast<const unsigned char*>(h.raw());
  const size_t n = h.nbytes();
  constexpr uint64_t kPrime = 0x100000001b3ull;  // FNV-1a's 64-bit prime
  // Four lanes so that the multiplies of neighbouring words run in parallel (a few GB/s, not the
  // byte-serial FNV-1a's one); each starts from FNV's offset basis, perturbed by the lane number.
  uint64_t lane[4] = {0xcbf29ce484222325ull, 0xcbf29ce484222325ull ^ 1, 0xcbf29ce484222325ull ^ 2,
                      0xcbf29ce484222325ull ^ 3};
  auto step = [](uint64_t x, uint64_t w) {
    x = (x ^ w) * kPrime;
    return x ^ (x >> 32);
  };
  size_t i = 0;
  for (; i + 32 <= n; i += 32)
    for (int k = 0; k < 4; ++k) {
      uint64_t w;
      std::memcpy(&w, p + i + 8 * k, 8);
      lane[k] = step(lane[k], w);
    }
  for (int k = 0; i < n; ++k) {  // the tail: whole words, then the last bytes zero-padded
    uint64_t w = 0;
    const size_t m = std::min<size_t>(8, n - i);
    std::memcpy(&w, p + i, m);
    lane[k % 4] = step(lane[k % 4], w);
    i += m;
  }
  // murmur3's 64-bit finaliser over the lanes and the length.
  auto fmix = [](uint64_t x) {
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdull;
    x ^= x >> 33;
    x *= 0xc4ceb9fe1a85ec53ull;
    return x ^ (x >> 33);
  };
  uint64_t d = fmix(uint64_t(n));
  for (uint64_t x : lane) d = fmix(d ^ fmix(x)) * kPrime;
  return d;
}

Tensor FsdpParams::local_shard(int u, bool grads) {
  MT_CHECK(u >= 0 && u < num_units(), "unit ", u, " of ", num_units());
  auto [lo, hi] = owned_elements(u);
  // Rank r's elements start at r × chunk, which is where its chunk of the local buffer starts.
  return (grads ? this->grads() : params_).rows(offset_[size_t(u)], hi - lo);
}

std::string FsdpParams::unit_name(int u) const {
  MT_CHECK(u >= 0 && u < num_units(), "unit ", u, " of ", num_units());
  const ParamUnit& pu = units_[size_t(u)];
  if (u == plan_.embed) return "embedding";
  if (u == plan_.head) return "head";
  const std::string block = "block " + std::to_string(pu.layer);
  if (pu.local_experts)
    return "experts " + std::to_string(pu.expert_begin) + ".." + std::to_string(pu.expert_end - 1) + " of " + block;
  if (pu.tp_group == 1) return "tp slices of " + block;
  if (pu.tp_group == 2) return "kv slices of " + block;
  return block;
}

std::vector<uint64_t> FsdpParams::replica_digests(bool grads) {
  device_mem::synchronize(device_);
  std::vector<uint64_t> d;
  for (int u = 0; u < num_units(); ++u) d.push_back(shard_digest(local_shard(u, grads)));
  return d;
}

FsdpParams::ReplicaReport FsdpParams::check_replicas(bool grads, int world_rank, comm::Communicator* world) {
  if (!replicate_) return {};
  if (grads) {
    MT_CHECK(pending_.empty(), "check_replicas with ", pending_.size(), " gradient reductions still pending");
    check_grads_complete();
  }
  const std::vector<uint64_t> mine = replica_digests(grads);
  const int64_t n = 1 + int64_t(mine.size()), R = replicate_->size();
  auto gather_i64 = [&](comm::Communicator& c, const Tensor& row) {
    Tensor all = Tensor::empty({row.numel() * c.size()}, DType::I64, c.device());
    {
      CommTimer t{comm_s_};
      c.all_gather(row.to(c.device()), all)->wait();
    }
    return all.to(Device::CPU);  // the copy waits for the compute stream, which waits for the gather
  };
  Tensor row = Tensor::empty({n}, DType::I64);
  row.data<int64_t>()[0] = world_rank;
  std::memcpy(row.data<int64_t>() + 1, mine.data(), mine.size() * sizeof(uint64_t));
  const Tensor table = gather_i64(*replicate_, row);
  const int64_t* v = table.data<int64_t>();
  // The verdict of this replica group: how many units differ, and the first one with the two ranks
  // and their digests. Every replica of the group walks the same table, so they agree.
  Tensor verdict = Tensor::zeros({6}, DType::I64);
  int64_t* d = verdict.data<int64_t>();
  for (int u = 0; u < num_units(); ++u)
    for (int64_t r = 1; r < R; ++r) {
      const int64_t a = v[1 + u], b = v[r * n + 1 + u];
      if (a == b) continue;
      if (d[0]++ == 0) {
        d[1] = u;
        d[2] = v[0];
        d[3] = v[r * n];
        d[4] = a;
        d[5] = b;
      }
      break;  // one pair per unit is enough to name it
    }
  // With `world`, the groups share their verdicts, so that every rank stops (or goes on) together and
  // reports the same unit, even a rank whose own group agrees.
  if (world) {
    const Tensor all = gather_i64(*world, verdict);
    for (int64_t k = 0; k < world->size(); ++k)
      if (all.data<int64_t>()[6 * k] > 0) {
        std::memcpy(d, all.data<int64_t>() + 6 * k, 6 * sizeof(int64_t));
        break;
      }
  }
  if (d[0] > 0) {
    auto hex = [](int64_t x) {
      char b[24];
      std::snprintf(b, sizeof b, "%016llx", (unsigned long long)x);
      return std::string(b);
    };
    MT_THROW("replicated ", grads ? "gradients" : "parameters", " differ across the ", R,
             " dp_replicate replicas (bitwise digests of each rank's shard): ", unit_name(int(d[1])), " (unit ", d[1],
             ") is ", hex(d[4]), " on rank ", d[2], " and ", hex(d[5]), " on rank ", d[3], "; ", d[0], " of ",
             num_units(), " units differ between those ranks");
  }
  return {num_units(), int(R)};
}

}  // namespace mt
