// Tests of the CPU MoE ops: router, aux loss, dispatch plan, permutation, SwiGLU and experts.
// Backward passes are checked against central differences (fd_check.h); the grouped expert path
// (plan -> permute -> experts -> unpermute) is checked against the plain reference loop, forward
// and backward; the dispatch plan is checked exactly with self-describing rows.
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

using namespace mt;
using mt::testutil::error_of;
using mt::testing::fd_grad;
using mt::testing::max_abs_diff;
using mt::testing::random_tensor;
using mt::testing::rel_l2;
using mt::testing::weighted_sum;

namespace {

constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

Tensor i32_tensor(const Shape& shape, const std::vector<int32_t>& v) {
  Tensor t = Tensor::empty(shape, DType::I32);
  EXPECT_EQ(int64_t(v.size()), t.numel());
  for (size_t i = 0; i < v.size(); ++i) t.data<int32_t>()[i] = v[i];
  return t;
}

Tensor filled(const Shape& shape, float value) {
  Tensor t = Tensor::empty(shape);
  t.fill_(value);
  return t;
}

// a - b elementwise (for checking += contracts: the op's contribution is after - before).
Tensor minus(const Tensor& a, const Tensor& b) {
  Tensor d = a.clone();
  for (int64_t i = 0; i < d.numel(); ++i) d.data<float>()[i] -= b.data<float>()[i];
  return d;
}

// Router logits whose top-k choice cannot flip under a finite-difference step: each row is a
// random permutation of values 0.7 apart, plus a little noise.
Tensor separated_logits(int64_t T, int64_t E, Rng& rng) {
  Tensor t = Tensor::empty({T, E});
  for (int64_t r = 0; r < T; ++r) {
    std::vector<int64_t> perm(static_cast<size_t>(E));
    for (int64_t e = 0; e < E; ++e) perm[size_t(e)] = e;
    for (int64_t e = E - 1; e > 0; --e) std::swap(perm[size_t(e)], perm[size_t(rng.randint(0, e + 1))]);
    for (int64_t e = 0; e < E; ++e)
      t.data<float>()[r * E + e] = 0.7f * float(perm[size_t(e)]) - 1.0f + float(rng.uniform() * 0.2 - 0.1);
  }
  return t;
}

struct Routing {
  Tensor probs, idx, w;
};

Routing route(const Tensor& logits, int64_t K, bool norm_topk) {
  const int64_t T = logits.size(0), E = logits.size(1);
  Routing r{Tensor::empty({T, E}), Tensor::empty({T, K}, DType::I32), Tensor::empty({T, K})};
  cpu::router_fwd(logits, K, norm_topk, r.probs, r.idx, r.w);
  return r;
}

struct Plan {
  Tensor offsets, assign_of_row, row_of_assign;
};

Plan plan_for(const Tensor& idx, int64_t E) {
  const int64_t T = idx.size(0), K = idx.size(1);
  Plan p{Tensor::empty({E + 1}, DType::I64), Tensor::empty({T * K}, DType::I32), Tensor::empty({T, K}, DType::I32)};
  cpu::make_dispatch_plan(idx, E, p.offsets, p.assign_of_row, p.row_of_assign);
  return p;
}

}  // namespace

// ---------------------------------------------------------------- router

TEST(OpsMoeRouter, SoftmaxAndTopkMatchDefinition) {
  Rng rng(1);
  const int64_t T = 12, E = 6, K = 3;
  Tensor logits = random_tensor({T, E}, rng, -3.0f, 3.0f);
  for (bool norm : {false, true}) {
    Routing r = route(logits, K, norm);
    for (int64_t t = 0; t < T; ++t) {
      const float* l = logits.data<float>() + t * E;
      double mx = l[0], sum = 0;
      for (int64_t e = 1; e < E; ++e) mx = std::max(mx, double(l[e]));
      for (int64_t e = 0; e < E; ++e) sum += std::exp(double(l[e]) - mx);
      for (int64_t e = 0; e < E; ++e)
        EXPECT_NEAR(r.probs.data<float>()[t * E + e], std::exp(double(l[e]) - mx) / sum, 1e-7);
      // Chosen experts are distinct, in descending probability, and beat every unchosen one.
      std::vector<bool> chosen(static_cast<size_t>(E), false);
      double wsum = 0;
      for (int64_t k = 0; k < K; ++k) {
        const int32_t e = r.idx.data<int32_t>()[t * K + k];
        ASSERT_TRUE(e >= 0 && e < E && !chosen[size_t(e)]);
        chosen[size_t(e)] = true;
        if (k > 0) {
          const int32_t prev = r.idx.data<int32_t>()[t * K + k - 1];
          EXPECT_LE(r.probs.data<float>()[t * E + e], r.probs.data<float>()[t * E + prev]);
        }
        wsum += r.w.data<float>()[t * K + k];
      }
      const float pmin = r.probs.data<float>()[t * E + r.idx.data<int32_t>()[t * K + K - 1]];
      for (int64_t e = 0; e < E; ++e) {
        if (!chosen[size_t(e)]) {
          EXPECT_LT(r.probs.data<float>()[t * E + e], pmin);
        }
      }
      if (norm) {
        EXPECT_NEAR(wsum, 1.0, 1e-6);
      } else {
        for (int64_t k = 0; k < K; ++k)
          EXPECT_EQ(r.w.data<float>()[t * K + k], r.probs.data<float>()[t * E + r.idx.data<int32_t>()[t * K + k]]);
      }
    }
  }
}

TEST(OpsMoeRouter, TiesGoToTheLowerExpertIndex) {
  const int64_t E = 5;
  Tensor logits = Tensor::empty({3, E});
  const float rows[3][5] = {{1, 3, 3, 0, 3}, {2, 2, 2, 2, 2}, {0, 1, 5, 5, 1}};
  for (int t = 0; t < 3; ++t)
    for (int e = 0; e < E; ++e) logits.data<float>()[t * E + e] = rows[t][e];
  Routing r = route(logits, 3, true);
  const std::vector<int32_t> want = {1, 2, 4, 0, 1, 2, 2, 3, 1};
  for (size_t i = 0; i < want.size(); ++i) EXPECT_EQ(r.idx.data<int32_t>()[i], want[i]) << "at " << i;
  for (int k = 0; k < 3; ++k) EXPECT_FLOAT_EQ(r.w.data<float>()[3 + k], 1.0f / 3.0f);  // all-equal row
}

// K is checked by the dispatch (ops/op_checks.h), so through ops::.
TEST(OpsMoeRouter, RejectsKAboveE) {
  Tensor logits = Tensor::zeros({2, 4});
  Tensor probs = Tensor::empty({2, 4}), idx = Tensor::empty({2, 5}, DType::I32), w = Tensor::empty({2, 5});
  const std::string msg = error_of([&] { ops::router_fwd(logits, 5, false, probs, idx, w); });
  EXPECT_NE(msg.find("K (5)"), std::string::npos) << msg;
  EXPECT_NE(msg.find("E (4)"), std::string::npos) << msg;
}

class OpsMoeRouterBwd : public ::testing::TestWithParam<std::tuple<bool, bool>> {};

TEST_P(OpsMoeRouterBwd, MatchesFiniteDifferences) {
  const auto [norm_topk, with_dprobs] = GetParam();
  Rng rng(2 + 2 * norm_topk + with_dprobs);
  const int64_t T = 12, E = 4, K = 2;
  Tensor logits = separated_logits(T, E, rng);
  Tensor r_w = random_tensor({T, K}, rng), r_p = random_tensor({T, E}, rng);
  const Routing base = route(logits, K, norm_topk);
  auto loss = [&] {
    Routing r = route(logits, K, norm_topk);
    for (int64_t i = 0; i < T * K; ++i) MT_CHECK(r.idx.data<int32_t>()[i] == base.idx.data<int32_t>()[i], "flip");
    return weighted_sum(r.w, r_w) + (with_dprobs ? weighted_sum(r.probs, r_p) : 0.0);
  };
  Tensor num = fd_grad(logits, loss, 1e-3);
  Tensor dlogits = filled({T, E}, kNaN);  // dlogits is "=": stale contents must not leak through
  cpu::router_bwd(r_w, with_dprobs ? &r_p : nullptr, base.probs, base.idx, norm_topk, dlogits);
  EXPECT_LT(rel_l2(dlogits, num), 1e-3);
}

INSTANTIATE_TEST_SUITE_P(OpsMoe, OpsMoeRouterBwd, ::testing::Combine(::testing::Bool(), ::testing::Bool()));

// ---------------------------------------------------------------- aux loss

TEST(OpsMoeAux, ValueMatchesDefinitionPooledOverTwoLayers) {
  Rng rng(7);
  const int64_t E = 4, K = 2, T1 = 12, T2 = 8, N = T1 + T2;
  Routing l1 = route(random_tensor({T1, E}, rng, -2, 2), K, true);
  Routing l2 = route(random_tensor({T2, E}, rng, -2, 2), K, true);
  Tensor counts = Tensor::zeros({E}, DType::I64), sums = Tensor::zeros({E});
  for (const Routing* l : {&l1, &l2}) {
    cpu::expert_counts(l->idx, E, counts);
    cpu::prob_column_sums(l->probs, sums);
  }
  // transformers: tokens_per_expert = mean over rows of one_hot(topk) [K, E]; P = mean of probs;
  // loss = E * sum(tokens_per_expert * P).
  std::vector<double> f(static_cast<size_t>(E), 0.0), P(static_cast<size_t>(E), 0.0);
  int64_t total = 0;
  for (const Routing* l : {&l1, &l2}) {
    const int64_t T = l->probs.size(0);
    for (int64_t t = 0; t < T; ++t) {
      for (int64_t k = 0; k < K; ++k) f[size_t(l->idx.data<int32_t>()[t * K + k])] += 1.0 / N;
      for (int64_t e = 0; e < E; ++e) P[size_t(e)] += double(l->probs.data<float>()[t * E + e]) / N;
    }
  }
  double want = 0;
  for (int64_t e = 0; e < E; ++e) {
    want += f[size_t(e)] * P[size_t(e)];
    total += counts.data<int64_t>()[e];
  }
  want *= E;
  EXPECT_EQ(total, N * K);
  EXPECT_NEAR(cpu::aux_loss_value(counts, sums, N), want, 1e-6 * want);
  // Perfectly balanced routing with uniform probabilities gives exactly K.
  Tensor c = Tensor::empty({E}, DType::I64), s = filled({E}, float(N) / E);
  for (int64_t e = 0; e < E; ++e) c.data<int64_t>()[e] = N * K / E;
  EXPECT_NEAR(cpu::aux_loss_value(c, s, N), double(K), 1e-12);
}

TEST(OpsMoeAux, BackwardMatchesFiniteDifferencesWithCountsFixed) {
  Rng rng(8);
  const int64_t E = 4, K = 2, T1 = 12, T2 = 8, N = T1 + T2;
  const float dloss = 0.37f;
  Routing l1 = route(random_tensor({T1, E}, rng, -2, 2), K, false);
  Routing l2 = route(random_tensor({T2, E}, rng, -2, 2), K, false);
  Tensor counts = Tensor::zeros({E}, DType::I64);
  cpu::expert_counts(l1.idx, E, counts);
  cpu::expert_counts(l2.idx, E, counts);
  auto loss = [&] {
    Tensor sums = Tensor::zeros({E});
    cpu::prob_column_sums(l1.probs, sums);
    cpu::prob_column_sums(l2.probs, sums);
    return double(dloss) * cpu::aux_loss_value(counts, sums, N);
  };
  Tensor num = fd_grad(l1.probs, loss, 1e-2);
  Tensor before = random_tensor({T1, E}, rng);
  Tensor dprobs = before.clone();
  cpu::aux_loss_bwd(counts, N, dloss, dprobs);  // +=
  EXPECT_LT(rel_l2(minus(dprobs, before), num), 1e-3);
}

// ---------------------------------------------------------------- dispatch plan and permutation

TEST(OpsMoeDispatch, PlanIsExactWithSelfDescribingRows) {
  const int64_t T = 6, K = 2, E = 4, D = 3;
  // Expert 2 receives no token.
  Tensor idx = i32_tensor({T, K}, {1, 0, 0, 3, 3, 1, 1, 3, 0, 1, 3, 0});
  Plan p = plan_for(idx, E);
  const std::vector<int64_t> want_off = {0, 4, 8, 8, 12};
  for (int64_t e = 0; e <= E; ++e) EXPECT_EQ(p.offsets.data<int64_t>()[e], want_off[size_t(e)]) << "e=" << e;
  const std::vector<int32_t> want_assign = {1, 2, 8, 11, 0, 5, 6, 9, 3, 4, 7, 10};
  for (int64_t r = 0; r < T * K; ++r) {
    EXPECT_EQ(p.assign_of_row.data<int32_t>()[r], want_assign[size_t(r)]) << "r=" << r;
    EXPECT_EQ(p.row_of_assign.data<int32_t>()[p.assign_of_row.data<int32_t>()[r]], r);
  }

  // Each row of x carries its token id; after permutation each expert's rows must be exactly the
  // tokens that chose it, in token order.
  Tensor x = Tensor::empty({T, D});
  for (int64_t t = 0; t < T; ++t)
    for (int64_t j = 0; j < D; ++j) x.data<float>()[t * D + j] = float(t);
  Tensor xp = filled({T * K, D}, kNaN);
  cpu::permute_fwd(x, p.assign_of_row, K, xp);
  for (int64_t e = 0; e < E; ++e) {
    std::vector<float> want, got;
    for (int64_t t = 0; t < T; ++t)
      for (int64_t k = 0; k < K; ++k)
        if (idx.data<int32_t>()[t * K + k] == e) want.push_back(float(t));
    for (int64_t r = p.offsets.data<int64_t>()[e]; r < p.offsets.data<int64_t>()[e + 1]; ++r) {
      for (int64_t j = 1; j < D; ++j) EXPECT_EQ(xp.data<float>()[r * D + j], xp.data<float>()[r * D]);
      got.push_back(xp.data<float>()[r * D]);
    }
    EXPECT_EQ(got, want) << "expert " << e;
  }

  // Experts as the identity, weights 1/K: unpermute restores every token exactly (y is "=").
  Tensor w = filled({T, K}, 1.0f / K), y = filled({T, D}, kNaN);
  cpu::unpermute_fwd(xp, p.row_of_assign, w, y);
  EXPECT_EQ(max_abs_diff(y, x), 0.0);
}

TEST(OpsMoeDispatch, ExpertIdOutOfRangeNamesTokenAndValue) {
  const int64_t T = 4, K = 2, E = 4;
  Tensor bad = i32_tensor({T, K}, {0, 1, 2, 3, 1, 7, 0, 2});
  Tensor off = Tensor::empty({E + 1}, DType::I64), aor = Tensor::empty({T * K}, DType::I32),
         roa = Tensor::empty({T, K}, DType::I32);
  std::string msg = error_of([&] { cpu::make_dispatch_plan(bad, E, off, aor, roa); });
  EXPECT_NE(msg.find("token 2"), std::string::npos) << msg;
  EXPECT_NE(msg.find("expert id 7"), std::string::npos) << msg;
  EXPECT_NE(msg.find("[0, 4)"), std::string::npos) << msg;

  Tensor neg = i32_tensor({T, K}, {0, 1, -1, 3, 1, 2, 0, 2});
  msg = error_of([&] { cpu::make_dispatch_plan(neg, E, off, aor, roa); });
  EXPECT_NE(msg.find("token 1"), std::string::npos) << msg;
  EXPECT_NE(msg.find("expert id -1"), std::string::npos) << msg;

  Tensor counts = Tensor::zeros({E}, DType::I64);
  msg = error_of([&] { cpu::expert_counts(bad, E, counts); });
  EXPECT_NE(msg.find("expert id 7"), std::string::npos) << msg;

  Tensor x = Tensor::zeros({T, 3}), w = Tensor::zeros({T, K}), y = Tensor::empty({T, 3});
  Tensor wgu = Tensor::zeros({E, 4, 3}), wd = Tensor::zeros({E, 3, 2});
  msg = error_of([&] { cpu::experts_ref_fwd(x, bad, w, wgu, wd, y); });
  EXPECT_NE(msg.find("expert id 7"), std::string::npos) << msg;
}

TEST(OpsMoeDispatch, PermuteBwdMatchesFiniteDifferencesAndAccumulates) {
  Rng rng(11);
  const int64_t T = 12, K = 2, E = 4, D = 8;
  Routing rt = route(separated_logits(T, E, rng), K, true);
  Plan p = plan_for(rt.idx, E);
  Tensor x = random_tensor({T, D}, rng), r = random_tensor({T * K, D}, rng), xp = Tensor::empty({T * K, D});
  auto loss = [&] {
    cpu::permute_fwd(x, p.assign_of_row, K, xp);
    return weighted_sum(xp, r);
  };
  Tensor num = fd_grad(x, loss, 1e-2);
  Tensor before = random_tensor({T, D}, rng), dx = before.clone();
  cpu::permute_bwd(r, p.assign_of_row, K, dx);  // +=
  EXPECT_LT(rel_l2(minus(dx, before), num), 1e-4);
}

TEST(OpsMoeDispatch, UnpermuteBwdMatchesFiniteDifferences) {
  Rng rng(12);
  const int64_t T = 12, K = 2, E = 4, D = 8;
  Routing rt = route(separated_logits(T, E, rng), K, true);
  Plan p = plan_for(rt.idx, E);
  Tensor yp = random_tensor({T * K, D}, rng), w = rt.w.clone(), r = random_tensor({T, D}, rng);
  Tensor y = Tensor::empty({T, D});
  auto loss = [&] {
    cpu::unpermute_fwd(yp, p.row_of_assign, w, y);
    return weighted_sum(y, r);
  };
  Tensor num_yp = fd_grad(yp, loss, 1e-2), num_w = fd_grad(w, loss, 1e-2);
  Tensor dyp = filled({T * K, D}, kNaN), dw = filled({T, K}, kNaN);
  cpu::unpermute_bwd(r, yp, p.row_of_assign, w, dyp, dw);
  EXPECT_LT(rel_l2(dyp, num_yp), 1e-4);
  EXPECT_LT(rel_l2(dw, num_w), 1e-4);
}

// ---------------------------------------------------------------- SwiGLU

TEST(OpsMoeSwiglu, ForwardMatchesDefinitionAndBackwardMatchesFiniteDifferences) {
  Rng rng(13);
  const int64_t N = 5, F = 6;
  Tensor gu = random_tensor({N, 2 * F}, rng, -4.0f, 4.0f), h = Tensor::empty({N, F});
  cpu::swiglu_fwd(gu, h);
  for (int64_t n = 0; n < N; ++n)
    for (int64_t f = 0; f < F; ++f) {
      const double g = gu.data<float>()[n * 2 * F + f], u = gu.data<float>()[n * 2 * F + F + f];
      EXPECT_NEAR(h.data<float>()[n * F + f], g / (1 + std::exp(-g)) * u, 1e-6);
    }
  Tensor r = random_tensor({N, F}, rng);
  auto loss = [&] {
    cpu::swiglu_fwd(gu, h);
    return weighted_sum(h, r);
  };
  Tensor num = fd_grad(gu, loss, 1e-3);
  Tensor dgu = filled({N, 2 * F}, kNaN);
  cpu::swiglu_bwd(r, gu, dgu);
  EXPECT_LT(rel_l2(dgu, num), 1e-3);
}

// ---------------------------------------------------------------- experts

namespace {

// A small routed problem: T=12 tokens, D=8, E=5 experts (expert 4 never chosen), K=2, F=6.
struct ExpertProblem {
  static constexpr int64_t T = 12, D = 8, E = 5, K = 2, F = 6;
  Tensor x, wgu, wd;
  Routing rt;
  Plan plan;
  explicit ExpertProblem(uint64_t seed) {
    Rng rng(seed);
    x = random_tensor({T, D}, rng);
    wgu = random_tensor({E, 2 * F, D}, rng, -0.6f, 0.6f);
    wd = random_tensor({E, D, F}, rng, -0.6f, 0.6f);
    Tensor logits = separated_logits(T, E, rng);
    for (int64_t t = 0; t < T; ++t) logits.data<float>()[t * E + E - 1] = -20.0f;
    rt = route(logits, K, true);
    plan = plan_for(rt.idx, E);
  }
  Tensor permuted_x() const {
    Tensor xp = Tensor::empty({T * K, D});
    cpu::permute_fwd(x, plan.assign_of_row, K, xp);
    return xp;
  }
};

}  // namespace

TEST(OpsMoeExperts, GroupedBackwardMatchesFiniteDifferences) {
  ExpertProblem P(21);
  const int64_t R = P.T * P.K, D = P.D, F = P.F;
  ASSERT_EQ(P.plan.offsets.data<int64_t>()[P.E - 1], P.plan.offsets.data<int64_t>()[P.E]);  // an empty expert
  Tensor xp = P.permuted_x();
  Tensor gu = Tensor::empty({R, 2 * F}), h = Tensor::empty({R, F}), yp = Tensor::empty({R, D});
  Rng rng(22);
  Tensor r = random_tensor({R, D}, rng);
  auto loss = [&] {
    cpu::experts_fwd(xp, P.plan.offsets, P.wgu, P.wd, gu, h, yp);
    return weighted_sum(yp, r);
  };
  Tensor num_xp = fd_grad(xp, loss, 1e-3), num_wgu = fd_grad(P.wgu, loss, 1e-3), num_wd = fd_grad(P.wd, loss, 1e-3);
  loss();
  Tensor dxp = filled({R, D}, kNaN);
  Tensor wgu_before = random_tensor(P.wgu.shape(), rng), wd_before = random_tensor(P.wd.shape(), rng);
  Tensor dwgu = wgu_before.clone(), dwd = wd_before.clone();
  cpu::experts_bwd(r, xp, P.plan.offsets, P.wgu, P.wd, gu, h, dxp, dwgu, dwd);
  EXPECT_LT(rel_l2(dxp, num_xp), 1e-3);
  EXPECT_LT(rel_l2(minus(dwgu, wgu_before), num_wgu), 1e-3);
  EXPECT_LT(rel_l2(minus(dwd, wd_before), num_wd), 1e-3);
}

TEST(OpsMoeExperts, ReferenceBackwardMatchesFiniteDifferences) {
  ExpertProblem P(31);
  const int64_t T = P.T, D = P.D, K = P.K;
  Tensor w = P.rt.w.clone(), y = Tensor::empty({T, D});
  Rng rng(32);
  Tensor r = random_tensor({T, D}, rng);
  auto loss = [&] {
    cpu::experts_ref_fwd(P.x, P.rt.idx, w, P.wgu, P.wd, y);
    return weighted_sum(y, r);
  };
  Tensor num_x = fd_grad(P.x, loss, 1e-3), num_w = fd_grad(w, loss, 1e-3);
  Tensor num_wgu = fd_grad(P.wgu, loss, 1e-3), num_wd = fd_grad(P.wd, loss, 1e-3);
  Tensor dx = filled({T, D}, kNaN), dtw = filled({T, K}, kNaN);
  Tensor wgu_before = random_tensor(P.wgu.shape(), rng), wd_before = random_tensor(P.wd.shape(), rng);
  Tensor dwgu = wgu_before.clone(), dwd = wd_before.clone();
  cpu::experts_ref_bwd(r, P.x, P.rt.idx, w, P.wgu, P.wd, dx, dtw, dwgu, dwd);
  EXPECT_LT(rel_l2(dx, num_x), 1e-3);
  EXPECT_LT(rel_l2(dtw, num_w), 1e-3);
  EXPECT_LT(rel_l2(minus(dwgu, wgu_before), num_wgu), 1e-3);
  EXPECT_LT(rel_l2(minus(dwd, wd_before), num_wd), 1e-3);
}

TEST(OpsMoeExperts, GroupedPathEqualsReferenceForwardAndBackward) {
  ExpertProblem P(41);
  const int64_t T = P.T, D = P.D, K = P.K, F = P.F, R = T * K;
  // Forward: plan -> permute -> experts -> unpermute vs the reference loop.
  Tensor xp = P.permuted_x();
  Tensor gu = Tensor::empty({R, 2 * F}), h = Tensor::empty({R, F}), yp = Tensor::empty({R, D});
  cpu::experts_fwd(xp, P.plan.offsets, P.wgu, P.wd, gu, h, yp);
  Tensor y = Tensor::empty({T, D}), y_ref = Tensor::empty({T, D});
  cpu::unpermute_fwd(yp, P.plan.row_of_assign, P.rt.w, y);
  cpu::experts_ref_fwd(P.x, P.rt.idx, P.rt.w, P.wgu, P.wd, y_ref);
  EXPECT_LT(rel_l2(y, y_ref), 1e-6);

  // Backward: unpermute_bwd -> experts_bwd -> permute_bwd vs the reference backward.
  Rng rng(42);
  Tensor dy = random_tensor({T, D}, rng);
  Tensor dyp = Tensor::empty({R, D}), dtw = Tensor::empty({T, K}), dxp = Tensor::empty({R, D});
  Tensor dwgu = Tensor::zeros(P.wgu.shape()), dwd = Tensor::zeros(P.wd.shape()), dx = Tensor::zeros({T, D});
  cpu::unpermute_bwd(dy, yp, P.plan.row_of_assign, P.rt.w, dyp, dtw);
  cpu::experts_bwd(dyp, xp, P.plan.offsets, P.wgu, P.wd, gu, h, dxp, dwgu, dwd);
  cpu::permute_bwd(dxp, P.plan.assign_of_row, K, dx);

  Tensor dx_ref = Tensor::empty({T, D}), dtw_ref = Tensor::empty({T, K});
  Tensor dwgu_ref = Tensor::zeros(P.wgu.shape()), dwd_ref = Tensor::zeros(P.wd.shape());
  cpu::experts_ref_bwd(dy, P.x, P.rt.idx, P.rt.w, P.wgu, P.wd, dx_ref, dtw_ref, dwgu_ref, dwd_ref);
  EXPECT_LT(rel_l2(dx, dx_ref), 1e-6);
  EXPECT_LT(rel_l2(dtw, dtw_ref), 1e-6);
  EXPECT_LT(rel_l2(dwgu, dwgu_ref), 1e-6);
  EXPECT_LT(rel_l2(dwd, dwd_ref), 1e-6);
  // The expert nobody chose gets exactly zero gradient on both paths.
  const int64_t per_gu = 2 * F * D, per_d = D * F;
  for (int64_t i = 0; i < per_gu; ++i) ASSERT_EQ(dwgu.data<float>()[(P.E - 1) * per_gu + i], 0.0f);
  for (int64_t i = 0; i < per_d; ++i) ASSERT_EQ(dwd.data<float>()[(P.E - 1) * per_d + i], 0.0f);
}

// ---------------------------------------------------------------- argument checks of the dispatch

// The shapes and scalar arguments of the router, dispatch and expert ops are checked once, by the
// dispatch (ops/op_checks.h): through ops::, naming the op, the argument, the value and what is allowed.
// Dtypes stay with the backend.
TEST(OpsMoeChecks, DispatchChecksRouterShapesAndScalars) {
  const int64_t T = 2, E = 4, K = 2;
  const Tensor logits = Tensor::zeros({T, E});
  Tensor probs = Tensor::empty({T, E}), idx = Tensor::zeros({T, K}, DType::I32), w = Tensor::empty({T, K});
  Tensor probs_bad = Tensor::empty({T, E - 1});
  std::string msg = error_of([&] { ops::router_fwd(logits, K, true, probs_bad, idx, w); });
  EXPECT_NE(msg.find("router_fwd probs_TE has shape [2, 3], expected [2, 4]"), std::string::npos) << msg;
  msg = error_of([&] { ops::router_fwd(logits, 0, true, probs, idx, w); });
  EXPECT_NE(msg.find("router_fwd: top-k K (0) must be in [1, E] where E (4) is the expert count"), std::string::npos)
      << msg;
  const Tensor logits_1d = Tensor::zeros({E});
  msg = error_of([&] { ops::router_fwd(logits_1d, K, true, probs, idx, w); });
  EXPECT_NE(msg.find("router_fwd logits_TE must be 2-D, got f32[4] cpu"), std::string::npos) << msg;
  Tensor probs_i32 = Tensor::empty({T, E}, DType::I32);  // a dtype error: the backend's
  msg = error_of([&] { ops::router_fwd(logits, K, true, probs_i32, idx, w); });
  EXPECT_NE(msg.find("router_fwd probs_TE has dtype i32, expected f32"), std::string::npos) << msg;

  const Tensor dw = Tensor::zeros({T, K});
  Tensor dlogits_bad = Tensor::empty({T + 1, E});
  msg = error_of([&] { ops::router_bwd(dw, nullptr, probs, idx, true, dlogits_bad); });
  EXPECT_NE(msg.find("router_bwd dlogits_TE has shape [3, 4], expected [2, 4]"), std::string::npos) << msg;

  Tensor counts = Tensor::zeros({E}, DType::I64), sums = Tensor::zeros({E});
  msg = error_of([&] { ops::expert_counts(idx, 0, counts); });
  EXPECT_NE(msg.find("expert_counts: expert count E (0) must be at least 1"), std::string::npos) << msg;
  Tensor sums_bad = Tensor::zeros({E + 1});
  msg = error_of([&] { ops::prob_column_sums(probs, sums_bad); });
  EXPECT_NE(msg.find("prob_column_sums sums_E has shape [5], expected [4]"), std::string::npos) << msg;
  msg = error_of([&] { ops::aux_loss_value(counts, sums, 0); });
  EXPECT_NE(msg.find("aux_loss_value: pooled router row count N (0) must be at least 1"), std::string::npos) << msg;
  const Tensor counts_2d = Tensor::zeros({2, 2}, DType::I64);
  Tensor dprobs = Tensor::zeros({T, E});
  msg = error_of([&] { ops::aux_loss_bwd(counts_2d, 4, 1.0f, dprobs); });
  EXPECT_NE(msg.find("aux_loss_bwd counts_E must be 1-D, got i64[2, 2] cpu"), std::string::npos) << msg;

  Tensor lse = Tensor::empty({T}), zsum_bad = Tensor::zeros({2});
  msg = error_of([&] { ops::router_z_loss_fwd(logits, lse, zsum_bad); });
  EXPECT_NE(msg.find("router_z_loss_fwd zsum has shape [2], expected [1]"), std::string::npos) << msg;
  Tensor lse_bad = Tensor::empty({T + 1}), dlogits = Tensor::zeros({T, E});
  msg = error_of([&] { ops::router_z_loss_bwd(lse_bad, probs, 1.0f, dlogits); });
  EXPECT_NE(msg.find("router_z_loss_bwd lse_T has shape [3], expected [2]"), std::string::npos) << msg;

  const Tensor counts_LE = Tensor::zeros({3, E}, DType::I64);
  Tensor bias = Tensor::zeros({3, E});
  msg = error_of([&] { ops::router_bias_update(counts_LE, std::numeric_limits<float>::infinity(), bias); });
  EXPECT_NE(msg.find("router_bias_update: rate (inf) must be finite"), std::string::npos) << msg;
}

TEST(OpsMoeChecks, DispatchChecksPermutationShapesAndScalars) {
  const int64_t T = 4, K = 2, E = 4, D = 3, R = T * K;
  const Tensor idx = i32_tensor({T, K}, {0, 1, 2, 3, 1, 2, 0, 2});
  Tensor off = Tensor::empty({E + 1}, DType::I64), aor = Tensor::empty({R}, DType::I32),
         roa = Tensor::empty({T, K}, DType::I32), off_bad = Tensor::empty({E}, DType::I64);
  std::string msg = error_of([&] { ops::make_dispatch_plan(idx, 0, off, aor, roa); });
  EXPECT_NE(msg.find("make_dispatch_plan: expert count E (0) must be at least 1"), std::string::npos) << msg;
  msg = error_of([&] { ops::make_dispatch_plan(idx, E, off_bad, aor, roa); });
  EXPECT_NE(msg.find("make_dispatch_plan offsets_E1 has shape [4], expected [5]"), std::string::npos) << msg;
  ops::make_dispatch_plan(idx, E, off, aor, roa);

  const Tensor x = Tensor::zeros({T, D}), w = Tensor::zeros({T, K});
  Tensor xp = Tensor::zeros({R, D}), xp_bad = Tensor::zeros({R, D - 1}), dx = Tensor::zeros({T, D}),
         dx_bad = Tensor::zeros({T, D + 1});
  msg = error_of([&] { ops::permute_fwd(x, aor, 0, xp); });
  EXPECT_NE(msg.find("permute_fwd: K (0) must be at least 1"), std::string::npos) << msg;
  msg = error_of([&] { ops::permute_fwd(x, aor, K, xp_bad); });
  EXPECT_NE(msg.find("permute_fwd xp_RD has shape [8, 2], expected [8, 3]"), std::string::npos) << msg;
  msg = error_of([&] { ops::permute_bwd(xp, aor, K, dx_bad); });
  EXPECT_NE(msg.find("permute_bwd dx_TD has shape [4, 4], expected [4, 3]"), std::string::npos) << msg;
  msg = error_of([&] { ops::unpermute_fwd(xp, roa, w, dx_bad); });
  EXPECT_NE(msg.find("unpermute_fwd y_TD has shape [4, 4], expected [4, 3]"), std::string::npos) << msg;
  Tensor none, dw = Tensor::zeros({T, K}), dw_bad = Tensor::zeros({T, K + 1});
  msg = error_of([&] { ops::unpermute_bwd(x, none, roa, w, none, dw); });
  EXPECT_NE(msg.find("unpermute_bwd: neither dyp_RD nor yp_RD given"), std::string::npos) << msg;
  msg = error_of([&] { ops::unpermute_bwd(x, xp, roa, w, xp, dw_bad); });
  EXPECT_NE(msg.find("unpermute_bwd dw_TK has shape [4, 3], expected [4, 2]"), std::string::npos) << msg;
  // The composite ops are checked under their own names.
  msg = error_of([&] { ops::permute_weighted_fwd(x, roa, w, xp_bad); });
  EXPECT_NE(msg.find("permute_weighted_fwd xp_RD has shape [8, 2], expected [8, 3]"), std::string::npos) << msg;
  msg = error_of([&] { ops::permute_weighted_bwd(xp, x, roa, w, dx, dw_bad); });
  EXPECT_NE(msg.find("permute_weighted_bwd dw_TK has shape [4, 3], expected [4, 2]"), std::string::npos) << msg;
}

TEST(OpsMoeChecks, DispatchChecksExpertShapes) {
  const int64_t T = 4, K = 2, E = 4, F = 2, D = 3, R = T * K;
  const Tensor idx = i32_tensor({T, K}, {0, 1, 2, 3, 1, 2, 0, 2});
  Plan p = plan_for(idx, E);
  const Tensor wgu = Tensor::zeros({E, 2 * F, D}), wd = Tensor::zeros({E, D, F});
  const Tensor wgu_odd = Tensor::zeros({E, 3, D}), wd_bad = Tensor::zeros({E, D, F + 1});
  const Tensor xp = Tensor::zeros({R, D});
  Tensor gu = Tensor::zeros({R, 2 * F}), h = Tensor::zeros({R, F}), yp = Tensor::zeros({R, D}),
         h_bad = Tensor::zeros({R + 1, F});
  std::string msg = error_of([&] { ops::experts_fwd(xp, p.offsets, wgu_odd, wd, gu, h, yp); });
  EXPECT_NE(msg.find("experts_fwd: w_gate_up_E2FD must be [E, 2F, D], got f32[4, 3, 3] cpu"), std::string::npos) << msg;
  msg = error_of([&] { ops::experts_fwd(xp, p.offsets, wgu, wd_bad, gu, h, yp); });
  EXPECT_NE(msg.find("experts_fwd w_down_EDF has shape [4, 3, 3], expected [4, 3, 2]"), std::string::npos) << msg;
  msg = error_of([&] { ops::experts_fwd(xp, p.offsets, wgu, wd, gu, h_bad, yp); });
  EXPECT_NE(msg.find("experts_fwd h_RF has shape [9, 2], expected [8, 2]"), std::string::npos) << msg;
  msg = error_of([&] { ops::experts_fwd(xp, p.assign_of_row, wgu, wd, gu, h, yp); });
  EXPECT_NE(msg.find("experts_fwd offsets_E1 has shape [8], expected [5]"), std::string::npos) << msg;
  Tensor dxp = Tensor::zeros({R, D}), dwgu = Tensor::zeros({E, 2 * F, D}), dwd_bad = Tensor::zeros({E, D, F + 1});
  msg = error_of([&] { ops::experts_bwd(yp, xp, p.offsets, wgu, wd, gu, h, dxp, dwgu, dwd_bad); });
  EXPECT_NE(msg.find("experts_bwd dw_down_EDF has shape [4, 3, 3], expected [4, 3, 2]"), std::string::npos) << msg;

  const Tensor x = Tensor::zeros({T, D}), w = Tensor::zeros({T, K}), idx3 = Tensor::zeros({T - 1, K}, DType::I32);
  Tensor y = Tensor::zeros({T, D}), dx = Tensor::zeros({T, D}), dtw_bad = Tensor::zeros({T, K + 1}),
         dwd = Tensor::zeros({E, D, F});
  msg = error_of([&] { ops::experts_ref_fwd(x, idx3, w, wgu, wd, y); });
  EXPECT_NE(msg.find("experts_ref_fwd: topk_idx_TK must be [T, K] with T = 4, got i32[3, 2] cpu"), std::string::npos)
      << msg;
  msg = error_of([&] { ops::experts_ref_bwd(y, x, idx, w, wgu, wd, dx, dtw_bad, dwgu, dwd); });
  EXPECT_NE(msg.find("experts_ref_bwd dtopk_w_TK has shape [4, 3], expected [4, 2]"), std::string::npos) << msg;
}
