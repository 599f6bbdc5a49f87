// CPU token embedding: a row gather forward and a scatter-add backward. Every id is checked before
// anything is written, so a bad id leaves the output (and the gradient) untouched.
#include <cstring>

#include "backend/cpu/cpu_ops.h"

namespace mt::cpu {

// Checks ids_T (1-D i64, each in [0, V)) and returns its length.
static int64_t check_ids(const Tensor& ids_T, int64_t V, const char* op) {
  check_dtype(ids_T, DType::I64, str(op, " ids_T").c_str());
  if (ids_T.dim() != 1) MT_THROW(op, " ids_T must be 1-D, got shape ", shape_str(ids_T.shape()));
  const int64_t* ids = ids_T.data<int64_t>();
  for (int64_t t = 0; t < ids_T.numel(); ++t)
    if (ids[t] < 0 || ids[t] >= V)
      MT_THROW(op, ": token id ", ids[t], " at position ", t, " is out of range [0, ", V, ")");
  return ids_T.numel();
}

void embedding_fwd(const Tensor& ids_T, const Tensor& table_VD, Tensor& out_TD) {
  check_dtype(table_VD, DType::F32, "embedding_fwd table_VD");
  if (table_VD.dim() != 2) MT_THROW("embedding_fwd table_VD must be 2-D, got shape ", shape_str(table_VD.shape()));
  const int64_t V = table_VD.size(0), D = table_VD.size(1);
  const int64_t T = check_ids(ids_T, V, "embedding_fwd");
  check_shape(out_TD, {T, D}, "embedding_fwd out_TD");
  check_dtype(out_TD, DType::F32, "embedding_fwd out_TD");
  const int64_t* ids = ids_T.data<int64_t>();
  const float* table = table_VD.data<float>();
  float* out = out_TD.data<float>();
  for (int64_t t = 0; t < T; ++t) std::memcpy(out + t * D, table + ids[t] * D, size_t(D) * sizeof(float));
}

void embedding_bwd(const Tensor& ids_T, const Tensor& dout_TD, Tensor& dtable_VD, bool accumulate_dw) {
  check_dtype(dtable_VD, DType::F32, "embedding_bwd dtable_VD");
  if (dtable_VD.dim() != 2) MT_THROW("embedding_bwd dtable_VD must be 2-D, got shape ", shape_str(dtable_VD.shape()));
  const int64_t V = dtable_VD.size(0), D = dtable_VD.size(1);
  const int64_t T = check_ids(ids_T, V, "embedding_bwd");
  check_shape(dout_TD, {T, D}, "embedding_bwd dout_TD");
  check_dtype(dout_TD, DType::F32, "embedding_bwd dout_TD");
  const int64_t* ids = ids_T.data<int64_t>();
  const float* dout = dout_TD.data<float>();
  float* dtable = dtable_VD.data<float>();
  if (!accumulate_dw) std::fill(dtable, dtable + V * D, 0.0f);
  // Sequential in t, so repeated ids accumulate in a fixed order (deterministic).
  for (int64_t t = 0; t < T; ++t) {
    float* row = dtable + ids[t] * D;
    const float* g = dout + t * D;
    for (int64_t d = 0; d < D; ++d) row[d] += g[d];
  }
}

}  // namespace mt::cpu
