// CUDA rotary position embedding, rotate-half form, in place on bf16 [T, heads, Hd].
//
// Same numbers as backend/cpu/rope.cpp (which follows transformers): inv_freq is computed on the host
// with the CPU's own expression (so it is bitwise the CPU's), the angle is the f32 product
// float(pos) * inv_freq, cos/sin are the full-precision cosf/sinf of that angle (within 2 ulp of the
// host's; not the __sinf intrinsics, whose error grows with the angle), and the rotation is done in f32
// in the CPU's order of operations without FMA contraction; only the store rounds to bf16.
//
// Launch: one block per token (grid-stride); the block computes the Hd/2 cos/sin pairs once into shared
// memory and then rotates every head of that token.
#include <algorithm>
#include <cmath>
#include <cstdint>

#include "backend/cuda/common.cuh"
#include "backend/cuda/cuda_ops.h"

namespace mt::cuda {

namespace {

using bf16 = __nv_bfloat16;

constexpr int kThreads = 256;
constexpr int kMaxHalf = 256;  // Hd up to 512: inv_freq travels as a kernel argument
constexpr int64_t kMaxGrid = int64_t(1) << 20;

struct InvFreq {
  float v[kMaxHalf];
};

// sign = +1 rotates by +angle (forward), -1 by -angle (the transpose, which is the backward).
__global__ void rope_kernel(bf16* __restrict__ x, const int32_t* __restrict__ pos, int64_t T, int64_t N, int half,
                            InvFreq f, float sign) {
  extern __shared__ float s_cs[];  // [cos_0..cos_{half-1}, sin_0..sin_{half-1}]
  const int64_t Hd = 2 * int64_t(half);
  for (int64_t t = blockIdx.x; t < T; t += gridDim.x) {
    __syncthreads();  // the previous token is done with s_cs
    const float p = float(pos[t]);
    for (int i = threadIdx.x; i < half; i += blockDim.x) {
      const float angle = __fmul_rn(p, f.v[i]);
      s_cs[i] = cosf(angle);
      s_cs[half + i] = sign * sinf(angle);
    }
    __syncthreads();
    bf16* xt = x + t * N * Hd;
    for (int64_t k = threadIdx.x; k < N * half; k += blockDim.x) {
      const int64_t n = k / half;
      const int i = int(k - n * half);
      bf16* v = xt + n * Hd;
      const float a = __bfloat162float(v[i]), b = __bfloat162float(v[i + half]);
      const float c = s_cs[i], s = s_cs[half + i];
      v[i] = __float2bfloat16_rn(__fadd_rn(__fmul_rn(a, c), __fmul_rn(-b, s)));
      v[i + half] = __float2bfloat16_rn(__fadd_rn(__fmul_rn(b, c), __fmul_rn(a, s)));
    }
  }
}

void rope_apply(Tensor& x_TNHd, const Tensor& pos_T, float theta, float sign, const char* op) {
  check_cuda(x_TNHd, DType::BF16, str(op, " x_TNHd").c_str());
  if (x_TNHd.dim() != 3) MT_THROW(op, " x_TNHd must be 3-D [T, heads, Hd], got shape ", shape_str(x_TNHd.shape()));
  const int64_t T = x_TNHd.size(0), N = x_TNHd.size(1), Hd = x_TNHd.size(2), half = Hd / 2;
  if (Hd % 2 != 0) MT_THROW(op, ": head dim Hd (", Hd, ") must be even for rotate-half RoPE");
  if (half > kMaxHalf) MT_THROW(op, ": head dim Hd (", Hd, ") is above the CUDA kernel's limit of ", 2 * kMaxHalf);
  check_cuda(pos_T, DType::I32, {T}, str(op, " pos_T").c_str());
  if (!(theta > 0.0f) || !std::isfinite(theta)) MT_THROW(op, ": rope theta (", theta, ") must be a positive number");
  if (x_TNHd.numel() == 0) return;

  InvFreq f{};
  for (int64_t i = 0; i < half; ++i) f.v[i] = 1.0f / std::pow(theta, float(2 * i) / float(Hd));  // as the CPU
  const unsigned grid = unsigned(std::min(T, kMaxGrid));
  rope_kernel<<<grid, kThreads, size_t(2 * half) * sizeof(float), stream()>>>(
      static_cast<bf16*>(x_TNHd.raw()), pos_T.data<int32_t>(), T, N, int(half), f, sign);
  MT_CUDA_LAUNCH_CHECK(op);
}

}  // namespace

void rope_fwd(Tensor& x_TNHd, const Tensor& pos_T, float theta) {
  rope_apply(x_TNHd, pos_T, theta, 1.0f, "rope_fwd");
}

void rope_bwd(Tensor& dx_TNHd, const Tensor& pos_T, float theta) {
  rope_apply(dx_TNHd, pos_T, theta, -1.0f, "rope_bwd");
}

}  // namespace mt::cuda
