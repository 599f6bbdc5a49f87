// Helpers shared by the test suites.
#pragma once
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>

#include "core/error.h"
#include "core/rng.h"
#include "core/tensor.h"

namespace mt::testutil {

// Runs f, expects it to throw mt::Error, and returns the message ("" and a test failure otherwise).
template <class F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  ADD_FAILURE() << "expected an mt::Error";
  return "";
}

// Same shape, dtype and bytes (tensors on a device are copied to the host first).
inline bool same_bits(const Tensor& a, const Tensor& b) {
  const Tensor x = a.is_cpu() ? a : a.to(Device::CPU), y = b.is_cpu() ? b : b.to(Device::CPU);
  return x.shape() == y.shape() && x.dtype() == y.dtype() && std::memcmp(x.raw(), y.raw(), x.nbytes()) == 0;
}

// ||a - b|| / ||b|| over two host f32 tensors of b's size (a zero b makes any difference fail a tolerance).
inline double rel_l2(const Tensor& a, const Tensor& b) {
  double num = 0, den = 0;
  for (int64_t i = 0; i < a.numel(); ++i) {
    const double d = double(a.data<float>()[i]) - b.data<float>()[i];
    num += d * d;
    den += double(b.data<float>()[i]) * b.data<float>()[i];
  }
  return std::sqrt(num / std::max(den, 1e-300));
}

// A host f32 tensor of N(0, std^2) draws.
inline Tensor randn(const Shape& s, Rng& rng, float std = 1.0f) {
  Tensor t = Tensor::empty(s);
  rng.fill_normal(t, 0.0f, std);
  return t;
}

}  // namespace mt::testutil
