// The CPU sampler: Philox known answers, greedy ties, the pre-truncation log-probability, the sets top-k /
// top-p / min-p keep (cases built by hand), a chi-square fit of 200k draws, determinism, and errors.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>
#include <numeric>
#include <set>
#include <vector>

#include "core/rng.h"
#include "ops/philox.h"
#include "ops/sampling.h"
#include "test_util.h"

using namespace mt;
using mt::testutil::error_of;

namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// log_softmax(x / T)[t] in fp64, written independently of the sampler.
double ref_logprob(const std::vector<float>& x, double T, int32_t t) {
  double m = -std::numeric_limits<double>::infinity();
  for (float v : x) m = std::max(m, double(v) / T);
  double s = 0;
  for (float v : x) s += std::exp(double(v) / T - m);
  return double(x[size_t(t)]) / T - m - std::log(s);
}

// Logits whose softmax (T = 1) is exactly proportional to `probs`.
std::vector<float> logits_of(const std::vector<double>& probs) {
  std::vector<float> x;
  for (double p : probs) x.push_back(p > 0 ? float(std::log(p)) : kNegInf);
  return x;
}

std::set<int32_t> drawn_set(const std::vector<float>& x, const SamplingParams& p, int draws) {
  std::set<int32_t> seen;
  for (int i = 0; i < draws; ++i) seen.insert(sample_row(x.data(), int64_t(x.size()), p, {uint64_t(i), 3}).token);
  return seen;
}

std::set<int32_t> kept_set(const std::vector<float>& x, const SamplingParams& p) {
  std::set<int32_t> kept;
  for (const TokenProb& tp : truncated_distribution(x.data(), int64_t(x.size()), p)) kept.insert(tp.token);
  return kept;
}

SamplingParams params(float T, int32_t top_k = 0, float top_p = 1.0f, float min_p = 0.0f, uint64_t seed = 0) {
  SamplingParams p;
  p.temperature = T;
  p.top_k = top_k;
  p.top_p = top_p;
  p.min_p = min_p;
  p.seed = seed;
  return p;
}

}  // namespace

TEST(Sampling, PhiloxMatchesTheRandom123KnownAnswers) {
  // Random123's kat_vectors for philox4x32_10: counter, key, output.
  struct Kat {
    Philox4x32 ctr;
    uint32_t k0, k1;
    Philox4x32 out;
  };
  const Kat kats[] = {
      {{{0, 0, 0, 0}}, 0, 0, {{0x6627e8d5u, 0xe169c58du, 0xbc57ac4cu, 0x9b00dbd8u}}},
      {{{0xffffffffu, 0xffffffffu, 0xffffffffu, 0xffffffffu}},
       0xffffffffu,
       0xffffffffu,
       {{0x408f276du, 0x41c83b0eu, 0xa20bc7c6u, 0x6d5451fdu}}},
      {{{0x243f6a88u, 0x85a308d3u, 0x13198a2eu, 0x03707344u}},
       0xa4093822u,
       0x299f31d0u,
       {{0xd16cfe09u, 0x94fdccebu, 0x5001e420u, 0x24126ea1u}}},
  };
  for (const Kat& k : kats) {
    const Philox4x32 r = philox4x32_10(k.ctr, k.k0, k.k1);
    for (int i = 0; i < 4; ++i) EXPECT_EQ(r.v[i], k.out.v[i]) << "word " << i;
  }
}

TEST(Sampling, ClockWordsDependOnEveryCounterWordAndAreUniform) {
  const Philox4x32 w = sampling_words(1, 2, 3, 4);
  auto same = [](const Philox4x32& a, const Philox4x32& b) {
    return a.v[0] == b.v[0] && a.v[1] == b.v[1] && a.v[2] == b.v[2] && a.v[3] == b.v[3];
  };
  EXPECT_TRUE(same(w, sampling_words(1, 2, 3, 4)));
  for (const Philox4x32& other : {sampling_words(1ull << 40 | 1, 2, 3, 4), sampling_words(1, 2ull << 40 | 2, 3, 4),
                                  sampling_words(2, 2, 3, 4), sampling_words(1, 3, 3, 4), sampling_words(1, 2, 4, 4),
                                  sampling_words(1, 2, 3, 5)})
    EXPECT_FALSE(same(w, other));
  EXPECT_EQ(word_uniform(0), 0x1.0p-33);
  EXPECT_LT(word_uniform(0xFFFFFFFFu), 1.0);
  // Mean and ten-bin histogram of 100k uniform numbers, four per Philox call along the token groups.
  const int n = 100000;
  std::vector<int> bins(10, 0);
  double sum = 0;
  for (int i = 0; i < n; ++i) {
    const double v = word_uniform(sampling_words(7, 0, 9, uint32_t(i / 4)).v[i % 4]);
    ASSERT_GT(v, 0.0);
    ASSERT_LT(v, 1.0);
    sum += v;
    ++bins[size_t(v * 10)];
  }
  EXPECT_NEAR(sum / n, 0.5, 0.005);
  double chi2 = 0;
  for (int b : bins) chi2 += (b - n / 10.0) * (b - n / 10.0) / (n / 10.0);
  EXPECT_LT(chi2, 33.720);  // chi-square with 9 degrees of freedom, p = 1e-4
}

// The race without truncation and with min-p only (no sorted order involved): 100k draws against
// softmax(x / T) restricted to w >= min_p, renormalised.
TEST(Sampling, ChiSquareOfTheRaceWithoutTopKOrTopP) {
  const std::vector<float> x = {0.3f, -1.5f, 2.0f, -0.2f, 1.0f, -3.0f, 0.8f, 1.5f};
  for (float min_p : {0.0f, 0.2f}) {
    const SamplingParams p = params(1.3f, 0, 1.0f, min_p, 99);
    const std::vector<TokenProb> d = truncated_distribution(x.data(), 8, p);
    EXPECT_EQ(d.size(), min_p > 0 ? 5u : 8u) << "min_p " << min_p;  // by hand: w >= 0.2 keeps 2, 7, 4, 6, 0
    const int n = 100000;
    std::vector<int64_t> count(8, 0);
    for (int i = 0; i < n; ++i) ++count[size_t(sample_row(x.data(), 8, p, {uint64_t(i), 5}).token)];
    double chi2 = 0;
    int64_t inside = 0;
    for (const TokenProb& t : d) {
      const double want = n * t.prob;
      chi2 += (double(count[size_t(t.token)]) - want) * (double(count[size_t(t.token)]) - want) / want;
      inside += count[size_t(t.token)];
    }
    EXPECT_EQ(inside, n) << "draws outside the kept tokens, min_p " << min_p;
    // 7 (or 4) degrees of freedom: P(chi2 > 29.878) = 1e-4 (7), P(chi2 > 23.513) = 1e-4 (4).
    EXPECT_LT(chi2, min_p > 0 ? 23.513 : 29.878) << "min_p " << min_p;
  }
}

TEST(Sampling, GreedyTieGoesToTheLowestIdAndLogprobIsAtTemperatureOne) {
  const std::vector<float> x = {1.0f, 3.0f, kNegInf, 3.0f, 2.0f, 3.0f};
  for (uint64_t s = 0; s < 20; ++s) {
    const SampledToken t = sample_row(x.data(), 6, params(0.0f, 0, 1.0f, 0.0f, s), {s, s});
    EXPECT_EQ(t.token, 1);
    EXPECT_NEAR(t.logprob, ref_logprob(x, 1.0, 1), 1e-6);
  }
  // Truncation parameters do not change a greedy choice.
  EXPECT_EQ(sample_row(x.data(), 6, params(0.0f, 1, 0.1f, 0.9f), {}).token, 1);
  // The same tie with T > 0 and top-k 1: the lowest id again.
  EXPECT_EQ(sample_row(x.data(), 6, params(0.8f, 1), {5, 5}).token, 1);
  // A -inf token ahead of the maximum does not win.
  const std::vector<float> y = {kNegInf, -5.0f, -4.0f};
  EXPECT_EQ(sample_row(y.data(), 3, params(0.0f), {}).token, 2);
}

TEST(Sampling, LogprobIsLogSoftmaxOverTemperatureBeforeTruncation) {
  Rng rng(11);
  std::vector<float> x(50);
  for (float& v : x) v = float(rng.normal() * 2.0);
  for (const SamplingParams& p : {params(0.7f, 3, 0.5f, 0.1f), params(1.3f, 0, 0.9f), params(0.5f, 5),
                                  params(2.0f, 0, 1.0f, 0.2f), params(1.0f)}) {
    for (uint64_t i = 0; i < 200; ++i) {
      const SampledToken t = sample_row(x.data(), 50, p, {i, 100 + i});
      const double want = ref_logprob(x, p.temperature, t.token);
      EXPECT_NEAR(t.logprob, want, 1e-5 * std::max(1.0, std::abs(want)))
          << "T " << p.temperature << " top_k " << p.top_k << " top_p " << p.top_p << " min_p " << p.min_p;
    }
  }
}

TEST(Sampling, TopKKeepsExactlyTheKMostProbableLowestIdsFirstOnTies) {
  const std::vector<float> x = {0.5f, 2.0f, 1.0f, 3.0f, -1.0f, 2.5f};
  // A high temperature flattens the distribution, so every kept token is drawn often.
  EXPECT_EQ(kept_set(x, params(5.0f, 2)), (std::set<int32_t>{3, 5}));
  EXPECT_EQ(drawn_set(x, params(5.0f, 2), 2000), (std::set<int32_t>{3, 5}));
  EXPECT_EQ(drawn_set(x, params(5.0f, 4), 4000), (std::set<int32_t>{1, 2, 3, 5}));
  EXPECT_EQ(kept_set(x, params(5.0f, 100)).size(), 6u);  // k beyond the vocabulary keeps everything

  const std::vector<float> tied = {1.0f, 2.0f, 2.0f, 2.0f, 0.0f};
  EXPECT_EQ(kept_set(tied, params(1.0f, 2)), (std::set<int32_t>{1, 2}));
  EXPECT_EQ(drawn_set(tied, params(1.0f, 2), 2000), (std::set<int32_t>{1, 2}));
  // -inf tokens are never kept, even when k reaches them.
  const std::vector<float> masked = {kNegInf, 0.0f, kNegInf, 1.0f};
  EXPECT_EQ(kept_set(masked, params(1.0f, 4)), (std::set<int32_t>{1, 3}));
}

TEST(Sampling, TopPKeepsTheSmallestPrefixReachingPOfTheTopKMass) {
  // Probabilities at T = 1, by id: 0.1, 0.4, 0.2, 0.3; most probable first: 1, 3, 2, 0.
  const std::vector<float> x = logits_of({0.1, 0.4, 0.2, 0.3});
  EXPECT_EQ(kept_set(x, params(1.0f, 0, 0.01f)), (std::set<int32_t>{1}));
  EXPECT_EQ(kept_set(x, params(1.0f, 0, 0.6f)), (std::set<int32_t>{1, 3}));  // mass before token 2: 0.7
  EXPECT_EQ(kept_set(x, params(1.0f, 0, 0.75f)), (std::set<int32_t>{1, 3, 2}));
  EXPECT_EQ(kept_set(x, params(1.0f, 0, 0.95f)), (std::set<int32_t>{0, 1, 2, 3}));
  EXPECT_EQ(drawn_set(x, params(1.0f, 0, 0.6f), 3000), (std::set<int32_t>{1, 3}));
  EXPECT_EQ(drawn_set(x, params(1.0f, 0, 0.75f), 3000), (std::set<int32_t>{1, 2, 3}));
  // After top-k 2 the kept mass is renormalised to 4/7 and 3/7: top-p 0.5 keeps token 1 alone, where
  // over the whole vocabulary (mass before token 3: 0.4) it would keep two.
  EXPECT_EQ(kept_set(x, params(1.0f, 0, 0.5f)), (std::set<int32_t>{1, 3}));
  EXPECT_EQ(kept_set(x, params(1.0f, 2, 0.5f)), (std::set<int32_t>{1}));
  EXPECT_EQ(drawn_set(x, params(1.0f, 2, 0.5f), 1000), (std::set<int32_t>{1}));
  // The kept probabilities are renormalised.
  const std::vector<TokenProb> d = truncated_distribution(x.data(), 4, params(1.0f, 0, 0.6f));
  ASSERT_EQ(d.size(), 2u);
  EXPECT_EQ(d[0].token, 1);
  EXPECT_NEAR(d[0].prob, 4.0 / 7.0, 1e-7);
  EXPECT_EQ(d[1].token, 3);
  EXPECT_NEAR(d[1].prob, 3.0 / 7.0, 1e-7);
}

TEST(Sampling, MinPKeepsTokensAtLeastMinPTimesTheLargestProbability) {
  const std::vector<float> x = logits_of({0.1, 0.4, 0.2, 0.3});
  EXPECT_EQ(kept_set(x, params(1.0f, 0, 1.0f, 0.6f)), (std::set<int32_t>{1, 3}));        // threshold 0.24
  EXPECT_EQ(kept_set(x, params(1.0f, 0, 1.0f, 0.45f)), (std::set<int32_t>{1, 2, 3}));    // threshold 0.18
  EXPECT_EQ(kept_set(x, params(1.0f, 0, 1.0f, 0.2f)), (std::set<int32_t>{0, 1, 2, 3}));  // threshold 0.08
  EXPECT_EQ(kept_set(x, params(1.0f, 0, 1.0f, 1.0f)), (std::set<int32_t>{1}));
  EXPECT_EQ(drawn_set(x, params(1.0f, 0, 1.0f, 0.6f), 3000), (std::set<int32_t>{1, 3}));
  // After top-p 0.75 (keeps 1, 3, 2): min-p 0.6 leaves 1 and 3; after top-k 1 only 1 is left.
  EXPECT_EQ(kept_set(x, params(1.0f, 0, 0.75f, 0.6f)), (std::set<int32_t>{1, 3}));
  EXPECT_EQ(drawn_set(x, params(1.0f, 0, 0.75f, 0.6f), 3000), (std::set<int32_t>{1, 3}));
  EXPECT_EQ(kept_set(x, params(1.0f, 1, 1.0f, 0.1f)), (std::set<int32_t>{1}));
  // Temperature comes first: at T = 0.5 the probabilities are proportional to p^2 (0.16 : 0.09 : 0.04
  // : 0.01), so min-p 0.3 (threshold 0.048 of 0.16) drops token 2 that it keeps at T = 1.
  EXPECT_EQ(kept_set(x, params(0.5f, 0, 1.0f, 0.3f)), (std::set<int32_t>{1, 3}));
  EXPECT_EQ(kept_set(x, params(1.0f, 0, 1.0f, 0.3f)), (std::set<int32_t>{1, 2, 3}));
}

TEST(Sampling, ChiSquareOf200kDrawsMatchesTheTruncatedDistribution) {
  const std::vector<float> x = {0.3f,  -1.5f, 2.0f, -0.2f, 1.0f, -3.0f, 0.8f, 1.5f,
                                -0.5f, 0.1f,  1.2f, -2.0f, 0.5f, -0.8f, 0.0f, -1.0f};
  const SamplingParams p = params(0.7f, 10, 0.9f, 0.0f, 20240607);
  // The expected distribution, computed here: softmax(x / 0.7), the ten most probable, renormalised,
  // then the prefix whose mass before each token is < 0.9, renormalised.
  const double T = double(p.temperature);  // 0.7f, not 0.7
  std::vector<double> prob(16);
  double m = -1e300, s = 0;
  for (float v : x) m = std::max(m, double(v) / T);
  for (int i = 0; i < 16; ++i) s += prob[size_t(i)] = std::exp(double(x[size_t(i)]) / T - m);
  for (double& v : prob) v /= s;
  std::vector<int32_t> order(16);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) { return prob[size_t(a)] > prob[size_t(b)]; });
  order.resize(10);
  double mass10 = 0;
  for (int32_t t : order) mass10 += prob[size_t(t)];
  std::vector<int32_t> kept;
  double before = 0;
  for (int32_t t : order) {
    if (before >= 0.9) break;
    kept.push_back(t);
    before += prob[size_t(t)] / mass10;
  }
  // By hand (Python): tokens 2, 7, 10, 4, 6, 12; token 0 would follow at a mass of 0.902 > 0.9 (over
  // the whole vocabulary the mass before it is 0.878, so top-p without the top-k renormalisation would
  // keep it).
  ASSERT_EQ(kept, (std::vector<int32_t>{2, 7, 10, 4, 6, 12}));
  double kept_mass = 0;
  for (int32_t t : kept) kept_mass += prob[size_t(t)];

  const std::vector<TokenProb> d = truncated_distribution(x.data(), 16, p);
  ASSERT_EQ(d.size(), kept.size());
  for (size_t i = 0; i < kept.size(); ++i) {
    EXPECT_EQ(d[i].token, kept[i]);
    EXPECT_NEAR(d[i].prob, prob[size_t(kept[i])] / kept_mass, 1e-9);
  }

  const int n = 200000;
  std::vector<int64_t> count(16, 0);
  for (int i = 0; i < n; ++i) ++count[size_t(sample_row(x.data(), 16, p, {uint64_t(i), uint64_t(i % 97)}).token)];
  double chi2 = 0;
  int64_t inside = 0;
  for (int32_t t : kept) {
    const double want = n * prob[size_t(t)] / kept_mass;
    chi2 += (double(count[size_t(t)]) - want) * (double(count[size_t(t)]) - want) / want;
    inside += count[size_t(t)];
  }
  EXPECT_EQ(inside, n) << "draws outside the kept tokens";
  // 6 categories, 5 degrees of freedom: P(chi2 > 25.745) = 1e-4.
  EXPECT_LT(chi2, 25.745);
  std::printf("chi-square %.3f (5 degrees of freedom; the p = 1e-4 critical value is 25.745)\n", chi2);
}

TEST(Sampling, SameSeedAndCountersGiveTheSameTokensWhateverTheBatch) {
  Rng rng(5);
  const int64_t N = 8, V = 300;
  Tensor logits = Tensor::empty({N, V});
  rng.fill_normal(logits, 0.0f, 3.0f);
  std::vector<SamplingParams> ps;
  std::vector<DrawCounter> cs;
  for (int64_t r = 0; r < N; ++r) {
    ps.push_back(params(0.6f + 0.1f * float(r), int32_t(r % 3) * 20, r % 2 ? 0.9f : 1.0f, r % 4 == 3 ? 0.05f : 0.0f,
                        1000 + uint64_t(r)));
    cs.push_back({uint64_t(r), uint64_t(40 + r)});
  }
  const std::vector<SampledToken> all = sample_tokens(logits, ps, cs);
  // Each row alone, and the rows in reverse order in one batch.
  Tensor reversed = Tensor::empty({N, V});
  std::vector<SamplingParams> ps_rev(ps.rbegin(), ps.rend());
  std::vector<DrawCounter> cs_rev(cs.rbegin(), cs.rend());
  for (int64_t r = 0; r < N; ++r) reversed.rows(N - 1 - r, 1).copy_from(logits.rows(r, 1));
  const std::vector<SampledToken> rev = sample_tokens(reversed, ps_rev, cs_rev);
  for (int64_t r = 0; r < N; ++r) {
    const SampledToken one = sample_row(logits.data<float>() + r * V, V, ps[size_t(r)], cs[size_t(r)]);
    EXPECT_EQ(one.token, all[size_t(r)].token);
    EXPECT_EQ(one.logprob, all[size_t(r)].logprob);
    EXPECT_EQ(rev[size_t(N - 1 - r)].token, all[size_t(r)].token);
  }
  // 64 positions of one row under two seeds: the same seed repeats, another seed differs.
  const float* x0 = logits.data<float>();
  int same_seed_diffs = 0, other_seed_diffs = 0;
  for (uint64_t pos = 0; pos < 64; ++pos) {
    const int32_t a = sample_row(x0, V, params(1.0f, 0, 1.0f, 0.0f, 1), {0, pos}).token;
    same_seed_diffs += a != sample_row(x0, V, params(1.0f, 0, 1.0f, 0.0f, 1), {0, pos}).token;
    other_seed_diffs += a != sample_row(x0, V, params(1.0f, 0, 1.0f, 0.0f, 2), {0, pos}).token;
  }
  EXPECT_EQ(same_seed_diffs, 0);
  EXPECT_GT(other_seed_diffs, 32);
  // Two samples of one prompt (same seed, same position) differ through their sample index.
  int sample_diffs = 0;
  for (uint64_t pos = 0; pos < 64; ++pos)
    sample_diffs += sample_row(x0, V, params(1.0f, 0, 1.0f, 0.0f, 1), {0, pos}).token !=
                    sample_row(x0, V, params(1.0f, 0, 1.0f, 0.0f, 1), {1, pos}).token;
  EXPECT_GT(sample_diffs, 32);
}

TEST(Sampling, RejectsBadParametersNamingTheValueAndRange) {
  const std::vector<float> x = {0.0f, 1.0f};
  const auto err = [&](const SamplingParams& p) { return error_of([&] { sample_row(x.data(), 2, p, {}); }); };
  EXPECT_EQ(err(params(-0.5f)), "temperature (-0.5) must be a finite number >= 0 (0 = greedy)");
  EXPECT_EQ(err(params(std::numeric_limits<float>::quiet_NaN())),
            "temperature (nan) must be a finite number >= 0 (0 = greedy)");
  EXPECT_EQ(err(params(1.0f, -1)), "top_k (-1) must be >= 0 (0 = off)");
  EXPECT_EQ(err(params(1.0f, 0, 0.0f)), "top_p (0) must be in (0, 1] (1 = off)");
  EXPECT_EQ(err(params(1.0f, 0, 1.5f)), "top_p (1.5) must be in (0, 1] (1 = off)");
  EXPECT_EQ(err(params(1.0f, 0, 1.0f, -0.1f)), "min_p (-0.1) must be in [0, 1] (0 = off)");
  EXPECT_EQ(err(params(1.0f, 0, 1.0f, 1.25f)), "min_p (1.25) must be in [0, 1] (0 = off)");

  const std::vector<float> nan_row = {0.0f, std::numeric_limits<float>::quiet_NaN()};
  EXPECT_EQ(error_of([&] { sample_row(nan_row.data(), 2, params(1.0f), {}); }),
            "the logit of token 1 is nan; logits may hold -inf (a masked token) but not NaN or +inf");
  const std::vector<float> masked = {kNegInf, kNegInf};
  EXPECT_EQ(error_of([&] { sample_row(masked.data(), 2, params(0.0f), {}); }),
            "all 2 logits are -inf: no token can be sampled");

  // In a batch the row is named.
  Tensor logits = Tensor::zeros({3, 4});
  std::vector<SamplingParams> ps(3, params(1.0f));
  ps[2].top_p = 2.0f;
  const std::vector<DrawCounter> cs(3);
  EXPECT_EQ(error_of([&] { sample_tokens(logits, ps, cs); }), "row 2: top_p (2) must be in (0, 1] (1 = off)");
  EXPECT_EQ(error_of([&] { sample_tokens(logits, std::span(ps).first(2), cs); }),
            "sample_tokens: 3 rows of logits but 2 parameter sets and 3 draw counters");
}
