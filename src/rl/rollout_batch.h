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
// Multi-turn samples (rl/multiturn.h): the response interleaves the model's turns with the observations the
// environment appended; model_mask marks which is which, and an observation token (mask 0) is labelled
// -100 like a prompt token: the forwards read it (positions and routing line up with the engine's), no
// loss, KL or entropy term is taken on it.
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
  // Per response token: 1 the model sampled it, 0 the environment appended it (an observation). Empty: every
  // response token is the model's.
  std::vector<uint8_t> model_mask;
};

struct PackedRollouts {
  MicroBatch mb;  // input_ids, labels i64 [B, S]; routing when every sample has a record
  int64_t S = 0;
  std::vector<int64_t> prompt_len, response_len;
};

// Errors name the sample: an empty response, a record that does not cover prompt + response - 1 tokens,
// records on some samples only, a model mask of another length than the response.
PackedRollouts pack_rollouts(const std::vector<RolloutSample>& samples, int64_t top_k);
// Token value k (MicroBatch::token_values[k], created as zeros up to k) from per-sample, per-response-token
// values: v[i][j] for response token j of sample i.
void set_token_values(PackedRollouts& p, size_t k, const std::vector<std::vector<float>>& v);
// Per-target rows of an unplanned one-process forward (e.g. LossParts::logp, f32 [B S], any device) back
// to per-sample, per-response-token values: row b S + t holds the target at position t + 1.
std::vector<std::vector<float>> response_values(const PackedRollouts& p, const Tensor& rows_BS);

}  // namespace mt::rl
