// CUDA paged KV cache: the first, simple version (correct before fast; bench/NOTES keeps its numbers).
// kv_cache_write: one thread per element. paged_attention_fwd: one warp per (token, query head); the
// warp walks the token's positions 0..pos, each lane holding Hd / 32 elements of q and of the output
// accumulator; the score is a warp reduction, the softmax online (running max and sum) in f32.
#include <algorithm>
#include <cmath>
#include <initializer_list>
#include <cstdint>

#include "backend/cuda/common.cuh"
#include "backend/cuda/cuda_ops.h"

namespace mt::cuda {

namespace {

using bf16 = __nv_bfloat16;
constexpr int kWarps = 4;
constexpr int kMaxPerLane = 8;  // Hd <= 256; lanes past Hd idle (Hd not a multiple of 32)

__global__ void kv_write_kernel(const bf16* __restrict__ k, const bf16* __restrict__ v, const int32_t* __restrict__ slot,
                                int64_t N, int64_t row, bf16* __restrict__ kc, bf16* __restrict__ vc) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < N * row; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t n = i / row, j = i - n * row, s = slot[n];
    kc[s * row + j] = k[i];
    vc[s * row + j] = v[i];
  }
}

template <int PER_LANE>
__global__ void paged_attention_kernel(const bf16* __restrict__ q, const bf16* __restrict__ kc,
                                       const bf16* __restrict__ vc, const int32_t* __restrict__ table, int64_t M,
                                       int64_t block_size, const int32_t* __restrict__ seq,
                                       const int32_t* __restrict__ pos, int64_t N, int64_t H, int64_t G, int64_t Hd,
                                       float scale, bf16* __restrict__ out) {
  const int lane = threadIdx.x % 32;
  const int64_t item = int64_t(blockIdx.x) * kWarps + threadIdx.x / 32;  // (token, head)
  if (item >= N * H) return;
  const int64_t n = item / H, h = item - n * H, g = h / (H / G);
  float qv[PER_LANE], acc[PER_LANE];
#pragma unroll
  for (int i = 0; i < PER_LANE; ++i) {
    const int64_t j = lane + 32 * i;  // lanes past Hd (Hd < 32 * PER_LANE) hold zeros
    qv[i] = j < Hd ? __bfloat162float(q[(n * H + h) * Hd + j]) : 0.0f;
    acc[i] = 0.0f;
  }
  const int32_t* row = table + int64_t(seq[n]) * M;
  const int64_t last = pos[n];
  float m = -INFINITY, sum = 0.0f;
  for (int64_t p = 0; p <= last; ++p) {
    const int64_t s = int64_t(row[p / block_size]) * block_size + p % block_size;
    const bf16* kp = kc + (s * G + g) * Hd;
    float d = 0.0f;
#pragma unroll
    for (int i = 0; i < PER_LANE; ++i)
      if (lane + 32 * i < Hd) d += qv[i] * __bfloat162float(kp[lane + 32 * i]);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) d += __shfl_xor_sync(0xffffffffu, d, o);
    const float x = d * scale, mn = fmaxf(m, x), corr = expf(m - mn), e = expf(x - mn);
    sum = sum * corr + e;
    const bf16* vp = vc + (s * G + g) * Hd;
#pragma unroll
    for (int i = 0; i < PER_LANE; ++i)
      if (lane + 32 * i < Hd) acc[i] = acc[i] * corr + e * __bfloat162float(vp[lane + 32 * i]);
    m = mn;
  }
#pragma unroll
  for (int i = 0; i < PER_LANE; ++i)
    if (lane + 32 * i < Hd) out[(n * H + h) * Hd + lane + 32 * i] = __float2bfloat16_rn(acc[i] / sum);
}

}  // namespace

void kv_cache_write(const Tensor& k_NGD, const Tensor& v_NGD, const Tensor& slot_N, Tensor& k_cache_SGD,
                    Tensor& v_cache_SGD) {
  const char* op = "kv_cache_write";
  for (const Tensor* t : std::initializer_list<const Tensor*>{&k_NGD, &v_NGD, &k_cache_SGD, &v_cache_SGD}) check_cuda(*t, DType::BF16, op);
  check_cuda(slot_N, DType::I32, op);
  const int64_t N = k_NGD.size(0), row = k_NGD.size(1) * k_NGD.size(2);
  if (N == 0) return;
  const unsigned grid = unsigned(std::min<int64_t>((N * row + 255) / 256, 65535));
  kv_write_kernel<<<grid, 256, 0, stream()>>>(static_cast<const bf16*>(k_NGD.raw()), static_cast<const bf16*>(v_NGD.raw()),
                                              slot_N.data<int32_t>(), N, row, static_cast<bf16*>(k_cache_SGD.raw()),
                                              static_cast<bf16*>(v_cache_SGD.raw()));
  MT_CUDA_LAUNCH_CHECK(op);
}

void paged_attention_fwd(const Tensor& q_NHD, const Tensor& k_cache_SGD, const Tensor& v_cache_SGD,
                         const Tensor& block_table_BM, int64_t block_size, const Tensor& seq_N, const Tensor& pos_N,
                         Tensor& out_NHD) {
  const char* op = "paged_attention_fwd";
  for (const Tensor* t : std::initializer_list<const Tensor*>{&q_NHD, &k_cache_SGD, &v_cache_SGD, &out_NHD}) check_cuda(*t, DType::BF16, op);
  for (const Tensor* t : std::initializer_list<const Tensor*>{&block_table_BM, &seq_N, &pos_N}) check_cuda(*t, DType::I32, op);
  const int64_t N = q_NHD.size(0), H = q_NHD.size(1), Hd = q_NHD.size(2), G = k_cache_SGD.size(1);
  if (Hd < 1 || Hd > 32 * kMaxPerLane)
    MT_THROW(op, ": head_dim ", Hd, " is not supported by the CUDA kernel (1 to ", 32 * kMaxPerLane, ")");
  if (N == 0) return;
  const float scale = float(1.0 / std::sqrt(double(Hd)));
  const unsigned grid = unsigned((N * H + kWarps - 1) / kWarps);
  const auto* q = static_cast<const bf16*>(q_NHD.raw());
  const auto* kc = static_cast<const bf16*>(k_cache_SGD.raw());
  const auto* vc = static_cast<const bf16*>(v_cache_SGD.raw());
  auto* out = static_cast<bf16*>(out_NHD.raw());
  const int64_t M = block_table_BM.size(1);
#define MT_PAGED(PL)                                                                                               \
  paged_attention_kernel<PL><<<grid, 32 * kWarps, 0, stream()>>>(q, kc, vc, block_table_BM.data<int32_t>(), M,     \
                                                                 block_size, seq_N.data<int32_t>(),                \
                                                                 pos_N.data<int32_t>(), N, H, G, Hd, scale, out)
  const int64_t per_lane = (Hd + 31) / 32;
  if (per_lane == 1) MT_PAGED(1);
  else if (per_lane == 2) MT_PAGED(2);
  else if (per_lane <= 4) MT_PAGED(4);
  else MT_PAGED(8);
#undef MT_PAGED
  MT_CUDA_LAUNCH_CHECK(op);
}

}  // namespace mt::cuda
