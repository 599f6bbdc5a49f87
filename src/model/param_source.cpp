#include "model/param_source.h"

#include <algorithm>

#include "ops/ops.h"

namespace mt {

static ParamUnit one_piece(int64_t begin, int64_t end, int64_t layer) {
  ParamUnit u;
  u.pieces.push_back({begin, end, 0});
  u.numel = end - begin;
  u.layer = layer;
  return u;
}

// This rank's experts of layer l (ep > 1): its rows [e0, e1) of gate_up_proj [E, 2F, D] and of
// down_proj [E, D, F], back to back in the unit (under tp the tp-local tensors).
static ParamUnit local_experts_unit(const ModelConfig& c, const ParamTable& t, int64_t l, const UnitPlan& p,
                                    int tp_group) {
  const std::string pre = "model.layers." + std::to_string(l) + ".mlp.experts.";
  const ParamEntry& gu = t.at(pre + "gate_up_proj");
  const ParamEntry& dn = t.at(pre + "down_proj");
  const int64_t E = c.num_experts, per = E / p.ep, e0 = int64_t(p.ep_rank) * per, e1 = e0 + per;
  const int64_t gu_row = gu.numel / E, dn_row = dn.numel / E;
  ParamUnit x;
  x.layer = l;
  x.local_experts = true;
  x.expert_begin = e0;
  x.expert_end = e1;
  x.tp_group = tp_group;
  x.pieces.push_back({gu.offset + e0 * gu_row, gu.offset + e1 * gu_row, 0});
  x.pieces.push_back({dn.offset + e0 * dn_row, dn.offset + e1 * dn_row, per * gu_row});
  x.numel = per * (gu_row + dn_row);
  return x;
}

// Under tensor parallelism a block is up to four units, each a list of pieces (runs of adjacent
// parameters of the same placement): the tp-replicated part (norms, router, experts when etp = 1 and
// ep = 1), this rank's tp slices, the replicated kv slices, and this rank's experts (ep > 1).
static void plan_block_tp(const ModelConfig& c, const ParamTable& t, int64_t l, const TpPlacement& tp, UnitPlan& p) {
  const std::string pre = "model.layers." + std::to_string(l) + ".";
  auto group_of = [&](const ParamEntry& e) {
    const std::string n = e.name.substr(pre.size());
    if (n == "self_attn.q_proj.weight" || n == "self_attn.o_proj.weight" || n.rfind("mlp.gate_proj", 0) == 0 ||
        n.rfind("mlp.up_proj", 0) == 0 || n.rfind("mlp.down_proj", 0) == 0)
      return 1;
    if (n == "self_attn.k_proj.weight" || n == "self_attn.v_proj.weight") return tp.kv_replicated ? 2 : 1;
    if (n.rfind("mlp.experts.", 0) == 0) return p.ep > 1 ? 3 : tp.experts ? 1 : 0;
    return 0;
  };
  ParamUnit units[4];
  for (ParamUnit& u : units) u.layer = l;
  for (const ParamEntry& e : t.entries()) {
    if (e.layer != l) continue;
    ParamUnit& u = units[group_of(e)];
    if (!u.pieces.empty() && u.pieces.back().end == e.offset)
      u.pieces.back().end += e.numel;
    else
      u.pieces.push_back({e.offset, e.offset + e.numel, u.numel});
    u.numel += e.numel;
  }
  MT_CHECK(!units[0].pieces.empty() && !units[1].pieces.empty(), "block ", l, " has no tp-replicated or tp-split part");
  p.block.push_back(int(p.units.size()));
  p.units.push_back(units[0]);
  units[1].tp_group = 1;
  p.tp_split.push_back(int(p.units.size()));
  p.units.push_back(units[1]);
  p.tp_kv.push_back(-1);
  if (!units[2].pieces.empty()) {
    units[2].tp_group = 2;
    p.tp_kv.back() = int(p.units.size());
    p.units.push_back(units[2]);
  }
  p.experts.push_back(-1);
  if (units[3].pieces.empty()) return;
  // This rank's experts (ep > 1), as without tp.
  p.experts.back() = int(p.units.size());
  p.units.push_back(local_experts_unit(c, t, l, p, tp.experts ? 1 : 0));
}

UnitPlan plan_units(const ModelConfig& c, const ParamTable& t, int ep, int ep_rank, const TpPlacement& tp) {
  const int64_t L = c.num_hidden_layers, E = c.num_experts;
  MT_CHECK(L > 0, "a model needs at least one layer");
  if (ep < 1 || ep_rank < 0 || ep_rank >= ep) MT_THROW("ep rank ", ep_rank, " of ep ", ep, " is invalid");
  bool any_sparse = false;
  for (int64_t l = 0; l < L; ++l) any_sparse |= c.is_sparse_layer(l);
  if (ep > 1 && any_sparse && E % ep != 0) MT_THROW("num_experts (", E, ") must be divisible by ep (", ep, ")");
  UnitPlan p;
  p.ep = ep;
  p.ep_rank = ep_rank;
  p.embed = 0;
  p.units.push_back(one_piece(0, t.layer_range(0).first, -1));
  for (int64_t l = 0; l < L && tp.on; ++l) plan_block_tp(c, t, l, tp, p);
  for (int64_t l = 0; l < L && !tp.on; ++l) {
    auto [b, e] = t.layer_range(l);
    MT_CHECK(b == p.units.back().pieces.back().end || p.units.back().local_experts,
             "block ", l, " does not follow the previous unit in the flat layout");
    if (ep == 1 || !c.is_sparse_layer(l)) {
      p.block.push_back(int(p.units.size()));
      p.experts.push_back(-1);
      p.units.push_back(one_piece(b, e, l));
      continue;
    }
    // The experts are the block's last two parameters; the rest of the block is one piece.
    const std::string pre = "model.layers." + std::to_string(l) + ".mlp.experts.";
    const ParamEntry& gu = t.at(pre + "gate_up_proj");
    const ParamEntry& dn = t.at(pre + "down_proj");
    MT_CHECK(dn.offset == gu.offset + gu.numel && dn.offset + dn.numel == e, "experts of layer ", l,
             " are not the end of the block");
    p.block.push_back(int(p.units.size()));
    p.units.push_back(one_piece(b, gu.offset, l));
    p.experts.push_back(int(p.units.size()));
    p.units.push_back(local_experts_unit(c, t, l, p, 0));
  }
  p.head = int(p.units.size());
  p.units.push_back(one_piece(t.layer_range(L - 1).second, t.total(), -1));
  return p;
}

std::vector<ParamUnit> param_units(const ModelConfig& c, const ParamTable& t) { return plan_units(c, t).units; }

void cast_host_to_device(const Tensor& src, Tensor& dst, int64_t staging_elements) {
  if (staging_elements < 1)
    MT_THROW("refresh_compute_weights: staging_elements = ", staging_elements, "; need >= 1 (f32 values per chunk)");
  MT_CHECK(src.is_cpu() && src.dtype() == DType::F32 && !dst.is_cpu() && dst.numel() == src.numel(),
           "cast_host_to_device: from ", src.desc(), " to ", dst.desc(), "; need host f32 and a device tensor of as many elements");
  // Host f32 -> device staging -> dst, chunk by chunk. The copies run on the legacy stream and the cast
  // on the compute stream, which synchronises with it, so refilling the staging buffer for the next
  // chunk waits for the previous cast.
  const int64_t total = src.numel(), chunk = std::min(total, staging_elements);
  if (total == 0) return;
  Tensor stage = Tensor::empty({chunk}, DType::F32, dst.device());
  const Tensor src_1d = src.view({total});
  Tensor dst_1d = dst.view({total});
  for (int64_t b = 0; b < total; b += chunk) {
    const int64_t n = std::min(chunk, total - b);
    Tensor s = stage.rows(0, n), d = dst_1d.rows(b, n);
    s.copy_from(src_1d.rows(b, n));
    ops::copy_cast(s, d);
  }
}

LocalParams::LocalParams(const ModelConfig& c, const ParamTable& t, Device device, Weights weights,
                         bool keep_host_masters)
    : plan_(plan_units(c, t)) {
  // A frozen CUDA source never updates its masters on the device: they stay in host memory (or, without
  // keep_host_masters, nowhere: fill_from_host writes the device's copies directly).
  const bool host_masters = device == Device::CUDA && weights == Weights::Frozen;
  if (!keep_host_masters && !host_masters)
    MT_THROW("LocalParams: only a frozen model on CUDA can go without its f32 masters");
  if (keep_host_masters) params_ = Tensor::zeros({t.total()}, DType::F32, host_masters ? Device::CPU : device);
  if (weights == Weights::Trainable) grads_ = Tensor::zeros({t.total()}, DType::F32, device);
  // On CUDA the forward and backward read a bf16 copy of the fp32 master weights.
  compute_ = device == Device::CUDA ? Tensor::zeros({t.total()}, DType::BF16, device) : params_;
  if (!keep_host_masters) host_only_ = true;
  if (!host_masters) return;
  constexpr int64_t kAlign = 64;  // elements: 256 bytes
  int64_t n = 0;
  for (const ParamEntry& e : t.entries()) {
    if (!fp32_compute_param(e.name)) continue;
    n += ((e.offset - n) % kAlign + kAlign) % kAlign;  // n == e.offset (mod kAlign)
    fp32_slots_.push_back({e.offset, n, e.numel});
    n += e.numel;
  }
  std::sort(fp32_slots_.begin(), fp32_slots_.end(),
            [](const Fp32Slot& a, const Fp32Slot& b) { return a.flat < b.flat; });
  if (n > 0) fp32_ = Tensor::zeros({n}, DType::F32, device);
}

Tensor LocalParams::acquire_weights(int u) {
  MT_CHECK(u >= 0 && size_t(u) < units_.size(), "unit ", u, " of ", units_.size());
  if (ready_ && size_t(u) < ready_->size()) ready_->compute_waits(size_t(u));
  return compute_.rows(units_[size_t(u)].begin(), units_[size_t(u)].numel);
}

Tensor& LocalParams::grads() {
  if (!grads_.defined())
    MT_THROW("these parameters are frozen (Weights::Frozen): they have no gradients; build the model with "
             "Weights::Trainable to train it");
  return grads_;
}

Tensor LocalParams::unit_grads(int u) {
  MT_CHECK(u >= 0 && size_t(u) < units_.size(), "unit ", u, " of ", units_.size());
  return grads().rows(units_[size_t(u)].begin(), units_[size_t(u)].numel);
}

Tensor LocalParams::fp32_param(const ParamEntry& e) {
  if (!has_compute_copy()) return {};
  if (!host_masters()) return params_.rows(e.offset, e.numel);
  auto it = std::lower_bound(fp32_slots_.begin(), fp32_slots_.end(), e.offset,
                             [](const Fp32Slot& s, int64_t flat) { return s.flat < flat; });
  if (it == fp32_slots_.end() || it->flat != e.offset || it->numel != e.numel)
    MT_THROW("fp32_param(", e.name, "): a frozen CUDA model keeps f32 copies on the device only of the "
             "parameters the kernels read in fp32 (RMSNorm gains, MoE routers: fp32_compute_param); ", e.name,
             " is not one of them");
  return fp32_.rows(it->at, it->numel);
}

std::vector<std::pair<int64_t, int64_t>> LocalParams::unit_ranges() const {
  std::vector<std::pair<int64_t, int64_t>> r;
  for (const ParamUnit& u : units_) r.emplace_back(u.begin(), u.begin() + u.numel);
  return r;
}

void LocalParams::fill_from_host(const std::function<void(int64_t, Tensor&)>& produce, int64_t staging_elements) {
  MT_CHECK(host_only_, "fill_from_host is for a frozen CUDA model without f32 masters");
  const int64_t total = compute_.numel(), step = std::max<int64_t>(1, staging_elements);
  Tensor host = Tensor::empty({std::min(step, total)});
  Tensor gains = fp32_.defined() ? Tensor::zeros({fp32_.numel()}) : Tensor();
  for (int64_t b = 0; b < total; b += step) {
    const int64_t n = std::min(step, total - b);
    Tensor chunk = host.rows(0, n);
    produce(b, chunk);
    Tensor dst = compute_.rows(b, n);
    cast_host_to_device(chunk, dst, step);
    for (const Fp32Slot& s : fp32_slots_) {  // the gains and routers inside this chunk, kept in f32
      const int64_t lo = std::max(s.flat, b), hi = std::min(s.flat + s.numel, b + n);
      if (lo < hi) gains.rows(s.at + (lo - s.flat), hi - lo).copy_from(chunk.rows(lo - b, hi - lo));
    }
  }
  if (fp32_.defined()) fp32_.copy_from(gains);
}

void LocalParams::refresh_compute_weights(int64_t staging_elements) {
  if (host_only_) return;  // no masters: fill_from_host wrote the copies
  if (!has_compute_copy()) return;
  if (!host_masters()) {
    ops::copy_cast(params_, compute_);
    return;
  }
  cast_host_to_device(params_, compute_, staging_elements);
  if (!fp32_.defined()) return;
  // fp32_param's buffer: the gains and routers gathered on the host, one copy to the device.
  Tensor host = Tensor::zeros({fp32_.numel()});
  for (const Fp32Slot& s : fp32_slots_) host.rows(s.at, s.numel).copy_from(params_.rows(s.flat, s.numel));
  fp32_.copy_from(host);
}

}  // namespace mt
