// Low-rank adapters (LoRA: Hu et al. 2021, in PEFT's conventions): a frozen base weight W [out, in] is
// used as W + s B A, with A [r, in], B [out, r] trained and s = alpha / r (alpha / sqrt(r) with rsLoRA).
// The base is never changed and no merged copy is made per step: each adapted GEMM y = x W^T gains the
// low-rank path y += s (x A^T) B^T, and its backward the matching dA, dB and input gradient; the base's
// weight gradient is not computed at all.
//
// What can be adapted (targets; groups in parentheses):
//   q_proj k_proj v_proj o_proj (attn), gate_proj up_proj down_proj of the dense MLPs (mlp),
//   each routed expert's gate_up_proj and down_proj (experts: per-expert A and B), the router (off unless named).
// Qwen3-MoE has no shared expert.
//
// Layout: every adapter of the model is a named slice of ONE flat f32 buffer (as the base's ParamTable),
// so the optimizer, gradient clipping and checkpoints treat the adapters as one more parameter set. Names
// follow PEFT's, without its "base_model.model." prefix: model.layers.L.self_attn.q_proj.lora_A.weight
// [r, in] and ...lora_B.weight [out, r]; for the experts, model.layers.L.mlp.experts.gate_up_proj.lora_A.weight
// [E, r, D] and .lora_B.weight [E, 2F, r] (down_proj: [E, r, F] and [E, D, r]): expert e's A and B are
// the e-th slices. (PEFT's files store the experts' B as [out, r E] with column j E + e: the converter
// reorders, model/lora_peft.h.) Init as PEFT's default: A ~ U(-1/sqrt(in), 1/sqrt(in)) (kaiming-uniform
// with a = sqrt(5)), B = 0, so a new adapter leaves the model's outputs unchanged.
#pragma once
#include <array>
#include <cstdint>
#include <string>
#include <vector>

#include "core/arena.h"
#include "core/tensor.h"
#include "model/config.h"

namespace mt {

enum class LoraTarget { Q, K, V, O, Gate, Up, Down, ExpertsGateUp, ExpertsDown, Router };
constexpr int kLoraTargets = 10;
// The module's name as PEFT targets it: "q_proj", ..., "gate_up_proj" (experts), "gate" (router).
const char* lora_target_name(LoraTarget t);

struct LoraSpec {
  int64_t rank = 0;    // 0: no adapters
  double alpha = 0;    // 0: 2 × rank
  bool rslora = false;  // s = alpha / sqrt(rank) instead of alpha / rank
  // What is adapted: any of attn, mlp, experts, router and the single names q_proj, k_proj, v_proj, o_proj,
  // gate_proj, up_proj, down_proj, experts.gate_up_proj, experts.down_proj. parse_lora_targets reads the
  // comma-separated form of the command line.
  std::array<bool, kLoraTargets> targets{};
  double effective_alpha() const { return alpha > 0 ? alpha : 2.0 * double(rank); }
  double scale() const;
  bool targets_any(std::initializer_list<LoraTarget> ts) const;
  bool operator[](LoraTarget t) const { return targets[size_t(t)]; }
};
// "attn,mlp,experts" (the default) -> the targets; an unknown name is an error listing the names.
std::array<bool, kLoraTargets> parse_lora_targets(const std::string& list);
std::string lora_targets_text(const LoraSpec& s);  // "attn,mlp,experts" style, for logs and configs
constexpr const char* kDefaultLoraTargets = "attn,mlp,experts";

struct LoraEntry {
  std::string name;  // e.g. "model.layers.0.self_attn.q_proj.lora_A.weight"
  Shape shape;
  int64_t offset = 0, numel = 0;
  int64_t layer = 0;
  LoraTarget target = LoraTarget::Q;
  bool b = false;  // lora_B (else lora_A)
  int64_t in = 0;  // the adapted weight's input features (A's fan-in)
};

// The adapters of a model under a spec, in layer order, each target's A then B. Targets a layer does not
// have (the experts of a dense layer, the MLP of a sparse one) are left out; a spec that adapts nothing in
// this model is an error naming the model's layers.
class LoraTable {
 public:
  LoraTable(const ModelConfig& c, const LoraSpec& s);
  const std::vector<LoraEntry>& entries() const { return entries_; }
  const LoraEntry* find(const std::string& name) const;
  int64_t total() const { return total_; }

 private:
  std::vector<LoraEntry> entries_;
  int64_t total_ = 0;
};

// One adapted weight's pair: A [r, in] and B [out, r], or for the experts A [E, r, in] and B [E, out, r].
struct LoraPair {
  Tensor A, B;
  bool defined() const { return A.defined(); }
  LoraPair expert(int64_t e) const;  // the e-th expert's [r, in] and [out, r]
  // A whole and B's rows [o0, o0 + n): a column-parallel layer's share under tensor parallelism (below).
  LoraPair out_rows(int64_t o0, int64_t n) const;
};
struct LayerLora {
  std::array<LoraPair, kLoraTargets> t;
  const LoraPair& operator[](LoraTarget x) const { return t[size_t(x)]; }
  // Whether this layer adapts any routed expert weight (the per-expert path then runs).
  bool experts() const {
    return t[size_t(LoraTarget::ExpertsGateUp)].defined() || t[size_t(LoraTarget::ExpertsDown)].defined();
  }
};
// Views of a flat buffer (weights or gradients) per layer.
std::vector<LayerLora> bind_lora(const ModelConfig& c, const LoraTable& table, const Tensor& flat);

// PEFT's default init into a host f32 buffer of table.total() elements; the values depend on the seed and
// the element's position only.
void init_lora(const LoraTable& table, Tensor& flat, uint64_t seed);

// The adapters of one model on its device: f32 weights and gradients (the optimizer's masters: no
// separate compute copy, the adapters' GEMMs run in fp32 on every device).
class LoraAdapters {
 public:
  LoraAdapters(const ModelConfig& c, const LoraSpec& s, Device device, uint64_t seed);
  const LoraSpec& spec() const { return spec_; }
  const LoraTable& table() const { return table_; }
  float scale() const { return float(spec_.scale()); }
  Tensor& params() { return params_; }
  Tensor& grads() { return grads_; }
  const LayerLora& weights(int64_t l) const { return w_[size_t(l)]; }
  const LayerLora& grads(int64_t l) const { return g_[size_t(l)]; }
  // Replaces the adapters' values (host or device f32 of table().total() elements).
  void load(const Tensor& flat);

 private:
  LoraSpec spec_;
  LoraTable table_;
  Tensor params_, grads_;
  std::vector<LayerLora> w_, g_;
};

// The low-rank path of one GEMM, on row blocks of any device's tensors (x bf16|f32, y and dx bf16|f32):
//   forward:  y[:, col0 : col0 + out] += s (x A^T) B^T
//   backward: with u = s x A^T and du = s dy' B (dy' = dy[:, col0 : col0 + out]):
//             dB += dy'^T u, dA += du^T x, dx += du A (dx null: not wanted).
// Temporaries come from `work` (f32 [rows, r] and [rows, out]).
void lora_fwd(const Tensor& x, const LoraPair& p, float s, Tensor& y, int64_t col0, Arena& work);
void lora_bwd(const Tensor& dy, int64_t col0, const Tensor& x, const LoraPair& p, const LoraPair& g, float s,
              Tensor* dx, Arena& work);

// Tensor parallelism (parallel/tensor_parallel.h): every rank holds every adapter whole and uses the part that
// matches its slice of the base weight; the adapters' gradients are then summed over the tp ranks, which
// completes the partial sums below.
// - Column-parallel layers (q/k/v, the dense gate/up; this rank's output features [o0, o0 + n)): lora_fwd and
//   lora_bwd on p.out_rows(o0, n) and g.out_rows(o0, n). u = s x A^T is the same on every rank; y gets this
//   rank's columns and B's rows their whole gradient; du, hence dA and dx, are this rank's share of a sum.
// - Row-parallel layers (o_proj, the dense down_proj; x holds the input features [k0, k0 + x.size(1))): the
//   two functions below, with A's columns [k0, k0 + x.size(1)). u, y (added into the base's partial output
//   before its reduce-scatter) and dB are this rank's share of a sum; du = s dy B is whole, so A's columns
//   get their whole gradient and dx this rank's input features' gradient.
void lora_fwd_in_cols(const Tensor& x, int64_t k0, const LoraPair& p, float s, Tensor& y, Arena& work);
void lora_bwd_in_cols(const Tensor& dy, const Tensor& x, int64_t k0, const LoraPair& p, const LoraPair& g, float s,
                      Tensor* dx, Arena& work);

// The experts' low-rank path over dispatched rows grouped by expert (offsets_E1: the rows of local expert e
// are [off[e], off[e+1])), for the local experts [e0, e0 + E) of an experts' pair (expert parallelism: e0 is
// the global id of local expert 0). Grouped GEMMs (ops::grouped_linear_*), no host synchronisation:
//   forward:  y += s (x A_e^T) B_e^T on each expert's rows;
//   backward: as lora_bwd per expert (dB, dA +=; dx += when dx is given). u is formed again from x.
void lora_grouped_fwd(const Tensor& x, const Tensor& offsets_E1, const LoraPair& p, int64_t e0, float s, Tensor& y,
                      Arena& work);
void lora_grouped_bwd(const Tensor& dy, const Tensor& x, const Tensor& offsets_E1, const LoraPair& p,
                      const LoraPair& g, int64_t e0, float s, Tensor* dx, Arena& work);

}  // namespace mt
