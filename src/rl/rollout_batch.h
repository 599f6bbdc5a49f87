// From rollouts to a training micro-batch: the RL update's input.
//
// Each sample is one row: its prompt then its response, padded with token 0 to the longest row. Labels
// follow HF semantics (aligned with input_ids; the model shifts them): the response tokens are targets,
// the prompt and the padding are -100. Per-token values (advantages, old and reference log-probs, token
// weights: PolicyObjective's inputs) are set per response token and land where MicroBatch::token_values
// expects them (aligned with the labels). The routing replay (R3) comes from each sample's
// RoutingRecord, which covers every token the engine read (prompt + response - 1); the last response
// token and the padding, which no target depends on, route to experts 0..K-1 as the batch planner's
// padding does.
#pragma once
#include <cstdint>
#include <vector>

#include "model/micro_batch.h"
#include "rollout/routing_record.h"

namespace mt::rl {

struct RolloutSample {
  std::vector<int32_t> prompt, response;
  std::vector<float> logprobs;  // the engine's, one per response token
  RoutingRecord routing;        // empty: no replay
};

struct PackedRollouts {
  MicroBatch mb;  // input_ids, labels i64 [B, S]; routing when every sample has a record
  int64_t S = 0;
  std::vector<int64_t> prompt_len, response_len;
};

// Errors name the sample: an empty response, a record that does not cover prompt + response - 1 tokens,
// records on some samples only.
PackedRollouts pack_rollouts(const std::vector<RolloutSample>& samples, int64_t top_k);
// Token value k (MicroBatch::token_values[k], created as zeros up to k) from per-sample, per-response-token
// values: v[i][j] for response token j of sample i.
void set_token_values(PackedRollouts& p, size_t k, const std::vector<std::vector<float>>& v);
// Per-target rows of an unplanned one-process forward (e.g. LossParts::logp, f32 [B S], any device) back
// to per-sample, per-response-token values: row b S + t holds the target at position t + 1.
std::vector<std::vector<float>> response_values(const PackedRollouts& p, const Tensor& rows_BS);

}  // namespace mt::rl
