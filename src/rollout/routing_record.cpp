// RoutingRecord (routing_record.h).
#include "rollout/routing_record.h"

#include "core/error.h"

namespace mt {

RoutingRecord::RoutingRecord(int64_t layers, int64_t top_k, int64_t num_experts)
    : layers_(layers), K_(top_k), E_(num_experts), per_layer_(size_t(layers)) {
  if (layers < 0 || top_k < 1 || num_experts < 1 || num_experts > 65536)
    MT_THROW("RoutingRecord: ", layers, " layers, top-", top_k, " of ", num_experts,
             " experts; allowed: layers >= 0, k >= 1, 1 to 65536 experts");
  width_ = num_experts <= 256 ? 1 : 2;
}

void RoutingRecord::append(const std::vector<Tensor>& ids, int64_t first, int64_t n) {
  if (int64_t(ids.size()) != layers_) MT_THROW("RoutingRecord::append: ", ids.size(), " layers, the record has ", layers_);
  for (int64_t l = 0; l < layers_; ++l) {
    const Tensor& t = ids[size_t(l)];
    if (t.dtype() != DType::I32 || t.dim() != 2 || t.size(1) != K_ || first < 0 || first + n > t.size(0))
      MT_THROW("RoutingRecord::append: layer ", l, " ids ", t.desc(), ", rows [", first, ", ", first + n,
               "); expected i32 [T, ", K_, "] holding them");
    std::vector<uint8_t>& out = per_layer_[size_t(l)];
    const int32_t* p = t.data<int32_t>() + first * K_;
    for (int64_t i = 0; i < n * K_; ++i) {
      const int32_t e = p[i];
      if (e < 0 || e >= E_) MT_THROW("RoutingRecord::append: layer ", l, " expert id ", e, " outside [0, ", E_, ")");
      out.push_back(uint8_t(e));
      if (width_ == 2) out.push_back(uint8_t(e >> 8));
    }
  }
  tokens_ += n;
}

std::vector<Tensor> RoutingRecord::tensors(int64_t begin, int64_t count) const {
  if (count < 0) count = tokens_ - begin;
  if (begin < 0 || begin + count > tokens_)
    MT_THROW("RoutingRecord::tensors: tokens [", begin, ", ", begin + count, ") of a record of ", tokens_);
  std::vector<Tensor> out;
  for (int64_t l = 0; l < layers_; ++l) {
    Tensor t = Tensor::empty({count, K_}, DType::I32);
    const uint8_t* p = per_layer_[size_t(l)].data() + begin * K_ * width_;
    for (int64_t i = 0; i < count * K_; ++i)
      t.data<int32_t>()[i] = width_ == 1 ? int32_t(p[i]) : int32_t(p[2 * i]) | int32_t(p[2 * i + 1]) << 8;
    out.push_back(t);
  }
  return out;
}

double routing_mismatch(const std::vector<Tensor>& a, const std::vector<Tensor>& b) {
  if (a.size() != b.size()) MT_THROW("routing_mismatch: ", a.size(), " layers against ", b.size());
  int64_t differ = 0, total = 0;
  for (size_t l = 0; l < a.size(); ++l) {
    if (a[l].shape() != b[l].shape() || a[l].dtype() != DType::I32 || b[l].dtype() != DType::I32)
      MT_THROW("routing_mismatch: layer ", l, ": ", a[l].desc(), " against ", b[l].desc());
    const int64_t T = a[l].size(0), K = a[l].size(1);
    const int32_t* x = a[l].data<int32_t>();
    const int32_t* y = b[l].data<int32_t>();
    for (int64_t t = 0; t < T; ++t)
      for (int64_t i = 0; i < K; ++i) {
        bool found = false;
        for (int64_t j = 0; j < K && !found; ++j) found = x[t * K + i] == y[t * K + j];
        differ += !found;
        ++total;
      }
  }
  return total ? double(differ) / double(total) : 0.0;
}

}  // namespace mt
