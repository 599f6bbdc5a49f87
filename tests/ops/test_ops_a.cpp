// Tests of the CPU reference ops owned by opsA: linear, embedding, RMSNorm, RoPE, attention,
// cross-entropy, AdamW and the gradient utilities, plus the sgemm wrapper they share.
// Gradients are checked against central finite differences (fd_check.h explains the tolerances);
// forward values against independent formulas computed in double inside the test.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "backend/cpu/cpu_ops.h"
#include "backend/cpu/gemm.h"
#include "core/rng.h"
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

// Relative L2 against finite differences. These ops reach 1e-6..5e-5 with the steps used here
// (fd_check.h explains the error budget), so 1e-3 keeps a 20x margin and still catches subtle bugs.
constexpr double kFdTol = 1e-3;
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

Tensor filled(const Shape& s, float v) {
  Tensor t = Tensor::empty(s);
  t.fill_(v);
  return t;
}

Tensor i64_tensor(const std::vector<int64_t>& v) {
  Tensor t = Tensor::empty({int64_t(v.size())}, DType::I64);
  for (size_t i = 0; i < v.size(); ++i) t.data<int64_t>()[i] = v[i];
  return t;
}

Tensor i32_tensor(const std::vector<int32_t>& v) {
  Tensor t = Tensor::empty({int64_t(v.size())}, DType::I32);
  for (size_t i = 0; i < v.size(); ++i) t.data<int32_t>()[i] = v[i];
  return t;
}

}  // namespace

// ---------------------------------------------------------------- sgemm

TEST(OpsAGemm, AllTransposesWithPaddedLeadingDims) {
  Rng rng(1);
  const int64_t M = 5, N = 4, K = 3, pad = 2;
  for (bool ta : {false, true}) {
    for (bool tb : {false, true}) {
      const int64_t lda = (ta ? M : K) + pad, ldb = (tb ? K : N) + pad, ldc = N + pad;
      Tensor A = random_tensor({ta ? K : M, lda}, rng), B = random_tensor({tb ? N : K, ldb}, rng);
      Tensor C = random_tensor({M, ldc}, rng);
      Tensor C0 = C.clone();
      const float* a = A.data<float>();
      const float* b = B.data<float>();
      cpu::sgemm(ta, tb, M, N, K, 0.5f, a, lda, b, ldb, 2.0f, C.data<float>(), ldc);
      for (int64_t i = 0; i < M; ++i) {
        for (int64_t j = 0; j < ldc; ++j) {
          const double c0 = C0.data<float>()[i * ldc + j];
          if (j >= N) {  // padding is not touched
            EXPECT_EQ(C.data<float>()[i * ldc + j], float(c0));
            continue;
          }
          double s = 0;
          for (int64_t k = 0; k < K; ++k)
            s += double(ta ? a[k * lda + i] : a[i * lda + k]) * double(tb ? b[j * ldb + k] : b[k * ldb + j]);
          EXPECT_NEAR(C.data<float>()[i * ldc + j], 0.5 * s + 2.0 * c0, 1e-5) << ta << tb << " " << i << "," << j;
        }
      }
    }
  }
}

TEST(OpsAGemm, BetaZeroOverwritesNaNAndKZeroScalesC) {
  Tensor A = filled({2, 3}, 1.0f), B = filled({3, 2}, 2.0f), C = filled({2, 2}, kNaN);
  cpu::sgemm(false, false, 2, 2, 3, 1.0f, A.data<float>(), 3, B.data<float>(), 2, 0.0f, C.data<float>(), 2);
  for (int i = 0; i < 4; ++i) EXPECT_EQ(C.data<float>()[i], 6.0f);
  cpu::sgemm(false, false, 2, 2, 0, 1.0f, A.data<float>(), 3, B.data<float>(), 2, 0.5f, C.data<float>(), 2);
  for (int i = 0; i < 4; ++i) EXPECT_EQ(C.data<float>()[i], 3.0f);
}

// ---------------------------------------------------------------- linear

TEST(OpsALinear, ForwardMatchesNaive) {
  Rng rng(2);
  const int64_t T = 6, I = 5, O = 3;
  Tensor x = random_tensor({T, I}, rng), w = random_tensor({O, I}, rng), y = filled({T, O}, kNaN);
  cpu::linear_fwd(x, w, y);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t o = 0; o < O; ++o) {
      double s = 0;
      for (int64_t i = 0; i < I; ++i) s += double(x.data<float>()[t * I + i]) * double(w.data<float>()[o * I + i]);
      EXPECT_NEAR(y.data<float>()[t * O + o], s, 1e-5);
    }
}

TEST(OpsALinear, FiniteDifferenceGradients) {
  Rng rng(3);
  const int64_t T = 5, I = 7, O = 4;
  Tensor x = random_tensor({T, I}, rng), w = random_tensor({O, I}, rng), y = Tensor::empty({T, O});
  Tensor r = random_tensor({T, O}, rng);
  auto loss = [&] {
    cpu::linear_fwd(x, w, y);
    return weighted_sum(y, r);
  };
  Tensor num_dx = fd_grad(x, loss, 1e-2), num_dw = fd_grad(w, loss, 1e-2);
  Tensor dx = filled({T, I}, kNaN), dw = Tensor::zeros({O, I});
  cpu::linear_bwd(r, x, w, &dx, false, dw);
  EXPECT_LT(rel_l2(dx, num_dx), kFdTol);
  EXPECT_LT(rel_l2(dw, num_dw), kFdTol);
}

TEST(OpsALinear, AccumulationContract) {
  Rng rng(4);
  const int64_t T = 4, I = 3, O = 2;
  Tensor x = random_tensor({T, I}, rng), w = random_tensor({O, I}, rng), dy = random_tensor({T, O}, rng);
  Tensor dx_ref = Tensor::empty({T, I}), dw_ref = Tensor::zeros({O, I});
  cpu::linear_bwd(dy, x, w, &dx_ref, false, dw_ref);

  // dw +=: two calls give twice the gradient; dx =: garbage (NaN) in dx is overwritten.
  Tensor dx = filled({T, I}, kNaN), dw = Tensor::zeros({O, I});
  cpu::linear_bwd(dy, x, w, &dx, false, dw);
  cpu::linear_bwd(dy, x, w, &dx, false, dw);
  EXPECT_LT(max_abs_diff(dx, dx_ref), 1e-6);
  Tensor dw2 = dw_ref.clone();
  cpu::scale_(dw2, 2.0f);
  EXPECT_LT(max_abs_diff(dw, dw2), 1e-6);

  // accumulate_dx: dx += dy @ w.
  Tensor dx_acc = filled({T, I}, 1.0f), dw_unused = Tensor::zeros({O, I});
  cpu::linear_bwd(dy, x, w, &dx_acc, true, dw_unused);
  for (int64_t i = 0; i < T * I; ++i) EXPECT_NEAR(dx_acc.data<float>()[i], 1.0f + dx_ref.data<float>()[i], 1e-6);

  // dx may be null: only dw is produced.
  Tensor dw_only = Tensor::zeros({O, I});
  cpu::linear_bwd(dy, x, w, nullptr, false, dw_only);
  EXPECT_LT(max_abs_diff(dw_only, dw_ref), 1e-6);
}

TEST(OpsALinear, ShapeErrorsNameRoleAndShapes) {
  Tensor x = Tensor::zeros({4, 7}), w = Tensor::zeros({3, 6}), y = Tensor::zeros({4, 3});
  std::string msg = error_of([&] { cpu::linear_fwd(x, w, y); });
  EXPECT_NE(msg.find("linear_fwd w_OI"), std::string::npos) << msg;
  EXPECT_NE(msg.find("[3, 6]"), std::string::npos) << msg;
  EXPECT_NE(msg.find("[3, 7]"), std::string::npos) << msg;
  Tensor w_ok = Tensor::zeros({3, 7}), y_bad = Tensor::zeros({4, 2});
  msg = error_of([&] { cpu::linear_fwd(x, w_ok, y_bad); });
  EXPECT_NE(msg.find("linear_fwd y_TO has shape [4, 2], expected [4, 3]"), std::string::npos) << msg;
  Tensor dy = Tensor::zeros({4, 3}), dw = Tensor::zeros({3, 7}), dx_bad = Tensor::zeros({4, 6});
  msg = error_of([&] { cpu::linear_bwd(dy, x, w_ok, &dx_bad, false, dw); });
  EXPECT_NE(msg.find("linear_bwd dx_TI has shape [4, 6], expected [4, 7]"), std::string::npos) << msg;
  Tensor x_i32 = Tensor::zeros({4, 7}, DType::I32);
  msg = error_of([&] { cpu::linear_fwd(x_i32, w_ok, y); });
  EXPECT_NE(msg.find("linear_fwd x_TI has dtype i32, expected f32"), std::string::npos) << msg;
}

// ---------------------------------------------------------------- embedding

TEST(OpsAEmbedding, ForwardGathersRows) {
  Rng rng(5);
  const int64_t V = 6, D = 3;
  Tensor table = random_tensor({V, D}, rng), ids = i64_tensor({5, 0, 5, 2}), out = filled({4, D}, kNaN);
  cpu::embedding_fwd(ids, table, out);
  const int64_t want[4] = {5, 0, 5, 2};
  for (int64_t t = 0; t < 4; ++t)
    for (int64_t d = 0; d < D; ++d) EXPECT_EQ(out.data<float>()[t * D + d], table.data<float>()[want[t] * D + d]);
}

TEST(OpsAEmbedding, FiniteDifferenceAndAccumulation) {
  Rng rng(6);
  const int64_t V = 7, D = 4;
  Tensor table = random_tensor({V, D}, rng), ids = i64_tensor({1, 3, 1, 6, 0, 1}), out = Tensor::empty({6, D});
  Tensor r = random_tensor({6, D}, rng);
  auto loss = [&] {
    cpu::embedding_fwd(ids, table, out);
    return weighted_sum(out, r);
  };
  Tensor num = fd_grad(table, loss, 1e-2);
  Tensor dtable = Tensor::zeros({V, D});
  cpu::embedding_bwd(ids, r, dtable);
  EXPECT_LT(rel_l2(dtable, num), kFdTol);
  // Rows never looked up (2, 4, 5) get exactly zero; a second call doubles everything (+=).
  for (int64_t d = 0; d < D; ++d) EXPECT_EQ(dtable.data<float>()[2 * D + d], 0.0f);
  Tensor once = dtable.clone();
  cpu::embedding_bwd(ids, r, dtable);
  cpu::scale_(once, 2.0f);
  EXPECT_LT(max_abs_diff(dtable, once), 1e-6);
}

TEST(OpsAEmbedding, BadIdsNameTheValue) {
  Tensor table = Tensor::zeros({8, 2}), out = Tensor::zeros({3, 2});
  Tensor ids = i64_tensor({1, 9, 2});
  std::string msg = error_of([&] { cpu::embedding_fwd(ids, table, out); });
  EXPECT_NE(msg.find("token id 9 at position 1 is out of range [0, 8)"), std::string::npos) << msg;
  Tensor neg = i64_tensor({-1, 0, 0});
  msg = error_of([&] { cpu::embedding_fwd(neg, table, out); });
  EXPECT_NE(msg.find("token id -1"), std::string::npos) << msg;
  // The backward checks every id before touching the gradient.
  Tensor dtable = Tensor::zeros({8, 2}), dout = filled({3, 2}, 1.0f);
  msg = error_of([&] { cpu::embedding_bwd(ids, dout, dtable); });
  EXPECT_NE(msg.find("token id 9"), std::string::npos) << msg;
  EXPECT_EQ(cpu::sum_squares(dtable), 0.0);
  Tensor ids32 = Tensor::zeros({3}, DType::I32);
  msg = error_of([&] { cpu::embedding_fwd(ids32, table, out); });
  EXPECT_NE(msg.find("embedding_fwd ids_T has dtype i32, expected i64"), std::string::npos) << msg;
}

// ---------------------------------------------------------------- RMSNorm

TEST(OpsARmsNorm, ForwardByHand) {
  // Row [3, 4]: mean of squares 12.5; with eps 0.5 the rstd is 1/sqrt(13) = 1/3.60555...
  Tensor x = Tensor::empty({2, 2}), w = Tensor::empty({2}), y = filled({2, 2}, kNaN), rstd = filled({2}, kNaN);
  float xv[4] = {3, 4, -1, 0}, wv[2] = {1, 2};
  for (int i = 0; i < 4; ++i) x.data<float>()[i] = xv[i];
  for (int i = 0; i < 2; ++i) w.data<float>()[i] = wv[i];
  cpu::rms_norm_fwd(x, w, 0.5f, y, rstd);
  const double r0 = 1 / std::sqrt(13.0), r1 = 1 / std::sqrt(0.5 + 0.5);
  EXPECT_NEAR(rstd.data<float>()[0], r0, 1e-7);
  EXPECT_NEAR(rstd.data<float>()[1], r1, 1e-7);
  EXPECT_NEAR(y.data<float>()[0], 3 * r0, 1e-6);
  EXPECT_NEAR(y.data<float>()[1], 2 * 4 * r0, 1e-6);
  EXPECT_NEAR(y.data<float>()[2], -1 * r1, 1e-6);
  EXPECT_EQ(y.data<float>()[3], 0.0f);
}

TEST(OpsARmsNorm, FiniteDifferenceAndAccumulation) {
  Rng rng(7);
  const int64_t N = 6, D = 8;
  Tensor x = random_tensor({N, D}, rng), w = random_tensor({D}, rng, 0.5f, 1.5f);
  Tensor y = Tensor::empty({N, D}), rstd = Tensor::empty({N}), r = random_tensor({N, D}, rng);
  auto loss = [&] {
    cpu::rms_norm_fwd(x, w, 1e-6f, y, rstd);
    return weighted_sum(y, r);
  };
  Tensor num_dx = fd_grad(x, loss, 1e-3), num_dw = fd_grad(w, loss, 1e-2);
  loss();  // restore rstd for the unperturbed x
  Tensor dx = filled({N, D}, kNaN), dw = Tensor::zeros({D});
  cpu::rms_norm_bwd(r, x, w, rstd, dx, dw);
  EXPECT_LT(rel_l2(dx, num_dx), kFdTol);
  EXPECT_LT(rel_l2(dw, num_dw), kFdTol);
  // dw +=, dx =
  Tensor dx2 = filled({N, D}, kNaN), dw_twice = dw.clone();
  cpu::rms_norm_bwd(r, x, w, rstd, dx2, dw_twice);
  EXPECT_EQ(max_abs_diff(dx2, dx), 0.0);
  Tensor want = dw.clone();
  cpu::scale_(want, 2.0f);
  EXPECT_LT(max_abs_diff(dw_twice, want), 1e-6);
}

TEST(OpsARmsNorm, ShapeErrors) {
  Tensor x = Tensor::zeros({3, 4}), w = Tensor::zeros({5}), y = Tensor::zeros({3, 4}), rstd = Tensor::zeros({3});
  std::string msg = error_of([&] { cpu::rms_norm_fwd(x, w, 1e-6f, y, rstd); });
  EXPECT_NE(msg.find("rms_norm_fwd w_D has shape [5], expected [4]"), std::string::npos) << msg;
  Tensor w_ok = Tensor::zeros({4}), rstd_bad = Tensor::zeros({4});
  msg = error_of([&] { cpu::rms_norm_fwd(x, w_ok, 1e-6f, y, rstd_bad); });
  EXPECT_NE(msg.find("rms_norm_fwd rstd_N has shape [4], expected [3]"), std::string::npos) << msg;
}

// ---------------------------------------------------------------- RoPE

TEST(OpsARope, KnownVector) {
  // Hd = 4, theta = 10000: inv_freq = [1, 0.01]. Token 0 at position 0 (identity), token 1 at 1.
  Tensor x = Tensor::empty({2, 1, 4});
  const float xv[4] = {1, 2, 3, 4};
  for (int t = 0; t < 2; ++t)
    for (int i = 0; i < 4; ++i) x.data<float>()[t * 4 + i] = xv[i];
  Tensor pos = i32_tensor({0, 1});
  cpu::rope_fwd(x, pos, 10000.0f);
  const float* o = x.data<float>();
  for (int i = 0; i < 4; ++i) EXPECT_EQ(o[i], xv[i]);
  const double c0 = std::cos(1.0), s0 = std::sin(1.0), c1 = std::cos(0.01), s1 = std::sin(0.01);
  EXPECT_NEAR(o[4], 1 * c0 - 3 * s0, 1e-6);
  EXPECT_NEAR(o[5], 2 * c1 - 4 * s1, 1e-6);
  EXPECT_NEAR(o[6], 3 * c0 + 1 * s0, 1e-6);
  EXPECT_NEAR(o[7], 4 * c1 + 2 * s1, 1e-6);
}

TEST(OpsARope, AnglesRoundedLikeTransformers) {
  // At position 3000 with Hd 128 the f32 angle pos * f32(inv_freq) differs from the exact one by
  // more than 1e-5; the op must use the f32 angle (what transformers computes), not the exact one.
  const int64_t Hd = 128;
  const float theta = 1e6f;
  const int32_t p = 3000;
  Tensor x = Tensor::zeros({1, 1, Hd});
  for (int64_t i = 0; i < Hd / 2; ++i) x.data<float>()[i] = 1.0f;  // out[i] = cos(angle_i)
  Tensor pos = i32_tensor({p});
  cpu::rope_fwd(x, pos, theta);
  double worst_f32 = 0, worst_exact = 0;
  for (int64_t i = 0; i < Hd / 2; ++i) {
    const float inv = 1.0f / std::pow(theta, float(2 * i) / float(Hd));
    const float angle32 = float(p) * inv;
    const double angle64 = double(p) * std::pow(double(theta), -2.0 * double(i) / double(Hd));
    worst_f32 = std::max(worst_f32, std::abs(double(x.data<float>()[i]) - std::cos(double(angle32))));
    worst_exact = std::max(worst_exact, std::abs(double(x.data<float>()[i]) - std::cos(angle64)));
  }
  EXPECT_LT(worst_f32, 1e-6);
  EXPECT_GT(worst_exact, 1e-5);  // shows that the choice matters at this position
}

TEST(OpsARope, FiniteDifferenceAndInverse) {
  Rng rng(8);
  const int64_t T = 5, N = 3, Hd = 8;
  Tensor x = random_tensor({T, N, Hd}, rng), r = random_tensor({T, N, Hd}, rng);
  Tensor pos = i32_tensor({0, 1, 2, 7, 100});
  auto loss = [&] {
    Tensor y = x.clone();
    cpu::rope_fwd(y, pos, 10000.0f);
    return weighted_sum(y, r);
  };
  Tensor num = fd_grad(x, loss, 1e-2);
  Tensor dx = r.clone();
  cpu::rope_bwd(dx, pos, 10000.0f);
  EXPECT_LT(rel_l2(dx, num), kFdTol);
  // The rotation is orthogonal: bwd(fwd(x)) == x and the norm is kept.
  Tensor y = x.clone();
  cpu::rope_fwd(y, pos, 10000.0f);
  EXPECT_NEAR(cpu::sum_squares(y), cpu::sum_squares(x), 1e-4);
  EXPECT_GT(max_abs_diff(y, x), 0.1);
  cpu::rope_bwd(y, pos, 10000.0f);
  EXPECT_LT(max_abs_diff(y, x), 1e-6);
}

TEST(OpsARope, ArgumentErrors) {
  Tensor x = Tensor::zeros({2, 1, 5});
  Tensor pos = i32_tensor({0, 1});
  std::string msg = error_of([&] { cpu::rope_fwd(x, pos, 10000.0f); });
  EXPECT_NE(msg.find("head dim Hd (5) must be even"), std::string::npos) << msg;
  Tensor x4 = Tensor::zeros({2, 1, 4}), pos64 = i64_tensor({0, 1});
  msg = error_of([&] { cpu::rope_fwd(x4, pos64, 10000.0f); });
  EXPECT_NE(msg.find("rope_fwd pos_T has dtype i64, expected i32"), std::string::npos) << msg;
  Tensor pos3 = i32_tensor({0, 1, 2});
  msg = error_of([&] { cpu::rope_bwd(x4, pos3, 10000.0f); });
  EXPECT_NE(msg.find("rope_bwd pos_T has shape [3], expected [2]"), std::string::npos) << msg;
}

// ---------------------------------------------------------------- attention

namespace {

struct NaiveAttention {
  std::vector<double> out, lse, dq, dk, dv;
};

// Full-matrix causal GQA attention and its backward in double, written independently of the op:
// the backward uses rowsum(P * dP) where the op uses dO . O.
NaiveAttention naive_attention(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor* dout, int64_t B,
                               int64_t S) {
  const int64_t H = q.size(1), G = k.size(1), Hd = q.size(2), T = B * S;
  const double scale = 1.0 / std::sqrt(double(Hd));
  NaiveAttention r;
  r.out.assign(size_t(T * H * Hd), 0);
  r.lse.assign(size_t(T * H), 0);
  r.dq.assign(size_t(T * H * Hd), 0);
  r.dk.assign(size_t(T * G * Hd), 0);
  r.dv.assign(size_t(T * G * Hd), 0);
  auto Q = [&](int64_t t, int64_t h, int64_t e) { return double(q.data<float>()[(t * H + h) * Hd + e]); };
  auto K = [&](int64_t t, int64_t g, int64_t e) { return double(k.data<float>()[(t * G + g) * Hd + e]); };
  auto V = [&](int64_t t, int64_t g, int64_t e) { return double(v.data<float>()[(t * G + g) * Hd + e]); };
  std::vector<double> P(size_t(S * S)), dP(size_t(S * S));
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t h = 0; h < H; ++h) {
      const int64_t g = h / (H / G), t0 = b * S;
      for (int64_t i = 0; i < S; ++i) {
        double mx = -1e300, sum = 0;
        for (int64_t j = 0; j < S; ++j) {
          double s = 0;
          for (int64_t e = 0; e < Hd; ++e) s += Q(t0 + i, h, e) * K(t0 + j, g, e);
          P[size_t(i * S + j)] = j <= i ? s * scale : -INFINITY;
          mx = std::max(mx, P[size_t(i * S + j)]);
        }
        for (int64_t j = 0; j < S; ++j) sum += std::exp(P[size_t(i * S + j)] - mx);
        for (int64_t j = 0; j < S; ++j) P[size_t(i * S + j)] = std::exp(P[size_t(i * S + j)] - mx) / sum;
        r.lse[size_t((t0 + i) * H + h)] = mx + std::log(sum);
        for (int64_t e = 0; e < Hd; ++e) {
          double o = 0;
          for (int64_t j = 0; j < S; ++j) o += P[size_t(i * S + j)] * V(t0 + j, g, e);
          r.out[size_t(((t0 + i) * H + h) * Hd + e)] = o;
        }
      }
      if (!dout) continue;
      auto dO = [&](int64_t t, int64_t e) { return double(dout->data<float>()[(t * H + h) * Hd + e]); };
      for (int64_t i = 0; i < S; ++i) {
        double rowsum = 0;
        for (int64_t j = 0; j < S; ++j) {
          double s = 0;
          for (int64_t e = 0; e < Hd; ++e) s += dO(t0 + i, e) * V(t0 + j, g, e);
          dP[size_t(i * S + j)] = s;
          rowsum += P[size_t(i * S + j)] * s;
        }
        for (int64_t j = 0; j < S; ++j) {
          const double p = P[size_t(i * S + j)], ds = p * (dP[size_t(i * S + j)] - rowsum) * scale;
          for (int64_t e = 0; e < Hd; ++e) {
            r.dq[size_t(((t0 + i) * H + h) * Hd + e)] += ds * K(t0 + j, g, e);
            r.dk[size_t(((t0 + j) * G + g) * Hd + e)] += ds * Q(t0 + i, h, e);
            r.dv[size_t(((t0 + j) * G + g) * Hd + e)] += p * dO(t0 + i, e);
          }
        }
      }
    }
  }
  return r;
}

double rel_l2_vs(const Tensor& a, const std::vector<double>& b) {
  double num = 0, den = 0;
  for (size_t i = 0; i < b.size(); ++i) {
    const double d = double(a.data<float>()[i]) - b[i];
    num += d * d;
    den += b[i] * b[i];
  }
  return std::sqrt(num / den);
}

}  // namespace

TEST(OpsAAttention, ForwardMatchesNaiveGqa) {
  Rng rng(9);
  const int64_t B = 2, S = 5, H = 4, G = 2, Hd = 8, T = B * S;
  Tensor q = random_tensor({T, H, Hd}, rng, -2, 2), k = random_tensor({T, G, Hd}, rng, -2, 2);
  Tensor v = random_tensor({T, G, Hd}, rng);
  Tensor out = filled({T, H, Hd}, kNaN), lse = filled({T, H}, kNaN);
  cpu::attention_fwd(q, k, v, B, S, out, lse);
  NaiveAttention ref = naive_attention(q, k, v, nullptr, B, S);
  EXPECT_LT(rel_l2_vs(out, ref.out), 1e-6);
  EXPECT_LT(rel_l2_vs(lse, ref.lse), 1e-6);
  // First token of each sequence attends only to itself: out = v of its kv head.
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t e = 0; e < Hd; ++e)
        EXPECT_NEAR(out.data<float>()[((b * S) * H + h) * Hd + e], v.data<float>()[((b * S) * G + h / 2) * Hd + e],
                    1e-6);
}

TEST(OpsAAttention, FiniteDifferenceGradientsGqa) {
  Rng rng(10);
  const int64_t B = 2, S = 4, H = 4, G = 2, Hd = 4, T = B * S;
  Tensor q = random_tensor({T, H, Hd}, rng), k = random_tensor({T, G, Hd}, rng), v = random_tensor({T, G, Hd}, rng);
  Tensor out = Tensor::empty({T, H, Hd}), lse = Tensor::empty({T, H}), r = random_tensor({T, H, Hd}, rng);
  auto loss = [&] {
    cpu::attention_fwd(q, k, v, B, S, out, lse);
    return weighted_sum(out, r);
  };
  Tensor num_dq = fd_grad(q, loss, 1e-2), num_dk = fd_grad(k, loss, 1e-2), num_dv = fd_grad(v, loss, 1e-2);
  loss();
  Tensor dq = filled({T, H, Hd}, kNaN), dk = filled({T, G, Hd}, kNaN), dv = filled({T, G, Hd}, kNaN);
  cpu::attention_bwd(r, q, k, v, out, lse, B, S, dq, dk, dv);
  EXPECT_LT(rel_l2(dq, num_dq), kFdTol);
  EXPECT_LT(rel_l2(dk, num_dk), kFdTol);
  EXPECT_LT(rel_l2(dv, num_dv), kFdTol);
  // dq/dk/dv are = (NaN prefill overwritten): a second call with garbage gives the same result.
  Tensor dq2 = filled({T, H, Hd}, 5.0f), dk2 = filled({T, G, Hd}, 5.0f), dv2 = filled({T, G, Hd}, 5.0f);
  cpu::attention_bwd(r, q, k, v, out, lse, B, S, dq2, dk2, dv2);
  EXPECT_EQ(max_abs_diff(dq2, dq), 0.0);
  EXPECT_EQ(max_abs_diff(dk2, dk), 0.0);
  EXPECT_EQ(max_abs_diff(dv2, dv), 0.0);
}

TEST(OpsAAttention, LongSequenceForwardAndBackwardMatchNaive) {
  // The T=256, H=4, Hd=16 case (one sequence), forward and backward against the double reference.
  Rng rng(11);
  const int64_t B = 1, S = 256, H = 4, G = 2, Hd = 16, T = B * S;
  Tensor q = random_tensor({T, H, Hd}, rng, -2, 2), k = random_tensor({T, G, Hd}, rng, -2, 2);
  Tensor v = random_tensor({T, G, Hd}, rng), dout = random_tensor({T, H, Hd}, rng);
  Tensor out = Tensor::empty({T, H, Hd}), lse = Tensor::empty({T, H});
  cpu::attention_fwd(q, k, v, B, S, out, lse);
  Tensor dq = Tensor::empty({T, H, Hd}), dk = Tensor::empty({T, G, Hd}), dv = Tensor::empty({T, G, Hd});
  cpu::attention_bwd(dout, q, k, v, out, lse, B, S, dq, dk, dv);
  NaiveAttention ref = naive_attention(q, k, v, &dout, B, S);
  EXPECT_LT(rel_l2_vs(out, ref.out), 1e-5);
  EXPECT_LT(rel_l2_vs(lse, ref.lse), 1e-6);
  EXPECT_LT(rel_l2_vs(dq, ref.dq), 1e-5);
  EXPECT_LT(rel_l2_vs(dk, ref.dk), 1e-5);
  EXPECT_LT(rel_l2_vs(dv, ref.dv), 1e-5);
}

TEST(OpsAAttention, ArgumentErrors) {
  Tensor q = Tensor::zeros({6, 3, 4}), k = Tensor::zeros({6, 2, 4}), v = Tensor::zeros({6, 2, 4});
  Tensor out = Tensor::zeros({6, 3, 4}), lse = Tensor::zeros({6, 3});
  std::string msg = error_of([&] { cpu::attention_fwd(q, k, v, 2, 3, out, lse); });
  EXPECT_NE(msg.find("query heads H (3) must be a multiple of key/value heads G (2)"), std::string::npos) << msg;
  Tensor q4 = Tensor::zeros({6, 4, 4}), out4 = Tensor::zeros({6, 4, 4}), lse4 = Tensor::zeros({6, 4});
  msg = error_of([&] { cpu::attention_fwd(q4, k, v, 2, 2, out4, lse4); });
  EXPECT_NE(msg.find("B (2) * S (2) must equal the number of tokens T (6)"), std::string::npos) << msg;
  Tensor v_bad = Tensor::zeros({6, 2, 5});
  msg = error_of([&] { cpu::attention_fwd(q4, k, v_bad, 2, 3, out4, lse4); });
  EXPECT_NE(msg.find("attention_fwd v_TGHd has shape [6, 2, 5], expected [6, 2, 4]"), std::string::npos) << msg;
}

// ---------------------------------------------------------------- cross-entropy

TEST(OpsACrossEntropy, ValuesWithIgnoredRows) {
  Rng rng(12);
  const int64_t T = 5, V = 7;
  Tensor logits = random_tensor({T, V}, rng, -3, 3), labels = i64_tensor({2, -100, 6, 0, -100});
  Tensor lse = filled({T}, kNaN);
  int64_t n_valid = -1;
  const double loss = cpu::cross_entropy_fwd(logits, labels, lse, &n_valid);
  EXPECT_EQ(n_valid, 3);
  double want = 0;
  for (int64_t t = 0; t < T; ++t) {
    double s = 0;
    for (int64_t j = 0; j < V; ++j) s += std::exp(double(logits.data<float>()[t * V + j]));
    const double l = std::log(s);
    EXPECT_NEAR(lse.data<float>()[t], l, 1e-6);
    const int64_t y = labels.data<int64_t>()[t];
    if (y != -100) want += l - double(logits.data<float>()[t * V + y]);
  }
  EXPECT_NEAR(loss, want, 1e-6);
}

TEST(OpsACrossEntropy, FiniteDifferenceGradient) {
  Rng rng(13);
  const int64_t T = 6, V = 5;
  Tensor logits = random_tensor({T, V}, rng, -2, 2), labels = i64_tensor({4, -100, 0, 3, -100, 1});
  Tensor lse = Tensor::empty({T});
  const float scale = 1.0f / 4.0f;  // mean over the 4 valid rows
  auto loss = [&] { return double(scale) * cpu::cross_entropy_fwd(logits, labels, lse, nullptr); };
  Tensor num = fd_grad(logits, loss, 1e-2);
  loss();
  Tensor dlogits = filled({T, V}, kNaN);
  cpu::cross_entropy_bwd(logits, labels, lse, scale, dlogits);
  EXPECT_LT(rel_l2(dlogits, num), kFdTol);
  for (int64_t t : {1, 4})
    for (int64_t j = 0; j < V; ++j) EXPECT_EQ(dlogits.data<float>()[t * V + j], 0.0f);
  // Each valid row sums to zero (softmax minus one-hot).
  for (int64_t t : {0, 2, 3, 5}) {
    double s = 0;
    for (int64_t j = 0; j < V; ++j) s += dlogits.data<float>()[t * V + j];
    EXPECT_NEAR(s, 0.0, 1e-7);
  }
}

TEST(OpsACrossEntropy, AllIgnored) {
  Rng rng(14);
  Tensor logits = random_tensor({3, 4}, rng), labels = i64_tensor({-100, -100, -100}), lse = Tensor::empty({3});
  int64_t n_valid = -1;
  EXPECT_EQ(cpu::cross_entropy_fwd(logits, labels, lse, &n_valid), 0.0);
  EXPECT_EQ(n_valid, 0);
  Tensor dlogits = filled({3, 4}, kNaN);
  cpu::cross_entropy_bwd(logits, labels, lse, 1.0f, dlogits);
  EXPECT_EQ(cpu::sum_squares(dlogits), 0.0);
}

TEST(OpsACrossEntropy, BadLabelsNameRowAndValue) {
  Tensor logits = Tensor::zeros({3, 5}), lse = Tensor::zeros({3});
  Tensor labels = i64_tensor({0, 5, -100});
  std::string msg = error_of([&] { cpu::cross_entropy_fwd(logits, labels, lse, nullptr); });
  EXPECT_NE(msg.find("label 5 at row 1 is out of range"), std::string::npos) << msg;
  EXPECT_NE(msg.find("[0, 5) or -100"), std::string::npos) << msg;
  Tensor neg = i64_tensor({-1, 0, 0});
  msg = error_of([&] { cpu::cross_entropy_fwd(logits, neg, lse, nullptr); });
  EXPECT_NE(msg.find("label -1 at row 0"), std::string::npos) << msg;
  Tensor labels32 = Tensor::zeros({3}, DType::I32);
  msg = error_of([&] { cpu::cross_entropy_fwd(logits, labels32, lse, nullptr); });
  EXPECT_NE(msg.find("cross_entropy_fwd labels_T has dtype i32, expected i64"), std::string::npos) << msg;
}

// The shapes are checked once, by the dispatch (ops/op_checks.h): through ops::, naming the op, the
// tensor and both shapes.
TEST(OpsACrossEntropy, DispatchChecksTheShapesOfCrossEntropyAndTheFusedLmHead) {
  Rng rng(15);
  const int64_t T = 6, D = 4, V = 7;
  const Tensor logits = random_tensor({T, V}, rng), labels = i64_tensor({0, 1, 2, 3, 4, -100});
  Tensor lse5 = Tensor::empty({5}), lse = Tensor::empty({T}), dlogits_bad = Tensor::empty({T, V + 1});
  std::string msg = error_of([&] { ops::cross_entropy_fwd(logits, labels, lse5, nullptr); });
  EXPECT_NE(msg.find("cross_entropy_fwd lse_T has shape [5], expected [6]"), std::string::npos) << msg;
  msg = error_of([&] { ops::cross_entropy_bwd(logits, labels, lse, 1.0f, dlogits_bad); });
  EXPECT_NE(msg.find("cross_entropy_bwd dlogits_TV has shape [6, 8], expected [6, 7]"), std::string::npos) << msg;
  const Tensor logits_3d = Tensor::zeros({T, V, 1});
  msg = error_of([&] { ops::cross_entropy_fwd(logits_3d, labels, lse, nullptr); });
  EXPECT_NE(msg.find("cross_entropy_fwd logits_TV must be 2-D [T, V], got shape [6, 7, 1]"), std::string::npos) << msg;
  const Tensor no_vocab = Tensor::empty({T, 0}), all_ignored = i64_tensor({-100, -100, -100, -100, -100, -100});
  msg = error_of([&] { ops::cross_entropy_fwd(no_vocab, all_ignored, lse, nullptr); });
  EXPECT_NE(msg.find("cross_entropy_fwd: vocabulary size V is 0"), std::string::npos) << msg;

  const Tensor hn = random_tensor({T, D}, rng), w = random_tensor({V, D}, rng);
  Tensor loss = Tensor::zeros({1}), loss2 = Tensor::zeros({2}), dhn = Tensor::empty({T, D}), dw = Tensor::zeros({V, D}),
         dw_bad = Tensor::zeros({V + 1, D});
  msg = error_of([&] { ops::lm_head_cross_entropy(hn, w, labels, 1.0f, 0, loss, dhn, dw_bad); });
  EXPECT_NE(msg.find("lm_head_cross_entropy dw_VD has shape [8, 4], expected [7, 4]"), std::string::npos) << msg;
  msg = error_of([&] { ops::lm_head_cross_entropy(hn, w, labels, 1.0f, 0, loss2, dhn, dw); });
  EXPECT_NE(msg.find("lm_head_cross_entropy loss_sum has shape [2], expected [1]"), std::string::npos) << msg;
  const Tensor w_bad = random_tensor({V, D + 1}, rng);
  msg = error_of([&] { ops::lm_head_cross_entropy(hn, w_bad, labels, 1.0f, 0, loss, dhn, dw); });
  EXPECT_NE(msg.find("lm_head_cross_entropy w_VD has shape [7, 5], expected [7, 4]"), std::string::npos) << msg;
}

// ---------------------------------------------------------------- AdamW and utilities

TEST(OpsAAdamW, ThreeStepsMatchScalarDerivation) {
  Rng rng(15);
  const int64_t n = 16;
  ops::AdamWHyper h;
  h.lr = 1e-2f;
  h.beta1 = 0.9f;
  h.beta2 = 0.95f;
  h.eps = 1e-8f;
  h.weight_decay = 0.1f;
  const float grad_scale = 0.5f;
  Tensor p = random_tensor({n}, rng), m = Tensor::zeros({n}), v = Tensor::zeros({n});
  std::vector<double> P(n), M(n, 0), Vv(n, 0);
  for (int64_t i = 0; i < n; ++i) P[size_t(i)] = p.data<float>()[i];
  for (int64_t step = 1; step <= 3; ++step) {
    Tensor g = random_tensor({n}, rng, -2, 2);
    h.step = step;
    cpu::adamw_step(p, g, m, v, h, grad_scale, nullptr);
    const double b1 = h.beta1, b2 = h.beta2, lr = h.lr;
    for (int64_t i = 0; i < n; ++i) {
      const size_t u = size_t(i);
      const double gi = double(grad_scale) * g.data<float>()[i];
      P[u] *= 1 - lr * double(h.weight_decay);
      M[u] = b1 * M[u] + (1 - b1) * gi;
      Vv[u] = b2 * Vv[u] + (1 - b2) * gi * gi;
      const double bc1 = 1 - std::pow(b1, double(step)), bc2 = 1 - std::pow(b2, double(step));
      P[u] -= lr / bc1 * M[u] / (std::sqrt(Vv[u]) / std::sqrt(bc2) + double(h.eps));
    }
    for (int64_t i = 0; i < n; ++i) {
      const size_t u = size_t(i);
      EXPECT_NEAR(p.data<float>()[i], P[u], 1e-6 * (1 + std::abs(P[u]))) << "step " << step << " i " << i;
      EXPECT_NEAR(m.data<float>()[i], M[u], 1e-6 * (1 + std::abs(M[u])));
      EXPECT_NEAR(v.data<float>()[i], Vv[u], 1e-6 * (1 + std::abs(Vv[u])));
    }
  }
}

TEST(OpsAAdamW, FirstStepMovesByLearningRate) {
  // At step 1, m_hat/sqrt(v_hat) = sign(g), so with no decay each weight moves by exactly lr.
  Tensor p = filled({3}, 1.0f), g = Tensor::empty({3}), m = Tensor::zeros({3}), v = Tensor::zeros({3});
  g.data<float>()[0] = 3.0f;
  g.data<float>()[1] = -0.001f;
  g.data<float>()[2] = 0.0f;
  ops::AdamWHyper h;
  h.lr = 0.1f;
  h.weight_decay = 0.0f;
  h.eps = 0.0f;
  h.step = 1;
  cpu::adamw_step(p, g, m, v, h, 1.0f, nullptr);
  EXPECT_NEAR(p.data<float>()[0], 0.9f, 1e-6);
  EXPECT_NEAR(p.data<float>()[1], 1.1f, 1e-6);
  EXPECT_TRUE(std::isnan(p.data<float>()[2]));  // 0/0 with eps 0, as torch gives
}

TEST(OpsAAdamW, ArgumentErrors) {
  // Shapes and hyper-parameters are checked by the dispatch (ops/op_checks.h), the dtypes by the backend.
  Tensor p = Tensor::zeros({4}), g = Tensor::zeros({4}), m = Tensor::zeros({4}), v = Tensor::zeros({5});
  ops::AdamWHyper h;
  std::string msg = error_of([&] { ops::adamw_step(p, g, m, v, h, 1.0f, nullptr); });
  EXPECT_NE(msg.find("adamw_step v has shape [5], expected [4]"), std::string::npos) << msg;
  Tensor v_ok = Tensor::zeros({4});
  Tensor p_compute = Tensor::zeros({3}, DType::BF16);
  msg = error_of([&] { ops::adamw_step(p, g, m, v_ok, h, 1.0f, &p_compute); });
  EXPECT_NE(msg.find("adamw_step p_compute has shape [3], expected [4]"), std::string::npos) << msg;
  Tensor g_bf16 = Tensor::zeros({4}, DType::BF16);
  msg = error_of([&] { cpu::adamw_step(p, g_bf16, m, v_ok, h, 1.0f, nullptr); });
  EXPECT_NE(msg.find("adamw_step g has dtype bf16, expected f32"), std::string::npos) << msg;
  h.step = 0;
  msg = error_of([&] { ops::adamw_step(p, g, m, v_ok, h, 1.0f, nullptr); });
  EXPECT_NE(msg.find("step (0) must be >= 1"), std::string::npos) << msg;
  h.step = 1;
  h.beta2 = 1.0f;
  msg = error_of([&] { ops::adamw_step(p, g, m, v_ok, h, 1.0f, nullptr); });
  EXPECT_NE(msg.find("beta2 (1) must be in [0, 1)"), std::string::npos) << msg;
}

TEST(OpsAGradUtils, SumSquaresAccumulatesInDouble) {
  // 1e14 + 1000: an f32 accumulator would return 1e14 (its ulp there is ~8e6); fp64 keeps every unit.
  Tensor x = filled({1001}, 1.0f);
  x.data<float>()[0] = 1e7f;
  EXPECT_EQ(cpu::sum_squares(x), 1e14 + 1000.0);
  EXPECT_EQ(cpu::sum_squares(Tensor::zeros({0})), 0.0);
}

TEST(OpsAGradUtils, ScaleAddAllFinite) {
  Tensor y = filled({4}, 2.0f), x = Tensor::empty({4});
  for (int i = 0; i < 4; ++i) x.data<float>()[i] = float(i);
  cpu::scale_(y, 1.5f);
  cpu::add_(y, x, -2.0f);
  for (int i = 0; i < 4; ++i) EXPECT_EQ(y.data<float>()[i], 3.0f - 2.0f * float(i));
  EXPECT_TRUE(cpu::all_finite(y));
  for (float bad : {kNaN, INFINITY, -INFINITY}) {
    Tensor z = y.clone();
    z.data<float>()[3] = bad;
    EXPECT_FALSE(cpu::all_finite(z)) << bad;
  }
  Tensor x5 = Tensor::zeros({5});
  std::string msg = error_of([&] { cpu::add_(y, x5, 1.0f); });
  EXPECT_NE(msg.find("add_ x has shape [5], expected [4]"), std::string::npos) << msg;
}
