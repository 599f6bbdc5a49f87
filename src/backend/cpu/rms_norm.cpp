// CPU RMSNorm over the last dim, as transformers' Qwen3RMSNorm computes it in fp32:
// y = w * (x * rstd), rstd = 1/sqrt(mean(x^2) + eps). The mean of squares, the backward's row dot
// product and dw's sum over rows are accumulated in fp64 so that long rows and many tokens do not
// lose digits; the saved rstd is rounded to f32 once and used as is by the backward. add_rms_norm_fwd/bwd
// fold the residual add into the same row loops (h += x before the norm; dx += dres after it), with the
// same f32 roundings as add_, so they equal the two-op sequences bit for bit.
#include <cmath>
#include <vector>

#include "backend/cpu/cpu_ops.h"

namespace mt::cpu {

// Checks x_ND (2-D f32; named x_role in errors) and w_D, returns {N, D}.
static std::pair<int64_t, int64_t> check_norm_args(const Tensor& x_ND, const Tensor& w_D, const Tensor& rstd_N,
                                                   const char* op, const char* x_role = "x_ND") {
  check_dtype(x_ND, DType::F32, str(op, " ", x_role).c_str());
  if (x_ND.dim() != 2) MT_THROW(op, " ", x_role, " must be 2-D, got shape ", shape_str(x_ND.shape()));
  const int64_t N = x_ND.size(0), D = x_ND.size(1);
  check_shape(w_D, {D}, str(op, " w_D").c_str());
  check_dtype(w_D, DType::F32, str(op, " w_D").c_str());
  check_shape(rstd_N, {N}, str(op, " rstd_N").c_str());
  check_dtype(rstd_N, DType::F32, str(op, " rstd_N").c_str());
  return {N, D};
}

// The forward of rms_norm_fwd (add null) and add_rms_norm_fwd (x, the op's h_ND, += add, its x_ND, row by
// row first, in f32 as add_ does, so the fused op gives the same bits as the two ops).
static void norm_fwd(const char* op, Tensor& x_ND, const Tensor* add_ND, const Tensor& w_D, float eps, Tensor& y_ND,
                     Tensor& rstd_N) {
  const auto [N, D] = check_norm_args(x_ND, w_D, rstd_N, op, add_ND ? "h_ND" : "x_ND");
  if (!(eps >= 0.0f)) MT_THROW(op, ": eps (", eps, ") must be >= 0");
  check_shape(y_ND, {N, D}, str(op, " y_ND").c_str());
  check_dtype(y_ND, DType::F32, str(op, " y_ND").c_str());
  if (add_ND) {
    check_shape(*add_ND, {N, D}, str(op, " x_ND").c_str());
    check_dtype(*add_ND, DType::F32, str(op, " x_ND").c_str());
  }
  float* x = x_ND.data<float>();
  const float* add = add_ND ? add_ND->data<float>() : nullptr;
  const float* w = w_D.data<float>();
  float* y = y_ND.data<float>();
  float* rstd = rstd_N.data<float>();
  for (int64_t n = 0; n < N; ++n) {
    float* xr = x + n * D;
    if (add)
      for (int64_t d = 0; d < D; ++d) xr[d] += add[n * D + d];
    double ss = 0;
    for (int64_t d = 0; d < D; ++d) ss += double(xr[d]) * double(xr[d]);
    const float r = float(1.0 / std::sqrt(ss / double(D) + double(eps)));
    rstd[n] = r;
    float* yr = y + n * D;
    for (int64_t d = 0; d < D; ++d) yr[d] = w[d] * (xr[d] * r);
  }
}

void rms_norm_fwd(const Tensor& x_ND, const Tensor& w_D, float eps, Tensor& y_ND, Tensor& rstd_N) {
  Tensor x = x_ND;  // a view: norm_fwd writes x only when given a tensor to add
  norm_fwd("rms_norm_fwd", x, nullptr, w_D, eps, y_ND, rstd_N);
}

void add_rms_norm_fwd(Tensor& h_ND, const Tensor& x_ND, const Tensor& w_D, float eps, Tensor& y_ND, Tensor& rstd_N) {
  norm_fwd("add_rms_norm_fwd", h_ND, &x_ND, w_D, eps, y_ND, rstd_N);
}

// With xn = x * r and r = (mean(x^2) + eps)^(-1/2): dr/dx_j = -r^3 x_j / D, so
// dx_j = r * (g_j - xn_j * mean_i(g_i * xn_i)) where g = dy * w; dw_j += sum_n dy_j * xn_j.
// The backward of both ops: with dres, dx = (the norm's dx rounded to f32) + dres in f32, as add_ would.
static void norm_bwd(const char* op, const Tensor& dy_ND, const Tensor& x_ND, const Tensor& w_D, const Tensor& rstd_N,
                     const Tensor* dres_ND, Tensor& dx_ND, Tensor& dw_D, bool accumulate_dw) {
  const auto [N, D] = check_norm_args(x_ND, w_D, rstd_N, op);
  check_shape(dy_ND, {N, D}, str(op, " dy_ND").c_str());
  check_dtype(dy_ND, DType::F32, str(op, " dy_ND").c_str());
  check_shape(dx_ND, {N, D}, str(op, " dx_ND").c_str());
  check_dtype(dx_ND, DType::F32, str(op, " dx_ND").c_str());
  check_shape(dw_D, {D}, str(op, " dw_D").c_str());
  check_dtype(dw_D, DType::F32, str(op, " dw_D").c_str());
  if (dres_ND) {
    check_shape(*dres_ND, {N, D}, str(op, " dres_ND").c_str());
    check_dtype(*dres_ND, DType::F32, str(op, " dres_ND").c_str());
  }
  const float* dres = dres_ND ? dres_ND->data<float>() : nullptr;
  const float* dy = dy_ND.data<float>();
  const float* x = x_ND.data<float>();
  const float* w = w_D.data<float>();
  const float* rstd = rstd_N.data<float>();
  float* dx = dx_ND.data<float>();
  float* dw = dw_D.data<float>();
  std::vector<double> dw_acc(size_t(D), 0.0);
  for (int64_t n = 0; n < N; ++n) {
    const float* xr = x + n * D;
    const float* dyr = dy + n * D;
    const double r = rstd[n];
    double dot = 0;
    for (int64_t d = 0; d < D; ++d) {
      const double xn = double(xr[d]) * r;
      dot += double(dyr[d]) * double(w[d]) * xn;
      dw_acc[size_t(d)] += double(dyr[d]) * xn;
    }
    const double mean_dot = D > 0 ? dot / double(D) : 0.0;
    float* dxr = dx + n * D;
    for (int64_t d = 0; d < D; ++d) dxr[d] = float(r * (double(dyr[d]) * double(w[d]) - double(xr[d]) * r * mean_dot));
    if (dres)
      for (int64_t d = 0; d < D; ++d) dxr[d] += dres[n * D + d];
  }
  for (int64_t d = 0; d < D; ++d) dw[d] = float(dw_acc[size_t(d)]) + (accumulate_dw ? dw[d] : 0.0f);
}

void rms_norm_bwd(const Tensor& dy_ND, const Tensor& x_ND, const Tensor& w_D, const Tensor& rstd_N, Tensor& dx_ND,
                  Tensor& dw_D, bool accumulate_dw) {
  norm_bwd("rms_norm_bwd", dy_ND, x_ND, w_D, rstd_N, nullptr, dx_ND, dw_D, accumulate_dw);
}

void add_rms_norm_bwd(const Tensor& dy_ND, const Tensor& x_ND, const Tensor& w_D, const Tensor& rstd_N,
                      const Tensor& dres_ND, Tensor& dx_ND, Tensor& dw_D, bool accumulate_dw) {
  norm_bwd("add_rms_norm_bwd", dy_ND, x_ND, w_D, rstd_N, &dres_ND, dx_ND, dw_D, accumulate_dw);
}

}  // namespace mt::cpu
