// CPU token sampler: fp64 throughout; see sampling.h for the order of truncations and the contract.
#include "ops/sampling.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <limits>
#include <numeric>

#include "core/error.h"
#include "ops/philox.h"

namespace mt {

namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

void check_logits(const float* x_V, int64_t V) {
  MT_CHECK(x_V != nullptr || V == 0, "null logits");
  if (V <= 0) MT_THROW("logits row has ", V, " entries; the vocabulary must hold at least one token");
  bool any_finite = false;
  for (int64_t i = 0; i < V; ++i) {
    const float v = x_V[i];
    if (std::isnan(v) || v == std::numeric_limits<float>::infinity())
      MT_THROW("the logit of token ", i, " is ", v, "; logits may hold -inf (a masked token) but not NaN or +inf");
    if (std::isfinite(v)) any_finite = true;
  }
  if (!any_finite) MT_THROW("all ", V, " logits are -inf: no token can be sampled");
}

// One row after temperature: z = logits / T, its maximum and log sum_i exp(z_i - z_max). The weight
// w_i = exp(z_i - z_max) of a token is at most 1, and exactly 1 for the most probable token.
struct Scaled {
  const float* x_V = nullptr;
  int64_t V = 0;
  double T = 1;
  double z_max = -kInf;
  double log_sum = 0;
  double z(int64_t t) const { return double(x_V[t]) / T; }
  double logprob(int32_t t) const { return z(t) - z_max - log_sum; }
};

Scaled scale(const float* x_V, int64_t V, double T) {
  Scaled s{x_V, V, T};
  for (int64_t i = 0; i < V; ++i) s.z_max = std::max(s.z_max, s.z(i));
  double sum = 0;
  for (int64_t i = 0; i < V; ++i) sum += std::exp(s.z(i) - s.z_max);
  s.log_sum = std::log(sum);
  return s;
}

int32_t greedy_token(const float* x_V, int64_t V) {
  int64_t best = 0;
  for (int64_t i = 1; i < V; ++i)
    if (x_V[i] > x_V[best]) best = i;  // strict: the lowest id wins ties
  return int32_t(best);
}

struct Candidate {
  double z;
  int32_t token;
  double w;  // exp(z - z_max)
};

bool before(const Candidate& a, const Candidate& b) { return a.z > b.z || (a.z == b.z && a.token < b.token); }

// The kept tokens after top-k, top-p and min-p, without zero-weight tokens (-inf logits, or exp underflow:
// they can never be drawn); at least one (the most probable, of weight 1). Sorted most probable first only
// when top-p needs the order (the race does not).
std::vector<Candidate> kept_tokens(const Scaled& s, const SamplingParams& p) {
  const int64_t V = s.V;
  std::vector<Candidate> c;
  c.reserve(size_t(V));
  for (int64_t i = 0; i < V; ++i) c.push_back(Candidate{s.z(i), int32_t(i), 0.0});
  const int64_t K = p.top_k > 0 ? std::min<int64_t>(p.top_k, V) : V;
  if (K < V) std::nth_element(c.begin(), c.begin() + K, c.end(), before);
  c.resize(size_t(K));
  for (Candidate& x : c) x.w = std::exp(x.z - s.z_max);
  if (p.top_p < 1.0f) {
    std::sort(c.begin(), c.end(), before);
    double mass_K = 0;
    for (const Candidate& x : c) mass_K += x.w;
    const double limit = double(p.top_p) * mass_K;
    double mass_before = 0;
    size_t n = 0;
    while (n < c.size() && mass_before < limit) mass_before += c[n++].w;
    c.resize(n);
  }
  // min-p: p_t >= min_p * p_max  <=>  w_t >= min_p, as w = 1 for the most probable token (always kept).
  const double floor_w = std::max(double(p.min_p), 0.0);
  std::erase_if(c, [&](const Candidate& x) { return x.w == 0.0 || x.w < floor_w; });
  return c;
}

}  // namespace

void validate_sampling_params(const SamplingParams& p) {
  if (!(std::isfinite(p.temperature) && p.temperature >= 0.0f))
    MT_THROW("temperature (", p.temperature, ") must be a finite number >= 0 (0 = greedy)");
  if (p.top_k < 0) MT_THROW("top_k (", p.top_k, ") must be >= 0 (0 = off)");
  if (!(p.top_p > 0.0f && p.top_p <= 1.0f)) MT_THROW("top_p (", p.top_p, ") must be in (0, 1] (1 = off)");
  if (!(p.min_p >= 0.0f && p.min_p <= 1.0f)) MT_THROW("min_p (", p.min_p, ") must be in [0, 1] (0 = off)");
}

std::vector<TokenProb> truncated_distribution(const float* logits_V, int64_t V, const SamplingParams& p) {
  validate_sampling_params(p);
  check_logits(logits_V, V);
  if (p.temperature == 0.0f) return {TokenProb{greedy_token(logits_V, V), 1.0}};
  const std::vector<Candidate> kept = kept_tokens(scale(logits_V, V, double(p.temperature)), p);
  std::vector<Candidate> kept_sorted = kept;
  std::sort(kept_sorted.begin(), kept_sorted.end(), before);
  double total = 0;
  for (const Candidate& c : kept_sorted) total += c.w;
  std::vector<TokenProb> out;
  out.reserve(kept.size());
  for (const Candidate& c : kept_sorted) out.push_back(TokenProb{c.token, c.w / total});
  return out;
}

SampledToken sample_row(const float* logits_V, int64_t V, const SamplingParams& p, DrawCounter counter) {
  validate_sampling_params(p);
  check_logits(logits_V, V);
  if (p.temperature == 0.0f) {
    const int32_t token = greedy_token(logits_V, V);
    return SampledToken{token, float(scale(logits_V, V, 1.0).logprob(token))};
  }
  const Scaled s = scale(logits_V, V, double(p.temperature));
  const std::vector<Candidate> kept = kept_tokens(s, p);
  // The race: the largest z_t - log(-log u_t); kept_tokens left at least one token of weight > 0.
  int32_t token = -1;
  double best = -kInf;
  uint32_t group = UINT32_MAX;
  Philox4x32 words{};
  for (const Candidate& c : kept) {
    const uint32_t g = uint32_t(c.token) / 4;
    if (g != group) words = sampling_words(p.seed, counter.sample, uint32_t(counter.position), group = g);
    const double score = c.z - std::log(-std::log(word_uniform(words.v[c.token % 4])));
    if (score > best || (score == best && c.token < token)) {
      best = score;
      token = c.token;
    }
  }
  return SampledToken{token, float(s.logprob(token))};
}

std::vector<SampledToken> sample_tokens(const Tensor& logits_NV, std::span<const SamplingParams> params_N,
                                        std::span<const DrawCounter> counters_N) {
  if (!logits_NV.is_cpu() || logits_NV.dtype() != DType::F32 || logits_NV.dim() != 2)
    MT_THROW("sample_tokens: logits must be a CPU f32 [N, V] tensor, got ", logits_NV.desc());
  const int64_t N = logits_NV.size(0), V = logits_NV.size(1);
  if (int64_t(params_N.size()) != N || int64_t(counters_N.size()) != N)
    MT_THROW("sample_tokens: ", N, " rows of logits but ", params_N.size(), " parameter sets and ", counters_N.size(),
             " draw counters");
  std::vector<SampledToken> out = std::vector<SampledToken>(size_t(N));
  const float* x = logits_NV.data<float>();
  for (int64_t r = 0; r < N; ++r) {
    try {
      out[size_t(r)] = sample_row(x + r * V, V, params_N[size_t(r)], counters_N[size_t(r)]);
    } catch (const Error& e) {
      MT_THROW("row ", r, ": ", e.what());
    }
  }
  return out;
}

Tensor pack_sample_rows(std::span<const SamplingParams> params_R, std::span<const DrawCounter> counters_R) {
  MT_CHECK(params_R.size() == counters_R.size(), "pack_sample_rows: ", params_R.size(), " parameter sets but ",
           counters_R.size(), " draw counters");
  const int64_t R = int64_t(params_R.size());
  Tensor t = Tensor::empty({R, kSampleRowWords}, DType::I64);
  auto bits = [](float f) { return uint64_t(std::bit_cast<uint32_t>(f)); };
  for (int64_t r = 0; r < R; ++r) {
    const SamplingParams& p = params_R[size_t(r)];
    const DrawCounter& c = counters_R[size_t(r)];
    uint64_t* w = reinterpret_cast<uint64_t*>(t.data<int64_t>() + r * kSampleRowWords);
    w[0] = bits(p.temperature) | bits(p.top_p) << 32;
    w[1] = bits(p.min_p) | uint64_t(uint32_t(p.top_k)) << 32;
    w[2] = p.seed;
    w[3] = c.sample;
    w[4] = c.position;
  }
  return t;
}

void unpack_sample_row(const int64_t* row, SamplingParams* p, DrawCounter* c) {
  const uint64_t* w = reinterpret_cast<const uint64_t*>(row);
  p->temperature = std::bit_cast<float>(uint32_t(w[0]));
  p->top_p = std::bit_cast<float>(uint32_t(w[0] >> 32));
  p->min_p = std::bit_cast<float>(uint32_t(w[1]));
  p->top_k = int32_t(uint32_t(w[1] >> 32));
  p->seed = w[2];
  c->sample = w[3];
  c->position = w[4];
}

}  // namespace mt
