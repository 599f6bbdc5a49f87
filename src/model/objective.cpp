// CrossEntropyObjective and ValueObjective's guard (objective.h).
#include "model/objective.h"

#include "core/error.h"

namespace mt {

double host_sum(const Tensor& x) {
  Tensor h = x.to(Device::CPU);
  MT_CHECK(h.dtype() == DType::F32, "host_sum of ", h.desc());
  double s = 0;
  for (int64_t i = 0; i < h.numel(); ++i) s += double(h.data<float>()[i]);
  return s;
}

double CrossEntropyObjective::coefficients(const TokenRows& rows, Tensor& dlogp, Tensor*) const {
  Tensor g = Tensor::zeros({rows.rows});
  for (int64_t t = 0; t < rows.rows; ++t)
    if (rows.labels.data<int64_t>()[t] != -100) g.data<float>()[t] = float(-scale_);
  dlogp.copy_from(g.to(dlogp.device()));
  return -scale_ * host_sum(rows.logp);
}

double ValueObjective::coefficients(const TokenRows&, Tensor&, Tensor*) const {
  MT_THROW("a value objective on a model with an LM head: it needs a value-head model (ModelConfig::value_head, "
           "score.weight [1, D])");
}

}  // namespace mt
