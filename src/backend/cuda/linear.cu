// CUDA linear layers (HF layout, w_OI is [out, in]) on the cuBLASLt GEMM, f32 accumulation.
// Contract (ops.h): y = x @ w^T (bf16 or f32 y); dx = (or +=) dy @ w (bf16); dw += (or =) dy^T @ x (f32).
// An f32 dy is rounded to bf16 once (a temporary) because the GEMM takes bf16 operands.
#include <algorithm>

#include "backend/cuda/cuda_ops.h"
#include "backend/cuda/gemm.cuh"

namespace mt::cuda {

namespace {

__global__ void f32_to_bf16_kernel(const float* __restrict__ in, __nv_bfloat16* __restrict__ out, int64_t n) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    out[i] = __float2bfloat16_rn(in[i]);
}

void check_matrix(const Tensor& t, const char* what) {
  check_cuda(t, what);
  MT_CHECK(t.dim() == 2, what, " must be 2-D, got ", t.desc());
}

const __nv_bfloat16* bf16_ptr(const Tensor& t) {
  return static_cast<const __nv_bfloat16*>(t.raw());
}

}  // namespace

void linear_fwd(const Tensor& x_TI, const Tensor& w_OI, Tensor& y_TO) {
  check_matrix(x_TI, "linear_fwd x_TI");
  check_matrix(w_OI, "linear_fwd w_OI");
  check_dtype(x_TI, DType::BF16, "linear_fwd x_TI");
  const int64_t T = x_TI.size(0), I = x_TI.size(1), O = w_OI.size(0);
  check_cuda(w_OI, DType::BF16, {O, I}, "linear_fwd w_OI");
  check_cuda(y_TO, "linear_fwd y_TO");
  check_shape(y_TO, {T, O}, "linear_fwd y_TO");
  MT_CHECK(y_TO.dtype() == DType::BF16 || y_TO.dtype() == DType::F32, "linear_fwd y_TO must be bf16 or f32, got ",
           y_TO.desc());
  gemm("linear_fwd", false, true, T, O, I, bf16_ptr(x_TI), I, bf16_ptr(w_OI), I, 0.0f, y_TO.raw(), y_TO.dtype(), O);
}

void linear_bwd(const Tensor& dy_TO, const Tensor& x_TI, const Tensor& w_OI, Tensor* dx_TI, bool accumulate_dx,
                Tensor& dw_OI, bool accumulate_dw) {
  check_matrix(x_TI, "linear_bwd x_TI");
  check_matrix(w_OI, "linear_bwd w_OI");
  check_dtype(x_TI, DType::BF16, "linear_bwd x_TI");
  const int64_t T = x_TI.size(0), I = x_TI.size(1), O = w_OI.size(0);
  check_cuda(w_OI, DType::BF16, {O, I}, "linear_bwd w_OI");
  check_cuda(dy_TO, "linear_bwd dy_TO");
  check_shape(dy_TO, {T, O}, "linear_bwd dy_TO");
  MT_CHECK(dy_TO.dtype() == DType::BF16 || dy_TO.dtype() == DType::F32, "linear_bwd dy_TO must be bf16 or f32, got ",
           dy_TO.desc());
  check_cuda(dw_OI, DType::F32, {O, I}, "linear_bwd dw_OI");
  if (dx_TI) check_cuda(*dx_TI, DType::BF16, {T, I}, "linear_bwd dx_TI");

  const __nv_bfloat16* dy = bf16_ptr(dy_TO);
  if (dy_TO.dtype() == DType::F32 && T * O > 0) {
    static DeviceScratch dy_bf16;
    __nv_bfloat16* tmp = dy_bf16.as<__nv_bfloat16>(T * O, "linear_bwd");
    const unsigned blocks = unsigned(std::min<int64_t>(blocks_for(T * O, 256), 65535));
    f32_to_bf16_kernel<<<blocks, 256, 0, stream()>>>(dy_TO.data<float>(), tmp, T * O);
    MT_CUDA_LAUNCH_CHECK("linear_bwd");
    dy = tmp;
  }
  if (dx_TI)
    gemm("linear_bwd dx", false, false, T, I, O, dy, O, bf16_ptr(w_OI), I, accumulate_dx ? 1.0f : 0.0f, dx_TI->raw(),
         DType::BF16, I);
  gemm("linear_bwd dw", true, false, O, I, T, dy, O, bf16_ptr(x_TI), I, accumulate_dw ? 1.0f : 0.0f, dw_OI.raw(),
       DType::F32, I);
}

}  // namespace mt::cuda
