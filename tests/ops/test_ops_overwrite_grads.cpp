// The `accumulate_dw` contract of every op that writes parameter gradients (ops.h): with false the
// gradient is written (=), and must equal exactly what += gives on a zeroed gradient, whatever the
// buffer held before (here NaN, so an element left unwritten or read fails). Covers the edge cases
// where no product writes an element: embedding rows of absent ids, experts without rows, empty
// batches.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <functional>
#include <string>

#include "core/rng.h"
#include "ops/ops.h"
#include "test_util.h"

using namespace mt;
using testutil::randn;

namespace {

Tensor nans(const Shape& s) {
  Tensor t = Tensor::empty(s);
  t.fill_(std::nanf(""));
  return t;
}

// Runs op(dw, accumulate_dw) on a NaN-filled and on a zeroed gradient; the two must be bit-equal.
void expect_set_equals_add_on_zero(const Shape& s, const std::function<void(Tensor&, bool)>& op,
                                   const std::string& what) {
  Tensor set = nans(s), add = Tensor::zeros(s);
  op(set, false);
  op(add, true);
  EXPECT_EQ(std::memcmp(set.raw(), add.raw(), set.nbytes()), 0) << what;
  EXPECT_TRUE(ops::all_finite(set)) << what;
}

TEST(OverwriteGrads, LinearRmsNormEmbeddingAndLmHead) {
  Rng rng(1);
  for (int64_t T : {0, 7}) {
    SCOPED_TRACE(::testing::Message() << "T " << T);
    const int64_t I = 6, O = 5, V = 9;
    const Tensor x = randn({T, I}, rng), w = randn({O, I}, rng), dy = randn({T, O}, rng);
    expect_set_equals_add_on_zero(
        {O, I},
        [&](Tensor& dw, bool acc) {
          Tensor dx = Tensor::empty({T, I});
          ops::linear_bwd(dy, x, w, &dx, false, dw, acc);
        },
        "linear_bwd");

    const Tensor wn = randn({I}, rng), dyn = randn({T, I}, rng);
    Tensor y = Tensor::empty({T, I}), rstd = Tensor::empty({T});
    ops::rms_norm_fwd(x, wn, 1e-6f, y, rstd);
    expect_set_equals_add_on_zero(
        {I},
        [&](Tensor& dw, bool acc) {
          Tensor dx = Tensor::empty({T, I});
          ops::rms_norm_bwd(dyn, x, wn, rstd, dx, dw, acc);
        },
        "rms_norm_bwd");

    Tensor ids = Tensor::empty({T}, DType::I64);
    for (int64_t t = 0; t < T; ++t) ids.data<int64_t>()[t] = rng.randint(0, V / 2);  // rows >= V/2 never hit
    const Tensor dout = randn({T, I}, rng);
    expect_set_equals_add_on_zero(
        {V, I}, [&](Tensor& dt, bool acc) { ops::embedding_bwd(ids, dout, dt, acc); }, "embedding_bwd");

    Tensor labels = Tensor::empty({T}, DType::I64);
    for (int64_t t = 0; t < T; ++t) labels.data<int64_t>()[t] = t == 2 ? -100 : rng.randint(0, V);
    const Tensor wv = randn({V, I}, rng);
    expect_set_equals_add_on_zero(
        {V, I},
        [&](Tensor& dw, bool acc) {
          Tensor loss = Tensor::zeros({1}), dhn = Tensor::empty({T, I});
          ops::lm_head_cross_entropy(x, wv, labels, 0.25f, 3, loss, dhn, dw, acc);  // chunks 3, 3, 1
        },
        "lm_head_cross_entropy");
    const Tensor g = randn({T}, rng), h = randn({T}, rng);
    expect_set_equals_add_on_zero(
        {V, I},
        [&](Tensor& dw, bool acc) {
          Tensor dhn = Tensor::empty({T, I});
          ops::lm_head_objective_bwd(x, wv, labels, g, &h, 3, dhn, dw, acc);  // chunks 3, 3, 1
        },
        "lm_head_objective_bwd");
  }
}

TEST(OverwriteGrads, ExpertsIncludingExpertsWithoutRows) {
  Rng rng(2);
  const int64_t E = 4, K = 2, D = 6, F = 3, T = 5, R = T * K;
  // Experts 0 and 2 only: 1 and 3 get no rows.
  Tensor idx = Tensor::empty({T, K}, DType::I32), wts = Tensor::empty({T, K});
  for (int64_t t = 0; t < T; ++t) {
    idx.data<int32_t>()[t * K] = 0;
    idx.data<int32_t>()[t * K + 1] = 2;
  }
  rng.fill_uniform(wts, 0.1f, 1.0f);
  const Tensor wgu = randn({E, 2 * F, D}, rng), wd = randn({E, D, F}, rng), x = randn({T, D}, rng),
               dy = randn({T, D}, rng);
  Tensor off = Tensor::empty({E + 1}, DType::I64), aor = Tensor::empty({R}, DType::I32),
         roa = Tensor::empty({T, K}, DType::I32);
  ops::make_dispatch_plan(idx, E, off, aor, roa);
  Tensor xp = Tensor::empty({R, D}), gu = Tensor::empty({R, 2 * F}), h = Tensor::empty({R, F}),
         yp = Tensor::empty({R, D});
  ops::permute_fwd(x, aor, K, xp);
  ops::experts_fwd(xp, off, wgu, wd, gu, h, yp);
  const Tensor dyp = randn({R, D}, rng);
  // Both gradients of one call: compare them together by writing into one buffer's two views.
  const int64_t n_gu = E * 2 * F * D, n_d = E * D * F;
  auto grouped = [&](Tensor& both, bool acc) {
    Tensor dgu = both.view({n_gu + n_d}).rows(0, n_gu).view({E, 2 * F, D});
    Tensor dd = both.view({n_gu + n_d}).rows(n_gu, n_d).view({E, D, F});
    Tensor dxp = Tensor::empty({R, D});
    ops::experts_bwd(dyp, xp, off, wgu, wd, gu, h, dxp, dgu, dd, acc);
  };
  expect_set_equals_add_on_zero({n_gu + n_d}, grouped, "experts_bwd");
  auto reference = [&](Tensor& both, bool acc) {
    Tensor dgu = both.view({n_gu + n_d}).rows(0, n_gu).view({E, 2 * F, D});
    Tensor dd = both.view({n_gu + n_d}).rows(n_gu, n_d).view({E, D, F});
    Tensor dx = Tensor::empty({T, D}), dtw = Tensor::empty({T, K});
    ops::experts_ref_bwd(dy, x, idx, wts, wgu, wd, dx, dtw, dgu, dd, acc);
  };
  expect_set_equals_add_on_zero({n_gu + n_d}, reference, "experts_ref_bwd");
}

}  // namespace
