// Per-expert load statistics (see load_balance.h).
#include "train/load_balance.h"

#include <algorithm>
#include <filesystem>

#include "core/error.h"
#include "io/safetensors.h"

namespace mt {

ExpertLoadStats expert_load_stats(const Tensor& counts_LE) {
  MT_CHECK(counts_LE.dim() == 2 && counts_LE.dtype() == DType::I64,
           "expert_load_stats: counts must be i64 [layers, experts], got ", counts_LE.desc());
  ExpertLoadStats s;
  s.layers = counts_LE.size(0);
  s.experts = counts_LE.size(1);
  if (s.layers == 0 || s.experts == 0) return s;
  Tensor h = counts_LE.to(Device::CPU);
  const int64_t* c = h.data<int64_t>();
  int64_t total = 0, mn = c[0], mx = c[0];
  for (int64_t l = 0; l < s.layers; ++l) {
    int64_t row_total = 0, row_max = 0;
    for (int64_t e = 0; e < s.experts; ++e) {
      const int64_t v = c[l * s.experts + e];
      row_total += v;
      row_max = std::max(row_max, v);
      mn = std::min(mn, v);
      mx = std::max(mx, v);
      s.unused += v == 0 ? 1 : 0;
    }
    total += row_total;
    const double row_mean = double(row_total) / double(s.experts);
    s.imbalance_per_layer.push_back(row_mean > 0 ? double(row_max) / row_mean : 0.0);
  }
  s.min = double(mn);
  s.max = double(mx);
  s.mean = double(total) / double(s.layers * s.experts);
  s.imbalance = s.mean > 0 ? s.max / s.mean : 0.0;
  return s;
}

namespace {
std::string bias_name(int64_t layer) {
  return str("model.layers.", layer, ".mlp.gate.e_score_correction_bias");
}
}  // namespace

void save_router_bias(const std::string& dir, const ModelConfig& mc, const Tensor& bias_LE) {
  Tensor h = bias_LE.to(Device::CPU);
  NamedTensors out;
  int64_t i = 0;
  for (int64_t l = 0; l < mc.num_hidden_layers; ++l)
    if (mc.is_sparse_layer(l)) out.emplace_back(bias_name(l), h.rows(i++, 1).view({mc.num_experts}).clone());
  MT_CHECK(i == h.size(0), "save_router_bias: ", i, " sparse layers but the bias is ", h.desc());
  write_safetensors((std::filesystem::path(dir) / kRouterBiasFile).string(), out,
                    {{"moetrain", "aux-loss-free balancing bias (optimizer-like state, not a model weight)"}});
}

bool load_router_bias(const std::string& dir, const ModelConfig& mc, Tensor& bias_LE) {
  const std::string path = (std::filesystem::path(dir) / kRouterBiasFile).string();
  if (!std::filesystem::is_regular_file(path)) return false;
  SafetensorsFile f(path);
  Tensor h = Tensor::empty(bias_LE.shape());
  int64_t i = 0;
  for (int64_t l = 0; l < mc.num_hidden_layers; ++l) {
    if (!mc.is_sparse_layer(l)) continue;
    const std::string name = bias_name(l);
    if (!f.has(name)) MT_THROW(path, " has no tensor ", name, " (sparse layer ", l, ")");
    Tensor t = f.read_f32(name);
    if (t.shape() != Shape{mc.num_experts})
      MT_THROW(path, ": ", name, " is ", t.desc(), "; expected [", mc.num_experts, "] (num_experts)");
    h.rows(i++, 1).view({mc.num_experts}).copy_from(t);
  }
  MT_CHECK(i == bias_LE.size(0), "load_router_bias: ", i, " sparse layers but the bias is ", bias_LE.desc());
  bias_LE.copy_from(h.to(bias_LE.device()));
  return true;
}

}  // namespace mt
