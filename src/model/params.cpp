#include "model/params.h"

#include <algorithm>
#include <string>
#include <thread>

#include "core/rng.h"

namespace mt {

static std::string layer_prefix(int64_t l) { return "model.layers." + std::to_string(l) + "."; }

ParamTable::ParamTable(const ModelConfig& c) {
  c.validate();
  const int64_t D = c.hidden_size, H = c.num_attention_heads, G = c.num_key_value_heads, Hd = c.head_dim;
  add("model.embed_tokens.weight", {c.vocab_size, D}, -1);
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
    std::string p = layer_prefix(l);
    add(p + "input_layernorm.weight", {D}, l);
    add(p + "self_attn.q_proj.weight", {H * Hd, D}, l);
    add(p + "self_attn.k_proj.weight", {G * Hd, D}, l);
    add(p + "self_attn.v_proj.weight", {G * Hd, D}, l);
    add(p + "self_attn.o_proj.weight", {D, H * Hd}, l);
    add(p + "self_attn.q_norm.weight", {Hd}, l);
    add(p + "self_attn.k_norm.weight", {Hd}, l);
    add(p + "post_attention_layernorm.weight", {D}, l);
    if (c.is_sparse_layer(l)) {
      const int64_t E = c.num_experts, F = c.moe_intermediate_size;
      add(p + "mlp.gate.weight", {E, D}, l);
      add(p + "mlp.experts.gate_up_proj", {E, 2 * F, D}, l);
      add(p + "mlp.experts.down_proj", {E, D, F}, l);
    } else {
      const int64_t I = c.intermediate_size;
      add(p + "mlp.gate_proj.weight", {I, D}, l);  // must stay adjacent to up_proj (fused view)
      add(p + "mlp.up_proj.weight", {I, D}, l);
      add(p + "mlp.down_proj.weight", {D, I}, l);
    }
  }
  add("model.norm.weight", {D}, -1);
  if (c.value_head) add("score.weight", {1, D}, -1);  // the critic's scalar head (config.h)
  else if (!c.tie_word_embeddings) add("lm_head.weight", {c.vocab_size, D}, -1);
}

void ParamTable::add(const std::string& name, const Shape& shape, int64_t layer) {
  ParamEntry e{name, shape, total_, shape_numel(shape), layer};
  index_[name] = entries_.size();
  entries_.push_back(e);
  total_ += e.numel;
}

const ParamEntry* ParamTable::find(const std::string& name) const {
  auto it = index_.find(name);
  return it == index_.end() ? nullptr : &entries_[it->second];
}

const ParamEntry& ParamTable::at(const std::string& name) const {
  const ParamEntry* e = find(name);
  if (!e) MT_THROW("the model has no parameter named '", name, "'");
  return *e;
}

std::pair<int64_t, int64_t> ParamTable::layer_range(int64_t layer) const {
  int64_t begin = -1, end = -1;
  for (const ParamEntry& e : entries_) {
    if (e.layer != layer) continue;
    if (begin < 0) begin = e.offset;
    end = e.offset + e.numel;
  }
  MT_CHECK(begin >= 0, "no parameters in layer ", layer);
  return {begin, end};
}

Tensor view_at(const Tensor& flat, int64_t offset, const Shape& shape) {
  return flat.view({flat.numel()}).rows(offset, shape_numel(shape)).view(shape);
}

bool fp32_compute_param(const std::string& name) {
  auto ends_with = [&](const char* suffix) {
    const size_t n = std::char_traits<char>::length(suffix);
    return name.size() >= n && name.compare(name.size() - n, n, suffix) == 0;
  };
  return ends_with("layernorm.weight") || ends_with("self_attn.q_norm.weight") ||
         ends_with("self_attn.k_norm.weight") || name == "model.norm.weight" || ends_with(".mlp.gate.weight");
}

// The field of w that a parameter binds to; null for up_proj, which is bound as the second half of
// the fused gate_up view that starts at gate_proj.
static Tensor* field_of(ModelWeights& w, const ParamEntry& e) {
  if (e.layer < 0) {
    if (e.name == "model.embed_tokens.weight") return &w.embed;
    if (e.name == "model.norm.weight") return &w.norm;
    if (e.name == "lm_head.weight" || e.name == "score.weight") return &w.lm_head;
    MT_CHECK(false, "unknown non-layer parameter ", e.name);
  }
  LayerWeights& lw = w.layers[size_t(e.layer)];
  const std::string n = e.name.substr(layer_prefix(e.layer).size());
  if (n == "input_layernorm.weight") return &lw.in_norm;
  if (n == "self_attn.q_proj.weight") return &lw.q;
  if (n == "self_attn.k_proj.weight") return &lw.k;
  if (n == "self_attn.v_proj.weight") return &lw.v;
  if (n == "self_attn.o_proj.weight") return &lw.o;
  if (n == "self_attn.q_norm.weight") return &lw.q_norm;
  if (n == "self_attn.k_norm.weight") return &lw.k_norm;
  if (n == "post_attention_layernorm.weight") return &lw.post_norm;
  if (n == "mlp.gate.weight") return &lw.router;
  if (n == "mlp.experts.gate_up_proj") return &lw.experts_gate_up;
  if (n == "mlp.experts.down_proj") return &lw.experts_down;
  if (n == "mlp.gate_proj.weight") return &lw.mlp_gate_up;
  if (n == "mlp.up_proj.weight") return nullptr;
  if (n == "mlp.down_proj.weight") return &lw.mlp_down;
  MT_CHECK(false, "unknown layer parameter ", e.name);
  return nullptr;
}

void bind_range(const ModelConfig& c, const ParamTable& t, const Tensor& buf, int64_t base, ModelWeights& w) {
  if (w.layers.size() != size_t(c.num_hidden_layers)) {
    w.layers.resize(size_t(c.num_hidden_layers));
    for (int64_t l = 0; l < c.num_hidden_layers; ++l) w.layers[size_t(l)].sparse = c.is_sparse_layer(l);
  }
  const int64_t end = base + buf.numel();
  bool embed_bound = false;
  for (const ParamEntry& e : t.entries()) {
    if (e.offset < base || e.offset + e.numel > end) {
      MT_CHECK(e.offset >= end || e.offset + e.numel <= base, "parameter ", e.name, " straddles the bound range [",
               base, ", ", end, ")");
      continue;
    }
    Tensor* f = field_of(w, e);
    if (!f) continue;
    Shape shape = e.shape;
    if (e.name.size() > 20 && e.name.compare(e.name.size() - 20, 20, "mlp.gate_proj.weight") == 0) {
      const ParamEntry& up = t.at(layer_prefix(e.layer) + "mlp.up_proj.weight");
      MT_CHECK(up.offset == e.offset + e.numel && up.offset + up.numel <= end, "gate_proj and up_proj of layer ",
               e.layer, " are not adjacent in the bound range");
      shape = {2 * c.intermediate_size, c.hidden_size};
    }
    *f = view_at(buf, e.offset - base, shape);
    embed_bound |= f == &w.embed;
  }
  if (c.tie_word_embeddings && embed_bound) w.lm_head = w.embed;
}

ModelWeights bind_weights(const ModelConfig& c, const ParamTable& t, const Tensor& flat) {
  MT_CHECK(flat.numel() == t.total(), "flat buffer has ", flat.numel(), " elements, the table needs ", t.total());
  ModelWeights w;
  bind_range(c, t, flat, 0, w);
  return w;
}

// Fixed chunks of the flat buffer, each with its own stream seeded from (seed, chunk): the values
// depend on the seed only, not on the thread count or on which pieces are asked for, and a
// 3 B-parameter model initialises in seconds instead of a minute.
static constexpr int64_t kInitChunk = int64_t(1) << 20;

namespace {
struct InitPiece {
  int64_t ch, lo, hi, dst;  // chunk, absolute flat positions [lo, hi) inside it, destination offset
};
}  // namespace

// Generates chunk ch once and writes the elements of its pieces (sorted by lo, disjoint) to dst. A
// chunk is generated once however many pieces ask for it: tensor-parallel slices are many short
// pieces (a column slice is one piece per row).
static void init_chunk(const ParamTable& table, float std, uint64_t seed, const InitPiece* ps, size_t n, float* dst) {
  const auto& entries = table.entries();
  const int64_t ch = ps[0].ch;
  Rng rng(seed * 0x9e3779b97f4a7c15ull + uint64_t(ch) + 1);
  const int64_t begin = ch * kInitChunk, hi = ps[n - 1].hi;
  size_t e = size_t(std::upper_bound(entries.begin(), entries.end(), begin,
                                     [](int64_t v, const ParamEntry& p) { return v < p.offset; }) -
                    entries.begin()) - 1;
  size_t k = 0;
  for (int64_t i = begin; i < hi; ++i) {
    while (i >= entries[e].offset + entries[e].numel) ++e;
    // 1-D parameters are RMSNorm weights: ones. Everything else: normal(0, initializer_range). The
    // stream advances only for matrices, so every element before a piece in the chunk is generated too.
    const float v = entries[e].shape.size() == 1 ? 1.0f : std * float(rng.normal());
    while (i >= ps[k].hi) ++k;
    if (i >= ps[k].lo) dst[ps[k].dst + (i - ps[k].lo)] = v;
  }
}

static void init_pieces(const ModelConfig& c, const ParamTable& table, const std::vector<FlatRange>& ranges,
                        float* dst, uint64_t seed) {
  std::vector<InitPiece> pieces;
  for (const FlatRange& r : ranges)
    for (int64_t lo = r.begin; lo < r.end;) {
      const int64_t ch = lo / kInitChunk, hi = std::min(r.end, (ch + 1) * kInitChunk);
      pieces.push_back({ch, lo, hi, r.dst_offset + (lo - r.begin)});
      lo = hi;
    }
  std::sort(pieces.begin(), pieces.end(), [](const InitPiece& a, const InitPiece& b) { return a.lo < b.lo; });
  std::vector<size_t> first;  // the first piece of each chunk
  for (size_t i = 0; i < pieces.size(); ++i)
    if (i == 0 || pieces[i].ch != pieces[i - 1].ch) first.push_back(i);
  first.push_back(pieces.size());
  const float std = float(c.initializer_range);
  auto fill = [&](size_t start, size_t stride) {
    for (size_t j = start; j + 1 < first.size(); j += stride)
      init_chunk(table, std, seed, &pieces[first[j]], first[j + 1] - first[j], dst);
  };
  const size_t jobs = first.size() - 1;
  const size_t threads = std::max<size_t>(1, std::min<size_t>(jobs, std::thread::hardware_concurrency()));
  std::vector<std::thread> pool;
  for (size_t t = 1; t < threads; ++t) pool.emplace_back(fill, t, threads);
  fill(0, threads);
  for (auto& th : pool) th.join();
}

void init_weights(const ModelConfig& c, const ParamTable& table, Tensor& flat, uint64_t seed) {
  MT_CHECK(flat.is_cpu() && flat.numel() == table.total(), "init_weights needs the CPU flat buffer, got ", flat.desc());
  init_pieces(c, table, {{0, table.total(), 0}}, flat.data<float>(), seed);
}

void init_weights_ranges(const ModelConfig& c, const ParamTable& table, const std::vector<FlatRange>& ranges,
                         Tensor& dst, uint64_t seed) {
  MT_CHECK(dst.is_cpu() && dst.dtype() == DType::F32, "init_weights_ranges needs a host f32 buffer, got ", dst.desc());
  for (const FlatRange& r : ranges)
    MT_CHECK(r.begin >= 0 && r.end <= table.total() && r.dst_offset + (r.end - r.begin) <= dst.numel(),
             "init range [", r.begin, ", ", r.end, ") -> ", r.dst_offset, " outside the buffers");
  init_pieces(c, table, ranges, dst.data<float>(), seed);
}

}  // namespace mt
