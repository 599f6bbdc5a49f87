// Parameter layout: every parameter of the model is a named slice of ONE flat f32 buffer (as in
// llm.c), in block order: embed, layer 0 ... layer L-1, final norm, lm_head. Gradients and AdamW
// states are flat buffers with the same table, so the optimizer is one call and a shard of any
// of them is an offset and a size. Names are the Hugging Face tensor names; the experts of a
// layer are stored fused as transformers (v5) does: gate_up_proj [E, 2F, D] (gate rows first)
// and down_proj [E, D, F]. A dense MLP's gate_proj and up_proj are adjacent, so together they are
// one [2I, D] matrix. With tied embeddings lm_head is the embedding parameter used twice.
#pragma once
#include <string>
#include <unordered_map>
#include <vector>

#include "core/tensor.h"
#include "model/config.h"

namespace mt {

struct ParamEntry {
  std::string name;  // HF name, e.g. "model.layers.0.self_attn.q_proj.weight"
  Shape shape;
  int64_t offset = 0;  // in elements, into the flat buffer
  int64_t numel = 0;
  int64_t layer = -1;  // transformer block, or -1 for embed / final norm / lm_head
};

class ParamTable {
 public:
  explicit ParamTable(const ModelConfig& c);
  const std::vector<ParamEntry>& entries() const { return entries_; }
  const ParamEntry* find(const std::string& name) const;  // null when absent
  const ParamEntry& at(const std::string& name) const;    // error naming the parameter when absent
  int64_t total() const { return total_; }
  // Elements [begin, end) of the flat buffer that belong to block `layer` (-1: not a block).
  std::pair<int64_t, int64_t> layer_range(int64_t layer) const;

 private:
  void add(const std::string& name, const Shape& shape, int64_t layer);
  std::vector<ParamEntry> entries_;
  std::unordered_map<std::string, size_t> index_;
  int64_t total_ = 0;
};

// Views of one flat buffer (parameters, gradients or optimizer states) by role.
struct LayerWeights {
  Tensor in_norm;          // (D)
  Tensor q, k, v;          // (H*Hd, D), (G*Hd, D), (G*Hd, D)
  Tensor q_norm, k_norm;   // (Hd)
  Tensor o;                // (D, H*Hd)
  Tensor post_norm;        // (D)
  bool sparse = false;
  Tensor router;           // (E, D)          sparse layers
  Tensor experts_gate_up;  // (E, 2F, D)      sparse layers
  Tensor experts_down;     // (E, D, F)       sparse layers
  Tensor mlp_gate_up;      // (2I, D)         dense layers: gate_proj rows then up_proj rows
  Tensor mlp_down;         // (D, I)          dense layers
};

struct ModelWeights {
  Tensor embed;  // (V, D)
  std::vector<LayerWeights> layers;
  Tensor norm;     // (D)
  Tensor lm_head;  // (V, D); the same memory as embed when tied
};

Tensor view_at(const Tensor& flat, int64_t offset, const Shape& shape);
// The parameters the compute path reads in fp32 even where the other weights are bf16 copies: the
// RMSNorm gains (a bf16 gain near 1 moves in steps of 2^-8, far coarser than AdamW's updates) and
// the MoE router (fp32 end to end, as Megatron keeps it: weights, logits, softmax, gradients).
bool fp32_compute_param(const std::string& name);
ModelWeights bind_weights(const ModelConfig& c, const ParamTable& table, const Tensor& flat);
// Binds the parameters that lie in elements [base, base + buf.numel()) of the flat layout to views of
// buf, leaving w's other views as they are (one FSDP unit at a time). With tied embeddings, binding
// the embedding binds lm_head too.
void bind_range(const ModelConfig& c, const ParamTable& table, const Tensor& buf, int64_t base, ModelWeights& w);

// A piece of the flat layout, [begin, end), that lands at dst_offset of a destination buffer (a
// rank's shards under FSDP are a list of these).
struct FlatRange {
  int64_t begin = 0, end = 0, dst_offset = 0;
};

// HF-style random init: normal(0, initializer_range) for matrices and embeddings, ones for norms.
// The values depend on the seed and the element's position only.
void init_weights(const ModelConfig& c, const ParamTable& table, Tensor& flat, uint64_t seed);
// The same values for the given pieces only, into a host f32 buffer (sharded init: no rank ever
// holds the full model).
void init_weights_ranges(const ModelConfig& c, const ParamTable& table, const std::vector<FlatRange>& ranges,
                         Tensor& dst, uint64_t seed);

}  // namespace mt
