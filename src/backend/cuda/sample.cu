// CUDA token sampling (ops::sample_tokens): the draw of ops/sampling.h, one thread block per row, in f32.
//
// Every pass reads the row's logits once (V f32); a thread takes groups of four consecutive tokens, the
// tokens one Philox call serves (ops/philox.h).
//   greedy (T = 0): one pass: the largest logit (lowest id on ties) and log-sum-exp at T = 1.
//   T > 0, no truncation: one pass: log-sum-exp of z = logits / T and the race max z_t - log(-log u_t).
//   min-p only: a pass for the maximum, then the race over w_t = exp(z_t - z_max) >= min_p.
//   top-k / top-p: each token has a 64-bit key, higher = earlier in "most probable first" order: the
//     order-preserving bits of its logit, then the complement of its id (lower id first on ties), so keys
//     are distinct. Top-k: the k-th largest key by radix selection (eight passes of 8-bit digits, counts).
//     Top-p: the last kept token by the same selection with histograms of weights: the token whose mass
//     strictly before it is < top_p x the top-k mass and whose own weight reaches it. Then the race over
//     keys at or above both thresholds (and min-p).
// The CPU reference computes in fp64; f32 here differs only where two race scores or a threshold's
// masses are within rounding (tests/cuda compare the two and the draws' distribution).
#include <cstdint>
#include <type_traits>

#include "backend/cuda/common.cuh"
#include "backend/cuda/cuda_ops.h"
#include "ops/philox.h"
#include "ops/sampling.h"

namespace mt::cuda {

namespace {

constexpr int kThreads = 512;
constexpr int kWarps = kThreads / 32;

struct Row {
  float T, top_p, min_p;
  int32_t top_k;
  uint64_t seed, sample;
  uint32_t position;
};

__device__ Row unpack(const int64_t* w64) {
  const uint64_t* w = reinterpret_cast<const uint64_t*>(w64);
  Row r;
  r.T = __uint_as_float(uint32_t(w[0]));
  r.top_p = __uint_as_float(uint32_t(w[0] >> 32));
  r.min_p = __uint_as_float(uint32_t(w[1]));
  r.top_k = int32_t(uint32_t(w[1] >> 32));
  r.seed = w[2];
  r.sample = w[3];
  r.position = uint32_t(w[4]);
  return r;
}

__device__ __forceinline__ uint64_t key_of(float x, int64_t t) {
  const uint32_t b = __float_as_uint(x);
  const uint32_t ord = (b & 0x80000000u) ? ~b : (b | 0x80000000u);
  return (uint64_t(ord) << 32) | uint64_t(0xFFFFFFFFu - uint32_t(t));
}

// -log u for the word's uniform number u = (w + 1/2) 2^-32 (ops/philox.h), in f32 without rounding u to 1:
// near 1 through log1p of 1 - u, which is exact in f32 there.
__device__ __forceinline__ float exp_clock(uint32_t w) {
  if (w < 0x80000000u) return -logf((float(w) + 0.5f) * 0x1.0p-32f);
  return -log1pf(-((float(0xFFFFFFFFu - w) + 0.5f) * 0x1.0p-32f));
}

// (max, sum of exp(x - max)) pairs: the online log-sum-exp.
struct Lse {
  float m, s;
};
__device__ __forceinline__ Lse lse_add(Lse a, Lse b) {
  if (a.m == -INFINITY) return b;
  if (b.m == -INFINITY) return a;
  const float m = fmaxf(a.m, b.m);
  return {m, a.s * expf(a.m - m) + b.s * expf(b.m - m)};
}
__device__ __forceinline__ Lse lse_push(Lse a, float x) { return lse_add(a, Lse{x, 1.0f}); }

// (score, token): larger score wins, then the lower token.
struct Best {
  float v;
  int32_t t;
};
__device__ __forceinline__ Best best_of(Best a, Best b) {
  if (b.t < 0) return a;
  if (a.t < 0) return b;
  return (b.v > a.v || (b.v == a.v && b.t < a.t)) ? b : a;
}

// The warp's reduction of x under op (T of 4 or 8 bytes, shuffled as raw bits).
template <class T, class Op>
__device__ T warp_reduce(T x, Op op) {
  static_assert(sizeof(T) == 4 || sizeof(T) == 8, "4- or 8-byte values");
  using Bits = std::conditional_t<sizeof(T) == 8, uint64_t, uint32_t>;
  for (int o = 16; o > 0; o >>= 1) {
    Bits bits;
    memcpy(&bits, &x, sizeof(T));
    bits = __shfl_xor_sync(0xffffffffu, bits, o);
    T y;
    memcpy(&y, &bits, sizeof(T));
    x = op(x, y);
  }
  return x;
}

// The block's reduction of x under op; identity is op's neutral element (the lanes past the warp count).
template <class T, class Op>
__device__ T block_reduce(T x, Op op, T identity, T* shared) {
  x = warp_reduce(x, op);
  const int w = threadIdx.x / 32, lane = threadIdx.x % 32;
  __syncthreads();  // shared may still be read by a previous reduction
  if (lane == 0) shared[w] = x;
  __syncthreads();
  if (w == 0) {
    x = warp_reduce(lane < kWarps ? shared[lane] : identity, op);
    if (lane == 0) shared[0] = x;
  }
  __syncthreads();
  return shared[0];
}

// Radix selection over the keys of the candidate tokens (those `take` accepts), MSB digit first. By
// count (WEIGHTED false): the key of the k-th largest candidate. By weight: the key of the candidate
// whose weight-before (in descending key order) is < limit and whose weight-through reaches it, or the
// smallest candidate key when rounding leaves the limit above the total.
template <bool WEIGHTED, class Take, class Weight>
__device__ uint64_t radix_select(const float* x, int64_t V, Take take, Weight weight, float* hist_w,
                                 unsigned* hist_c, uint64_t* s_prefix, double* s_target) {
  uint64_t prefix = 0, mask = 0;
  for (int shift = 56; shift >= 0; shift -= 8) {
    for (int i = threadIdx.x; i < 256; i += blockDim.x) {
      hist_c[i] = 0;
      hist_w[i] = 0.0f;
    }
    __syncthreads();
    for (int64_t t = threadIdx.x; t < V; t += blockDim.x) {
      const uint64_t key = key_of(x[t], t);
      if ((key & mask) != prefix || !take(t, x[t])) continue;
      const int d = int((key >> shift) & 0xFF);
      atomicAdd(&hist_c[d], 1u);
      if constexpr (WEIGHTED) atomicAdd(&hist_w[d], weight(x[t]));
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      double cum = 0;
      int chosen = -1, lowest = -1;
      double cum_lowest = 0;
      for (int d = 255; d >= 0; --d) {
        if (hist_c[d] == 0) continue;
        const double m = WEIGHTED ? double(hist_w[d]) : double(hist_c[d]);
        lowest = d;
        cum_lowest = cum;
        if (cum + m >= *s_target) {
          chosen = d;
          break;
        }
        cum += m;
      }
      if (chosen < 0) {
        chosen = lowest;
        cum = cum_lowest;
      }
      *s_prefix = prefix | (uint64_t(chosen < 0 ? 0 : chosen) << shift);
      *s_target -= cum;
    }
    __syncthreads();
    prefix = *s_prefix;
    mask |= uint64_t(0xFF) << shift;
    __syncthreads();
  }
  return prefix;
}

__global__ void sample_kernel(const float* __restrict__ logits, const int64_t* __restrict__ rows, int64_t V,
                              int32_t* __restrict__ tokens, float* __restrict__ logprobs) {
  __shared__ uint64_t red8[kWarps];
  __shared__ float hist_w[256];
  __shared__ unsigned hist_c[256];
  __shared__ uint64_t s_prefix;
  __shared__ double s_target;
  const int64_t r = blockIdx.x;
  const Row p = unpack(rows + r * kSampleRowWords);
  const float* x = logits + r * V;
  auto lse_op = [](Lse a, Lse b) { return lse_add(a, b); };
  auto best_op = [](Best a, Best b) { return best_of(a, b); };
  Lse* lse_sh = reinterpret_cast<Lse*>(red8);
  Best* best_sh = reinterpret_cast<Best*>(red8);

  if (p.T == 0.0f) {  // greedy; log-prob at T = 1
    Lse l{-INFINITY, 0.0f};
    Best b{-INFINITY, -1};
    for (int64_t t = threadIdx.x; t < V; t += blockDim.x) {
      l = lse_push(l, x[t]);
      b = best_of(b, Best{x[t], int32_t(t)});
    }
    l = block_reduce(l, lse_op, Lse{-INFINITY, 0.0f}, lse_sh);
    b = block_reduce(b, best_op, Best{-INFINITY, -1}, best_sh);
    if (threadIdx.x == 0) {
      tokens[r] = b.t;
      logprobs[r] = x[b.t] - l.m - logf(l.s);
    }
    return;
  }
  const float invT = 1.0f / p.T;
  const bool top_k = p.top_k > 0 && p.top_k < V, top_p = p.top_p < 1.0f, min_p = p.min_p > 0.0f;
  auto race_score = [&](int64_t t, float z, const Philox4x32& w) { return z - logf(exp_clock(w.v[t & 3])); };
  // Pass 1: log-sum-exp of z (and, with no truncation, the race).
  Lse l{-INFINITY, 0.0f};
  Best b{-INFINITY, -1};
  const bool race_now = !top_k && !top_p && !min_p;
  for (int64_t g = threadIdx.x; g * 4 < V; g += blockDim.x) {
    Philox4x32 w{};
    if (race_now) w = sampling_words(p.seed, p.sample, p.position, uint32_t(g));
    for (int64_t t = g * 4; t < g * 4 + 4 && t < V; ++t) {
      const float z = x[t] * invT;
      l = lse_push(l, z);
      if (race_now && z > -INFINITY) b = best_of(b, Best{race_score(t, z, w), int32_t(t)});
    }
  }
  l = block_reduce(l, lse_op, Lse{-INFINITY, 0.0f}, lse_sh);
  const float z_max = l.m, log_z = l.m + logf(l.s);
  if (!race_now) {
    // Thresholds: keys at or above k_thr (top-k) and p_thr (top-p) are kept.
    const float w_floor = min_p ? p.min_p : 0.0f;
    auto weight = [&](float xv) { return expf(xv * invT - z_max); };
    uint64_t k_thr = 0, p_thr = 0;
    if (top_k) {
      if (threadIdx.x == 0) s_target = double(p.top_k);
      __syncthreads();
      k_thr = radix_select<false>(x, V, [](int64_t, float) { return true; }, weight, hist_w, hist_c,
                                  &s_prefix, &s_target);
    }
    if (top_p) {
      float mass = 0.0f;
      for (int64_t t = threadIdx.x; t < V; t += blockDim.x)
        if (key_of(x[t], t) >= k_thr) mass += weight(x[t]);
      auto add = [](float a, float c) { return a + c; };
      mass = block_reduce(mass, add, 0.0f, reinterpret_cast<float*>(red8));
      if (threadIdx.x == 0) s_target = double(p.top_p) * double(mass);
      __syncthreads();
      p_thr = radix_select<true>(
          x, V, [&](int64_t t, float xv) { return key_of(xv, t) >= k_thr && weight(xv) > 0.0f; }, weight,
          hist_w, hist_c, &s_prefix, &s_target);
    }
    const uint64_t thr = k_thr > p_thr ? k_thr : p_thr;
    for (int64_t g = threadIdx.x; g * 4 < V; g += blockDim.x) {
      const Philox4x32 w = sampling_words(p.seed, p.sample, p.position, uint32_t(g));
      for (int64_t t = g * 4; t < g * 4 + 4 && t < V; ++t) {
        const float wt = weight(x[t]);
        if (key_of(x[t], t) < thr || wt == 0.0f || wt < w_floor) continue;
        b = best_of(b, Best{race_score(t, x[t] * invT, w), int32_t(t)});
      }
    }
  }
  b = block_reduce(b, best_op, Best{-INFINITY, -1}, best_sh);
  if (threadIdx.x == 0) {
    tokens[r] = b.t;
    logprobs[r] = x[b.t] * invT - log_z;
  }
}

}  // namespace

void sample_tokens(const Tensor& logits_RV, const Tensor& rows_R5, Tensor& tokens_R, Tensor& logprobs_R) {
  const char* op = "sample_tokens";
  check_cuda(logits_RV, DType::F32, op);
  check_cuda(rows_R5, DType::I64, op);
  check_cuda(tokens_R, DType::I32, op);
  check_cuda(logprobs_R, DType::F32, op);
  const int64_t R = logits_RV.size(0), V = logits_RV.size(1);
  if (R == 0) return;
  sample_kernel<<<unsigned(R), kThreads, 0, stream()>>>(logits_RV.data<float>(), rows_R5.data<int64_t>(), V,
                                                        tokens_R.data<int32_t>(), logprobs_R.data<float>());
  MT_CUDA_LAUNCH_CHECK(op);
}

}  // namespace mt::cuda
