// Low-rank adapters (lora.h).
#include "model/lora.h"

#include <cmath>

#include "core/error.h"
#include "core/rng.h"
#include "ops/ops.h"

namespace mt {

namespace {

struct TargetInfo {
  LoraTarget t;
  const char* name;    // PEFT's module name
  const char* prefix;  // under model.layers.L.
};
constexpr std::array<TargetInfo, kLoraTargets> kTargets = {{
    {LoraTarget::Q, "q_proj", "self_attn.q_proj"},
    {LoraTarget::K, "k_proj", "self_attn.k_proj"},
    {LoraTarget::V, "v_proj", "self_attn.v_proj"},
    {LoraTarget::O, "o_proj", "self_attn.o_proj"},
    {LoraTarget::Gate, "gate_proj", "mlp.gate_proj"},
    {LoraTarget::Up, "up_proj", "mlp.up_proj"},
    {LoraTarget::Down, "down_proj", "mlp.down_proj"},
    {LoraTarget::ExpertsGateUp, "experts.gate_up_proj", "mlp.experts.gate_up_proj"},
    {LoraTarget::ExpertsDown, "experts.down_proj", "mlp.experts.down_proj"},
    {LoraTarget::Router, "gate", "mlp.gate"},
}};

struct Group {
  const char* name;
  std::vector<LoraTarget> members;
};
const std::vector<Group>& groups() {
  static const std::vector<Group> g = {
      {"attn", {LoraTarget::Q, LoraTarget::K, LoraTarget::V, LoraTarget::O}},
      {"mlp", {LoraTarget::Gate, LoraTarget::Up, LoraTarget::Down}},
      {"experts", {LoraTarget::ExpertsGateUp, LoraTarget::ExpertsDown}},
      {"router", {LoraTarget::Router}},
  };
  return g;
}

// The adapted weight's [out, in] in layer l of c, or {0, 0} when the layer has no such weight.
std::pair<int64_t, int64_t> out_in(const ModelConfig& c, int64_t l, LoraTarget t) {
  const int64_t D = c.hidden_size, H = c.num_attention_heads, G = c.num_key_value_heads, Hd = c.head_dim;
  const bool sparse = c.is_sparse_layer(l);
  switch (t) {
    case LoraTarget::Q: return {H * Hd, D};
    case LoraTarget::K:
    case LoraTarget::V: return {G * Hd, D};
    case LoraTarget::O: return {D, H * Hd};
    case LoraTarget::Gate:
    case LoraTarget::Up: return sparse ? std::pair<int64_t, int64_t>{0, 0} : std::pair{c.intermediate_size, D};
    case LoraTarget::Down: return sparse ? std::pair<int64_t, int64_t>{0, 0} : std::pair{D, c.intermediate_size};
    case LoraTarget::ExpertsGateUp:
      return sparse ? std::pair{2 * c.moe_intermediate_size, D} : std::pair<int64_t, int64_t>{0, 0};
    case LoraTarget::ExpertsDown:
      return sparse ? std::pair{D, c.moe_intermediate_size} : std::pair<int64_t, int64_t>{0, 0};
    case LoraTarget::Router: return sparse ? std::pair{c.num_experts, D} : std::pair<int64_t, int64_t>{0, 0};
  }
  return {0, 0};
}

std::string trim(const std::string& s) {
  const size_t b = s.find_first_not_of(" \t"), e = s.find_last_not_of(" \t");
  return b == std::string::npos ? std::string() : s.substr(b, e - b + 1);
}

bool is_experts(LoraTarget t) { return t == LoraTarget::ExpertsGateUp || t == LoraTarget::ExpertsDown; }

}  // namespace

const char* lora_target_name(LoraTarget t) { return kTargets[size_t(t)].name; }

double LoraSpec::scale() const {
  MT_CHECK(rank > 0, "LoRA scale of rank ", rank);
  return rslora ? effective_alpha() / std::sqrt(double(rank)) : effective_alpha() / double(rank);
}

bool LoraSpec::targets_any(std::initializer_list<LoraTarget> ts) const {
  for (LoraTarget t : ts)
    if (targets[size_t(t)]) return true;
  return false;
}

std::array<bool, kLoraTargets> parse_lora_targets(const std::string& list) {
  std::array<bool, kLoraTargets> on{};
  std::vector<std::string> names;
  for (const Group& g : groups()) names.push_back(g.name);
  for (const TargetInfo& t : kTargets) names.push_back(t.name);
  size_t start = 0;
  bool any = false;
  while (start <= list.size()) {
    size_t comma = list.find(',', start);
    if (comma == std::string::npos) comma = list.size();
    const std::string item = trim(list.substr(start, comma - start));
    start = comma + 1;
    if (item.empty()) continue;
    bool found = false;
    for (const Group& g : groups())
      if (item == g.name) {
        for (LoraTarget t : g.members) on[size_t(t)] = true;
        found = true;
      }
    for (const TargetInfo& t : kTargets)
      if (item == t.name || item == t.prefix || (std::string("mlp.") + t.name) == item) {
        on[size_t(t.t)] = true;
        found = true;
      }
    if (!found) {
      std::string all;
      for (const std::string& n : names) all += str(all.empty() ? "" : ", ", n);
      MT_THROW("LoRA targets: unknown target '", item, "'; the targets are: ", all);
    }
    any = true;
  }
  if (!any) MT_THROW("LoRA targets: '", list, "' names no target (e.g. attn,mlp,experts)");
  return on;
}

std::string lora_targets_text(const LoraSpec& s) {
  std::string out;
  std::array<bool, kLoraTargets> left = s.targets;
  for (const Group& g : groups()) {
    bool all = true;
    for (LoraTarget t : g.members) all = all && left[size_t(t)];
    if (!all) continue;
    for (LoraTarget t : g.members) left[size_t(t)] = false;
    out += str(out.empty() ? "" : ",", g.name);
  }
  for (const TargetInfo& t : kTargets)
    if (left[size_t(t.t)]) out += str(out.empty() ? "" : ",", t.name);
  return out;
}

LoraTable::LoraTable(const ModelConfig& c, const LoraSpec& s) {
  if (s.rank < 1) MT_THROW("LoRA rank must be >= 1, got ", s.rank);
  if (!(s.effective_alpha() > 0) || !std::isfinite(s.effective_alpha()))
    MT_THROW("LoRA alpha must be > 0, got ", s.alpha);
  const int64_t r = s.rank, E = c.num_experts;
  for (int64_t l = 0; l < c.num_hidden_layers; ++l)
    for (const TargetInfo& ti : kTargets) {
      if (!s[ti.t]) continue;
      const auto [out, in] = out_in(c, l, ti.t);
      if (out == 0) continue;
      const std::string base = str("model.layers.", l, ".", ti.prefix);
      const bool ex = is_experts(ti.t);
      for (bool b : {false, true}) {
        LoraEntry e;
        e.name = base + (b ? ".lora_B.weight" : ".lora_A.weight");
        e.shape = b ? (ex ? Shape{E, out, r} : Shape{out, r}) : (ex ? Shape{E, r, in} : Shape{r, in});
        e.numel = 1;
        for (int64_t d : e.shape) e.numel *= d;
        e.offset = total_;
        e.layer = l;
        e.target = ti.t;
        e.b = b;
        e.in = in;
        total_ += e.numel;
        entries_.push_back(e);
      }
    }
  if (entries_.empty())
    MT_THROW("LoRA targets ", lora_targets_text(s), " adapt nothing in this model (", c.num_hidden_layers, " layers, ",
             c.num_sparse_layers(), " of them MoE): the dense MLPs are `mlp`, the experts `experts`");
}

const LoraEntry* LoraTable::find(const std::string& name) const {
  for (const LoraEntry& e : entries_)
    if (e.name == name) return &e;
  return nullptr;
}

LoraPair LoraPair::expert(int64_t e) const {
  MT_CHECK(A.dim() == 3 && B.dim() == 3, "LoraPair::expert on a pair that is not the experts': ", A.desc());
  return {A.rows(e, 1).view({A.size(1), A.size(2)}), B.rows(e, 1).view({B.size(1), B.size(2)})};
}

LoraPair LoraPair::out_rows(int64_t o0, int64_t n) const {
  MT_CHECK(A.dim() == 2 && B.dim() == 2 && o0 >= 0 && n >= 0 && o0 + n <= B.size(0), "LoraPair::out_rows [", o0, ", ",
           o0 + n, ") of B ", B.desc());
  return {A, B.rows(o0, n)};
}

std::vector<LayerLora> bind_lora(const ModelConfig& c, const LoraTable& table, const Tensor& flat) {
  MT_CHECK(flat.numel() == table.total(), "bind_lora: buffer of ", flat.numel(), " elements for a table of ",
           table.total());
  std::vector<LayerLora> out(size_t(c.num_hidden_layers));
  for (const LoraEntry& e : table.entries()) {
    LoraPair& p = out[size_t(e.layer)].t[size_t(e.target)];
    (e.b ? p.B : p.A) = flat.rows(e.offset, e.numel).view(e.shape);
  }
  return out;
}

void init_lora(const LoraTable& table, Tensor& flat, uint64_t seed) {
  MT_CHECK(flat.is_cpu() && flat.dtype() == DType::F32 && flat.numel() == table.total(),
           "init_lora needs a host f32 buffer of ", table.total(), " elements, got ", flat.desc());
  float* p = flat.data<float>();
  for (const LoraEntry& e : table.entries()) {
    if (e.b) {
      for (int64_t i = 0; i < e.numel; ++i) p[e.offset + i] = 0;
      continue;
    }
    const double bound = 1.0 / std::sqrt(double(e.in));
    for (int64_t i = 0; i < e.numel; ++i) {
      // A value per (seed, element): the same init whatever else the table holds before it.
      const uint64_t h = mix64(seed ^ mix64(uint64_t(e.offset + i) * 0x9e3779b97f4a7c15ull + 0x4c6f5241ull));
      const double u = double(h >> 11) * (1.0 / 9007199254740992.0);  // [0, 1)
      p[e.offset + i] = float((2 * u - 1) * bound);
    }
  }
}

LoraAdapters::LoraAdapters(const ModelConfig& c, const LoraSpec& s, Device device, uint64_t seed)
    : spec_(s), table_(c, s) {
  Tensor host = Tensor::empty({table_.total()});
  init_lora(table_, host, seed);
  params_ = host.to(device);
  grads_ = Tensor::zeros({table_.total()}, DType::F32, device);
  w_ = bind_lora(c, table_, params_);
  g_ = bind_lora(c, table_, grads_);
}

void LoraAdapters::load(const Tensor& flat) {
  MT_CHECK(flat.dtype() == DType::F32 && flat.numel() == table_.total(), "LoRA adapters of ", table_.total(),
           " f32 values; got ", flat.desc());
  params_.copy_from(flat.view({table_.total()}));
}

void lora_fwd(const Tensor& x, const LoraPair& p, float s, Tensor& y, int64_t col0, Arena& work) {
  const int64_t T = x.size(0), r = p.A.size(0), out = p.B.size(0);
  if (T == 0) return;
  Tensor u = work.alloc({T, r}), v = work.alloc({T, out});
  ops::linear_fwd(x, p.A, u);
  ops::scale_(u, s);
  ops::linear_fwd(u, p.B, v);
  ops::add_cols_(y, v, col0, 1.0f);
}

void lora_bwd(const Tensor& dy, int64_t col0, const Tensor& x, const LoraPair& p, const LoraPair& g, float s,
              Tensor* dx, Arena& work) {
  const int64_t T = x.size(0), r = p.A.size(0), out = p.B.size(0), in = p.A.size(1);
  if (T == 0) return;
  Tensor dys = dy;
  if (col0 != 0 || dy.size(1) != out || dy.dtype() != DType::F32) {
    dys = work.alloc({T, out});
    ops::copy_cols(dy, col0, dys);
  }
  Tensor u = work.alloc({T, r}), du = work.alloc({T, r});
  ops::linear_fwd(x, p.A, u);
  ops::scale_(u, s);
  Tensor dA = g.A, dB = g.B;  // views of the gradient buffer
  ops::linear_bwd(dys, u, p.B, &du, false, dB, true);  // du = dy' B, dB += dy'^T u
  ops::scale_(du, s);
  Tensor dxl = dx ? work.alloc({T, in}) : Tensor();
  ops::linear_bwd(du, x, p.A, dx ? &dxl : nullptr, false, dA, true);  // dx' = du A, dA += du^T x
  if (dx) ops::add_cols_(*dx, dxl, 0, 1.0f);
}

namespace {
// A's columns [k0, k0 + kn) as an [r, kn] matrix of the work arena.
Tensor a_cols(const LoraPair& p, int64_t k0, int64_t kn, Arena& work, const char* who) {
  MT_CHECK(p.A.dim() == 2 && k0 >= 0 && k0 + kn <= p.A.size(1), who, ": input features [", k0, ", ", k0 + kn, ") of A ",
           p.A.desc());
  Tensor As = work.alloc({p.A.size(0), kn});
  ops::copy_cols(p.A, k0, As);
  return As;
}
}  // namespace

void lora_fwd_in_cols(const Tensor& x, int64_t k0, const LoraPair& p, float s, Tensor& y, Arena& work) {
  if (x.size(0) == 0) return;
  lora_fwd(x, {a_cols(p, k0, x.size(1), work, "lora_fwd_in_cols"), p.B}, s, y, 0, work);
}

void lora_bwd_in_cols(const Tensor& dy, const Tensor& x, int64_t k0, const LoraPair& p, const LoraPair& g, float s,
                      Tensor* dx, Arena& work) {
  const int64_t kn = x.size(1);
  if (x.size(0) == 0) return;
  const Tensor As = a_cols(p, k0, kn, work, "lora_bwd_in_cols");
  Tensor dAs = work.zeros({p.A.size(0), kn});
  lora_bwd(dy, 0, x, {As, p.B}, {dAs, g.B}, s, dx, work);
  Tensor dA = g.A;  // a view of the gradient buffer
  ops::add_cols_(dA, dAs, k0, 1.0f);
}

namespace {
// Experts [e0, e0 + E) of an experts' pair.
LoraPair local_experts(const LoraPair& p, int64_t e0, int64_t E) {
  MT_CHECK(p.A.dim() == 3 && e0 >= 0 && e0 + E <= p.A.size(0), "LoRA: experts [", e0, ", ", e0 + E,
           ") of an experts' pair ", p.A.desc());
  return {p.A.rows(e0, E), p.B.rows(e0, E)};
}
}  // namespace

void lora_grouped_fwd(const Tensor& x, const Tensor& offsets_E1, const LoraPair& p, int64_t e0, float s, Tensor& y,
                      Arena& work) {
  if (!p.defined()) return;
  const LoraPair l = local_experts(p, e0, offsets_E1.numel() - 1);
  Tensor u = work.alloc({x.size(0), l.A.size(1)});
  ops::grouped_linear_fwd(x, offsets_E1, l.A, s, u);           // u = s x A_e^T
  ops::grouped_linear_fwd(u, offsets_E1, l.B, 1.0f, y, true);  // y += u B_e^T
}

void lora_grouped_bwd(const Tensor& dy, const Tensor& x, const Tensor& offsets_E1, const LoraPair& p,
                      const LoraPair& g, int64_t e0, float s, Tensor* dx, Arena& work) {
  if (!p.defined()) return;
  const int64_t E = offsets_E1.numel() - 1;
  const LoraPair l = local_experts(p, e0, E);
  LoraPair lg = local_experts(g, e0, E);
  Tensor u = work.alloc({x.size(0), l.A.size(1)}), du = work.alloc({x.size(0), l.A.size(1)});
  ops::grouped_linear_fwd(x, offsets_E1, l.A, s, u);
  ops::grouped_linear_bwd(dy, u, offsets_E1, l.B, 1.0f, &du, false, lg.B);  // du = dy B_e, dB_e += dy^T u
  ops::grouped_linear_bwd(du, x, offsets_E1, l.A, s, dx, true, lg.A);       // dx += s du A_e, dA_e += s du^T x
}

}  // namespace mt
