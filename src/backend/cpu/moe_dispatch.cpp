// CPU reference for dropless token dispatch: the plan (a stable counting sort of the T*K
// assignments by expert), the permutation of token rows into expert-contiguous rows, and the
// weighted un-permutation back to tokens. Every loop runs in a fixed order so that results are
// bit-reproducible run to run.
#include <algorithm>
#include <cstring>
#include <limits>
#include <vector>

#include "backend/cpu/cpu_ops.h"

namespace mt::cpu {

namespace {

void check_matrix(const Tensor& t, DType dtype, const char* what) {
  MT_CHECK(t.dim() == 2, what, " must be 2-D, got ", t.desc());
  check_dtype(t, dtype, what);
}

}  // namespace

void make_dispatch_plan(const Tensor& topk_idx_TK, int64_t E, Tensor& offsets_E1, Tensor& assign_of_row_R,
                        Tensor& row_of_assign_TK) {
  check_matrix(topk_idx_TK, DType::I32, "make_dispatch_plan topk_idx_TK");
  if (E < 1) MT_THROW("make_dispatch_plan: expert count E (", E, ") must be at least 1");
  const int64_t T = topk_idx_TK.size(0), K = topk_idx_TK.size(1), R = T * K;
  if (R > std::numeric_limits<int32_t>::max())
    MT_THROW("make_dispatch_plan: T*K (", T, "*", K, " = ", R, ") dispatched rows exceed the i32 row index range");
  check_shape(offsets_E1, {E + 1}, "make_dispatch_plan offsets_E1");
  check_dtype(offsets_E1, DType::I64, "make_dispatch_plan offsets_E1");
  check_shape(assign_of_row_R, {R}, "make_dispatch_plan assign_of_row_R");
  check_dtype(assign_of_row_R, DType::I32, "make_dispatch_plan assign_of_row_R");
  check_shape(row_of_assign_TK, {T, K}, "make_dispatch_plan row_of_assign_TK");
  check_dtype(row_of_assign_TK, DType::I32, "make_dispatch_plan row_of_assign_TK");

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
  check_matrix(x_TD, DType::F32, "permute_fwd x_TD");
  MT_CHECK(assign_of_row_R.dim() == 1, "permute_fwd assign_of_row_R must be 1-D, got ", assign_of_row_R.desc());
  check_dtype(assign_of_row_R, DType::I32, "permute_fwd assign_of_row_R");
  MT_CHECK(K >= 1, "permute_fwd: K (", K, ") must be at least 1");
  const int64_t T = x_TD.size(0), D = x_TD.size(1), R = assign_of_row_R.size(0);
  check_shape(xp_RD, {R, D}, "permute_fwd xp_RD");
  check_dtype(xp_RD, DType::F32, "permute_fwd xp_RD");
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
  check_matrix(dxp_RD, DType::F32, "permute_bwd dxp_RD");
  MT_CHECK(assign_of_row_R.dim() == 1, "permute_bwd assign_of_row_R must be 1-D, got ", assign_of_row_R.desc());
  check_dtype(assign_of_row_R, DType::I32, "permute_bwd assign_of_row_R");
  MT_CHECK(K >= 1, "permute_bwd: K (", K, ") must be at least 1");
  check_matrix(dx_TD, DType::F32, "permute_bwd dx_TD");
  const int64_t R = dxp_RD.size(0), D = dxp_RD.size(1), T = dx_TD.size(0);
  check_shape(assign_of_row_R, {R}, "permute_bwd assign_of_row_R");
  check_shape(dx_TD, {T, D}, "permute_bwd dx_TD");
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
  check_matrix(yp_RD, DType::F32, "unpermute_fwd yp_RD");
  check_matrix(row_of_assign_TK, DType::I32, "unpermute_fwd row_of_assign_TK");
  const int64_t R = yp_RD.size(0), D = yp_RD.size(1);
  const int64_t T = row_of_assign_TK.size(0), K = row_of_assign_TK.size(1);
  check_shape(w_TK, {T, K}, "unpermute_fwd w_TK");
  check_dtype(w_TK, DType::F32, "unpermute_fwd w_TK");
  check_shape(y_TD, {T, D}, "unpermute_fwd y_TD");
  check_dtype(y_TD, DType::F32, "unpermute_fwd y_TD");
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
  // undefined = no rows written (ops::permute_weighted_fwd / _bwd use one half each).
  const bool rows = dyp_RD.defined(), dots = yp_RD.defined();
  MT_CHECK(rows || dots, "unpermute_bwd: neither dyp_RD nor yp_RD given");
  check_matrix(dy_TD, DType::F32, "unpermute_bwd dy_TD");
  check_matrix(row_of_assign_TK, DType::I32, "unpermute_bwd row_of_assign_TK");
  const Tensor& rd = dots ? yp_RD : dyp_RD;
  check_matrix(rd, DType::F32, dots ? "unpermute_bwd yp_RD" : "unpermute_bwd dyp_RD");
  const int64_t T = dy_TD.size(0), D = dy_TD.size(1), R = rd.size(0), K = row_of_assign_TK.size(1);
  check_shape(rd, {R, D}, dots ? "unpermute_bwd yp_RD" : "unpermute_bwd dyp_RD");
  check_shape(row_of_assign_TK, {T, K}, "unpermute_bwd row_of_assign_TK");
  check_shape(w_TK, {T, K}, "unpermute_bwd w_TK");
  check_dtype(w_TK, DType::F32, "unpermute_bwd w_TK");
  if (rows) {
    check_shape(dyp_RD, {R, D}, "unpermute_bwd dyp_RD");
    check_dtype(dyp_RD, DType::F32, "unpermute_bwd dyp_RD");
  }
  if (dots) {
    check_shape(dw_TK, {T, K}, "unpermute_bwd dw_TK");
    check_dtype(dw_TK, DType::F32, "unpermute_bwd dw_TK");
  }
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
