// CUDA SwiGLU on a fused [gate | up] tensor: h = silu(gate) * up, silu(g) = g / (1 + exp(-g)), bf16 in and
// out with the element math in f32 (full-precision expf), so each output carries one bf16 rounding
// relative to the CPU reference's fp64 math.
//
// Launch: a grid-stride loop over groups of VEC consecutive columns of one row (VEC = 8, 16-byte
// accesses, when F % 8 == 0 and the bases are aligned; otherwise 1).
#include <algorithm>
#include <cstdint>

#include "backend/cuda/common.cuh"
#include "backend/cuda/cuda_ops.h"

namespace mt::cuda {

namespace {

using bf16 = __nv_bfloat16;

constexpr int kThreads = 256;
constexpr int64_t kMaxGrid = 8192;

template <class T, int N>
struct alignas(sizeof(T) * N) Pack {
  T v[N];
};

inline bool aligned16(const void* p) {
  return reinterpret_cast<uintptr_t>(p) % 16 == 0;
}

template <int VEC>
__global__ void swiglu_fwd_kernel(const bf16* __restrict__ gu, bf16* __restrict__ h, int64_t N, int64_t F) {
  using P = Pack<bf16, VEC>;
  const int64_t per_row = F / VEC, total = N * per_row;
  for (int64_t k = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; k < total; k += int64_t(gridDim.x) * blockDim.x) {
    const int64_t n = k / per_row, f = (k - n * per_row) * VEC;
    const P g = *reinterpret_cast<const P*>(gu + n * 2 * F + f);
    const P u = *reinterpret_cast<const P*>(gu + n * 2 * F + F + f);
    P out;
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
      const float gf = __bfloat162float(g.v[j]);
      out.v[j] = __float2bfloat16_rn(gf / (1.0f + expf(-gf)) * __bfloat162float(u.v[j]));
    }
    *reinterpret_cast<P*>(h + n * F + f) = out;
  }
}

template <int VEC>
__global__ void swiglu_bwd_kernel(const bf16* __restrict__ dh, const bf16* __restrict__ gu, bf16* __restrict__ dgu,
                                  int64_t N, int64_t F) {
  using P = Pack<bf16, VEC>;
  const int64_t per_row = F / VEC, total = N * per_row;
  for (int64_t k = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; k < total; k += int64_t(gridDim.x) * blockDim.x) {
    const int64_t n = k / per_row, f = (k - n * per_row) * VEC;
    const P g = *reinterpret_cast<const P*>(gu + n * 2 * F + f);
    const P u = *reinterpret_cast<const P*>(gu + n * 2 * F + F + f);
    const P d = *reinterpret_cast<const P*>(dh + n * F + f);
    P dg, du;
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
      const float gf = __bfloat162float(g.v[j]), uf = __bfloat162float(u.v[j]), df = __bfloat162float(d.v[j]);
      const float sig = 1.0f / (1.0f + expf(-gf));
      // d silu/dg = sig + g * sig * (1 - sig)
      dg.v[j] = __float2bfloat16_rn(df * uf * sig * (1.0f + gf * (1.0f - sig)));
      du.v[j] = __float2bfloat16_rn(df * gf * sig);
    }
    *reinterpret_cast<P*>(dgu + n * 2 * F + f) = dg;
    *reinterpret_cast<P*>(dgu + n * 2 * F + F + f) = du;
  }
}

// Checks gu_N2F (bf16 [N, 2F]) and other_NF (bf16 [N, F]) on CUDA; returns F.
int64_t check_swiglu(const Tensor& gu_N2F, const Tensor& other_NF, const char* op, const char* other_name) {
  check_cuda(gu_N2F, DType::BF16, str(op, " gu_N2F").c_str());
  MT_CHECK(gu_N2F.dim() == 2, op, " gu_N2F must be 2-D, got ", gu_N2F.desc());
  MT_CHECK(gu_N2F.size(1) % 2 == 0, op, " gu_N2F last dim must be even ([gate | up]), got ", gu_N2F.desc());
  const int64_t F = gu_N2F.size(1) / 2;
  check_cuda(other_NF, DType::BF16, {gu_N2F.size(0), F}, other_name);
  return F;
}

unsigned grid_for(int64_t work) {
  return unsigned(std::clamp<int64_t>((work + kThreads - 1) / kThreads, 1, kMaxGrid));
}

}  // namespace

void swiglu_fwd(const Tensor& gu_N2F, Tensor& h_NF) {
  const int64_t F = check_swiglu(gu_N2F, h_NF, "swiglu_fwd", "swiglu_fwd h_NF");
  const int64_t N = gu_N2F.size(0);
  if (N == 0 || F == 0) return;
  const auto* gu = static_cast<const bf16*>(gu_N2F.raw());
  auto* h = static_cast<bf16*>(h_NF.raw());
  if (F % 8 == 0 && aligned16(gu) && aligned16(h))
    swiglu_fwd_kernel<8><<<grid_for(N * F / 8), kThreads, 0, stream()>>>(gu, h, N, F);
  else
    swiglu_fwd_kernel<1><<<grid_for(N * F), kThreads, 0, stream()>>>(gu, h, N, F);
  MT_CUDA_LAUNCH_CHECK("swiglu_fwd");
}

void swiglu_bwd(const Tensor& dh_NF, const Tensor& gu_N2F, Tensor& dgu_N2F) {
  const int64_t F = check_swiglu(gu_N2F, dh_NF, "swiglu_bwd", "swiglu_bwd dh_NF");
  check_cuda(dgu_N2F, DType::BF16, gu_N2F.shape(), "swiglu_bwd dgu_N2F");
  const int64_t N = gu_N2F.size(0);
  if (N == 0 || F == 0) return;
  const auto* dh = static_cast<const bf16*>(dh_NF.raw());
  const auto* gu = static_cast<const bf16*>(gu_N2F.raw());
  auto* dgu = static_cast<bf16*>(dgu_N2F.raw());
  if (F % 8 == 0 && aligned16(dh) && aligned16(gu) && aligned16(dgu))
    swiglu_bwd_kernel<8><<<grid_for(N * F / 8), kThreads, 0, stream()>>>(dh, gu, dgu, N, F);
  else
    swiglu_bwd_kernel<1><<<grid_for(N * F), kThreads, 0, stream()>>>(dh, gu, dgu, N, F);
  MT_CUDA_LAUNCH_CHECK("swiglu_bwd");
}

}  // namespace mt::cuda
