// CUDA token sampling (ops::sample_tokens): the draw of ops/sampling.h in f32, in two kernels, with no host
// synchronisation and no allocation once its scratch has grown (so a CUDA graph can capture it: the
// rollout engine's decode steps, docs/rollout.md "CUDA graphs").
//
// 1. Partials: the row is cut into chunks of kChunkTokens tokens (the count depends on V alone, so a row's
//    result does not depend on the batch), one block of kPartThreads per (row, chunk). One read of the
//    chunk gives the largest logit m, the sum of exp((x - m) / T) (in base 2: exp2((x - m) log2(e) / T)) and
//    the chunk's winner: for greedy rows the largest logit (lowest id on ties), for the plain race (T > 0,
//    no truncation) the largest score z_t - log(-log u_t), computed as x_t log2(e) / T - log2(-log2 u_t)
//    (the same order up to the constant log2(log2 e): the Gumbel-max / exponential race). Rows with
//    truncation only sum here. A thread loads its 8 groups of four tokens (float4 when aligned) before
//    computing, and each group's four uniform numbers are one Philox call (ops/philox.h).
// 2. Finish: one block per row merges its chunks' partials (log-sum-exp and winner). Greedy and race rows
//    are done: the token and log_softmax(logits / T)[token] = (x_t - m) / T - log(sum). Rows with top-k /
//    top-p / min-p take the truncation path, reading the row again: each token has a 64-bit key, higher =
//    earlier in "most probable first" order (the order-preserving bits of its logit, then the complement
//    of its id, so keys are distinct). Top-k: the k-th largest key by radix selection (eight passes of
//    8-bit digits, counts). Top-p: the last kept token by the same selection with histograms of weights
//    w_t = exp(z_t - z_max): the token whose mass strictly before it is < top_p x the top-k mass and whose
//    own weight reaches it. Then the race, with the same scores, over keys at or above both thresholds and
//    weights at or above min_p.
// The CPU reference computes in fp64; f32 here differs only where two race scores or a threshold's masses
// are within rounding (-log2 u within ~1.2e-6 relative: the hardware log2 away from u = 1, a series near
// it; its log2 within 2 ulp of a result below 32.5 in magnitude, i.e. < 8e-6 absolute, the size of the
// rounding of x log2(e) / T itself). tests/cuda compare the two, the draws' distribution, and the fast
// path with the truncation path.
#include <cstdint>
#include <cstdlib>
#include <string>
#include <type_traits>

#include "backend/cuda/common.cuh"
#include "backend/cuda/cuda_ops.h"
#include "backend/cuda/gemm.cuh"
#include "backend/cuda/invariant.cuh"
#include "backend/cuda/sample.cuh"
#include "core/determinism.h"
#include "ops/philox.h"
#include "ops/sampling.h"

namespace mt::cuda {

namespace {

constexpr int kPartThreads = 256;    // kernel 1
constexpr int kGroupsPerThread = 8;  // groups of four tokens per thread of kernel 1
constexpr int64_t kChunkTokens = int64_t(kPartThreads) * kGroupsPerThread * 4;  // 8,192
constexpr int kFinishThreads = 512;                                             // kernel 2
constexpr float kLog2e = 1.4426950408889634f;

enum RowKind : int { kGreedy = 0, kRace = 1, kTruncated = 2 };

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

__device__ __forceinline__ int row_kind(const Row& p, int64_t V, bool all_truncated) {
  if (p.T == 0.0f) return kGreedy;
  const bool truncated = (p.top_k > 0 && p.top_k < V) || p.top_p < 1.0f || p.min_p > 0.0f;
  return truncated || all_truncated ? kTruncated : kRace;
}

// log2(e) / T: the factor that takes a logit to base-2 units of z = x / T (greedy rows: T = 1).
__device__ __forceinline__ float base2_scale(const Row& p) {
  return p.T == 0.0f ? kLog2e : kLog2e / p.T;
}

__device__ __forceinline__ uint64_t key_of(float x, int64_t t) {
  const uint32_t b = __float_as_uint(x);
  const uint32_t ord = (b & 0x80000000u) ? ~b : (b | 0x80000000u);
  return (uint64_t(ord) << 32) | uint64_t(0xFFFFFFFFu - uint32_t(t));
}

// -log2 u for the word's uniform number u = (w + 1/2) 2^-32 (ops/philox.h), within ~1e-6 relative. For
// u < 7/8 the hardware log2 (absolute error 2^-22 there, against |log2 u| > 0.19); nearer 1, where u
// itself would round in f32, -ln(1 - v) = v (1 + v/2 + ... + v^7/8) of v = 1 - u, which is exact in f32
// (the series' remainder is below 1e-8 of it for v <= 1/8).
__device__ __forceinline__ float neg_log2_uniform(uint32_t w) {
  if (w < 0xE0000000u) return -__log2f((float(w) + 0.5f) * 0x1.0p-32f);
  const float v = (float(0xFFFFFFFFu - w) + 0.5f) * 0x1.0p-32f;
  float s = 1.0f / 8;
  s = fmaf(s, v, 1.0f / 7);
  s = fmaf(s, v, 1.0f / 6);
  s = fmaf(s, v, 1.0f / 5);
  s = fmaf(s, v, 1.0f / 4);
  s = fmaf(s, v, 1.0f / 3);
  s = fmaf(s, v, 1.0f / 2);
  s = fmaf(s, v, 1.0f);
  return v * s * kLog2e;
}

// The race score of a token with logit x (finite) and Philox word w, in base-2 units: larger wins.
// -log2(-log2 u) lies in [-5.1, 32.5]; the hardware log2 is within 2^-22 there for -log2 u in [0.5, 2]
// and 2 ulp elsewhere: below 8e-6 absolute.
// One explicit fused multiply-add, so every call site rounds the same way (the fast and the truncation
// paths must give a token the same score).
__device__ __forceinline__ float race_score(float x, float k2, uint32_t w) {
  return __fmaf_rn(x, k2, -__log2f(neg_log2_uniform(w)));
}

// A block's (or chunk's) log-sum-exp: m the largest logit (raw), s = sum of exp2((x - m) k2).
struct Lse {
  float m, s;
};
__device__ __forceinline__ Lse lse_add(Lse a, Lse b, float k2) {
  if (a.m == -INFINITY) return b;
  if (b.m == -INFINITY) return a;
  const float m = fmaxf(a.m, b.m);
  return {m, a.s * exp2f((a.m - m) * k2) + b.s * exp2f((b.m - m) * k2)};
}

// (score, token): larger score wins, then the lower token; t < 0 is "none".
struct Best {
  float v;
  int32_t t;
};
__device__ __forceinline__ Best best_of(Best a, Best b) {
  if (b.t < 0) return a;
  if (a.t < 0) return b;
  return (b.v > a.v || (b.v == a.v && b.t < a.t)) ? b : a;
}

// What kernel 1 leaves per (row, chunk) for kernel 2.
struct Partial {
  float m, s;  // Lse
  float best_v;
  int32_t best_t;
};

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

// The block's reduction of x under op (kThreads threads); identity is op's neutral element. shared holds
// kThreads / 32 values.
template <int kThreads, class T, class Op>
__device__ T block_reduce(T x, Op op, T identity, T* shared) {
  constexpr int kWarps = kThreads / 32;
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

// Four consecutive logits from token t (those at or past V read as -inf); kVec: one 16-byte load (the row
// is 16-byte aligned and V a multiple of four).
template <bool kVec>
__device__ __forceinline__ float4 load4(const float* __restrict__ x, int64_t V, int64_t t) {
  if constexpr (kVec) {
    if (t < V) return __ldg(reinterpret_cast<const float4*>(x + t));
    return make_float4(-INFINITY, -INFINITY, -INFINITY, -INFINITY);
  } else {
    float4 v;
    v.x = t < V ? __ldg(x + t) : -INFINITY;
    v.y = t + 1 < V ? __ldg(x + t + 1) : -INFINITY;
    v.z = t + 2 < V ? __ldg(x + t + 2) : -INFINITY;
    v.w = t + 3 < V ? __ldg(x + t + 3) : -INFINITY;
    return v;
  }
}

// Kernel 1: block b is chunk b % chunks of row b / chunks.
template <bool kVec>
__global__ void __launch_bounds__(kPartThreads)
    sample_partials_kernel(const float* __restrict__ logits, const int64_t* __restrict__ rows, int64_t V, int chunks,
                           bool all_truncated, Partial* __restrict__ parts) {
  __shared__ uint64_t red8[kPartThreads / 32];
  const int64_t r = blockIdx.x / chunks;
  const int c = int(blockIdx.x % chunks);
  const Row p = unpack(rows + r * kSampleRowWords);
  const int kind = row_kind(p, V, all_truncated);
  const float k2 = base2_scale(p);
  const float* x = logits + r * V;
  const int64_t g0 = int64_t(c) * (kChunkTokens / 4) + threadIdx.x;  // this thread's first group

  float4 v[kGroupsPerThread];
#pragma unroll
  for (int i = 0; i < kGroupsPerThread; ++i) v[i] = load4<kVec>(x, V, (g0 + int64_t(i) * kPartThreads) * 4);

  float m = -INFINITY;
#pragma unroll
  for (int i = 0; i < kGroupsPerThread; ++i) m = fmaxf(m, fmaxf(fmaxf(v[i].x, v[i].y), fmaxf(v[i].z, v[i].w)));
  float s = 0.0f;
  if (m > -INFINITY) {
#pragma unroll
    for (int i = 0; i < kGroupsPerThread; ++i)
      s +=
          (exp2f((v[i].x - m) * k2) + exp2f((v[i].y - m) * k2)) + (exp2f((v[i].z - m) * k2) + exp2f((v[i].w - m) * k2));
  }
  // This thread's winner: its tokens are visited in increasing id, so a strict > leaves ties to the lower.
  Best b{-INFINITY, -1};
  if (kind == kGreedy) {
#pragma unroll
    for (int i = 0; i < kGroupsPerThread; ++i) {
      const int32_t t = int32_t((g0 + int64_t(i) * kPartThreads) * 4);
      if (v[i].x > b.v) b = {v[i].x, t};
      if (v[i].y > b.v) b = {v[i].y, t + 1};
      if (v[i].z > b.v) b = {v[i].z, t + 2};
      if (v[i].w > b.v) b = {v[i].w, t + 3};
    }
  } else if (kind == kRace && m > -INFINITY) {
#pragma unroll
    for (int i = 0; i < kGroupsPerThread; ++i) {
      const int64_t g = g0 + int64_t(i) * kPartThreads;
      if (fmaxf(fmaxf(v[i].x, v[i].y), fmaxf(v[i].z, v[i].w)) == -INFINITY) continue;  // also past V
      const Philox4x32 w = sampling_words(p.seed, p.sample, p.position, uint32_t(g));
      const int32_t t = int32_t(g * 4);
      const float xs[4] = {v[i].x, v[i].y, v[i].z, v[i].w};
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        if (xs[j] == -INFINITY) continue;
        const float score = race_score(xs[j], k2, w.v[j]);
        if (b.t < 0 || score > b.v) b = {score, t + j};
      }
    }
  }
  const Lse l = block_reduce<kPartThreads>(
      Lse{m, s}, [k2](Lse a, Lse e) { return lse_add(a, e, k2); }, Lse{-INFINITY, 0.0f}, reinterpret_cast<Lse*>(red8));
  const Best best = block_reduce<kPartThreads>(
      b, [](Best a, Best e) { return best_of(a, e); }, Best{-INFINITY, -1}, reinterpret_cast<Best*>(red8));
  if (threadIdx.x == 0) parts[blockIdx.x] = Partial{l.m, l.s, best.v, best.t};
}

// Radix selection over the keys of the candidate tokens (those `take` accepts), MSB digit first. By
// count (WEIGHTED false): the key of the k-th largest candidate. By weight: the key of the candidate
// whose weight-before (in descending key order) is < limit and whose weight-through reaches it, or the
// smallest candidate key when rounding leaves the limit above the total; the limit is *s_target, or, with
// `fraction` >= 0 (top-p), fraction x the candidates' total weight, which the first pass's histogram sums.
// Each pass histograms the candidates that share the digits chosen so far. Once the chosen digit's bin holds
// at most kListCap (8,192) candidates, one more read of the row lists them (`list`, shared memory) and the remaining
// passes visit only the list: typically 2-3 reads of the row instead of 8. The same candidates, digits and
// sums (in another order, as the atomics already were), so the same selection. MOETRAIN_SAMPLE_LIST=0 (read
// at every call) turns the list off, for A/B timing and the tests.
constexpr int kListCap = 8192;
template <bool WEIGHTED, class Take, class Weight>
__device__ uint64_t radix_select(const float* x, int64_t V, Take take, Weight weight, float* hist_w, unsigned* hist_c,
                                 uint64_t* s_prefix, double* s_target, int32_t* list, unsigned* s_n, bool use_list,
                                 double fraction = -1.0) {
  uint64_t prefix = 0, mask = 0;
  bool listed = false;
  unsigned n = 0;
  for (int shift = 56; shift >= 0; shift -= 8) {
    for (int i = threadIdx.x; i < 256; i += blockDim.x) {
      hist_c[i] = 0;
      hist_w[i] = 0.0f;
    }
    __syncthreads();
    auto visit = [&](int64_t t) {
      const float xv = x[t];
      const uint64_t key = key_of(xv, t);
      if ((key & mask) != prefix || !take(t, xv)) return;
      const int d = int((key >> shift) & 0xFF);
      atomicAdd(&hist_c[d], 1u);
      if constexpr (WEIGHTED) atomicAdd(&hist_w[d], weight(xv));
    };
    if (listed)
      for (unsigned i = threadIdx.x; i < n; i += blockDim.x) visit(list[i]);
    else
      for (int64_t t = threadIdx.x; t < V; t += blockDim.x) visit(t);
    __syncthreads();
    if (threadIdx.x == 0) {
      if (WEIGHTED && fraction >= 0.0 && shift == 56) {
        double total = 0;
        for (int d = 0; d < 256; ++d) total += double(hist_w[d]);
        *s_target = fraction * total;
      }
      double cum = 0;
      int chosen = -1, lowest = -1;
      double cum_lowest = 0;
      for (int d = 255; d >= 0; --d) {
        if (hist_c[d] == 0) continue;
        const double mass = WEIGHTED ? double(hist_w[d]) : double(hist_c[d]);
        lowest = d;
        cum_lowest = cum;
        if (cum + mass >= *s_target) {
          chosen = d;
          break;
        }
        cum += mass;
      }
      if (chosen < 0) {
        chosen = lowest;
        cum = cum_lowest;
      }
      *s_prefix = prefix | (uint64_t(chosen < 0 ? 0 : chosen) << shift);
      *s_target -= cum;
      // The candidates of the next pass: those in the chosen bin (none when no candidate is left).
      *s_n = chosen < 0 ? 0u : hist_c[chosen];
    }
    __syncthreads();
    prefix = *s_prefix;
    mask |= uint64_t(0xFF) << shift;
    const unsigned next = *s_n;
    __syncthreads();
    if (use_list && !listed && shift > 0 && next <= unsigned(kListCap)) {
      if (threadIdx.x == 0) *s_n = 0;
      __syncthreads();
      // One shared atomic per warp and row stride (the same trip count on every thread, so the ballot sees
      // the whole warp).
      const unsigned lane = threadIdx.x & 31u;
      for (int64_t t0 = 0; t0 < V; t0 += blockDim.x) {
        const int64_t t = t0 + threadIdx.x;
        bool in = false;
        if (t < V) {
          const float xv = x[t];
          in = (key_of(xv, t) & mask) == prefix && take(t, xv);
        }
        const unsigned ballot = __ballot_sync(0xFFFFFFFFu, in);
        if (ballot == 0) continue;
        unsigned base = 0;
        if (lane == unsigned(__ffs(ballot) - 1)) base = atomicAdd(s_n, unsigned(__popc(ballot)));
        base = __shfl_sync(0xFFFFFFFFu, base, __ffs(ballot) - 1);
        const unsigned i = base + unsigned(__popc(ballot & ((1u << lane) - 1u)));
        if (in && i < unsigned(kListCap)) list[i] = int32_t(t);  // always: the count is `next` (the same test)
      }
      __syncthreads();
      n = min(*s_n, unsigned(kListCap));
      listed = true;
      __syncthreads();
    }
  }
  return prefix;
}

// Kernel 2: one block per row.
__global__ void __launch_bounds__(kFinishThreads)
    sample_finish_kernel(const float* __restrict__ logits, const int64_t* __restrict__ rows, int64_t V, int chunks,
                         bool all_truncated, const Partial* __restrict__ parts, int32_t* __restrict__ tokens,
                         float* __restrict__ logprobs, bool use_list) {
  __shared__ uint64_t red8[kFinishThreads / 32];
  __shared__ float hist_w[256];
  __shared__ unsigned hist_c[256];
  __shared__ uint64_t s_prefix;
  __shared__ double s_target;
  __shared__ int32_t list[kListCap];
  __shared__ unsigned s_n;
  const int64_t r = blockIdx.x;
  const Row p = unpack(rows + r * kSampleRowWords);
  const int kind = row_kind(p, V, all_truncated);
  const float k2 = base2_scale(p);
  const float invT = kind == kGreedy ? 1.0f : 1.0f / p.T;
  const float* x = logits + r * V;
  auto best_op = [](Best a, Best e) { return best_of(a, e); };
  Best* best_sh = reinterpret_cast<Best*>(red8);

  Lse l{-INFINITY, 0.0f};
  Best b{-INFINITY, -1};
  for (int c = threadIdx.x; c < chunks; c += blockDim.x) {
    const Partial q = parts[r * chunks + c];
    l = lse_add(l, Lse{q.m, q.s}, k2);
    b = best_of(b, Best{q.best_v, q.best_t});
  }
  l = block_reduce<kFinishThreads>(
      l, [k2](Lse a, Lse e) { return lse_add(a, e, k2); }, Lse{-INFINITY, 0.0f}, reinterpret_cast<Lse*>(red8));
  const float x_max = l.m, log_sum = logf(l.s);  // log sum_t exp((x_t - x_max) / T)
  auto finish = [&](int32_t t) {
    tokens[r] = t;  // -1 only for a row of all -inf (or NaN) logits, which the contract excludes
    logprobs[r] = t < 0 ? NAN : (x[t] - x_max) * invT - log_sum;
  };
  if (kind != kTruncated) {
    b = block_reduce<kFinishThreads>(b, best_op, Best{-INFINITY, -1}, best_sh);
    if (threadIdx.x == 0) finish(b.t);
    return;
  }
  // The truncation path. Weights w_t = exp(z_t - z_max): exactly 1 for the largest logit.
  const float z_max = x_max * invT;
  const bool top_k = p.top_k > 0 && p.top_k < V, top_p = p.top_p < 1.0f;
  const float w_floor = p.min_p > 0.0f ? p.min_p : 0.0f;
  auto weight = [&](float xv) { return expf(xv * invT - z_max); };
  // Thresholds: keys at or above k_thr (top-k) and p_thr (top-p) are kept.
  uint64_t k_thr = 0, p_thr = 0;
  if (top_k) {
    if (threadIdx.x == 0) s_target = double(p.top_k);
    __syncthreads();
    k_thr = radix_select<false>(
        x, V, [](int64_t, float) { return true; }, weight, hist_w, hist_c, &s_prefix, &s_target, list, &s_n, use_list);
  }
  if (top_p) {
    // The limit: top_p x the mass of the tokens top-k keeps, summed by the selection's first pass.
    p_thr = radix_select<true>(
        x, V, [&](int64_t t, float xv) { return key_of(xv, t) >= k_thr && weight(xv) > 0.0f; }, weight, hist_w, hist_c,
        &s_prefix, &s_target, list, &s_n, use_list, double(p.top_p));
  }
  const uint64_t thr = k_thr > p_thr ? k_thr : p_thr;
  b = Best{-INFINITY, -1};
  for (int64_t g = threadIdx.x; g * 4 < V; g += blockDim.x) {
    const Philox4x32 w = sampling_words(p.seed, p.sample, p.position, uint32_t(g));
    for (int64_t t = g * 4; t < g * 4 + 4 && t < V; ++t) {
      const float wt = weight(x[t]);
      if (key_of(x[t], t) < thr || wt == 0.0f || wt < w_floor) continue;
      b = best_of(b, Best{race_score(x[t], k2, w.v[t & 3]), int32_t(t)});
    }
  }
  b = block_reduce<kFinishThreads>(b, best_op, Best{-INFINITY, -1}, best_sh);
  if (threadIdx.x == 0) finish(b.t);
}

// The batch-invariant mode (core/determinism.h): the log-prob of each row sampled at temperature 1 (or greedily,
// whose log-prob is at temperature 1 too) again, by row_logprob (invariant.cuh), the LM head's function in that
// mode. A row at another temperature keeps the finish kernel's value.
__global__ void __launch_bounds__(kRowLogprobThreads)
    invariant_logprobs_kernel(const float* __restrict__ logits, const int64_t* __restrict__ rows, int64_t V,
                              const int32_t* __restrict__ tokens, float* __restrict__ logprobs, bool all_truncated) {
  const int64_t r = blockIdx.x;
  const Row p = unpack(rows + r * kSampleRowWords);
  const int32_t t = tokens[r];
  if (!(row_kind(p, V, all_truncated) == kGreedy || p.T == 1.0f) || t < 0 || t >= V) return;  // the whole block
  const float lp = row_logprob(logits + r * V, V, t);
  if (threadIdx.x == 0) logprobs[r] = lp;
}

void sample(const Tensor& logits_RV, const Tensor& rows_R5, Tensor& tokens_R, Tensor& logprobs_R, bool all_truncated,
            const char* op) {
  check_cuda(logits_RV, DType::F32, op);
  check_cuda(rows_R5, DType::I64, op);
  check_cuda(tokens_R, DType::I32, op);
  check_cuda(logprobs_R, DType::F32, op);
  const int64_t R = logits_RV.size(0), V = logits_RV.size(1);
  if (R == 0) return;
  const int64_t chunks = (V + kChunkTokens - 1) / kChunkTokens;
  if (R * chunks > int64_t(INT32_MAX))
    MT_THROW(op, ": ", R, " rows x ", chunks, " chunks of ", kChunkTokens, " logits exceed one launch's ", INT32_MAX,
             " blocks; sample fewer rows at a time");
  // Grows only when a call has more rows than any before: the engine's eager step before a capture grows
  // it, so the captured call allocates nothing (a growth bumps the graph epoch: core/cuda_graph.h).
  static DeviceScratch scratch;
  Partial* parts = scratch.as<Partial>(R * chunks, op);
  const float* x = logits_RV.data<float>();
  const bool vec = V % 4 == 0 && reinterpret_cast<uintptr_t>(x) % 16 == 0;
  const char* list_env = std::getenv("MOETRAIN_SAMPLE_LIST");
  const std::string list_mode = list_env ? list_env : "";
  if (!list_mode.empty() && list_mode != "0" && list_mode != "1")
    MT_THROW("MOETRAIN_SAMPLE_LIST (", list_mode, ") must be 0 (the radix selection reads the whole row every pass) or 1");
  const bool use_list = list_mode != "0";
  const unsigned blocks = unsigned(R * chunks);
  if (vec)
    sample_partials_kernel<true>
        <<<blocks, kPartThreads, 0, stream()>>>(x, rows_R5.data<int64_t>(), V, int(chunks), all_truncated, parts);
  else
    sample_partials_kernel<false>
        <<<blocks, kPartThreads, 0, stream()>>>(x, rows_R5.data<int64_t>(), V, int(chunks), all_truncated, parts);
  MT_CUDA_LAUNCH_CHECK(op);
  sample_finish_kernel<<<unsigned(R), kFinishThreads, 0, stream()>>>(x, rows_R5.data<int64_t>(), V, int(chunks),
                                                                     all_truncated, parts, tokens_R.data<int32_t>(),
                                                                     logprobs_R.data<float>(), use_list);
  MT_CUDA_LAUNCH_CHECK(op);
  if (batch_invariant()) {
    invariant_logprobs_kernel<<<unsigned(R), kRowLogprobThreads, 0, stream()>>>(
        x, rows_R5.data<int64_t>(), V, tokens_R.data<int32_t>(), logprobs_R.data<float>(), all_truncated);
    MT_CUDA_LAUNCH_CHECK(op);
  }
}

}  // namespace

void sample_tokens(const Tensor& logits_RV, const Tensor& rows_R5, Tensor& tokens_R, Tensor& logprobs_R) {
  sample(logits_RV, rows_R5, tokens_R, logprobs_R, false, "sample_tokens");
}

void sample_tokens_truncation_path(const Tensor& logits_RV, const Tensor& rows_R5, Tensor& tokens_R,
                                   Tensor& logprobs_R) {
  sample(logits_RV, rows_R5, tokens_R, logprobs_R, true, "sample_tokens_truncation_path");
}

}  // namespace mt::cuda
