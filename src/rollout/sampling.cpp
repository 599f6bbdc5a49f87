// CPU token sampler: fp64 throughout; see sampling.h for the order of truncations and the contract.
#include "rollout/sampling.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>

#include "core/error.h"
#include "rollout/philox.h"

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

// The kept tokens, most probable first, after top-k, top-p and min-p; zero-weight tokens (-inf logits,
// or exp underflow) are dropped since they can never be drawn. The first has weight 1.
std::vector<Candidate> kept_tokens(const Scaled& s, const SamplingParams& p) {
  const int64_t V = s.V;
  std::vector<Candidate> c;
  c.reserve(size_t(V));
  for (int64_t i = 0; i < V; ++i) c.push_back(Candidate{s.z(i), int32_t(i), 0.0});
  const auto before = [](const Candidate& a, const Candidate& b) {
    return a.z > b.z || (a.z == b.z && a.token < b.token);
  };
  const int64_t K = p.top_k > 0 ? std::min<int64_t>(p.top_k, V) : V;
  if (K < V) std::nth_element(c.begin(), c.begin() + K, c.end(), before);
  std::sort(c.begin(), c.begin() + K, before);
  c.resize(size_t(K));
  for (Candidate& x : c) x.w = std::exp(x.z - s.z_max);

  int64_t n = K;
  if (p.top_p < 1.0f) {
    double mass_K = 0;
    for (const Candidate& x : c) mass_K += x.w;
    const double limit = double(p.top_p) * mass_K;
    double mass_before = 0;
    n = 0;
    while (n < K && mass_before < limit) mass_before += c[size_t(n++)].w;
  }
  if (p.min_p > 0.0f) {
    // p_t >= min_p * p_max  <=>  w_t >= min_p, as w = 1 for the most probable token.
    int64_t m = 0;
    while (m < n && c[size_t(m)].w >= double(p.min_p)) ++m;
    n = m;
  }
  while (n > 1 && c[size_t(n - 1)].w == 0.0) --n;
  c.resize(size_t(n));
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
  double total = 0;
  for (const Candidate& c : kept) total += c.w;
  std::vector<TokenProb> out;
  out.reserve(kept.size());
  for (const Candidate& c : kept) out.push_back(TokenProb{c.token, c.w / total});
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
  double total = 0;
  for (const Candidate& c : kept) total += c.w;
  const double target = sampling_uniform(p.seed, counter.sample, counter.position) * total;
  // Rounding can leave target at or above the last partial sum; the last kept token then takes it
  // (kept_tokens dropped the zero-weight tail, so it has weight > 0).
  int32_t token = kept.back().token;
  double cum = 0;
  for (const Candidate& c : kept) {
    cum += c.w;
    if (target < cum) {
      token = c.token;
      break;
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

}  // namespace mt
