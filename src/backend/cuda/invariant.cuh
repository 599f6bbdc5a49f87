// The batch-invariant CUDA kernels (core/determinism.h, MOETRAIN_BATCH_INVARIANT=1 or --true-on-policy): with
// them a token's log-prob depends on its own sequence only, not on the rows around it, so the rollout engine's
// log-probs equal the trainer's forward on the same tokens bit for bit. What makes the default kernels differ
// with the batch: cuBLASLt picks its algorithm (tiles, split-K) by the row count, the grouped expert GEMM its tile
// by the rows per expert, the paged decode attention splits a sequence's positions by how many tokens share the
// launch and the training attention is another kernel altogether (cuDNN), and the sampler and the LM head sum
// their log-sum-exp in different trees. In the mode:
//   - every forward GEMM (C = A B^T: the linear layers, the LM head, the router, the experts, the adapters) runs
//     invariant_gemm_nt: each C element is one fp32 accumulator that takes the K dimension in steps of 16 in
//     order (one tensor-core MMA per step for bf16 operands, one fused multiply-add per element for f32), no split-K,
//     so its bits depend on its row of A and its column of B only, whatever the tile or the row count;
//   - attention, training and decode, is attend_row_warp below: one warp per (token, query head) walking the keys
//     in order with an online softmax in explicitly rounded f32 operations;
//   - a log-prob from f32 logits is row_logprob below, one fixed reduction tree, for the sampler and the LM head.
// The backward keeps its fast kernels (its bits do not reach a log-prob). docs/rl.md "Bit-equal rollout and
// trainer log-probs".
#pragma once
#include <cuda_bf16.h>

#include <cmath>
#include <cstdint>

#include "backend/cuda/invariant.h"

namespace mt::cuda {

// --- device functions, shared by the kernels that must agree bit for bit ---

constexpr int kRowLogprobThreads = 256;

// Merges the online-softmax state (max m2, sum of exp(x - m2) s2) into (m, s).
__device__ __forceinline__ void row_lse_merge(float& m, float& s, float m2, float s2) {
  if (m2 == -INFINITY) return;
  if (m == -INFINITY) {
    m = m2;
    s = s2;
    return;
  }
  const float M = fmaxf(m, m2);
  s = __fadd_rn(__fmul_rn(s, expf(__fsub_rn(m, M))), __fmul_rn(s2, expf(__fsub_rn(m2, M))));
  m = M;
}

// The log-prob of token t under the softmax of the f32 row x[0, V), computed by a block of exactly
// kRowLogprobThreads threads (every thread calls it; every thread gets the result): each thread keeps an online
// (max, sum) over v = thread, thread + 256, ..., then a fixed tree over the threads; logp = (x_t - max) - log(sum).
__device__ __forceinline__ float row_logprob(const float* __restrict__ x, int64_t V, int64_t t) {
  __shared__ float sm[kRowLogprobThreads], ss[kRowLogprobThreads];
  float m = -INFINITY, s = 0.0f;
  for (int64_t v = threadIdx.x; v < V; v += kRowLogprobThreads) row_lse_merge(m, s, x[v], 1.0f);
  sm[threadIdx.x] = m;
  ss[threadIdx.x] = s;
  __syncthreads();
  for (int w = kRowLogprobThreads / 2; w > 0; w >>= 1) {
    if (int(threadIdx.x) < w) {
      float a = sm[threadIdx.x], b = ss[threadIdx.x];
      row_lse_merge(a, b, sm[threadIdx.x + w], ss[threadIdx.x + w]);
      sm[threadIdx.x] = a;
      ss[threadIdx.x] = b;
    }
    __syncthreads();
  }
  const float r = __fsub_rn(__fsub_rn(x[t], sm[0]), logf(ss[0]));
  __syncthreads();  // the shared arrays are free for the caller's next row
  return r;
}

// One query row of attention by one warp (all 32 lanes call it): q [Hd] bf16, keys j = 0..n-1 at kc + row(j) * Hd
// and values at vc + row(j) * Hd (bf16), PER_LANE = ceil(Hd / 32) dims per lane. Scores q.k_j * scale (lane
// products summed by a fixed shuffle tree), an online softmax over j in order, the weighted sum of the values, all
// in explicitly rounded f32 operations (no contraction the compiler could choose differently per kernel). Writes
// out [Hd] bf16 and returns the scores' log-sum-exp (natural log) to every lane.
template <int PER_LANE, class Row>
__device__ __forceinline__ float attend_row_warp(const __nv_bfloat16* __restrict__ q, int64_t n, int64_t Hd,
                                                 float scale, const __nv_bfloat16* __restrict__ kc,
                                                 const __nv_bfloat16* __restrict__ vc, const Row& row,
                                                 __nv_bfloat16* __restrict__ out) {
  const int lane = threadIdx.x % 32;
  float qv[PER_LANE], acc[PER_LANE];
#pragma unroll
  for (int i = 0; i < PER_LANE; ++i) {
    const int64_t j = lane + 32 * i;  // lanes past Hd hold zeros
    qv[i] = j < Hd ? __bfloat162float(q[j]) : 0.0f;
    acc[i] = 0.0f;
  }
  float m = -INFINITY, sum = 0.0f;
  // Key and value p + 1 are loaded while position p is computed (the loop is latency-bound otherwise); the
  // arithmetic is the same.
  __nv_bfloat16 kn[PER_LANE], vn[PER_LANE];
  auto load = [&](int64_t p) {
    const int64_t s = row(p);
#pragma unroll
    for (int i = 0; i < PER_LANE; ++i) {
      const bool in = lane + 32 * i < Hd;
      kn[i] = in ? kc[s * Hd + lane + 32 * i] : __nv_bfloat16();
      vn[i] = in ? vc[s * Hd + lane + 32 * i] : __nv_bfloat16();
    }
  };
  if (n > 0) load(0);
  for (int64_t p = 0; p < n; ++p) {
    float kv[PER_LANE], vv[PER_LANE];
#pragma unroll
    for (int i = 0; i < PER_LANE; ++i) {
      kv[i] = __bfloat162float(kn[i]);
      vv[i] = __bfloat162float(vn[i]);
    }
    if (p + 1 < n) load(p + 1);
    float d = 0.0f;
#pragma unroll
    for (int i = 0; i < PER_LANE; ++i)
      if (lane + 32 * i < Hd) d = __fmaf_rn(qv[i], kv[i], d);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) d = __fadd_rn(d, __shfl_xor_sync(0xffffffffu, d, o));
    const float x = __fmul_rn(d, scale), mn = fmaxf(m, x), corr = expf(__fsub_rn(m, mn)), e = expf(__fsub_rn(x, mn));
    sum = __fmaf_rn(sum, corr, e);
#pragma unroll
    for (int i = 0; i < PER_LANE; ++i)
      if (lane + 32 * i < Hd) acc[i] = __fmaf_rn(e, vv[i], __fmul_rn(acc[i], corr));
    m = mn;
  }
#pragma unroll
  for (int i = 0; i < PER_LANE; ++i)
    if (lane + 32 * i < Hd) out[lane + 32 * i] = __float2bfloat16_rn(__fdiv_rn(acc[i], sum));
  return __fadd_rn(m, logf(sum));
}

}  // namespace mt::cuda
