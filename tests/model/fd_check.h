// Finite-difference check of a model's gradients, shared by the objective, value-head and RL tests:
// central differences of loss() at six entries of each named parameter against the analytic gradient.
#pragma once
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <initializer_list>

#include "model/qwen3_moe.h"

namespace mt::test {

struct FdResult {
  double rel_l2 = 0;  // ||fd - analytic|| / ||analytic|| over the checked entries
  double analytic_norm2 = 0;
  int checked = 0;
};

// step: the perturbation relative to max(1, |p|). loss(): the loss at the model's current parameters.
template <class F>
FdResult finite_difference_check(Qwen3MoeModel& m, const Tensor& analytic, std::initializer_list<const char*> names,
                                 float step, F&& loss) {
  FdResult r;
  double num2 = 0;
  for (const char* name : names) {
    const ParamEntry* e = m.table().find(name);
    EXPECT_NE(e, nullptr) << name;
    if (!e) continue;
    for (int64_t k = 0; k < 6; ++k) {
      const int64_t i = e->offset + (k * 7919) % e->numel;
      float& p = m.params().data<float>()[i];
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
  }
  r.rel_l2 = r.analytic_norm2 > 0 ? std::sqrt(num2 / r.analytic_norm2) : 0;
  return r;
}

}  // namespace mt::test
