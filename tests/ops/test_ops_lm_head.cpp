// Tests of the CPU LM-head ops for per-token objectives (ops.h): lm_head_logprobs against log-softmax of
// the full logits in double, lm_head_objective_bwd against lm_head_cross_entropy (g = -scale, no h) and
// against finite differences of L = sum_t g_t logp_t + h_t H_t, the accumulate_dw contract, and the
// argument errors (labels here, shapes in the dispatch's op_checks). The ops run through the dispatch
// (ops::), so its shape checks are part of what is tested.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "backend/cpu/cpu_ops.h"
#include "core/rng.h"
#include "fd_check.h"
#include "ops/ops.h"
#include "test_util.h"

using namespace mt;
using mt::testing::fd_grad;
using mt::testing::max_abs_diff;
using mt::testing::random_tensor;
using mt::testing::rel_l2;
using mt::testutil::error_of;

namespace {

constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

Tensor filled(const Shape& s, float v) {
  Tensor t = Tensor::empty(s);
  t.fill_(v);
  return t;
}

Tensor randn(const Shape& s, Rng& rng, float std = 1.0f) {
  Tensor t = Tensor::empty(s);
  rng.fill_normal(t, 0.0f, std);
  return t;
}

// Labels in [0, V), -100 on the rows where ignore(t).
template <class F>
Tensor make_labels(int64_t T, int64_t V, Rng& rng, F ignore) {
  Tensor t = Tensor::empty({T}, DType::I64);
  for (int64_t i = 0; i < T; ++i) t.data<int64_t>()[i] = ignore(i) ? -100 : rng.randint(0, V);
  return t;
}

Tensor plus(const Tensor& a, const Tensor& b) {
  Tensor c = a.clone();
  for (int64_t i = 0; i < c.numel(); ++i) c.data<float>()[i] += b.data<float>()[i];
  return c;
}

// log p[label] and the entropy of each row of the full logits, straight from the definitions in double
// (log p_v = x_v - lse; H = -sum_v p_v log p_v); 0 on ignored rows.
struct Direct {
  std::vector<double> logp, entropy;
};
Direct direct(const Tensor& hn, const Tensor& w, const Tensor& labels) {
  const int64_t T = hn.size(0), V = w.size(0);
  Tensor logits = Tensor::empty({T, V});
  cpu::linear_fwd(hn, w, logits);
  Direct d{std::vector<double>(T, 0.0), std::vector<double>(T, 0.0)};
  for (int64_t t = 0; t < T; ++t) {
    const int64_t y = labels.data<int64_t>()[t];
    if (y == -100) continue;
    const float* x = logits.data<float>() + t * V;
    double s = 0;
    for (int64_t v = 0; v < V; ++v) s += std::exp(double(x[v]));
    const double lse = std::log(s);
    d.logp[t] = double(x[y]) - lse;
    for (int64_t v = 0; v < V; ++v) d.entropy[t] -= std::exp(double(x[v]) - lse) * (double(x[v]) - lse);
  }
  return d;
}

}  // namespace

TEST(OpsLmHead, LogprobsAndEntropiesMatchTheFullLogits) {
  Rng rng(21);
  const int64_t T = 23, D = 8, V = 37;
  const Tensor hn = randn({T, D}, rng), w = randn({V, D}, rng, 0.5f);
  const Tensor labels = make_labels(T, V, rng, [](int64_t t) { return t % 4 == 1; });
  const Direct want = direct(hn, w, labels);
  for (int64_t chunk : {5, 1, 0}) {  // 4 full chunks and a partial one; one row per chunk; the default
    SCOPED_TRACE(::testing::Message() << "chunk_rows " << chunk);
    Tensor logp = filled({T}, kNaN), entropy = filled({T}, kNaN);
    ops::lm_head_logprobs(hn, w, labels, chunk, logp, &entropy);
    for (int64_t t = 0; t < T; ++t) {
      // f32 outputs of values of size log V: a few 1e-7 relative.
      EXPECT_NEAR(logp.data<float>()[t], want.logp[t], 1e-5) << t;
      EXPECT_NEAR(entropy.data<float>()[t], want.entropy[t], 1e-5) << t;
      if (t % 4 == 1) {
        EXPECT_EQ(logp.data<float>()[t], 0.0f) << t;
        EXPECT_EQ(entropy.data<float>()[t], 0.0f) << t;
      }
    }
    Tensor logp_only = filled({T}, kNaN);
    ops::lm_head_logprobs(hn, w, labels, chunk, logp_only, nullptr);
    EXPECT_EQ(max_abs_diff(logp_only, logp), 0.0);
  }
}

TEST(OpsLmHead, UniformLogitsGiveLogVEntropy) {
  const int64_t T = 3, D = 4, V = 10;
  Rng rng(20);
  const Tensor hn = filled({T, D}, 1.0f), w = Tensor::zeros({V, D});  // every logit 0
  const Tensor labels = make_labels(T, V, rng, [](int64_t) { return false; });
  Tensor logp = filled({T}, kNaN), entropy = filled({T}, kNaN);
  ops::lm_head_logprobs(hn, w, labels, 2, logp, &entropy);
  for (int64_t t = 0; t < T; ++t) {
    EXPECT_NEAR(logp.data<float>()[t], -std::log(10.0), 1e-6);
    EXPECT_NEAR(entropy.data<float>()[t], std::log(10.0), 1e-6);
  }
}

// With g = -scale and no entropy term, the objective is scale * cross-entropy: the same dhn and dw.
TEST(OpsLmHead, ObjectiveWithMinusScaleIsTheCrossEntropyGradient) {
  Rng rng(22);
  const int64_t T = 29, D = 12, V = 41;
  const Tensor hn = randn({T, D}, rng), w = randn({V, D}, rng, 0.3f);
  const Tensor labels = make_labels(T, V, rng, [](int64_t t) { return t % 5 == 2; });
  const float scale = 1.0f / 23.0f;
  const Tensor dw0 = randn({V, D}, rng, 0.01f);
  Tensor loss = Tensor::zeros({1}), dhn_ce = filled({T, D}, kNaN), dw_ce = dw0.clone();
  ops::lm_head_cross_entropy(hn, w, labels, scale, 7, loss, dhn_ce, dw_ce);
  const Tensor g = filled({T}, -scale);
  Tensor dhn = filled({T, D}, kNaN), dw = dw0.clone();
  ops::lm_head_objective_bwd(hn, w, labels, g, nullptr, 7, dhn, dw);
  // dlogits differ only by the cross-entropy's lse being rounded to f32 (about 1e-7 relative).
  EXPECT_LT(rel_l2(dhn, dhn_ce), 1e-5);
  EXPECT_LT(rel_l2(dw, dw_ce), 1e-5);
  // Ignored rows get no gradient, whatever their g says.
  Tensor g_nan = g.clone();
  for (int64_t t = 2; t < T; t += 5) g_nan.data<float>()[t] = kNaN;
  Tensor dhn2 = filled({T, D}, kNaN), dw2 = dw0.clone();
  ops::lm_head_objective_bwd(hn, w, labels, g_nan, nullptr, 7, dhn2, dw2);
  EXPECT_EQ(max_abs_diff(dhn2, dhn), 0.0);
  EXPECT_EQ(max_abs_diff(dw2, dw), 0.0);
}

// L(hn, w) = sum_t g_t logp_t + h_t H_t, computed with lm_head_logprobs; its gradient is what
// lm_head_objective_bwd gives with dlogp = g and dentropy = h (and, without h, of sum_t g_t logp_t).
TEST(OpsLmHead, ObjectiveGradientMatchesFiniteDifferences) {
  Rng rng(23);
  const int64_t T = 6, D = 5, V = 7;
  Tensor hn = random_tensor({T, D}, rng), w = random_tensor({V, D}, rng);
  const Tensor labels = make_labels(T, V, rng, [](int64_t t) { return t == 3; });
  const Tensor g = random_tensor({T}, rng), h = random_tensor({T}, rng);
  for (bool with_h : {true, false}) {
    SCOPED_TRACE(with_h ? "g and h" : "g only");
    auto loss = [&] {
      Tensor logp = Tensor::empty({T}), entropy = Tensor::empty({T});
      ops::lm_head_logprobs(hn, w, labels, 4, logp, &entropy);
      double l = 0;
      for (int64_t t = 0; t < T; ++t)
        l += double(g.data<float>()[t]) * logp.data<float>()[t] +
             (with_h ? double(h.data<float>()[t]) * entropy.data<float>()[t] : 0.0);
      return l;
    };
    const Tensor num_hn = fd_grad(hn, loss, 1e-2), num_w = fd_grad(w, loss, 1e-2);
    Tensor dhn = filled({T, D}, kNaN), dw = filled({V, D}, kNaN);
    ops::lm_head_objective_bwd(hn, w, labels, g, with_h ? &h : nullptr, 4, dhn, dw, false);  // chunks 4, 2
    EXPECT_LT(rel_l2(dhn, num_hn), 2e-3);
    EXPECT_LT(rel_l2(dw, num_w), 2e-3);
    for (int64_t d = 0; d < D; ++d) EXPECT_EQ(dhn.data<float>()[3 * D + d], 0.0f);  // the ignored row
  }
}

TEST(OpsLmHead, ObjectiveAccumulatesOrWritesDw) {
  Rng rng(24);
  const int64_t T = 11, D = 6, V = 9;
  const Tensor hn = randn({T, D}, rng), w = randn({V, D}, rng);
  const Tensor labels = make_labels(T, V, rng, [](int64_t t) { return t == 0; });
  const Tensor g = randn({T}, rng), h = randn({T}, rng), dw0 = randn({V, D}, rng);
  Tensor dhn_set = filled({T, D}, kNaN), dw_set = filled({V, D}, kNaN);
  ops::lm_head_objective_bwd(hn, w, labels, g, &h, 4, dhn_set, dw_set, false);  // chunks 4, 4, 3
  EXPECT_TRUE(ops::all_finite(dw_set));
  Tensor dhn_acc = filled({T, D}, kNaN), dw_acc = dw0.clone();
  ops::lm_head_objective_bwd(hn, w, labels, g, &h, 4, dhn_acc, dw_acc, true);
  EXPECT_EQ(max_abs_diff(dhn_acc, dhn_set), 0.0);  // dhn is = either way
  EXPECT_LT(max_abs_diff(dw_acc, plus(dw0, dw_set)), 1e-5);
  // No rows: = gives zeros, += leaves dw as it was.
  const Tensor none = Tensor::empty({0, D}), no_labels = Tensor::empty({0}, DType::I64), no_g = Tensor::empty({0});
  Tensor no_dhn = Tensor::empty({0, D}), dw_zero = filled({V, D}, kNaN), dw_kept = dw0.clone();
  ops::lm_head_objective_bwd(none, w, no_labels, no_g, nullptr, 0, no_dhn, dw_zero, false);
  EXPECT_EQ(max_abs_diff(dw_zero, Tensor::zeros({V, D})), 0.0);
  ops::lm_head_objective_bwd(none, w, no_labels, no_g, nullptr, 0, no_dhn, dw_kept, true);
  EXPECT_EQ(max_abs_diff(dw_kept, dw0), 0.0);
}

TEST(OpsLmHead, OutOfRangeLabelNamesRowAndValue) {
  Rng rng(25);
  const int64_t T = 6, D = 4, V = 7;
  const Tensor hn = randn({T, D}, rng), w = randn({V, D}, rng);
  Tensor labels = make_labels(T, V, rng, [](int64_t t) { return t == 1; });
  labels.data<int64_t>()[3] = V;
  Tensor logp = filled({T}, kNaN), entropy = filled({T}, kNaN);
  std::string msg = error_of([&] { ops::lm_head_logprobs(hn, w, labels, 0, logp, &entropy); });
  EXPECT_NE(msg.find("lm_head_logprobs: label 7 at row 3 is out of range: labels must be in [0, 7) or -100"),
            std::string::npos)
      << msg;
  EXPECT_TRUE(std::isnan(logp.data<float>()[0]));  // checked before anything is written
  labels.data<int64_t>()[3] = 0;
  labels.data<int64_t>()[5] = -2;
  const Tensor g = randn({T}, rng);
  Tensor dhn = filled({T, D}, kNaN), dw = Tensor::zeros({V, D});
  msg = error_of([&] { ops::lm_head_objective_bwd(hn, w, labels, g, nullptr, 0, dhn, dw); });
  EXPECT_NE(msg.find("lm_head_objective_bwd: label -2 at row 5 is out of range"), std::string::npos) << msg;
}

// The dispatch checks the ops' shapes (op_checks.h), naming the op, the tensor and both shapes.
TEST(OpsLmHead, ShapeErrorsNameTheTensorAndBothShapes) {
  Rng rng(26);
  const int64_t T = 6, D = 4, V = 7;
  const Tensor hn = randn({T, D}, rng), w = randn({V, D}, rng);
  const Tensor labels = make_labels(T, V, rng, [](int64_t) { return false; });
  Tensor logp = Tensor::empty({T}), entropy5 = Tensor::empty({5});
  std::string msg = error_of([&] { ops::lm_head_logprobs(hn, w, labels, 0, logp, &entropy5); });
  EXPECT_NE(msg.find("lm_head_logprobs entropy_T has shape [5], expected [6]"), std::string::npos) << msg;
  const Tensor w_bad = randn({V, D + 1}, rng);
  msg = error_of([&] { ops::lm_head_logprobs(hn, w_bad, labels, 0, logp, nullptr); });
  EXPECT_NE(msg.find("lm_head_logprobs w_VD has shape [7, 5], expected [7, 4]"), std::string::npos) << msg;

  const Tensor g = Tensor::zeros({T}), h5 = Tensor::zeros({5});
  Tensor dhn = Tensor::empty({T, D}), dw = Tensor::zeros({V, D}), dw_bad = Tensor::zeros({V + 1, D});
  msg = error_of([&] { ops::lm_head_objective_bwd(hn, w, labels, g, &h5, 0, dhn, dw); });
  EXPECT_NE(msg.find("lm_head_objective_bwd dentropy_T has shape [5], expected [6]"), std::string::npos) << msg;
  msg = error_of([&] { ops::lm_head_objective_bwd(hn, w, labels, g, nullptr, 0, dhn, dw_bad); });
  EXPECT_NE(msg.find("lm_head_objective_bwd dw_VD has shape [8, 4], expected [7, 4]"), std::string::npos) << msg;
  const Tensor no_vocab = Tensor::empty({0, D});
  msg = error_of([&] { ops::lm_head_logprobs(hn, no_vocab, labels, 0, logp, nullptr); });
  EXPECT_NE(msg.find("lm_head_logprobs: vocabulary size V is 0"), std::string::npos) << msg;
}
