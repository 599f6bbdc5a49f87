// Hugging Face checkpoints <-> the model's flat parameter buffer. Reads config.json + safetensors
// (single or sharded, f32/bf16/f16) with experts either per expert
// (`mlp.experts.{e}.{gate,up,down}_proj.weight`) or fused 3-D (`mlp.experts.gate_up_proj`,
// `mlp.experts.down_proj`, as transformers v5 writes). Writes the per-expert form by default.
// Every mismatch is an error naming the tensor and the expected vs found shape or dtype; tensors the
// model does not have are an error listing them.
#pragma once
#include <string>
#include <vector>

#include "io/safetensors.h"
#include "model/config.h"
#include "model/params.h"

namespace mt {

enum class ExpertLayout { PerExpert, Fused };
const char* expert_layout_name(ExpertLayout l);
ExpertLayout parse_expert_layout(const std::string& s);  // "per_expert" | "fused"

struct LoadReport {
  ExpertLayout layout = ExpertLayout::PerExpert;
  size_t bytes_read = 0;
  size_t tensors = 0;
  size_t files = 0;
  double seconds = 0;
  bool ignored_tied_lm_head = false;  // the file carried lm_head.weight although embeddings are tied
  bool router_bias = false;  // TrainSession::load also read the directory's routing bias (router_bias.safetensors)
};

// Loads every parameter of `table` from the checkpoint at `dir` into `flat` (f32, CPU or CUDA).
LoadReport load_hf_weights(const std::string& dir, const ModelConfig& c, const ParamTable& table, Tensor& flat);

// Loads only the given pieces of the flat layout (a rank's shards under FSDP) into dst (f32, CPU or
// CUDA): each rank maps the files and reads only its slices of each tensor. The checkpoint is still
// validated as a whole (missing, extra, mis-shaped tensors). bytes_read counts the bytes read.
LoadReport load_hf_weights_ranges(const std::string& dir, const ModelConfig& c, const ParamTable& table,
                                  const std::vector<FlatRange>& ranges, Tensor& dst);
// The same from a checkpoint already opened (callers that load in several passes open it once).
LoadReport load_hf_weights_ranges(const CheckpointReader& r, const ModelConfig& c, const ParamTable& table,
                                  const std::vector<FlatRange>& ranges, Tensor& dst);

// HF-named tensors (host f32 copies) of a flat buffer: parameters, gradients or anything laid out
// by `table`, in `layout`'s naming.
NamedTensors export_hf_tensors(const ModelConfig& c, const ParamTable& table, const Tensor& flat, ExpertLayout layout);

// The layout a checkpoint directory uses (fused when any fused expert tensor is present).
ExpertLayout detect_expert_layout(const CheckpointReader& r);

// The HF tensors of a model in file order, each produced on demand from `param_data(entry)` (the
// parameter's f32 values, host, its full shape; called once per parameter, in table order) and
// sliced per expert for the per-expert layout. Used to save sharded models one tensor at a time.
std::vector<PendingTensor> pending_hf_tensors(const ModelConfig& c, const ParamTable& table, ExpertLayout layout,
                                              std::function<Tensor(const ParamEntry&)> param_data);

// Writes config.json + safetensors (sharded above max_shard_bytes) into dir, creating it.
void save_hf_checkpoint(const std::string& dir, const ModelConfig& c, const ParamTable& table, const Tensor& flat,
                        ExpertLayout layout = ExpertLayout::PerExpert, size_t max_shard_bytes = size_t(5) << 30);

}  // namespace mt
