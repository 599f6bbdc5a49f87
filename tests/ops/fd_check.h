// Finite-difference gradient checking for the op tests (header-only, shared by every op test file).
//
// How to use: pick a random "cotangent" r with the output's shape and define the scalar loss
// L(x) = sum(r * f(x)) (see weighted_sum). The analytic gradient of L with respect to an input is
// then exactly what the op's backward returns when given dy = r. fd_grad computes the same gradient
// numerically, by central differences on each element of the input:
//
//   Tensor r = random_tensor(y.shape(), rng);
//   auto loss = [&] { op_fwd(x, w, y); return weighted_sum(y, r); };
//   Tensor num = fd_grad(x, loss, 1e-2);   // perturbs x in place, restores it
//   op_bwd(r, x, w, dx, ...);
//   EXPECT_LT(rel_l2(dx, num), 1e-2);
//
// Why these tolerances: the ops compute in fp32, so L carries a rounding error of about
// 1e-7 * sum|r*y|. A central difference divides that by 2*eps, and its truncation error is
// O(eps^2 * f'''). With eps in [1e-3, 1e-2] and O(1) inputs both terms stay below ~1e-4 of the
// gradient's size (the opsA ops measure 1e-6..5e-5), so a relative L2 tolerance of 1e-3..1e-2
// separates a correct backward from a wrong one (a wrong term, sign, transpose or index gives errors
// of order 1; a missing small term, 1e-2..1e-1). The loss is summed in double so that the only fp32
// rounding is the op's own. Use eps ~1e-2 for smooth ops; smaller only where curvature is high.
#pragma once
#include <cmath>
#include <cstdint>
#include <functional>

#include "core/error.h"
#include "core/rng.h"
#include "core/tensor.h"

namespace mt::testing {

// A CPU f32 tensor with values uniform in [lo, hi), drawn from rng.
inline Tensor random_tensor(const Shape& shape, Rng& rng, float lo = -1.0f, float hi = 1.0f) {
  Tensor t = Tensor::empty(shape);
  rng.fill_uniform(t, lo, hi);
  return t;
}

// sum(y * r) accumulated in double; y and r are CPU f32 with the same number of elements.
inline double weighted_sum(const Tensor& y, const Tensor& r) {
  MT_CHECK(y.numel() == r.numel(), "weighted_sum: ", y.desc(), " vs ", r.desc());
  const float* a = y.data<float>();
  const float* b = r.data<float>();
  double s = 0;
  for (int64_t i = 0; i < y.numel(); ++i) s += double(a[i]) * double(b[i]);
  return s;
}

// Numeric gradient dL/dx by central differences. `loss` must recompute L from the current contents
// of x (which fd_grad perturbs in place, one element at a time, and restores exactly). The step
// actually taken is the float-rounded one, so the quotient uses (x+ - x-) as stored, not 2*eps.
inline Tensor fd_grad(Tensor& x, const std::function<double()>& loss, double eps) {
  MT_CHECK(x.dtype() == DType::F32 && x.is_cpu(), "fd_grad needs a CPU f32 tensor, got ", x.desc());
  Tensor g = Tensor::zeros(x.shape());
  float* px = x.data<float>();
  float* pg = g.data<float>();
  for (int64_t i = 0; i < x.numel(); ++i) {
    const float orig = px[i];
    const float up = float(double(orig) + eps);
    const float dn = float(double(orig) - eps);
    px[i] = up;
    const double lp = loss();
    px[i] = dn;
    const double lm = loss();
    px[i] = orig;
    pg[i] = float((lp - lm) / (double(up) - double(dn)));
  }
  return g;
}

// ||a - b|| / ||b|| in double (b is the reference). NaN anywhere gives NaN, which fails any `<` check.
// When b is exactly zero, returns ||a|| so that "both zero" passes and "a nonzero" fails.
inline double rel_l2(const Tensor& a, const Tensor& b) {
  MT_CHECK(a.numel() == b.numel(), "rel_l2: ", a.desc(), " vs ", b.desc());
  const float* pa = a.data<float>();
  const float* pb = b.data<float>();
  double num = 0, den = 0;
  for (int64_t i = 0; i < a.numel(); ++i) {
    const double d = double(pa[i]) - double(pb[i]);
    num += d * d;
    den += double(pb[i]) * double(pb[i]);
  }
  return den == 0 ? std::sqrt(num) : std::sqrt(num / den);
}

// Largest |a - b| over all elements (for exact or near-exact comparisons).
inline double max_abs_diff(const Tensor& a, const Tensor& b) {
  MT_CHECK(a.numel() == b.numel(), "max_abs_diff: ", a.desc(), " vs ", b.desc());
  const float* pa = a.data<float>();
  const float* pb = b.data<float>();
  double m = 0;
  for (int64_t i = 0; i < a.numel(); ++i) {
    const double d = std::abs(double(pa[i]) - double(pb[i]));
    if (std::isnan(d)) return d;
    if (d > m) m = d;
  }
  return m;
}

}  // namespace mt::testing
