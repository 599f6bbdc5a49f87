#include "model/hf_checkpoint.h"

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <set>

namespace mt {

const char* expert_layout_name(ExpertLayout l) { return l == ExpertLayout::Fused ? "fused" : "per_expert"; }

ExpertLayout parse_expert_layout(const std::string& s) {
  if (s == "per_expert") return ExpertLayout::PerExpert;
  if (s == "fused") return ExpertLayout::Fused;
  MT_THROW("expert layout '", s, "' is not supported; allowed: per_expert, fused");
}

static std::string expert_name(const std::string& fused_name, int64_t e, const char* proj) {
  // "model.layers.3.mlp.experts.gate_up_proj" -> "model.layers.3.mlp.experts.<e>.<proj>.weight"
  std::string base = fused_name.substr(0, fused_name.rfind('.') + 1);
  return base + std::to_string(e) + "." + proj + ".weight";
}

static bool is_fused_expert(const std::string& name) {
  return name.size() > 13 && (name.ends_with("mlp.experts.gate_up_proj") || name.ends_with("mlp.experts.down_proj"));
}

ExpertLayout detect_expert_layout(const CheckpointReader& r) {
  for (const std::string& n : r.names())
    if (is_fused_expert(n)) return ExpertLayout::Fused;
  return ExpertLayout::PerExpert;
}

// One on-disk tensor and where it goes: rows [row0, row0 + rows) of parameter `param` viewed as
// 2-D [outer, inner] (for per-expert slices of a fused parameter), or the whole parameter.
struct HfSlot {
  std::string name;
  Shape shape;
  const ParamEntry* param;
  int64_t offset;  // element offset into the flat buffer
};

static std::vector<HfSlot> hf_slots(const ModelConfig& c, const ParamTable& table, ExpertLayout layout) {
  std::vector<HfSlot> slots;
  const int64_t D = c.hidden_size, F = c.moe_intermediate_size;
  for (const ParamEntry& p : table.entries()) {
    if (layout == ExpertLayout::Fused || !is_fused_expert(p.name)) {
      slots.push_back({p.name, p.shape, &p, p.offset});
      continue;
    }
    const int64_t E = p.shape[0];
    for (int64_t e = 0; e < E; ++e) {
      if (p.name.ends_with("gate_up_proj")) {
        int64_t base = p.offset + e * 2 * F * D;
        slots.push_back({expert_name(p.name, e, "gate_proj"), {F, D}, &p, base});
        slots.push_back({expert_name(p.name, e, "up_proj"), {F, D}, &p, base + F * D});
      } else {
        slots.push_back({expert_name(p.name, e, "down_proj"), {D, F}, &p, p.offset + e * D * F});
      }
    }
  }
  return slots;
}

LoadReport load_hf_weights(const std::string& dir, const ModelConfig& c, const ParamTable& table, Tensor& flat) {
  MT_CHECK(flat.numel() == table.total(), "flat buffer has ", flat.numel(), " elements, the table needs ", table.total());
  return load_hf_weights_ranges(dir, c, table, {{0, table.total(), 0}}, flat);
}

LoadReport load_hf_weights_ranges(const std::string& dir, const ModelConfig& c, const ParamTable& table,
                                  const std::vector<FlatRange>& ranges, Tensor& dst) {
  return load_hf_weights_ranges(CheckpointReader(dir), c, table, ranges, dst);
}

LoadReport load_hf_weights_ranges(const CheckpointReader& r, const ModelConfig& c, const ParamTable& table,
                                  const std::vector<FlatRange>& ranges, Tensor& dst) {
  auto t0 = std::chrono::steady_clock::now();
  const std::string& dir = r.path();
  LoadReport rep;
  rep.layout = detect_expert_layout(r);
  rep.files = r.num_files();
  std::vector<HfSlot> slots = hf_slots(c, table, rep.layout);
  std::set<std::string> used;
  MT_CHECK(dst.dtype() == DType::F32, "load destination must be f32, got ", dst.desc());
  Tensor host = dst.is_cpu() ? dst : Tensor::zeros({dst.numel()}, DType::F32, Device::CPU);
  std::vector<FlatRange> sorted = ranges;
  std::sort(sorted.begin(), sorted.end(), [](const FlatRange& a, const FlatRange& b) { return a.begin < b.begin; });
  for (size_t i = 1; i < sorted.size(); ++i)
    MT_CHECK(sorted[i].begin >= sorted[i - 1].end, "load ranges [", sorted[i - 1].begin, ", ", sorted[i - 1].end,
             ") and [", sorted[i].begin, ", ", sorted[i].end, ") overlap");
  for (const HfSlot& s : slots) {
    if (!r.has(s.name))
      MT_THROW("checkpoint ", dir, " lacks tensor '", s.name, "' (expected shape ", shape_str(s.shape), ", ",
               expert_layout_name(rep.layout), " expert layout)");
    const SafetensorsEntry& info = r.info(s.name);
    if (info.shape != s.shape)
      MT_THROW("tensor '", s.name, "' in ", dir, " has shape ", shape_str(info.shape), ", expected ",
               shape_str(s.shape));
    if (info.dtype != DType::F32 && info.dtype != DType::BF16 && info.dtype != DType::F16)
      MT_THROW("tensor '", s.name, "' in ", dir, " has dtype ", dtype_name(info.dtype),
               "; parameters must be f32, bf16 or f16");
    used.insert(s.name);
    // Only the elements inside the requested ranges are touched (the file is mapped, so only their
    // pages are read from disk).
    const int64_t n = shape_numel(s.shape);
    Tensor file_view;
    // The ranges that overlap this tensor (sorted and disjoint: found by bisection, so that thousands of
    // small slices, as tensor parallelism asks for, do not cost tensors x ranges).
    auto it = std::partition_point(sorted.begin(), sorted.end(), [&](const FlatRange& r) { return r.end <= s.offset; });
    for (; it != sorted.end() && it->begin < s.offset + n; ++it) {
      const FlatRange& fr = *it;
      const int64_t b = std::max(fr.begin, s.offset), e = std::min(fr.end, s.offset + n);
      if (e <= b) continue;
      if (!file_view.defined()) file_view = r.view(s.name).view({n});
      Tensor part = file_view.rows(b - s.offset, e - b);
      Tensor out = host.rows(fr.dst_offset + (b - fr.begin), e - b);
      out.copy_from(part.dtype() == DType::F32 ? part : part.to(DType::F32));
      rep.bytes_read += size_t(e - b) * dtype_size(info.dtype);
    }
  }
  std::vector<std::string> extra;
  for (const std::string& n : r.names()) {
    if (used.count(n)) continue;
    if (n == "lm_head.weight" && c.tie_word_embeddings) {
      rep.ignored_tied_lm_head = true;  // some exporters write the tied matrix twice
      continue;
    }
    extra.push_back(n);
  }
  if (!extra.empty()) {
    std::string list;
    for (size_t i = 0; i < extra.size() && i < 5; ++i) list += (i ? ", '" : "'") + extra[i] + "'";
    if (extra.size() > 5) list += str(" and ", extra.size() - 5, " more");
    MT_THROW("checkpoint ", dir, " has ", extra.size(), " tensor(s) this ", c.architecture, " config does not: ", list);
  }
  if (!dst.is_cpu()) dst.copy_from(host);
  rep.tensors = used.size();
  rep.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return rep;
}

NamedTensors export_hf_tensors(const ModelConfig& c, const ParamTable& table, const Tensor& flat, ExpertLayout layout) {
  Tensor host = flat.to(Device::CPU);
  NamedTensors out;
  for (const HfSlot& s : hf_slots(c, table, layout)) out.emplace_back(s.name, view_at(host, s.offset, s.shape).clone());
  return out;
}

std::vector<PendingTensor> pending_hf_tensors(const ModelConfig& c, const ParamTable& table, ExpertLayout layout,
                                              std::function<Tensor(const ParamEntry&)> param_data) {
  struct Cache {
    const ParamEntry* entry = nullptr;
    Tensor data;
  };
  auto cache = std::make_shared<Cache>();
  std::vector<PendingTensor> out;
  for (const HfSlot& s : hf_slots(c, table, layout)) {
    out.push_back({s.name, s.shape, DType::F32, [cache, param_data, s] {
                     if (cache->entry != s.param) {
                       cache->data = Tensor();  // drop the previous parameter before fetching the next
                       cache->data = param_data(*s.param);
                       cache->entry = s.param;
                       MT_CHECK(cache->data.numel() == s.param->numel, "parameter ", s.param->name, " produced ",
                                cache->data.desc());
                     }
                     return view_at(cache->data, s.offset - s.param->offset, s.shape).clone();
                   }});
  }
  return out;
}

void save_hf_checkpoint(const std::string& dir, const ModelConfig& c, const ParamTable& table, const Tensor& flat,
                        ExpertLayout layout, size_t max_shard_bytes) {
  std::filesystem::create_directories(dir);
  write_safetensors_sharded(dir, export_hf_tensors(c, table, flat, layout), max_shard_bytes);
  save_model_config(c, dir + "/config.json");
}

}  // namespace mt
