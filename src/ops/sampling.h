// Token sampling for the rollout engine: the contract and its CPU reference (ops::sample_tokens runs it
// on either backend; the CUDA kernel is tested against this file).
//
// Per row of logits f32 [N, V] and per-row parameters, one token and its log-probability.
//
// Order, for temperature T > 0 (as SGLang's FlashInfer path and Hugging Face's logits warpers):
//   1. temperature: z = logits / T
//   2. top-k:  keep the k most probable tokens
//   3. top-p:  of those, keep the smallest prefix whose probability, renormalised over the top-k set,
//              reaches top_p (a token is kept iff the mass strictly before it is < top_p)
//   4. min-p:  of those, keep the tokens whose probability is >= min_p x the largest probability
//   5. draw:   an exponential race over the kept tokens: token = argmax_t z_t - log(-log u_t), u_t the
//              token's own uniform number (the Gumbel-max trick: exactly a draw from the kept tokens'
//              renormalised probabilities), ties to the lower id. It needs no sorted order and no
//              prefix sum, so a GPU draws in one pass over the vocabulary.
// "Most probable first" is one total order: descending z, ties by the lower token id. Top-k keeps
// exactly k tokens in that order and top-p a prefix of it, so the token is a function of (logits,
// params, the u_t) alone. vLLM v1 applies min-p before top-k/top-p; min-p is a
// ratio to the largest probability, which renormalisation does not change, so the two orders differ
// only when top-p and min-p are both on.
// T = 0 is greedy: the largest logit, the lowest token id among equal ones; no truncation applies.
//
// Log-probability: log_softmax(logits / T)[token] over the whole vocabulary, BEFORE top-k, top-p and
// min-p (the trainer's definition, docs/design.md "Rollout and RL"). For T = 0 it is
// log_softmax(logits)[token], i.e. as if T = 1. Computed in fp64, returned as f32.
//
// Randomness is counter-based: u = sampling_uniform(seed, counter.sample, counter.position)
// (ops/philox.h), a pure function of the row's seed and counter. The same seed and counters give
// the same tokens whatever else is in the batch; the engine gives every sample of a rollout its own
// sample index (two samples of one prompt must not share (seed, sample)).
//
// Logits may hold -inf (masked tokens), not NaN or +inf, and not only -inf.
#pragma once
#include <cstdint>
#include <span>
#include <vector>

#include "core/tensor.h"

namespace mt {

struct SamplingParams {
  float temperature = 1.0f;  // >= 0; 0 = greedy
  int32_t top_k = 0;         // >= 0; 0 = off
  float top_p = 1.0f;        // in (0, 1]; 1 = off
  float min_p = 0.0f;        // in [0, 1]; 0 = off
  uint64_t seed = 0;
};

// Which draw of which sample: the Philox counter of the row's uniform number.
struct DrawCounter {
  uint64_t sample = 0;    // the sample's index in the rollout (unique per sample)
  uint64_t position = 0;  // the position of the token being sampled
};

struct SampledToken {
  int32_t token = -1;
  float logprob = 0;  // log_softmax(logits / T)[token] before truncation (T = 0: as T = 1)
};

struct TokenProb {
  int32_t token;
  double prob;
};

// Throws mt::Error naming the field, its value and the allowed range.
void validate_sampling_params(const SamplingParams& p);

// One row: logits_V points at V floats.
SampledToken sample_row(const float* logits_V, int64_t V, const SamplingParams& p, DrawCounter counter);

// Every row of logits_NV (CPU f32 [N, V]); params_N and counters_N hold one entry per row. Errors in a
// row's parameters or logits name the row.
std::vector<SampledToken> sample_tokens(const Tensor& logits_NV, std::span<const SamplingParams> params_N,
                                        std::span<const DrawCounter> counters_N);

// The distribution a row is drawn from: the kept tokens in draw order (most probable first) and their
// renormalised probabilities. For T = 0 the greedy token with probability 1. Tests and the CUDA
// sampler's checks use it.
std::vector<TokenProb> truncated_distribution(const float* logits_V, int64_t V, const SamplingParams& p);

// The rows of ops::sample_tokens: i64 [R, 5], row r = (temperature and top_p as f32 bits, min_p and top_k,
// seed, sample, position). Checks nothing (sample_tokens' CPU backend validates).
constexpr int64_t kSampleRowWords = 5;
Tensor pack_sample_rows(std::span<const SamplingParams> params_R, std::span<const DrawCounter> counters_R);
void unpack_sample_row(const int64_t* row, SamplingParams* p, DrawCounter* c);

}  // namespace mt
