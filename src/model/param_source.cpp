#include "model/param_source.h"

#include "ops/ops.h"

namespace mt {

std::vector<ParamUnit> param_units(const ModelConfig& c, const ParamTable& t) {
  std::vector<ParamUnit> u;
  const int64_t L = c.num_hidden_layers;
  MT_CHECK(L > 0, "a model needs at least one layer");
  u.push_back({0, t.layer_range(0).first});
  for (int64_t l = 0; l < L; ++l) {
    auto [b, e] = t.layer_range(l);
    MT_CHECK(b == u.back().end, "block ", l, " does not follow the previous unit in the flat layout");
    u.push_back({b, e});
  }
  u.push_back({u.back().end, t.total()});
  return u;
}

LocalParams::LocalParams(const ModelConfig& c, const ParamTable& t, Device device) : units_(param_units(c, t)) {
  params_ = Tensor::zeros({t.total()}, DType::F32, device);
  grads_ = Tensor::zeros({t.total()}, DType::F32, device);
  // On CUDA the forward and backward read a bf16 copy of the fp32 master weights.
  compute_ = device == Device::CUDA ? Tensor::zeros({t.total()}, DType::BF16, device) : params_;
}

Tensor LocalParams::acquire_weights(int u) {
  MT_CHECK(u >= 0 && size_t(u) < units_.size(), "unit ", u, " of ", units_.size());
  return compute_.rows(units_[size_t(u)].begin, units_[size_t(u)].numel());
}

Tensor LocalParams::unit_grads(int u) {
  MT_CHECK(u >= 0 && size_t(u) < units_.size(), "unit ", u, " of ", units_.size());
  return grads_.rows(units_[size_t(u)].begin, units_[size_t(u)].numel());
}

void LocalParams::refresh_compute_weights() {
  if (has_compute_copy()) ops::copy_cast(params_, compute_);
}

}  // namespace mt
