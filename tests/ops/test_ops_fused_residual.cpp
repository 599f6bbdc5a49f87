// The residual-stream fusions on the CPU (ops.h: add_rms_norm_fwd/bwd, linear_fwd_add) equal the op
// sequences they replace bit for bit: add_ then rms_norm_fwd; rms_norm_bwd then add_; linear_fwd then
// add_. Inputs are full-precision f32 (the residual stream is), shapes include the per-head, hidden and
// odd sizes and no rows; "=" outputs start as NaN, so an element left unwritten fails the comparison.
// The unfused ops' own finite-difference tests (test_ops_a.cpp) then cover the fused ones too.
#include <gtest/gtest.h>

#include <cmath>
#include <string>

#include "core/rng.h"
#include "ops/ops.h"
#include "test_util.h"

using namespace mt;
using mt::testutil::error_of;
using mt::testutil::same_bits;

namespace {

Tensor randn(const Shape& s, Rng& rng, float std = 1.0f) {
  Tensor t = Tensor::empty(s);
  rng.fill_normal(t, 0.0f, std);
  return t;
}

Tensor nans(const Shape& s) {
  Tensor t = Tensor::empty(s);
  t.fill_(std::nanf(""));
  return t;
}

struct Case {
  int64_t N, D;
};
const Case kCases[] = {{64, 16}, {37, 128}, {9, 2048}, {5, 7}, {0, 16}};

}  // namespace

TEST(OpsFusedResidual, AddRmsNormForwardEqualsAddThenNorm) {
  Rng rng(1);
  for (Case c : kCases) {
    SCOPED_TRACE(str("N=", c.N, " D=", c.D));
    const Tensor h0 = randn({c.N, c.D}, rng), x = randn({c.N, c.D}, rng, 0.5f), w = randn({c.D}, rng);
    Tensor h_ref = h0.clone(), y_ref = nans({c.N, c.D}), rstd_ref = nans({c.N});
    ops::add_(h_ref, x);
    ops::rms_norm_fwd(h_ref, w, 1e-6f, y_ref, rstd_ref);
    Tensor h = h0.clone(), y = nans({c.N, c.D}), rstd = nans({c.N});
    ops::add_rms_norm_fwd(h, x, w, 1e-6f, y, rstd);
    EXPECT_TRUE(same_bits(h, h_ref)) << "h (the residual after the add)";
    EXPECT_TRUE(same_bits(y, y_ref)) << "y";
    EXPECT_TRUE(same_bits(rstd, rstd_ref)) << "rstd";
    if (c.N > 0) EXPECT_FALSE(same_bits(h, h0)) << "the add did not reach h";
  }
}

TEST(OpsFusedResidual, AddRmsNormBackwardEqualsNormBackwardThenAdd) {
  Rng rng(2);
  for (Case c : kCases) {
    for (bool accumulate : {true, false}) {
      SCOPED_TRACE(str("N=", c.N, " D=", c.D, " accumulate_dw ", accumulate));
      const Tensor x = randn({c.N, c.D}, rng), w = randn({c.D}, rng), dy = randn({c.N, c.D}, rng);
      const Tensor dres = randn({c.N, c.D}, rng), dw0 = randn({c.D}, rng);
      Tensor y = Tensor::empty({c.N, c.D}), rstd = Tensor::empty({c.N});
      ops::rms_norm_fwd(x, w, 1e-6f, y, rstd);
      Tensor dx_ref = nans({c.N, c.D}), dw_ref = dw0.clone();
      ops::rms_norm_bwd(dy, x, w, rstd, dx_ref, dw_ref, accumulate);
      ops::add_(dx_ref, dres);
      Tensor dx = nans({c.N, c.D}), dw = dw0.clone();
      ops::add_rms_norm_bwd(dy, x, w, rstd, dres, dx, dw, accumulate);
      EXPECT_TRUE(same_bits(dx, dx_ref)) << "dx";
      EXPECT_TRUE(same_bits(dw, dw_ref)) << "dw";
    }
  }
}

TEST(OpsFusedResidual, LinearForwardAddEqualsLinearThenAdd) {
  Rng rng(3);
  struct L {
    int64_t T, I, O;
  };
  for (L c : {L{33, 64, 48}, L{8, 256, 2048}, L{1, 3, 5}, L{0, 16, 8}}) {
    SCOPED_TRACE(str("T=", c.T, " I=", c.I, " O=", c.O));
    const Tensor x = randn({c.T, c.I}, rng), w = randn({c.O, c.I}, rng, 0.1f), r = randn({c.T, c.O}, rng);
    Tensor want = nans({c.T, c.O});
    ops::linear_fwd(x, w, want);
    ops::add_(want, r);
    Tensor y = nans({c.T, c.O});
    ops::linear_fwd_add(x, w, r, y);
    EXPECT_TRUE(same_bits(y, want)) << "y = x w^T + r";
    // r being y itself: y += x w^T.
    Tensor acc = r.clone();
    ops::linear_fwd_add(x, w, acc, acc);
    EXPECT_TRUE(same_bits(acc, want)) << "in place";
  }
}

TEST(OpsFusedResidual, ArgumentErrorsNameTheTensor) {
  Rng rng(4);
  Tensor h = randn({4, 8}, rng), x_bad = randn({4, 6}, rng), w = randn({8}, rng), y = Tensor::empty({4, 8}),
         rstd = Tensor::empty({4});
  std::string msg = error_of([&] { ops::add_rms_norm_fwd(h, x_bad, w, 1e-6f, y, rstd); });
  EXPECT_NE(msg.find("add_rms_norm_fwd x_ND has shape [4, 6], expected [4, 8]"), std::string::npos) << msg;
  Tensor h3 = randn({2, 2, 8}, rng);
  msg = error_of([&] { ops::add_rms_norm_fwd(h3, h3, w, 1e-6f, y, rstd); });
  EXPECT_NE(msg.find("add_rms_norm_fwd h_ND must be 2-D"), std::string::npos) << msg;
  Tensor dres_bad = randn({3, 8}, rng), dx = Tensor::empty({4, 8}), dw = Tensor::zeros({8});
  msg = error_of([&] { ops::add_rms_norm_bwd(h, h, w, rstd, dres_bad, dx, dw); });
  EXPECT_NE(msg.find("add_rms_norm_bwd dres_ND has shape [3, 8], expected [4, 8]"), std::string::npos) << msg;
  // r overlapping y without being it (a shifted view of one buffer) is refused.
  Tensor buf = randn({5, 8}, rng), xi = randn({4, 3}, rng), wo = randn({8, 3}, rng);
  Tensor r_view = buf.rows(0, 4), y_view = buf.rows(1, 4);
  msg = error_of([&] { ops::linear_fwd_add(xi, wo, r_view, y_view); });
  EXPECT_NE(msg.find("linear_fwd_add: r_TO"), std::string::npos) << msg;
  EXPECT_NE(msg.find("overlaps y_TO without being it"), std::string::npos) << msg;
  Tensor r_bad = randn({4, 7}, rng), y8 = Tensor::empty({4, 8});
  msg = error_of([&] { ops::linear_fwd_add(xi, wo, r_bad, y8); });
  EXPECT_NE(msg.find("linear_fwd_add r_TO has shape [4, 7], expected [4, 8]"), std::string::npos) << msg;
}
