// Per-expert load statistics of a training step, for the metrics and the step line: from the tokens
// routed to each expert of each sparse layer (i64 [sparse layers, E], already summed over the step's
// micro-batches and data-parallel ranks), the pooled min / max / mean over every (layer, expert) cell,
// the imbalance max / mean, and the cells that got no token. Every sparse layer routes the same number
// of assignments (tokens x top-k), so the mean is the same per layer and the pooled imbalance is the
// worst layer's; the per-layer imbalance is kept too.
//
// Also the file that holds the aux-loss-free balancing bias beside a checkpoint: the bias is
// optimizer-like state, not a model weight, so it is not in the HF weights (Qwen3-MoE has no such
// tensor; transformers reads only model*.safetensors) but in <checkpoint>/router_bias.safetensors, one
// f32 [E] tensor per sparse layer named as DeepSeek-V3's
// `model.layers.{l}.mlp.gate.e_score_correction_bias`.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "core/tensor.h"
#include "model/config.h"

namespace mt {

struct ExpertLoadStats {
  int64_t layers = 0, experts = 0;
  double min = 0, max = 0;                  // tokens of the least and most loaded (layer, expert) cell
  double mean = 0;                          // tokens per expert and layer: total assignments / (layers x E)
  double imbalance = 0;                     // max / mean (1 = perfectly balanced; 0 when no token was routed)
  int64_t unused = 0;                       // (layer, expert) cells that got no token
  std::vector<double> imbalance_per_layer;  // max_l / mean_l for each sparse layer
};

// counts_LE: i64 [L, E] on any device (copied to the host). L = 0 gives all zeros.
ExpertLoadStats expert_load_stats(const Tensor& counts_LE);

inline constexpr const char* kRouterBiasFile = "router_bias.safetensors";
// Writes bias_LE (f32 [sparse layers, E], any device) to dir/router_bias.safetensors.
void save_router_bias(const std::string& dir, const ModelConfig& mc, const Tensor& bias_LE);
// Reads dir/router_bias.safetensors into bias_LE when the file exists (returns false when it does not);
// a missing layer or a wrong shape is an error naming the tensor and the file.
bool load_router_bias(const std::string& dir, const ModelConfig& mc, Tensor& bias_LE);

}  // namespace mt
