// Finite-difference check of a model's gradients, shared by the objective, value-head and RL tests:
// central differences of loss() at six entries of each named parameter against the analytic gradient.
#pragma once
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <initializer_list>
#include <utility>
#include <vector>

#include "model/qwen3_moe.h"

namespace mt::test {

struct FdResult {
  double rel_l2 = 0;  // ||fd - analytic|| / ||analytic|| over the checked entries
  double analytic_norm2 = 0;
  int checked = 0;
};

// The same over any f32 host buffer: `per` entries of each [offset, offset + numel) range of `values`
// (picked by a stride, starting at `first`), against `analytic` at the same indices.
template <class F>
FdResult finite_difference_ranges(float* values, const Tensor& analytic,
                                  const std::vector<std::pair<int64_t, int64_t>>& ranges, int per, int64_t first,
                                  float step, F&& loss) {
  FdResult r;
  double num2 = 0;
  for (const auto& [offset, numel] : ranges)
    for (int64_t k = 0; k < per; ++k) {
      const int64_t i = offset + (k * 7919 + first) % numel;
      float& p = values[i];
      const float orig = p;
      const float h = step * std::max(1.0f, std::abs(orig));
      p = orig + h;
      const double up = loss();
      p = orig - h;
      const double down = loss();
      p = orig;
      const double fd = (up - down) / (2.0 * double(h)), an = analytic.data<float>()[i];
      num2 += (fd - an) * (fd - an);
      r.analytic_norm2 += an * an;
      ++r.checked;
    }
  r.rel_l2 = r.analytic_norm2 > 0 ? std::sqrt(num2 / r.analytic_norm2) : 0;
  return r;
}

// step: the perturbation relative to max(1, |p|). loss(): the loss at the model's current parameters.
template <class F>
FdResult finite_difference_check(Qwen3MoeModel& m, const Tensor& analytic, std::initializer_list<const char*> names,
                                 float step, F&& loss) {
  std::vector<std::pair<int64_t, int64_t>> ranges;
  for (const char* name : names) {
    const ParamEntry* e = m.table().find(name);
    EXPECT_NE(e, nullptr) << name;
    if (e) ranges.emplace_back(e->offset, e->numel);
  }
  return finite_difference_ranges(m.params().data<float>(), analytic, ranges, 6, 0, step, loss);
}

}  // namespace mt::test
