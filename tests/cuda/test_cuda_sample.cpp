// The CUDA sampler (backend/cuda/sample.cu) against the CPU reference (ops/sampling.h): on random logits,
// every path (greedy, the plain race, min-p, top-k, top-p, top-k with top-p, with min-p) draws the same
// tokens as the CPU with the same seeds and counters (the race in f32 against fp64 could differ only
// where two scores are within rounding; none is in these cases) and log-probs within 1e-4; a vocabulary of
// 151,936 (Qwen3's) and one of 1,003 (not a multiple of four: the last Philox group is partial, the loads
// scalar). The distribution of 40k CUDA draws of one row matches the truncated distribution (chi-square,
// p = 1e-4) in every mode, through the fast path and through the truncation path. Without truncation the
// truncation path draws the fast path's tokens exactly; greedy ties go to the lowest id across threads
// and chunks; a captured sampler replayed over new counters and logits draws what the eager one draws.
#include <gtest/gtest.h>

#ifdef MT_HAVE_CUDA

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <functional>
#include <string>

#include "backend/cuda/sample.cuh"
#include "core/cuda_graph.h"
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

using Sampler = std::function<void(const Tensor&, const Tensor&, Tensor&, Tensor&)>;
const Sampler kOp = [](const Tensor& l, const Tensor& r, Tensor& t, Tensor& lp) { ops::sample_tokens(l, r, t, lp); };
const Sampler kTruncationPath = [](const Tensor& l, const Tensor& r, Tensor& t, Tensor& lp) {
  cuda::sample_tokens_truncation_path(l, r, t, lp);
};

Drawn draw(const Tensor& logits, const std::vector<SamplingParams>& ps, const std::vector<DrawCounter>& cs, Device d,
           const Sampler& sampler = kOp) {
  const int64_t R = logits.size(0);
  Drawn out{Tensor::empty({R}, DType::I32, d), Tensor::empty({R}, DType::F32, d)};
  sampler(logits.to(d), pack_sample_rows(ps, cs).to(d), out.tokens, out.logprobs);
  return {out.tokens.to(Device::CPU), out.logprobs.to(Device::CPU)};
}

bool same_bits(const Tensor& a, const Tensor& b) {
  const Tensor x = a.to(Device::CPU), y = b.to(Device::CPU);
  return x.shape() == y.shape() && x.dtype() == y.dtype() && std::memcmp(x.raw(), y.raw(), x.nbytes()) == 0;
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
  // Every mode: top-k with top-p, the plain race at two temperatures, min-p, top-k, top-p; each through the
  // op (fast path where no truncation is set) and through the truncation path.
  const SamplingParams modes[] = {params(0.7f, 10, 0.9f, 0, 11), params(1.0f, 0, 1, 0, 12),  params(0.5f, 0, 1, 0, 14),
                                  params(1.0f, 0, 1, 0.1f, 13),  params(1.3f, 6, 1, 0, 15), params(0.9f, 0, 0.8f, 0, 16)};
  struct Case {
    SamplingParams p;
    bool truncation_path;
  };
  for (const Case& k : {Case{modes[0], false}, Case{modes[1], false}, Case{modes[2], false}, Case{modes[3], false},
                        Case{modes[4], false}, Case{modes[5], false}, Case{modes[1], true}, Case{modes[2], true}}) {
    const SamplingParams& p = k.p;
    const Sampler& sampler = k.truncation_path ? kTruncationPath : kOp;
    Tensor logits = Tensor::empty({n, V});
    for (int64_t i = 0; i < n; ++i) std::copy(x.begin(), x.end(), logits.data<float>() + i * V);
    std::vector<SamplingParams> ps(size_t(n), p);
    std::vector<DrawCounter> cs;
    for (int64_t i = 0; i < n; ++i) cs.push_back({uint64_t(i), uint64_t(i % 89)});
    const Drawn d = draw(logits, ps, cs, Device::CUDA, sampler);
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
    std::printf("CUDA draws (T %.1f, top-k %d, top-p %.2f, min-p %.2f%s): %zu kept tokens, chi-square %.2f (critical "
                "%.2f)\n",
                p.temperature, p.top_k, p.top_p, p.min_p, k.truncation_path ? ", truncation path" : "",
                want.size(), chi2, crit[dof]);
  }
}

// The radix selection lists its candidates once the chosen bin holds at most 8,192 of them (sample.cu): a
// boundary inside a run of more tied logits than that (the bins stay large through the logit's 32 bits and
// only the ids split them), and a top-k of 100,000 (the first bins hold tens of thousands), must select
// what the CPU selects: the same tokens from the same uniform numbers.
TEST(CudaSample, TopKBoundaryInsideLargeBinsDrawsTheCpuTokens) {
  MT_REQUIRE_GPU();
  const int64_t V = 151936, R = 16;
  Rng rng{77};
  Tensor logits = Tensor::empty({R, V});
  rng.fill_normal(logits, 0.0f, 2.0f);
  for (int64_t r = 0; r < R; r += 2)  // even rows: 12,000 tokens tied at the top (every 12th id)
    for (int64_t i = 0; i < 12000; ++i) logits.data<float>()[r * V + i * 12] = 12.0f;
  std::vector<SamplingParams> ps;
  std::vector<DrawCounter> cs;
  for (int64_t r = 0; r < R; ++r) {
    ps.push_back(r % 4 < 2 ? params(1.0f, 6000, 1, 0, uint64_t(50 + r)) : params(1.0f, 100000, 1, 0, uint64_t(50 + r)));
    cs.push_back({uint64_t(r), uint64_t(3 * r)});
  }
  const Drawn cpu = draw(logits, ps, cs, Device::CPU);
  for (const char* list : {"1", "0"}) {  // MOETRAIN_SAMPLE_LIST: with the candidate list, and every pass on the row
    const cudatest::EnvGuard env("MOETRAIN_SAMPLE_LIST", list);
    const Drawn gpu = draw(logits, ps, cs, Device::CUDA);
    for (int64_t r = 0; r < R; ++r) {
      const int32_t t = gpu.tokens.data<int32_t>()[r];
      EXPECT_EQ(t, cpu.tokens.data<int32_t>()[r]) << "list " << list << " row " << r << " top_k " << ps[size_t(r)].top_k;
      if (r % 4 == 0) {  // top-k 6,000 of the tied 12,000: the lowest ids, so only ids < 72,000 can be drawn
        EXPECT_EQ(t % 12, 0) << "list " << list << " row " << r;
        EXPECT_LT(t, 72000) << "list " << list << " row " << r;
      }
    }
  }
}

// With no truncation set, the truncation path (radix thresholds at zero, the race over every token of
// weight > 0) must draw what the one-pass race draws: the same scores from the same uniform numbers, so the
// same tokens and log-probs bit for bit, on random rows of both vocabulary sizes; greedy rows too.
TEST(CudaSample, TruncationPathDrawsTheFastPathsTokensWithoutTruncation) {
  MT_REQUIRE_GPU();
  for (const int64_t V : {int64_t(1003), int64_t(151936)}) {
    const int64_t R = 48;
    Rng rng{static_cast<uint64_t>(V)};
    Tensor logits = Tensor::empty({R, V});
    rng.fill_normal(logits, 0.0f, 3.0f);
    for (int64_t t = 0; t < V; t += 7) logits.data<float>()[t] = -INFINITY;  // masked tokens in row 0
    std::vector<SamplingParams> ps;
    std::vector<DrawCounter> cs;
    for (int64_t r = 0; r < R; ++r) {
      const float T = r % 6 == 5 ? 0.0f : 0.4f + 0.25f * float(r % 6);
      ps.push_back(params(T, 0, 1, 0, uint64_t(1000 + r)));
      cs.push_back({uint64_t(r % 5), uint64_t(7 * r)});
    }
    const Drawn fast = draw(logits, ps, cs, Device::CUDA), slow = draw(logits, ps, cs, Device::CUDA, kTruncationPath);
    EXPECT_TRUE(same_bits(fast.tokens, slow.tokens)) << "V " << V;
    EXPECT_TRUE(same_bits(fast.logprobs, slow.logprobs)) << "V " << V;
    int64_t distinct = 0;  // the rows really are random draws, not all the argmax
    for (int64_t r = 0; r < R; ++r) {
      const float* row = logits.data<float>() + r * V;
      distinct += fast.tokens.data<int32_t>()[r] != int32_t(std::max_element(row, row + V) - row);
    }
    EXPECT_GT(distinct, R / 4) << "V " << V;
  }
}

// Greedy: the largest logit, the lowest id among equal ones, whether the tied tokens share a thread, a
// block (chunk of 8,192 tokens) or neither; a tie between -inf and a finite logit is no tie.
TEST(CudaSample, GreedyTiesGoToTheLowestId) {
  MT_REQUIRE_GPU();
  const int64_t V = 151936;
  // Each case: the ids that hold the row's maximum 5.0; the rest are N(0, 1).
  const std::vector<std::vector<int32_t>> cases = {
      {150000, 20000, 9000}, {6, 5}, {1027, 3}, {40, 4}, {8192, 8191}, {151935, 151934}, {0, 151935}, {77777}};
  const int64_t R = int64_t(cases.size());
  Tensor logits = Tensor::empty({R, V});
  Rng rng(3);
  rng.fill_normal(logits, 0.0f, 1.0f);
  std::vector<SamplingParams> ps;
  std::vector<DrawCounter> cs;
  for (int64_t r = 0; r < R; ++r) {
    for (const int32_t t : cases[size_t(r)]) logits.data<float>()[r * V + t] = 5.0f;
    ps.push_back(params(0, 0, 1, 0, 1));
    cs.push_back({0, 0});
  }
  const Drawn gpu = draw(logits, ps, cs, Device::CUDA), cpu = draw(logits, ps, cs, Device::CPU);
  for (int64_t r = 0; r < R; ++r) {
    const int32_t want = *std::min_element(cases[size_t(r)].begin(), cases[size_t(r)].end());
    EXPECT_EQ(gpu.tokens.data<int32_t>()[r], want) << "row " << r;
    EXPECT_EQ(cpu.tokens.data<int32_t>()[r], want) << "row " << r;
    EXPECT_NEAR(gpu.logprobs.data<float>()[r], cpu.logprobs.data<float>()[r], 1e-4) << "row " << r;
  }
  // A row of -inf but one finite logit at the end: that token, log-prob 0.
  Tensor one = Tensor::empty({1, V});
  one.fill_(-INFINITY);
  one.data<float>()[V - 1] = -3.0f;
  const std::vector<DrawCounter> c0 = {DrawCounter{0, 0}};
  const Drawn d = draw(one, {params(0, 0, 1, 0, 1)}, c0, Device::CUDA);
  EXPECT_EQ(d.tokens.data<int32_t>()[0], V - 1);
  EXPECT_EQ(d.logprobs.data<float>()[0], 0.0f);
  const Drawn s = draw(one, {params(0.8f, 0, 1, 0, 1)}, c0, Device::CUDA);
  EXPECT_EQ(s.tokens.data<int32_t>()[0], V - 1);
  EXPECT_EQ(s.logprobs.data<float>()[0], 0.0f);
}

// The sampler captured in a CUDA graph over fixed buffers (as the engine's decode step captures it): each
// replay reads the rows and logits written since, so new counters draw new tokens, and every replay equals
// the eager sampler on the same inputs bit for bit, in every mode.
TEST(CudaSample, CapturedSamplerReplaysDrawTheEagerTokens) {
  MT_REQUIRE_GPU();
  const int64_t R = 40, V = 151936;
  const std::vector<SamplingParams> kinds = {params(0, 0, 1, 0, 1),       params(1, 0, 1, 0, 2),
                                             params(0.7f, 0, 1, 0.05f, 3), params(0.9f, 50, 1, 0, 4),
                                             params(1, 0, 0.9f, 0, 5),     params(1.2f, 100, 0.95f, 0.02f, 7),
                                             params(0.6f, 0, 1, 0, 8),     params(1.5f, 0, 1, 0, 9)};
  Tensor logits = Tensor::empty({R, V}, DType::F32, Device::CUDA), rows = Tensor::empty({R, 5}, DType::I64, Device::CUDA);
  Tensor tokens = Tensor::empty({R}, DType::I32, Device::CUDA), logprobs = Tensor::empty({R}, DType::F32, Device::CUDA);
  Tensor eager_t = Tensor::empty({R}, DType::I32, Device::CUDA), eager_lp = Tensor::empty({R}, DType::F32, Device::CUDA);
  // Step s: the rows' counters at position 50 + s; the logits change at step 3.
  auto fill = [&](int64_t s) {
    std::vector<SamplingParams> ps;
    std::vector<DrawCounter> cs;
    for (int64_t r = 0; r < R; ++r) {
      ps.push_back(kinds[size_t(r) % kinds.size()]);
      cs.push_back({uint64_t(r), uint64_t(50 + s)});
    }
    rows.copy_from(pack_sample_rows(ps, cs));
    if (s == 0 || s == 3) {
      Tensor h = Tensor::empty({R, V});
      Rng rng{static_cast<uint64_t>(17 + s)};
      rng.fill_normal(h, 0.0f, 2.0f);
      logits.copy_from(h);
    }
  };
  fill(0);
  ops::sample_tokens(logits, rows, tokens, logprobs);  // sizes the sampler's scratch before the capture
  cuda_graph::Graph g;
  std::string why;
  ASSERT_TRUE(g.capture([&] { ops::sample_tokens(logits, rows, tokens, logprobs); }, &why)) << why;
  Tensor previous;
  int64_t changed = 0;
  for (int64_t s = 1; s <= 4; ++s) {
    fill(s);
    ops::sample_tokens(logits, rows, eager_t, eager_lp);
    tokens.zero_();
    logprobs.zero_();
    ASSERT_EQ(g.captured_epoch(), cuda_graph::epoch());
    g.replay();
    EXPECT_TRUE(same_bits(tokens, eager_t)) << "step " << s;
    EXPECT_TRUE(same_bits(logprobs, eager_lp)) << "step " << s;
    const Tensor now = tokens.to(Device::CPU);
    if (previous.defined())
      for (int64_t r = 0; r < R; ++r) changed += now.data<int32_t>()[r] != previous.data<int32_t>()[r];
    previous = now;
  }
  EXPECT_GT(changed, R) << "replays drew new tokens as the counters moved";
  // One replayed step against the CPU reference too.
  std::vector<SamplingParams> ps;
  std::vector<DrawCounter> cs;
  for (int64_t r = 0; r < R; ++r) {
    ps.push_back(kinds[size_t(r) % kinds.size()]);
    cs.push_back({uint64_t(r), uint64_t(54)});
  }
  const Drawn cpu = draw(logits.to(Device::CPU), ps, cs, Device::CPU);
  const Tensor gpu_t = tokens.to(Device::CPU);
  for (int64_t r = 0; r < R; ++r) EXPECT_EQ(gpu_t.data<int32_t>()[r], cpu.tokens.data<int32_t>()[r]) << "row " << r;
}

#endif  // MT_HAVE_CUDA
