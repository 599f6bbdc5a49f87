// CPU grouped linear layers: per expert e, one sgemm over its rows [off[e], off[e+1]).
// Contract (ops.h): y = (or +=) alpha x w[e]^T; dx = (or +=) alpha dy w[e]; dw[e] += alpha dy^T x.
#include "backend/cpu/cpu_ops.h"
#include "backend/cpu/gemm.h"

namespace mt::cpu {

namespace {

// offsets_E1 (i64, checked: non-decreasing from 0 to R) as a host pointer.
const int64_t* grouped_offsets(const Tensor& offsets_E1, int64_t E, int64_t R, const char* op) {
  check_dtype(offsets_E1, DType::I64, str(op, " offsets_E1").c_str());
  const int64_t* off = offsets_E1.data<int64_t>();
  MT_CHECK(off[0] == 0 && off[E] == R, op, ": offsets_E1 must run from 0 to R (", R, "), got ", off[0], " .. ",
           off[E]);
  for (int64_t e = 0; e < E; ++e)
    MT_CHECK(off[e] <= off[e + 1], op, ": offsets_E1 decrease at expert ", e, " (", off[e], " > ", off[e + 1], ")");
  return off;
}

}  // namespace

void grouped_linear_fwd(const Tensor& x_RK, const Tensor& offsets_E1, const Tensor& w_ENK, float alpha, Tensor& y_RN,
                        bool accumulate) {
  const char* op = "grouped_linear_fwd";
  check_dtype(x_RK, DType::F32, "grouped_linear_fwd x_RK");
  check_dtype(w_ENK, DType::F32, "grouped_linear_fwd w_ENK");
  check_dtype(y_RN, DType::F32, "grouped_linear_fwd y_RN");
  const int64_t E = w_ENK.size(0), N = w_ENK.size(1), K = w_ENK.size(2), R = x_RK.size(0);
  const int64_t* off = grouped_offsets(offsets_E1, E, R, op);
  const float* x = x_RK.data<float>();
  const float* w = w_ENK.data<float>();
  float* y = y_RN.data<float>();
  for (int64_t e = 0; e < E; ++e) {
    const int64_t r0 = off[e], n = off[e + 1] - r0;
    if (n > 0)
      sgemm(false, true, n, N, K, alpha, x + r0 * K, K, w + e * N * K, K, accumulate ? 1.0f : 0.0f, y + r0 * N, N);
  }
}

void grouped_linear_bwd(const Tensor& dy_RN, const Tensor& x_RK, const Tensor& offsets_E1, const Tensor& w_ENK,
                        float alpha, Tensor* dx_RK, bool accumulate_dx, Tensor& dw_ENK) {
  const char* op = "grouped_linear_bwd";
  check_dtype(dy_RN, DType::F32, "grouped_linear_bwd dy_RN");
  check_dtype(x_RK, DType::F32, "grouped_linear_bwd x_RK");
  check_dtype(w_ENK, DType::F32, "grouped_linear_bwd w_ENK");
  if (dx_RK) check_dtype(*dx_RK, DType::F32, "grouped_linear_bwd dx_RK");
  if (dw_ENK.defined()) check_dtype(dw_ENK, DType::F32, "grouped_linear_bwd dw_ENK");
  const int64_t E = w_ENK.size(0), N = w_ENK.size(1), K = w_ENK.size(2), R = x_RK.size(0);
  const int64_t* off = grouped_offsets(offsets_E1, E, R, op);
  const float* dy = dy_RN.data<float>();
  const float* x = x_RK.data<float>();
  const float* w = w_ENK.data<float>();
  for (int64_t e = 0; e < E; ++e) {
    const int64_t r0 = off[e], n = off[e + 1] - r0;
    if (n == 0) continue;
    if (dx_RK)  // dx = dy @ w[e]: [n, N] x [N, K]
      sgemm(false, false, n, K, N, alpha, dy + r0 * N, N, w + e * N * K, K, accumulate_dx ? 1.0f : 0.0f,
            dx_RK->data<float>() + r0 * K, K);
    if (dw_ENK.defined())  // dw[e] += dy^T @ x: [N, n] x [n, K]
      sgemm(true, false, N, K, n, alpha, dy + r0 * N, N, x + r0 * K, K, 1.0f, dw_ENK.data<float>() + e * N * K, K);
  }
}

}  // namespace mt::cpu
