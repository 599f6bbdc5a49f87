// grouped_linear_fwd / grouped_linear_bwd on the CPU: each expert's rows through its own weight, equal to
// one linear_fwd / linear_bwd per expert (the same sgemm calls, so bit for bit), with alpha, +=, experts
// without rows, and the checks' messages.
#include <gtest/gtest.h>

#include <cstring>

#include "core/rng.h"
#include "ops/ops.h"
#include "test_util.h"

using namespace mt;
using testutil::randn;

namespace {

Tensor offsets_of(std::initializer_list<int64_t> counts) {
  Tensor o = Tensor::empty({int64_t(counts.size()) + 1}, DType::I64);
  int64_t* p = o.data<int64_t>();
  p[0] = 0;
  int64_t i = 0;
  for (int64_t c : counts) p[i + 1] = p[i] + c, ++i;
  return o;
}

}  // namespace

TEST(GroupedLinear, EqualsOneLinearPerExpert) {
  Rng rng(3);
  const Tensor off = offsets_of({5, 0, 9, 1, 0});  // experts 1 and 4 get no rows
  const int64_t E = 5, R = 15, N = 6, K = 7;
  const float alpha = 0.75f;
  const Tensor x = randn({R, K}, rng), w = randn({E, N, K}, rng), dy = randn({R, N}, rng);
  const Tensor y0 = randn({R, N}, rng), dx0 = randn({R, K}, rng), dw0 = randn({E, N, K}, rng);
  for (bool acc : {false, true}) {
    SCOPED_TRACE(acc ? "+=" : "=");
    Tensor y = y0.clone(), dx = dx0.clone(), dw = dw0.clone();
    ops::grouped_linear_fwd(x, off, w, alpha, y, acc);
    ops::grouped_linear_bwd(dy, x, off, w, alpha, &dx, acc, dw);
    Tensor ey = y0.clone(), edx = dx0.clone(), edw = dw0.clone();
    const int64_t* o = off.data<int64_t>();
    for (int64_t e = 0; e < E; ++e) {
      const int64_t n = o[e + 1] - o[e];
      if (n == 0) continue;
      const Tensor we = w.rows(e, 1).view({N, K});
      Tensor v = Tensor::empty({n, N}), yr = ey.rows(o[e], n);
      ops::linear_fwd(x.rows(o[e], n), we, v);
      ops::scale_(v, alpha);
      if (acc) ops::add_(yr, v);
      else yr.copy_from(v);
      Tensor dys = dy.rows(o[e], n).clone();
      ops::scale_(dys, alpha);
      Tensor dxr = edx.rows(o[e], n), dwe = edw.rows(e, 1).view({N, K});
      ops::linear_bwd(dys, x.rows(o[e], n), we, &dxr, acc, dwe, true);
    }
    for (int64_t i = 0; i < y.numel(); ++i) EXPECT_NEAR(y.data<float>()[i], ey.data<float>()[i], 1e-5f) << i;
    for (int64_t i = 0; i < dx.numel(); ++i) EXPECT_NEAR(dx.data<float>()[i], edx.data<float>()[i], 1e-5f) << i;
    for (int64_t i = 0; i < dw.numel(); ++i) EXPECT_NEAR(dw.data<float>()[i], edw.data<float>()[i], 1e-5f) << i;
    // experts without rows keep their gradient
    EXPECT_TRUE(testutil::same_bits(dw.rows(1, 1), dw0.rows(1, 1)));
    EXPECT_TRUE(testutil::same_bits(dw.rows(4, 1), dw0.rows(4, 1)));
  }
  // dx null and dw undefined skip their products
  Tensor none;
  Tensor dx = dx0.clone();
  ops::grouped_linear_bwd(dy, x, off, w, 1.0f, &dx, false, none);
  Tensor dw = dw0.clone();
  ops::grouped_linear_bwd(dy, x, off, w, 1.0f, nullptr, false, dw);
  EXPECT_FALSE(testutil::same_bits(dx, dx0));
  EXPECT_FALSE(testutil::same_bits(dw, dw0));
}

TEST(GroupedLinear, BadArgumentsAreNamed) {
  Rng rng(4);
  const Tensor x = randn({4, 3}, rng), w = randn({2, 5, 3}, rng);
  Tensor y = Tensor::empty({4, 5});
  using testutil::error_of;
  EXPECT_NE(error_of([&] { ops::grouped_linear_fwd(x, offsets_of({1, 2}), w, 1.0f, y); }).find("must run from 0 to R (4)"),
            std::string::npos);
  Tensor bad = offsets_of({3, 1});
  bad.data<int64_t>()[1] = 5;
  EXPECT_NE(error_of([&] { ops::grouped_linear_fwd(x, bad, w, 1.0f, y); }).find("decrease at expert 1"), std::string::npos);
  Tensor y_bad = Tensor::empty({4, 4});
  EXPECT_NE(error_of([&] { ops::grouped_linear_fwd(x, offsets_of({3, 1}), w, 1.0f, y_bad); }).find("y_RN"),
            std::string::npos);
  EXPECT_NE(error_of([&] { ops::grouped_linear_fwd(x, offsets_of({1, 1, 2}), w, 1.0f, y); }).find("offsets_E1"),
            std::string::npos);
}
