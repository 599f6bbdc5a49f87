// The loss, out of the model: what the LM head hands an objective and what it takes back.
//
// The head computes, for each of this rank's target rows t of a micro-batch, logp_t = log p(label_t)
// under the current weights and, when asked, the entropy H_t of the row's distribution. An objective
// turns them (and the micro-batch's per-token values: advantages, old log-probabilities, ...) into its
// loss value and the coefficients g_t = dL/dlogp_t and h_t = dL/dH_t; the head's backward
// (ops::lm_head_objective_bwd) multiplies them into the logits' gradient, chunk by chunk, never holding
// the logits of the whole micro-batch. Pretraining's cross-entropy is one such objective
// (g_t = -scale); the model also keeps a fused single-pass path for it (PassOptions::ce_scale), which
// needs no log-probabilities first. RL objectives (rl/policy_loss.h, rl/value_loss.h) implement this interface.
//
// Contract: an objective sees only this rank's rows (under data, sequence and tensor parallelism
// each rank sees its own), so its loss and coefficients must be sums of per-token terms with every
// normaliser (token counts of the whole step, group sizes) fixed by the caller beforehand; that is what
// makes the gradients under any layout equal those of one process. Ignored rows (label -100) get
// g = h = 0 whatever the objective writes.
#pragma once
#include <cstdint>
#include <vector>

#include "core/tensor.h"

namespace mt {

// This rank's target rows of a micro-batch, as the head computed them.
struct TokenRows {
  int64_t rows = 0;
  Tensor labels;               // i64 [rows] on the host; -100: not a target
  Tensor logp;                 // f32 [rows] on the model's device: log p(label), 0 on ignored rows
  Tensor entropy;              // f32 [rows] on the model's device; defined when the objective asks
  std::vector<Tensor> values;  // MicroBatch::token_values for these rows, f32 [rows] each (host)
  Tensor value;                // value-head models: v_t, f32 [rows] on the model's device (logp undefined)
};

class TokenObjective {
 public:
  virtual ~TokenObjective() = default;
  virtual bool needs_entropy() const { return false; }
  // Writes g = dL/dlogp into dlogp (f32 [rows], the model's device, zeroed) and, when needs_entropy(),
  // h = dL/dH into dentropy (f32 [rows], zeroed); returns this rank's loss value of the micro-batch.
  virtual double coefficients(const TokenRows& rows, Tensor& dlogp, Tensor* dentropy) const = 0;
};

// Cross-entropy as a per-token objective: L = scale × sum over targets of -logp, so g = -scale.
// The same gradients as the fused path (PassOptions::ce_scale), through the general one.
class CrossEntropyObjective : public TokenObjective {
 public:
  explicit CrossEntropyObjective(double scale) : scale_(scale) {}
  double coefficients(const TokenRows& rows, Tensor& dlogp, Tensor* dentropy) const override;

 private:
  double scale_;
};

// The objective of a value model (ModelConfig::value_head, the RL critic): the head computes v_t = hn_t . w
// for each target row, the objective returns its loss and writes dv = dL/dv_t; the backward gives
// dhn_t = dv_t w and dw = sum_t dv_t hn_t. The same contract as above (sums of per-token terms, normalisers
// fixed by the caller; ignored rows get dv = 0 whatever the objective writes). A value objective handed
// to an LM-head model, or a token objective to a value-head model, is an error.
class ValueObjective : public TokenObjective {
 public:
  double coefficients(const TokenRows& rows, Tensor& dlogp, Tensor* dentropy) const final;  // throws
  // Writes dv (f32 [rows], the model's device, zeroed); returns this rank's loss of the micro-batch.
  virtual double value_coefficients(const TokenRows& rows, Tensor& dv) const = 0;
};

// The sum of an f32 [n] tensor on any device, in fp64 on the host (metrics of a micro-batch).
double host_sum(const Tensor& x);

}  // namespace mt
