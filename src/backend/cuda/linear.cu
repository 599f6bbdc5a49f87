// CUDA linear layers (HF layout, w_OI is [out, in]) on the cuBLASLt GEMM, f32 accumulation.
// Contract (ops.h): y = x @ w^T (linear_fwd_add: + r, in the GEMM's epilogue); dx = (or +=) dy @ w;
// dw += (or =) dy^T @ x (f32).
// A bf16 weight: bf16 GEMM operands (an f32 dy is rounded to bf16 once, a temporary), y and dx bf16 or
// f32. An f32 weight (the MoE router, kept in fp32 end to end): fp32 GEMMs, bf16 inputs widened to
// f32 first (exact), y and dx f32.
#include <algorithm>

#include "backend/cuda/cuda_ops.h"
#include "backend/cuda/gemm.cuh"

namespace mt::cuda {

namespace {

__global__ void f32_to_bf16_kernel(const float* __restrict__ in, __nv_bfloat16* __restrict__ out, int64_t n) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    out[i] = __float2bfloat16_rn(in[i]);
}

__global__ void bf16_to_f32_kernel(const __nv_bfloat16* __restrict__ in, float* __restrict__ out, int64_t n) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    out[i] = __bfloat162float(in[i]);
}

unsigned grid_for(int64_t n) {
  return unsigned(std::max<int64_t>(1, std::min<int64_t>(blocks_for(n, 256), 65535)));
}

// t as bf16: itself, or rounded once into `scratch`.
const __nv_bfloat16* as_bf16(const Tensor& t, DeviceScratch& scratch, const char* op) {
  if (t.dtype() == DType::BF16 || t.numel() == 0) return static_cast<const __nv_bfloat16*>(t.raw());
  __nv_bfloat16* tmp = scratch.as<__nv_bfloat16>(t.numel(), op);
  f32_to_bf16_kernel<<<grid_for(t.numel()), 256, 0, stream()>>>(t.data<float>(), tmp, t.numel());
  MT_CUDA_LAUNCH_CHECK(op);
  return tmp;
}

// t as f32: itself, or widened (exactly) into `scratch`.
const float* as_f32(const Tensor& t, DeviceScratch& scratch, const char* op) {
  if (t.dtype() == DType::F32 || t.numel() == 0) return static_cast<const float*>(t.raw());
  float* tmp = scratch.as<float>(t.numel(), op);
  bf16_to_f32_kernel<<<grid_for(t.numel()), 256, 0, stream()>>>(static_cast<const __nv_bfloat16*>(t.raw()), tmp,
                                                                 t.numel());
  MT_CUDA_LAUNCH_CHECK(op);
  return tmp;
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
  check_cuda_bf16_or_f32(x_TI, "linear_fwd x_TI");
  check_cuda_bf16_or_f32(w_OI, "linear_fwd w_OI");
  const int64_t T = x_TI.size(0), I = x_TI.size(1), O = w_OI.size(0);
  check_shape(w_OI, {O, I}, "linear_fwd w_OI");
  check_cuda_bf16_or_f32(y_TO, {T, O}, "linear_fwd y_TO");
  if (w_OI.dtype() == DType::F32) {
    MT_CHECK(y_TO.dtype() == DType::F32, "linear_fwd y_TO must be f32 with an f32 weight (fp32 GEMM), got ",
             y_TO.desc());
    static DeviceScratch x32;
    gemm("linear_fwd (fp32)", false, true, T, O, I, as_f32(x_TI, x32, "linear_fwd"), I, w_OI.data<float>(), I, 0.0f,
         y_TO.raw(), DType::F32, O);
    return;
  }
  MT_CHECK(x_TI.dtype() == DType::BF16, "linear_fwd x_TI must be bf16 with a bf16 weight, got ", x_TI.desc());
  gemm("linear_fwd", false, true, T, O, I, bf16_ptr(x_TI), I, bf16_ptr(w_OI), I, 0.0f, y_TO.raw(), y_TO.dtype(), O);
}

void linear_fwd_add(const Tensor& x_TI, const Tensor& w_OI, const Tensor& r_TO, Tensor& y_TO) {
  check_matrix(x_TI, "linear_fwd_add x_TI");
  check_matrix(w_OI, "linear_fwd_add w_OI");
  const int64_t T = x_TI.size(0), I = x_TI.size(1), O = w_OI.size(0);
  check_cuda(w_OI, DType::BF16, {O, I}, "linear_fwd_add w_OI");
  check_cuda(x_TI, DType::BF16, {T, I}, "linear_fwd_add x_TI");
  check_cuda_bf16_or_f32(y_TO, {T, O}, "linear_fwd_add y_TO");
  check_cuda(r_TO, y_TO.dtype(), {T, O}, "linear_fwd_add r_TO");
  if (r_TO.raw() != y_TO.raw() && y_TO.numel() > 0) {
    const char* r0 = static_cast<const char*>(r_TO.raw());
    const char* y0 = static_cast<const char*>(y_TO.raw());
    if (r0 < y0 + y_TO.nbytes() && y0 < r0 + r_TO.nbytes())
      MT_THROW("linear_fwd_add: r_TO ", r_TO.desc(), " overlaps y_TO without being it (pass y or a separate one)");
  }
  gemm_add("linear_fwd_add", false, true, T, O, I, bf16_ptr(x_TI), I, bf16_ptr(w_OI), I, r_TO.raw(), y_TO.raw(),
           y_TO.dtype(), O);
}

void linear_bwd(const Tensor& dy_TO, const Tensor& x_TI, const Tensor& w_OI, Tensor* dx_TI, bool accumulate_dx,
                Tensor& dw_OI, bool accumulate_dw) {
  check_matrix(x_TI, "linear_bwd x_TI");
  check_matrix(w_OI, "linear_bwd w_OI");
  check_cuda_bf16_or_f32(x_TI, "linear_bwd x_TI");
  check_cuda_bf16_or_f32(w_OI, "linear_bwd w_OI");
  const int64_t T = x_TI.size(0), I = x_TI.size(1), O = w_OI.size(0);
  check_shape(w_OI, {O, I}, "linear_bwd w_OI");
  check_cuda_bf16_or_f32(dy_TO, {T, O}, "linear_bwd dy_TO");
  if (dw_OI.defined()) check_cuda(dw_OI, DType::F32, {O, I}, "linear_bwd dw_OI");
  if (dx_TI) {
    check_cuda_bf16_or_f32(*dx_TI, {T, I}, "linear_bwd dx_TI");
  }
  if (w_OI.dtype() == DType::F32) {
    if (dx_TI)
      MT_CHECK(dx_TI->dtype() == DType::F32, "linear_bwd dx_TI must be f32 with an f32 weight (fp32 GEMM), got ",
               dx_TI->desc());
    static DeviceScratch dy32, x32;
    const float* dy = as_f32(dy_TO, dy32, "linear_bwd");
    if (dx_TI)
      gemm("linear_bwd dx (fp32)", false, false, T, I, O, dy, O, w_OI.data<float>(), I, accumulate_dx ? 1.0f : 0.0f,
           dx_TI->raw(), DType::F32, I);
    if (!dw_OI.defined()) return;  // a frozen weight
    gemm("linear_bwd dw (fp32)", true, false, O, I, T, dy, O, as_f32(x_TI, x32, "linear_bwd"), I,
         accumulate_dw ? 1.0f : 0.0f, dw_OI.raw(), DType::F32, I);
    return;
  }
  MT_CHECK(x_TI.dtype() == DType::BF16, "linear_bwd x_TI must be bf16 with a bf16 weight, got ", x_TI.desc());
  static DeviceScratch dy16;
  const __nv_bfloat16* dy = as_bf16(dy_TO, dy16, "linear_bwd");
  if (dx_TI)
    gemm("linear_bwd dx", false, false, T, I, O, dy, O, bf16_ptr(w_OI), I, accumulate_dx ? 1.0f : 0.0f, dx_TI->raw(),
         dx_TI->dtype(), I);
  if (!dw_OI.defined()) return;  // a frozen weight
  gemm("linear_bwd dw", true, false, O, I, T, dy, O, bf16_ptr(x_TI), I, accumulate_dw ? 1.0f : 0.0f, dw_OI.raw(),
       DType::F32, I);
}

}  // namespace mt::cuda
