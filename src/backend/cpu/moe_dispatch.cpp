// CPU reference for dropless token dispatch: the plan (a stable counting sort of the T*K
// assignments by expert), the permutation of token rows into expert-contiguous rows, and the
// weighted un-permutation back to tokens. Every loop runs in a fixed order so that results are
// bit-reproducible run to run. Shapes and scalar arguments are checked by the dispatch (ops/op_checks.h);
// dtypes, expert ids, assignments and rows here.
#include <algorithm>
#include <cstring>
#include <vector>

#include "backend/cpu/cpu_ops.h"

namespace mt::cpu {

void make_dispatch_plan(const Tensor& topk_idx_TK, int64_t E, Tensor& offsets_E1, Tensor& assign_of_row_R,
                        Tensor& row_of_assign_TK) {
  check_dtype(topk_idx_TK, DType::I32, "make_dispatch_plan topk_idx_TK");
  check_dtype(offsets_E1, DType::I64, "make_dispatch_plan offsets_E1");
  check_dtype(assign_of_row_R, DType::I32, "make_dispatch_plan assign_of_row_R");
  check_dtype(row_of_assign_TK, DType::I32, "make_dispatch_plan row_of_assign_TK");
  const int64_t K = topk_idx_TK.size(1), R = topk_idx_TK.numel();

  const int32_t* idx = topk_idx_TK.data<int32_t>();
  int64_t* off = offsets_E1.data<int64_t>();
  int32_t* assign_of_row = assign_of_row_R.data<int32_t>();
  int32_t* row_of_assign = row_of_assign_TK.data<int32_t>();

  std::fill(off, off + E + 1, int64_t(0));
  for (int64_t a = 0; a < R; ++a) {
    const int32_t e = idx[a];
    if (e < 0 || e >= E)
      MT_THROW("make_dispatch_plan: token ", a / K, " choice ", a % K, " has expert id ", e,
               ", expected a value in [0, ", E, ")");
    ++off[e + 1];
  }
  for (int64_t e = 0; e < E; ++e) off[e + 1] += off[e];
  // Visiting assignments in increasing a makes the sort stable: within an expert, rows follow a.
  std::vector<int64_t> next(off, off + E);
  for (int64_t a = 0; a < R; ++a) {
    const int64_t r = next[size_t(idx[a])]++;
    assign_of_row[r] = int32_t(a);
    row_of_assign[a] = int32_t(r);
  }
}

void permute_fwd(const Tensor& x_TD, const Tensor& assign_of_row_R, int64_t K, Tensor& xp_RD) {
  check_dtype(x_TD, DType::F32, "permute_fwd x_TD");
  check_dtype(assign_of_row_R, DType::I32, "permute_fwd assign_of_row_R");
  check_dtype(xp_RD, DType::F32, "permute_fwd xp_RD");
  const int64_t T = x_TD.size(0), D = x_TD.size(1), R = assign_of_row_R.size(0);
  const int32_t* assign = assign_of_row_R.data<int32_t>();
  const float* x = x_TD.data<float>();
  float* xp = xp_RD.data<float>();
  for (int64_t r = 0; r < R; ++r) {
    const int64_t a = assign[r];
    MT_CHECK(a >= 0 && a < T * K, "permute_fwd: row ", r, " has assignment ", a, ", expected [0, ", T * K, ")");
    std::memcpy(xp + r * D, x + (a / K) * D, size_t(D) * sizeof(float));
  }
}

void permute_bwd(const Tensor& dxp_RD, const Tensor& assign_of_row_R, int64_t K, Tensor& dx_TD) {
  check_dtype(dxp_RD, DType::F32, "permute_bwd dxp_RD");
  check_dtype(assign_of_row_R, DType::I32, "permute_bwd assign_of_row_R");
  check_dtype(dx_TD, DType::F32, "permute_bwd dx_TD");
  const int64_t R = dxp_RD.size(0), D = dxp_RD.size(1), T = dx_TD.size(0);
  const int32_t* assign = assign_of_row_R.data<int32_t>();
  const float* dxp = dxp_RD.data<float>();
  float* dx = dx_TD.data<float>();
  for (int64_t r = 0; r < R; ++r) {
    const int64_t a = assign[r];
    MT_CHECK(a >= 0 && a < T * K, "permute_bwd: row ", r, " has assignment ", a, ", expected [0, ", T * K, ")");
    float* d = dx + (a / K) * D;
    const float* s = dxp + r * D;
    for (int64_t j = 0; j < D; ++j) d[j] += s[j];
  }
}

void unpermute_fwd(const Tensor& yp_RD, const Tensor& row_of_assign_TK, const Tensor& w_TK, Tensor& y_TD) {
  check_dtype(yp_RD, DType::F32, "unpermute_fwd yp_RD");
  check_dtype(row_of_assign_TK, DType::I32, "unpermute_fwd row_of_assign_TK");
  check_dtype(w_TK, DType::F32, "unpermute_fwd w_TK");
  check_dtype(y_TD, DType::F32, "unpermute_fwd y_TD");
  const int64_t R = yp_RD.size(0), D = yp_RD.size(1);
  const int64_t T = row_of_assign_TK.size(0), K = row_of_assign_TK.size(1);
  const float* yp = yp_RD.data<float>();
  const int32_t* row = row_of_assign_TK.data<int32_t>();
  const float* w = w_TK.data<float>();
  float* y = y_TD.data<float>();
  for (int64_t t = 0; t < T; ++t) {
    float* yt = y + t * D;
    std::fill(yt, yt + D, 0.0f);
    for (int64_t k = 0; k < K; ++k) {
      const int64_t r = row[t * K + k];
      MT_CHECK(r >= 0 && r < R, "unpermute_fwd: assignment (", t, ", ", k, ") has row ", r, ", expected [0, ", R, ")");
      const float wk = w[t * K + k];
      const float* src = yp + r * D;
      for (int64_t j = 0; j < D; ++j) yt[j] += wk * src[j];
    }
  }
}

void unpermute_bwd(const Tensor& dy_TD, const Tensor& yp_RD, const Tensor& row_of_assign_TK, const Tensor& w_TK,
                   Tensor& dyp_RD, Tensor& dw_TK) {
  // Either half may be skipped: yp_RD undefined = no dot products (dw_TK untouched), dyp_RD
  // undefined = no rows written (ops::permute_weighted_fwd / _bwd use one half each; the dispatch
  // checks that one is given).
  const bool rows = dyp_RD.defined(), dots = yp_RD.defined();
  check_dtype(dy_TD, DType::F32, "unpermute_bwd dy_TD");
  check_dtype(row_of_assign_TK, DType::I32, "unpermute_bwd row_of_assign_TK");
  check_dtype(w_TK, DType::F32, "unpermute_bwd w_TK");
  if (rows) check_dtype(dyp_RD, DType::F32, "unpermute_bwd dyp_RD");
  if (dots) {
    check_dtype(yp_RD, DType::F32, "unpermute_bwd yp_RD");
    check_dtype(dw_TK, DType::F32, "unpermute_bwd dw_TK");
  }
  const Tensor& rd = dots ? yp_RD : dyp_RD;
  const int64_t T = dy_TD.size(0), D = dy_TD.size(1), R = rd.size(0), K = row_of_assign_TK.size(1);
  const float* dy = dy_TD.data<float>();
  const float* yp = dots ? yp_RD.data<float>() : nullptr;
  const int32_t* row = row_of_assign_TK.data<int32_t>();
  const float* w = w_TK.data<float>();
  float* dyp = rows ? dyp_RD.data<float>() : nullptr;
  float* dw = dots ? dw_TK.data<float>() : nullptr;
  // A row no assignment points at (possible only with a plan that is not a bijection) gets zero, not garbage.
  if (rows && R != T * K) dyp_RD.zero_();
  for (int64_t t = 0; t < T; ++t) {
    const float* dyt = dy + t * D;
    for (int64_t k = 0; k < K; ++k) {
      const int64_t r = row[t * K + k];
      MT_CHECK(r >= 0 && r < R, "unpermute_bwd: assignment (", t, ", ", k, ") has row ", r, ", expected [0, ", R, ")");
      const float wk = w[t * K + k];
      if (rows) {
        float* dst = dyp + r * D;
        for (int64_t j = 0; j < D; ++j) dst[j] = wk * dyt[j];
      }
      if (dots) {
        const float* src = yp + r * D;
        double dot = 0;
        for (int64_t j = 0; j < D; ++j) dot += double(dyt[j]) * double(src[j]);
        dw[t * K + k] = float(dot);
      }
    }
  }
}

}  // namespace mt::cpu
