// Tests of the CPU load-balancing ops beside the aux loss: the biased top-k selection (aux-loss-free
// balancing), its bias update rule, and the router z-loss (value by definition, backward by finite
// differences); and the per-expert load statistics of the metrics on a hand-made routing.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "backend/cpu/cpu_ops.h"
#include "core/rng.h"
#include "core/tensor.h"
#include "fd_check.h"
#include "ops/ops.h"
#include "test_util.h"
#include "train/load_balance.h"

using namespace mt;
using mt::testing::fd_grad;
using mt::testing::random_tensor;
using mt::testing::rel_l2;
using mt::testutil::error_of;
using mt::testutil::same_bits;

namespace {

struct Routing {
  Tensor probs, idx, w;
};

Routing route(const Tensor& logits, int64_t K, bool norm_topk, const Tensor* bias = nullptr) {
  const int64_t T = logits.size(0), E = logits.size(1);
  Routing r{Tensor::empty({T, E}), Tensor::empty({T, K}, DType::I32), Tensor::empty({T, K})};
  cpu::router_fwd(logits, K, norm_topk, r.probs, r.idx, r.w, bias);
  return r;
}

Tensor i64_tensor(const Shape& shape, const std::vector<int64_t>& v) {
  Tensor t = Tensor::empty(shape, DType::I64);
  EXPECT_EQ(int64_t(v.size()), t.numel());
  for (size_t i = 0; i < v.size(); ++i) t.data<int64_t>()[i] = v[i];
  return t;
}

}  // namespace

// ---------------------------------------------------------------- biased selection

TEST(OpsBalanceRouter, BiasFavouringOneExpertPicksItAndKeepsUnbiasedWeights) {
  for (bool norm_topk : {false, true}) {
    Rng rng(11 + norm_topk);
    const int64_t T = 40, E = 8, K = 3, favoured = 5;
    Tensor logits = random_tensor({T, E}, rng, -3, 3);
    Tensor bias = Tensor::zeros({E});
    bias.data<float>()[favoured] = 10.0f;  // above any probability gap
    Routing plain = route(logits, K, norm_topk), biased = route(logits, K, norm_topk, &bias);
    EXPECT_TRUE(same_bits(plain.probs, biased.probs)) << "the bias must not change the probabilities";
    for (int64_t t = 0; t < T; ++t) {
      const int32_t* bi = biased.idx.data<int32_t>() + t * K;
      const int32_t* pi = plain.idx.data<int32_t>() + t * K;
      EXPECT_EQ(bi[0], favoured) << "token " << t;
      // The other choices are the unbiased ranking without the favoured expert.
      std::vector<int32_t> rest;
      for (int64_t k = 0; k < K && int64_t(rest.size()) < K - 1; ++k)
        if (pi[k] != favoured) rest.push_back(pi[k]);
      for (int64_t k = 1; k < K; ++k) EXPECT_EQ(bi[k], rest[size_t(k - 1)]) << "token " << t << " choice " << k;
      // Weights: the unbiased probabilities of the chosen experts, renormalised over them when asked.
      double sum = 0;
      for (int64_t k = 0; k < K; ++k) sum += biased.probs.data<float>()[t * E + bi[k]];
      for (int64_t k = 0; k < K; ++k) {
        const double p = biased.probs.data<float>()[t * E + bi[k]];
        EXPECT_NEAR(biased.w.data<float>()[t * K + k], norm_topk ? p / sum : p, 1e-7) << "token " << t;
      }
    }
  }
}

TEST(OpsBalanceRouter, ZeroBiasIsBitIdenticalToNoBiasAndShapeIsChecked) {
  Rng rng(12);
  Tensor logits = random_tensor({30, 6}, rng, -2, 2), zero = Tensor::zeros({6});
  Routing a = route(logits, 2, true), b = route(logits, 2, true, &zero);
  EXPECT_TRUE(same_bits(a.probs, b.probs));
  EXPECT_TRUE(same_bits(a.idx, b.idx));
  EXPECT_TRUE(same_bits(a.w, b.w));
  Tensor wrong = Tensor::zeros({5});  // the shape is checked by the dispatch (ops/op_checks.h)
  const std::string msg = error_of([&] { ops::router_fwd(logits, 2, true, b.probs, b.idx, b.w, &wrong); });
  EXPECT_NE(msg.find("router_fwd bias_E has shape [5], expected [6]"), std::string::npos) << msg;
}

// ---------------------------------------------------------------- bias update

TEST(OpsBalanceBias, UpdateMovesEachExpertTowardsTheMeanByRate) {
  // Row 0: mean 3 -> expert 0 over-loaded (-), 1 under-loaded (+), 2 and 3 exactly at the mean (0).
  // Row 1: mean 3 -> +, +, -, -. Row 2: nothing routed: no change.
  Tensor counts = i64_tensor({3, 4}, {5, 1, 3, 3, 0, 0, 8, 4, 0, 0, 0, 0});
  Tensor bias = Tensor::empty({3, 4});
  for (int64_t i = 0; i < 12; ++i) bias.data<float>()[i] = 0.25f * float(i) - 1.0f;
  Tensor before = bias.clone();
  const float rate = 0.125f;
  cpu::router_bias_update(counts, rate, bias);
  const float sign[12] = {-1, 1, 0, 0, 1, 1, -1, -1, 0, 0, 0, 0};
  for (int64_t i = 0; i < 12; ++i) EXPECT_EQ(bias.data<float>()[i], before.data<float>()[i] + rate * sign[i]) << i;
  // A mean that is not an integer: counts 2, 1, 0 (mean 1): -, 0, +.
  Tensor c2 = i64_tensor({1, 3}, {2, 1, 0}), b2 = Tensor::zeros({1, 3});
  cpu::router_bias_update(c2, 1.0f, b2);
  EXPECT_EQ(b2.data<float>()[0], -1.0f);
  EXPECT_EQ(b2.data<float>()[1], 0.0f);
  EXPECT_EQ(b2.data<float>()[2], 1.0f);
  Tensor wrong = Tensor::zeros({3, 5});  // the shape is checked by the dispatch (ops/op_checks.h)
  const std::string msg = error_of([&] { ops::router_bias_update(counts, rate, wrong); });
  EXPECT_NE(msg.find("router_bias_update bias_LE has shape [3, 5], expected [3, 4]"), std::string::npos) << msg;
}

// ---------------------------------------------------------------- z-loss

TEST(OpsBalanceZLoss, ValueIsTheSumOfSquaredLogSumExpAndAccumulates) {
  Rng rng(13);
  const int64_t T = 17, E = 8;
  Tensor logits = random_tensor({T, E}, rng, -4, 4);
  logits.data<float>()[3] = 60.0f;  // large logits: the max-shifted form must not overflow
  Tensor lse = Tensor::empty({T}), zsum = Tensor::empty({1});
  zsum.data<float>()[0] = 1.5f;  // +=
  cpu::router_z_loss_fwd(logits, lse, zsum);
  double want = 0;
  for (int64_t t = 0; t < T; ++t) {
    double mx = -INFINITY;
    for (int64_t e = 0; e < E; ++e) mx = std::max(mx, double(logits.data<float>()[t * E + e]));
    double s = 0;
    for (int64_t e = 0; e < E; ++e) s += std::exp(double(logits.data<float>()[t * E + e]) - mx);
    const double v = mx + std::log(s);
    EXPECT_NEAR(lse.data<float>()[t], v, 1e-6 * std::abs(v) + 1e-7) << "token " << t;
    want += v * v;
  }
  EXPECT_NEAR(zsum.data<float>()[0], 1.5 + want, 1e-6 * want);
}

TEST(OpsBalanceZLoss, BackwardMatchesFiniteDifferencesAndAccumulates) {
  Rng rng(14);
  const int64_t T = 12, E = 6;
  const float scale = 0.37f;
  Tensor logits = random_tensor({T, E}, rng, -2, 2);
  auto loss = [&] {
    Tensor lse = Tensor::empty({T}), zsum = Tensor::zeros({1});
    cpu::router_z_loss_fwd(logits, lse, zsum);
    return double(scale) * double(zsum.data<float>()[0]);
  };
  Tensor num = fd_grad(logits, loss, 1e-2);
  Routing r = route(logits, 2, false);
  Tensor lse = Tensor::empty({T}), zsum = Tensor::zeros({1});
  cpu::router_z_loss_fwd(logits, lse, zsum);
  Tensor before = random_tensor({T, E}, rng), d = before.clone();
  cpu::router_z_loss_bwd(lse, r.probs, scale, d);  // +=
  for (int64_t i = 0; i < d.numel(); ++i) d.data<float>()[i] -= before.data<float>()[i];
  EXPECT_LT(rel_l2(d, num), 1e-3);
}

// ---------------------------------------------------------------- load statistics

TEST(LoadBalanceStats, HandMadeRoutingGivesMinMaxMeanImbalanceAndUnused) {
  // Two sparse layers, E = 4, 6 tokens top-2 (12 assignments per layer).
  // Layer 0 ids: expert 0 x6, 1 x4, 2 x2, 3 x0. Layer 1: 3 each (balanced).
  const int64_t E = 4, K = 2;
  Tensor idx0 = Tensor::empty({6, K}, DType::I32), idx1 = Tensor::empty({6, K}, DType::I32);
  const int32_t l0[12] = {0, 1, 0, 1, 0, 1, 0, 1, 0, 2, 0, 2};
  const int32_t l1[12] = {0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3};
  for (int i = 0; i < 12; ++i) {
    idx0.data<int32_t>()[i] = l0[i];
    idx1.data<int32_t>()[i] = l1[i];
  }
  Tensor counts = Tensor::zeros({2, E}, DType::I64);
  Tensor row0 = counts.rows(0, 1).view({E}), row1 = counts.rows(1, 1).view({E});
  cpu::expert_counts(idx0, E, row0);
  cpu::expert_counts(idx1, E, row1);
  ExpertLoadStats s = expert_load_stats(counts);
  EXPECT_EQ(s.layers, 2);
  EXPECT_EQ(s.experts, E);
  EXPECT_EQ(s.min, 0.0);
  EXPECT_EQ(s.max, 6.0);
  EXPECT_EQ(s.mean, 3.0);
  EXPECT_EQ(s.imbalance, 2.0);
  EXPECT_EQ(s.unused, 1);
  ASSERT_EQ(s.imbalance_per_layer.size(), 2u);
  EXPECT_EQ(s.imbalance_per_layer[0], 2.0);
  EXPECT_EQ(s.imbalance_per_layer[1], 1.0);
  ExpertLoadStats none = expert_load_stats(Tensor::zeros({2, E}, DType::I64));
  EXPECT_EQ(none.imbalance, 0.0);
  EXPECT_EQ(none.unused, 2 * E);
}
