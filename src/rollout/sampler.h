// The rollout sampler step: one draw per logit row of a step, on the logits' device, through
// ops::sample_tokens (temperature, top-k, top-p, min-p, log-probabilities before truncation: docs/rollout.md
// "Sampling"). Randomness is counter-based: a draw's numbers depend on (request seed, sample index,
// position) only, never on the rest of the batch.
#pragma once
#include <cstdint>
#include <vector>

#include "core/tensor.h"
#include "ops/sampling.h"
#include "rollout/scheduler.h"

namespace mt {

// The step's draws, one per row of the plan's draw rows: the request's sampling parameters and the
// counter (sample j of an admitted prompt's n; a decoding sequence its own sample index; the position of
// the token being drawn).
struct SamplingBatch {
  std::vector<SamplingParams> params;
  std::vector<DrawCounter> counters;
  int64_t rows() const { return int64_t(params.size()); }
};
SamplingBatch sampling_batch(const StepPlan& plan, const std::vector<GenerateRequest>& requests);

// ops::sample_tokens' rows (i64 [rows, kSampleRowWords]) for the batch, padded to `rows` with greedy rows
// at counter 0 (a decode graph's padding).
Tensor pack_padded_sample_rows(const SamplingBatch& batch, int64_t rows);

// Draws every row of logits_RV (f32 [R, V], on the model's device) there and brings the tokens and
// log-probabilities to the host: the step's one synchronisation. Routing is left empty.
StepDraws sample_step(const Tensor& logits_RV, const SamplingBatch& batch);

}  // namespace mt
