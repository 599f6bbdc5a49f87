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

// One row after temperature: z = logits / T, and log sum_i exp(z_i - z_max). Every weight
// w_i = exp(z_i - z_max) is at most 1, and exactly 1 for the most probable token.
struct Scaled {
  std::vector<double> z_V;
  double z_max = -kInf;
  double log_sum = 0;
  double weight(int32_t t) const { return std::exp(z_V[size_t(t)] - z_max); }
};

void scale(const float* x_V, int64_t V, double T, Scaled& s) {
  s.z_V.resize(size_t(V));
  s.z_max = -kInf;
  for (int64_t i = 0; i < V; ++i) {
    s.z_V[size_t(i)] = double(x_V[i]) / T;
    s.z_max = std::max(s.z_max, s.z_V[size_t(i)]);
  }
  double sum = 0;
  for (double z : s.z_V) sum += std::exp(z - s.z_max);
  s.log_sum = std::log(sum);
}

double logprob_of(const Scaled& s, int32_t token) {
  return s.z_V[size_t(token)] - s.z_max - s.log_sum;
}

int32_t greedy_token(const float* x_V, int64_t V) {
  int64_t best = 0;
  for (int64_t i = 1; i < V; ++i)
    if (x_V[i] > x_V[best]) best = i;  // strict: the lowest id wins ties
  return int32_t(best);
}

// The kept tokens, most probable first, after top-k, top-p and min-p; zero-weight tokens (-inf logits,
// or exp underflow) are dropped since they can never be drawn.
std::vector<int32_t> kept_tokens(const Scaled& s, const SamplingParams& p) {
  const int64_t V = int64_t(s.z_V.size());
  std::vector<int32_t> order = std::vector<int32_t>(size_t(V));
  std::iota(order.begin(), order.end(), 0);
  const auto before = [&](int32_t a, int32_t b) {
    const double za = s.z_V[size_t(a)], zb = s.z_V[size_t(b)];
    return za > zb || (za == zb && a < b);
  };
  const int64_t K = p.top_k > 0 ? std::min<int64_t>(p.top_k, V) : V;
  if (K < V) std::nth_element(order.begin(), order.begin() + K, order.end(), before);
  std::sort(order.begin(), order.begin() + K, before);
  order.resize(size_t(K));

  int64_t n = K;
  if (p.top_p < 1.0f) {
    double mass_K = 0;
    for (int32_t t : order) mass_K += s.weight(t);
    const double limit = double(p.top_p) * mass_K;
    double mass_before = 0;
    n = 0;
    while (n < K && mass_before < limit) mass_before += s.weight(order[size_t(n++)]);
  }
  if (p.min_p > 0.0f) {
    // p_t >= min_p * p_max  <=>  w_t >= min_p, as w = 1 for the most probable token.
    int64_t m = 0;
    while (m < n && s.weight(order[size_t(m)]) >= double(p.min_p)) ++m;
    n = m;
  }
  while (n > 1 && s.weight(order[size_t(n - 1)]) == 0.0) --n;
  order.resize(size_t(n));
  return order;
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
  Scaled s;
  scale(logits_V, V, double(p.temperature), s);
  const std::vector<int32_t> kept = kept_tokens(s, p);
  double total = 0;
  for (int32_t t : kept) total += s.weight(t);
  std::vector<TokenProb> out;
  out.reserve(kept.size());
  for (int32_t t : kept) out.push_back(TokenProb{t, s.weight(t) / total});
  return out;
}

SampledToken sample_row(const float* logits_V, int64_t V, const SamplingParams& p, DrawCounter counter) {
  validate_sampling_params(p);
  check_logits(logits_V, V);
  Scaled s;
  if (p.temperature == 0.0f) {
    scale(logits_V, V, 1.0, s);
    const int32_t token = greedy_token(logits_V, V);
    return SampledToken{token, float(logprob_of(s, token))};
  }
  scale(logits_V, V, double(p.temperature), s);
  const std::vector<int32_t> kept = kept_tokens(s, p);
  double total = 0;
  for (int32_t t : kept) total += s.weight(t);
  const double target = sampling_uniform(p.seed, counter.sample, counter.position) * total;
  // Rounding can leave target at or above the last partial sum; the last kept token then takes it
  // (kept_tokens dropped the zero-weight tail, so it has weight > 0).
  int32_t token = kept.back();
  double cum = 0;
  for (int32_t t : kept) {
    cum += s.weight(t);
    if (target < cum) {
      token = t;
      break;
    }
  }
  return SampledToken{token, float(logprob_of(s, token))};
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
