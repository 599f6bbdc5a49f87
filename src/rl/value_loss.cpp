// Clipped value loss (value_loss.h).
#include "rl/value_loss.h"

#include <algorithm>
#include <cmath>

#include "core/error.h"

namespace mt::rl {

ValueTerm value_term(double v, double ret, double v_old, double w, double eps) {
  ValueTerm r;
  const double a = v - ret;
  if (eps <= 0) {
    r.loss = 0.5 * w * a * a;
    r.grad = w * a;
    return r;
  }
  const double d = v - v_old;
  const double dc = std::clamp(d, -eps, eps);
  const double b = v_old + dc - ret;
  if (a * a >= b * b) {
    r.loss = 0.5 * w * a * a;
    r.grad = w * a;
  } else {
    r.loss = 0.5 * w * b * b;
    const bool inside = d > -eps && d < eps;
    r.grad = inside ? w * b : 0.0;
    r.clipped = !inside;
  }
  return r;
}

double ValueLossObjective::value_coefficients(const TokenRows& rows, Tensor& dv) const {
  if (rows.values.size() <= size_t(kWeight))
    MT_THROW("value loss: the micro-batch carries ", rows.values.size(),
             " token values; it needs 3: [0] return, [1] old value, [2] weight");
  const Tensor v = rows.value.to(Device::CPU);
  const float* vr = v.data<float>();
  const float* ret = rows.values[kReturn].data<float>();
  const float* old = rows.values[kOldValue].data<float>();
  const float* w = rows.values[kWeight].data<float>();
  const int64_t* lab = rows.labels.data<int64_t>();
  Tensor g = Tensor::zeros({rows.rows});
  double loss = 0;
  for (int64_t t = 0; t < rows.rows; ++t) {
    if (lab[t] == -100 || w[t] == 0) continue;
    const ValueTerm x = value_term(vr[t], ret[t], old[t], w[t], eps_);
    if (!std::isfinite(x.loss))
      MT_THROW("value loss: row ", t, " is not finite (value ", vr[t], ", return ", ret[t], ", old value ", old[t],
               ", weight ", w[t], ")");
    g.data<float>()[t] = float(x.grad);
    loss += x.loss;
    metrics_.loss += x.loss;
    metrics_.sq_err += (double(vr[t]) - ret[t]) * (double(vr[t]) - ret[t]);
    metrics_.value_sum += vr[t];
    ++metrics_.tokens;
    metrics_.clipped += x.clipped;
  }
  dv.copy_from(g.to(dv.device()));
  return loss;
}

}  // namespace mt::rl
