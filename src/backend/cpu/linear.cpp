// CPU linear layers with the HF weight layout (w_OI is [out, in]), both directions through sgemm.
// Contract (ops.h): y = x @ w^T; dx = (or +=) dy @ w; dw += (or =) dy^T @ x.
#include "backend/cpu/cpu_ops.h"
#include "backend/cpu/gemm.h"

namespace mt::cpu {

static void require_2d(const Tensor& t, const char* what) {
  if (t.dim() != 2) MT_THROW(what, " must be 2-D, got shape ", shape_str(t.shape()));
  check_dtype(t, DType::F32, what);
}

void linear_fwd(const Tensor& x_TI, const Tensor& w_OI, Tensor& y_TO) {
  require_2d(x_TI, "linear_fwd x_TI");
  require_2d(w_OI, "linear_fwd w_OI");
  const int64_t T = x_TI.size(0), I = x_TI.size(1), O = w_OI.size(0);
  check_shape(w_OI, {O, I}, "linear_fwd w_OI");
  check_shape(y_TO, {T, O}, "linear_fwd y_TO");
  check_dtype(y_TO, DType::F32, "linear_fwd y_TO");
  sgemm(false, true, T, O, I, 1.0f, x_TI.data<float>(), I, w_OI.data<float>(), I, 0.0f, y_TO.data<float>(), O);
}

void linear_bwd(const Tensor& dy_TO, const Tensor& x_TI, const Tensor& w_OI, Tensor* dx_TI, bool accumulate_dx,
                Tensor& dw_OI, bool accumulate_dw) {
  require_2d(x_TI, "linear_bwd x_TI");
  require_2d(w_OI, "linear_bwd w_OI");
  const int64_t T = x_TI.size(0), I = x_TI.size(1), O = w_OI.size(0);
  check_shape(w_OI, {O, I}, "linear_bwd w_OI");
  check_shape(dy_TO, {T, O}, "linear_bwd dy_TO");
  check_dtype(dy_TO, DType::F32, "linear_bwd dy_TO");
  check_shape(dw_OI, {O, I}, "linear_bwd dw_OI");
  check_dtype(dw_OI, DType::F32, "linear_bwd dw_OI");
  if (dx_TI) {
    check_shape(*dx_TI, {T, I}, "linear_bwd dx_TI");
    check_dtype(*dx_TI, DType::F32, "linear_bwd dx_TI");
    sgemm(false, false, T, I, O, 1.0f, dy_TO.data<float>(), O, w_OI.data<float>(), I, accumulate_dx ? 1.0f : 0.0f,
          dx_TI->data<float>(), I);
  }
  sgemm(true, false, O, I, T, 1.0f, dy_TO.data<float>(), O, x_TI.data<float>(), I, accumulate_dw ? 1.0f : 0.0f,
        dw_OI.data<float>(), I);
}

}  // namespace mt::cpu
