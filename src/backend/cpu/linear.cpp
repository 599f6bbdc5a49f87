// CPU linear layers with the HF weight layout (w_OI is [out, in]), both directions through sgemm.
// Contract (ops.h): y = x @ w^T (linear_fwd_add: + r); dx = (or +=) dy @ w; dw += (or =) dy^T @ x.
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

// y = x w^T, then y += r in f32 (the same bits as linear_fwd then add_). With r being y itself, the GEMM
// goes to a temporary first.
void linear_fwd_add(const Tensor& x_TI, const Tensor& w_OI, const Tensor& r_TO, Tensor& y_TO) {
  require_2d(r_TO, "linear_fwd_add r_TO");
  check_shape(r_TO, y_TO.shape(), "linear_fwd_add r_TO");
  const bool in_place = r_TO.raw() == y_TO.raw();
  if (!in_place && y_TO.numel() > 0) {
    const char* r0 = static_cast<const char*>(r_TO.raw());
    const char* y0 = static_cast<const char*>(y_TO.raw());
    if (r0 < y0 + y_TO.nbytes() && y0 < r0 + r_TO.nbytes())
      MT_THROW("linear_fwd_add: r_TO ", r_TO.desc(), " overlaps y_TO without being it (pass y or a separate one)");
  }
  Tensor y = in_place ? Tensor::empty(y_TO.shape()) : y_TO;
  linear_fwd(x_TI, w_OI, y);
  float* py = y_TO.data<float>();
  const float* pr = r_TO.data<float>();
  const float* pg = y.data<float>();
  for (int64_t i = 0; i < y_TO.numel(); ++i) py[i] = pg[i] + pr[i];
}

void linear_bwd(const Tensor& dy_TO, const Tensor& x_TI, const Tensor& w_OI, Tensor* dx_TI, bool accumulate_dx,
                Tensor& dw_OI, bool accumulate_dw) {
  require_2d(x_TI, "linear_bwd x_TI");
  require_2d(w_OI, "linear_bwd w_OI");
  const int64_t T = x_TI.size(0), I = x_TI.size(1), O = w_OI.size(0);
  check_shape(w_OI, {O, I}, "linear_bwd w_OI");
  check_shape(dy_TO, {T, O}, "linear_bwd dy_TO");
  check_dtype(dy_TO, DType::F32, "linear_bwd dy_TO");
  if (dw_OI.defined()) {
    check_shape(dw_OI, {O, I}, "linear_bwd dw_OI");
    check_dtype(dw_OI, DType::F32, "linear_bwd dw_OI");
  }
  if (dx_TI) {
    check_shape(*dx_TI, {T, I}, "linear_bwd dx_TI");
    check_dtype(*dx_TI, DType::F32, "linear_bwd dx_TI");
    sgemm(false, false, T, I, O, 1.0f, dy_TO.data<float>(), O, w_OI.data<float>(), I, accumulate_dx ? 1.0f : 0.0f,
          dx_TI->data<float>(), I);
  }
  if (!dw_OI.defined()) return;  // a frozen weight
  sgemm(true, false, O, I, T, 1.0f, dy_TO.data<float>(), O, x_TI.data<float>(), I, accumulate_dw ? 1.0f : 0.0f,
        dw_OI.data<float>(), I);
}

}  // namespace mt::cpu
