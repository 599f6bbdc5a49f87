// The CUDA sampler (backend/cuda/sample.cu) against the CPU reference (ops/sampling.h): on random logits,
// every path (greedy, the plain race, min-p, top-k, top-p, top-k with top-p, with min-p) draws the same
// tokens as the CPU with the same seeds and counters (the race in f32 against fp64 could differ only
// where two scores are within rounding; none is in these cases) and log-probs within 1e-4; a vocabulary of
// 151,936 (Qwen3's) and one of 1,003 (not a multiple of four: the last Philox group is partial). And the
// distribution of 40k CUDA draws of one row matches the truncated distribution (chi-square, p = 1e-4).
#include <gtest/gtest.h>

#ifdef MT_HAVE_CUDA

#include <cstdio>

#include "cuda_test_util.h"
#include "ops/ops.h"
#include "ops/sampling.h"

using namespace mt;

namespace {

SamplingParams params(float T, int32_t k, float top_p, float min_p, uint64_t seed) {
  SamplingParams p;
  p.temperature = T;
  p.top_k = k;
  p.top_p = top_p;
  p.min_p = min_p;
  p.seed = seed;
  return p;
}

struct Drawn {
  Tensor tokens, logprobs;
};

Drawn draw(const Tensor& logits, const std::vector<SamplingParams>& ps, const std::vector<DrawCounter>& cs, Device d) {
  const int64_t R = logits.size(0);
  Drawn out{Tensor::empty({R}, DType::I32, d), Tensor::empty({R}, DType::F32, d)};
  ops::sample_tokens(logits.to(d), pack_sample_rows(ps, cs).to(d), out.tokens, out.logprobs);
  return {out.tokens.to(Device::CPU), out.logprobs.to(Device::CPU)};
}

void compare_paths(int64_t V, uint64_t seed) {
  const std::vector<SamplingParams> kinds = {
      params(0, 0, 1, 0, 1),        params(1, 0, 1, 0, 2),      params(0.7f, 0, 1, 0.05f, 3),
      params(0.9f, 50, 1, 0, 4),    params(1, 0, 0.9f, 0, 5),   params(0.8f, 40, 0.8f, 0, 6),
      params(1.2f, 100, 0.95f, 0.02f, 7), params(1, 1, 1, 0, 8), params(0.5f, 0, 0.3f, 0, 9)};
  const int64_t R = int64_t(kinds.size()) * 4;
  Rng rng(seed);
  Tensor logits = Tensor::empty({R, V});
  rng.fill_normal(logits, 0.0f, 2.5f);
  std::vector<SamplingParams> ps;
  std::vector<DrawCounter> cs;
  for (int64_t r = 0; r < R; ++r) {
    ps.push_back(kinds[size_t(r) % kinds.size()]);
    cs.push_back({uint64_t(r), uint64_t(100 + r)});
  }
  const Drawn cpu = draw(logits, ps, cs, Device::CPU), gpu = draw(logits, ps, cs, Device::CUDA);
  double max_diff = 0;
  for (int64_t r = 0; r < R; ++r) {
    EXPECT_EQ(gpu.tokens.data<int32_t>()[r], cpu.tokens.data<int32_t>()[r]) << "V " << V << " row " << r;
    const double d = std::abs(double(gpu.logprobs.data<float>()[r]) - double(cpu.logprobs.data<float>()[r]));
    max_diff = std::max(max_diff, d);
    EXPECT_LT(d, 1e-4) << "V " << V << " row " << r;
  }
  std::printf("sample_tokens V %lld: %lld rows, max |dlogprob| %.2e\n", (long long)V, (long long)R, max_diff);
}

}  // namespace

TEST(CudaSample, EveryPathDrawsTheCpuTokens) {
  MT_REQUIRE_GPU();
  compare_paths(1003, 1);
  compare_paths(151936, 2);
}

TEST(CudaSample, ChiSquareOfCudaDrawsMatchesTheTruncatedDistribution) {
  MT_REQUIRE_GPU();
  const std::vector<float> x = {0.3f,  -1.5f, 2.0f, -0.2f, 1.0f, -3.0f, 0.8f, 1.5f,
                                -0.5f, 0.1f,  1.2f, -2.0f, 0.5f, -0.8f, 0.0f, -1.0f};
  const int64_t n = 40000, V = 16;
  for (const SamplingParams& p : {params(0.7f, 10, 0.9f, 0, 11), params(1.0f, 0, 1, 0, 12), params(1.0f, 0, 1, 0.1f, 13)}) {
    Tensor logits = Tensor::empty({n, V});
    for (int64_t i = 0; i < n; ++i) std::copy(x.begin(), x.end(), logits.data<float>() + i * V);
    std::vector<SamplingParams> ps(size_t(n), p);
    std::vector<DrawCounter> cs;
    for (int64_t i = 0; i < n; ++i) cs.push_back({uint64_t(i), uint64_t(i % 89)});
    const Drawn d = draw(logits, ps, cs, Device::CUDA);
    std::vector<int64_t> count(size_t(V), 0);
    for (int64_t i = 0; i < n; ++i) ++count[size_t(d.tokens.data<int32_t>()[i])];
    const std::vector<TokenProb> want = truncated_distribution(x.data(), V, p);
    double chi2 = 0;
    int64_t inside = 0;
    for (const TokenProb& t : want) {
      const double e = double(n) * t.prob;
      chi2 += (double(count[size_t(t.token)]) - e) * (double(count[size_t(t.token)]) - e) / e;
      inside += count[size_t(t.token)];
    }
    EXPECT_EQ(inside, n) << "draws outside the kept tokens";
    // Critical values at p = 1e-4 for 1..15 degrees of freedom.
    const double crit[] = {0, 15.137, 18.421, 21.108, 23.513, 25.745, 27.856, 29.878, 31.828, 33.720,
                           35.564, 37.367, 39.134, 40.871, 42.579, 44.263};
    const size_t dof = want.size() - 1;
    EXPECT_LT(chi2, crit[dof]) << want.size() << " kept tokens";
    std::printf("CUDA draws: %zu kept tokens, chi-square %.2f (critical %.2f)\n", want.size(), chi2, crit[dof]);
  }
}

#endif  // MT_HAVE_CUDA
