#include "parallel/tensor_parallel.h"

#include <algorithm>

#include "parallel/dist.h"

namespace mt {

ModelConfig tp_local_config(const ModelConfig& c, int tp, int etp) {
  if (tp < 1 || etp < 1) MT_THROW("tp ", tp, " and etp ", etp, " must be at least 1");
  if (etp != 1 && etp != tp) MT_THROW("etp ", etp, " must be 1 or equal to tp ", tp);
  ModelConfig l = c;
  if (tp == 1) return l;
  const int64_t H = c.num_attention_heads, G = c.num_key_value_heads;
  if (H % tp != 0) MT_THROW("num_attention_heads (", H, ") must be divisible by tp (", tp, ")");
  if (G >= tp ? G % tp != 0 : tp % G != 0)
    MT_THROW("num_key_value_heads (", G, ") and tp (", tp, ") must divide one another (kv heads are split over tp, ",
             "or replicated over tp / num_key_value_heads ranks when fewer)");
  l.num_attention_heads = H / tp;
  l.num_key_value_heads = std::max<int64_t>(1, G / tp);
  bool dense = false, sparse = false;
  for (int64_t i = 0; i < c.num_hidden_layers; ++i) (c.is_sparse_layer(i) ? sparse : dense) = true;
  if (dense) {
    if (c.intermediate_size % tp != 0)
      MT_THROW("intermediate_size (", c.intermediate_size, ") must be divisible by tp (", tp, ")");
    l.intermediate_size = c.intermediate_size / tp;
  }
  if (sparse && c.moe_intermediate_size % etp != 0)
    MT_THROW("moe_intermediate_size (", c.moe_intermediate_size, ") must be divisible by etp (", etp, ")");
  if (sparse) l.moe_intermediate_size = c.moe_intermediate_size / etp;
  return l;
}

TpLayout::TpLayout(const ModelConfig& global, int tp, int etp)
    : g_(global), l_(tp_local_config(global, tp, etp)), tp_(tp), etp_(etp) {
  gt_ = std::make_unique<ParamTable>(g_);
  lt_ = std::make_unique<ParamTable>(l_);
}

TpPlacement TpLayout::placement() const {
  TpPlacement p;
  p.on = tp_ > 1;
  p.experts = etp_ > 1;
  p.kv_replicated = kv_replicated();
  return p;
}

namespace {
// Local index l0 + i of a dim is global index g0 + i, for i < n.
struct Seg {
  int64_t l0, g0, n;
};
using DimMap = std::vector<Seg>;

bool ends_with(const std::string& s, const char* t) {
  return s.ends_with(t);
}

int64_t map_index(const DimMap& m, int64_t i) {
  for (const Seg& s : m)
    if (i >= s.l0 && i < s.l0 + s.n) return s.g0 + (i - s.l0);
  MT_CHECK(false, "index ", i, " outside the slice map");
  return 0;
}
}  // namespace

// Per dim of the local parameter: which global indices it holds (tp rank r).
static std::vector<DimMap> slice_map(const ModelConfig& g, const ModelConfig& l, const ParamEntry& le, int r) {
  std::vector<DimMap> m;
  for (int64_t d : le.shape) m.push_back({{0, 0, d}});
  const int64_t Hd = g.head_dim, Hl = l.num_attention_heads, Gl = l.num_key_value_heads;
  const int64_t kv0 = int64_t(r) * g.num_key_value_heads / (g.num_attention_heads / Hl);  // r G / tp
  const int64_t Il = l.intermediate_size, F = g.moe_intermediate_size, Fl = l.moe_intermediate_size;
  const std::string& n = le.name;
  if (ends_with(n, "self_attn.q_proj.weight"))
    m[0] = {{0, r * Hl * Hd, Hl * Hd}};
  else if (ends_with(n, "self_attn.k_proj.weight") || ends_with(n, "self_attn.v_proj.weight"))
    m[0] = {{0, kv0 * Hd, Gl * Hd}};
  else if (ends_with(n, "self_attn.o_proj.weight"))
    m[1] = {{0, r * Hl * Hd, Hl * Hd}};
  else if (ends_with(n, "mlp.gate_proj.weight") || ends_with(n, "mlp.up_proj.weight"))
    m[0] = {{0, r * Il, Il}};
  else if (ends_with(n, "mlp.down_proj.weight"))
    m[1] = {{0, r * Il, Il}};
  else if (Fl != F && ends_with(n, "mlp.experts.gate_up_proj"))
    m[1] = {{0, r * Fl, Fl}, {Fl, F + r * Fl, Fl}};
  else if (Fl != F && ends_with(n, "mlp.experts.down_proj"))
    m[2] = {{0, r * Fl, Fl}};
  return m;
}

bool TpLayout::replicated(const ParamEntry& local) const {
  return local.shape == gt_->at(local.name).shape;
}

std::vector<FlatRange> TpLayout::to_global(int tp_rank, const std::vector<FlatRange>& local) const {
  MT_CHECK(tp_rank >= 0 && tp_rank < tp_, "tp rank ", tp_rank, " of ", tp_);
  const auto& entries = lt_->entries();
  std::vector<FlatRange> out;
  for (const FlatRange& fr : local) {
    // The local entries that overlap [begin, end), in order.
    size_t i = size_t(std::upper_bound(entries.begin(), entries.end(), fr.begin,
                                       [](int64_t v, const ParamEntry& e) { return v < e.offset; }) -
                      entries.begin());
    i = i > 0 ? i - 1 : 0;
    for (; i < entries.size() && entries[i].offset < fr.end; ++i) {
      const ParamEntry& le = entries[i];
      const int64_t a = std::max(fr.begin, le.offset) - le.offset,
                    z = std::min(fr.end, le.offset + le.numel) - le.offset;
      if (z <= a) continue;
      const ParamEntry& ge = gt_->at(le.name);
      const std::vector<DimMap> m = slice_map(g_, l_, le, tp_rank);
      const int nd = int(le.shape.size());
      std::vector<int64_t> gstride(size_t(nd), 1);
      for (int d = nd - 2; d >= 0; --d) gstride[size_t(d)] = gstride[size_t(d) + 1] * ge.shape[size_t(d) + 1];
      const int64_t nl = le.shape[size_t(nd - 1)];
      for (int64_t p = a; p < z;) {
        int64_t o = p / nl, j = p % nl, goff = 0;
        for (int d = nd - 2; d >= 0; --d) {
          goff += map_index(m[size_t(d)], o % le.shape[size_t(d)]) * gstride[size_t(d)];
          o /= le.shape[size_t(d)];
        }
        const Seg* s = nullptr;
        for (const Seg& x : m[size_t(nd - 1)])
          if (j >= x.l0 && j < x.l0 + x.n) s = &x;
        MT_CHECK(s, "no slice holds column ", j, " of ", le.name);
        const int64_t run = std::min(s->l0 + s->n - j, z - p);
        const int64_t gpos = ge.offset + goff + s->g0 + (j - s->l0);
        const int64_t dpos = fr.dst_offset + (le.offset + p - fr.begin);
        if (!out.empty() && out.back().end == gpos &&
            out.back().dst_offset + (out.back().end - out.back().begin) == dpos)
          out.back().end += run;
        else
          out.push_back({gpos, gpos + run, dpos});
        p += run;
      }
    }
  }
  return out;
}

Tensor TpLayout::gather_global(const ParamEntry& ge, comm::Communicator* tp,
                               const std::function<Tensor(const ParamEntry&)>& local_param) const {
  const ParamEntry& le = lt_->at(ge.name);
  Tensor mine = local_param(le);
  MT_CHECK(mine.numel() == le.numel && mine.is_cpu(), "local ", le.name, " is ", mine.desc());
  if (replicated(le) || tp_ == 1) return mine.view(ge.shape);
  MT_CHECK(tp && tp->size() == tp_, "gather_global needs the tp communicator of size ", tp_);
  Tensor all = Tensor::empty({tp_ * le.numel}, DType::F32, tp->device());
  tp->all_gather(mine.view({le.numel}).to(tp->device()), all)->wait();
  device_mem::synchronize(tp->device());
  Tensor host = all.to(Device::CPU), out = Tensor::zeros({ge.numel});
  for (int r = 0; r < tp_; ++r)
    for (const FlatRange& g : to_global(r, {{le.offset, le.offset + le.numel, int64_t(r) * le.numel}}))
      out.rows(g.begin - ge.offset, g.end - g.begin).copy_from(host.rows(g.dst_offset, g.end - g.begin));
  return out.view(ge.shape);
}

TpComms make_tp_comms(DistContext& dist, const TpLayout& layout) {
  TpComms c;
  const DeviceMesh& m = dist.mesh();
  const int r = dist.rank(), tp = m.size(Axis::Tp), rep = m.coord(Axis::DpReplicate, r);
  MT_CHECK(tp == layout.tp(), "mesh tp ", tp, " and layout tp ", layout.tp());
  c.tp_rank = m.coord(Axis::Tp, r);
  comm::Communicator& w = *dist.world();
  auto split = [&](int color, const char* name) { return dist.adopt(w.split(color, r, name)); };
  c.tp = dist.adopt(w.split(m.group_color(Axis::Tp, r), c.tp_rank, "tp"));
  c.dense = split(rep, "tp_dense");
  c.split = split(rep * tp + c.tp_rank, "tp_split");
  c.dense_reduce = dist.adopt(c.dense->split(0, c.dense->rank(), "tp_dense.reduce"));
  c.split_reduce = dist.adopt(c.split->split(0, c.split->rank(), "tp_split.reduce"));
  if (layout.kv_replicated()) {
    const int G = int(layout.global_config().num_key_value_heads);
    c.kv = split(rep * G + layout.kv_head_of(c.tp_rank), "tp_kv");
    c.kv_reduce = dist.adopt(c.kv->split(0, c.kv->rank(), "tp_kv.reduce"));
  }
  return c;
}

}  // namespace mt
