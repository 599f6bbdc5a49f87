// CPU LM head fused with cross-entropy, chunked over tokens, built from the CPU ops themselves:
// the reference for the CUDA kernel, which must give the same loss and gradients.
#include "backend/cpu/cpu_ops.h"

namespace mt::cpu {

void lm_head_cross_entropy(const Tensor& hn_TD, const Tensor& w_VD, const Tensor& labels_T, float scale,
                           int64_t chunk_rows, Tensor& loss_sum, Tensor& dhn_TD, Tensor& dw_VD, bool accumulate_dw) {
  const int64_t T = hn_TD.size(0), V = w_VD.size(0);  // shapes: op_checks.h, checked by the dispatch
  check_dtype(loss_sum, DType::F32, "lm_head_cross_entropy loss_sum");
  if (chunk_rows <= 0) chunk_rows = std::max<int64_t>(1, (int64_t(64) << 20) / (4 * std::max<int64_t>(V, 1)));
  if (!accumulate_dw && T == 0) dw_VD.zero_();  // no chunk writes it
  double total = 0;
  for (int64_t t0 = 0; t0 < T; t0 += chunk_rows) {
    const int64_t n = std::min(chunk_rows, T - t0);
    Tensor hn = hn_TD.rows(t0, n), labels = labels_T.rows(t0, n), dhn = dhn_TD.rows(t0, n);
    Tensor logits = Tensor::empty({n, V}), lse = Tensor::empty({n}), dlogits = Tensor::empty({n, V});
    linear_fwd(hn, w_VD, logits);
    int64_t valid = 0;
    total += cross_entropy_fwd(logits, labels, lse, &valid);
    cross_entropy_bwd(logits, labels, lse, scale, dlogits);
    linear_bwd(dlogits, hn, w_VD, &dhn, false, dw_VD, accumulate_dw || t0 > 0);
  }
  loss_sum.data<float>()[0] += float(total);
}

void copy_cast(const Tensor& src, Tensor& dst) {
  MT_CHECK(src.shape() == dst.shape(), "copy_cast ", src.desc(), " into ", dst.desc());
  dst.copy_from(src.to(dst.dtype()));
}

}  // namespace mt::cpu
