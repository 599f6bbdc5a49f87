// CUDA LM head fused with cross-entropy; same contract as the CPU reference (backend/cpu/lm_head.cpp):
// loss_sum += sum over labels != -100 of (lse - logit[label]), dhn = dlogits @ w (=),
// dw += dlogits^T @ hn (= on request), with dlogits = scale * (softmax - onehot).
//
// Rows are processed in groups, each group in chunks:
//   per chunk: f32 logits = hn @ w^T (cuBLASLt), then one block per row computes max and sum-exp in
//     one pass (online softmax, f32), the row's loss term and the row's bf16 dlogits;
//   per group: dhn = dlogits @ w and dw += dlogits^T @ hn over all the group's rows.
// Why two levels: f32 logits are 4 B per vocabulary entry, so a chunk stays small (<= 256 MiB), but
// every dw GEMM reads and writes all of dw (V*D f32: 1.24 GB at V = 151,936, D = 2048). Keeping the
// bf16 dlogits of a whole group (<= 1.25 GiB: 4,416 rows at that V) makes that one dw pass per group
// instead of one per chunk (10 per 4,096 tokens before), and gives the dhn and dw GEMMs a full
// K = group rows / M = group rows instead of a few hundred. MOETRAIN_LM_HEAD_GROUP_ROWS overrides
// the group size (tests use it to cover several groups; 0 or unset = by the byte budget).
//
// Per-row losses go to a [T] buffer that one block sums in fp64 at the end, so the result is
// deterministic and no host synchronisation happens. Buffers are cached across calls.
//
// Labels: -100 is ignored; any other label outside [0, V) makes that row's loss and gradients NaN (so
// the loss and the gradient norm cannot pass unnoticed) and is recorded in a deferred error that the
// next lm_head_cross_entropy call throws, naming the row and the label (gemm.cuh, DeferredError).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>

#include "backend/cuda/cuda_ops.h"
#include "backend/cuda/gemm.cuh"

namespace mt::cuda {

namespace {

constexpr int64_t kIgnoreIndex = -100;
constexpr int kCeThreads = 512;
constexpr int64_t kDefaultChunkBytes = int64_t(256) << 20;   // f32 logits of one chunk
constexpr int64_t kDefaultGroupBytes = int64_t(1280) << 20;  // bf16 dlogits of one group

// Merges two online-softmax states (max m, sum of exp(x - m) s).
__device__ __forceinline__ void merge(float& m, float& s, float m2, float s2) {
  if (m2 == -INFINITY) return;
  if (m == -INFINITY) {
    m = m2;
    s = s2;
    return;
  }
  const float M = fmaxf(m, m2);
  s = s * expf(m - M) + s2 * expf(m2 - M);
  m = M;
}

// One block per row of the chunk. VEC = 4 moves 16-byte f32 loads and 8-byte bf16 stores (V % 4 == 0
// and 16-byte aligned rows); the pass is memory-bound: it reads the f32 row twice (the second read
// mostly from L2) and writes the bf16 row once.
template <int VEC>
__global__ void ce_rows_kernel(const float* __restrict__ logits, int64_t V, const int64_t* __restrict__ labels,
                               float scale, int64_t row0, float* __restrict__ loss_rows,
                               __nv_bfloat16* __restrict__ dlogits, unsigned long long* err) {
  __shared__ float sm[32], ss[32];
  __shared__ float s_lse;
  const int64_t i = blockIdx.x;
  const float* x = logits + i * V;
  const int64_t nv = V / VEC;
  float m = -INFINITY, s = 0.0f;
  for (int64_t j = threadIdx.x; j < nv; j += blockDim.x) {
    float v[VEC];
    if constexpr (VEC == 4) {
      const float4 q = reinterpret_cast<const float4*>(x)[j];
      v[0] = q.x, v[1] = q.y, v[2] = q.z, v[3] = q.w;
    } else {
      v[0] = x[j];
    }
#pragma unroll
    for (int k = 0; k < VEC; ++k) {
      if (v[k] > m) {  // a NaN logit falls to the else branch and makes s NaN, as it should
        s = s * __expf(m - v[k]) + 1.0f;
        m = v[k];
      } else {
        s += __expf(v[k] - m);
      }
    }
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) merge(m, s, __shfl_xor_sync(0xffffffffu, m, o), __shfl_xor_sync(0xffffffffu, s, o));
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = (blockDim.x + 31) / 32;
  if (lane == 0) {
    sm[warp] = m;
    ss[warp] = s;
  }
  __syncthreads();
  if (warp == 0) {
    m = lane < warps ? sm[lane] : -INFINITY;
    s = lane < warps ? ss[lane] : 0.0f;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1)
      merge(m, s, __shfl_xor_sync(0xffffffffu, m, o), __shfl_xor_sync(0xffffffffu, s, o));
    if (lane == 0) s_lse = m + logf(s);
  }
  __syncthreads();
  const float lse = s_lse;
  const int64_t label = labels[row0 + i];
  const bool ignored = label == kIgnoreIndex;
  const bool bad = !ignored && (label < 0 || label >= V);
  if (threadIdx.x == 0) {
    if (bad) {
      const int32_t shown = label > INT32_MAX ? INT32_MAX : label < INT32_MIN ? INT32_MIN : int32_t(label);
      atomicMin(err, deferred_error_key(row0 + i, shown));
      loss_rows[row0 + i] = NAN;
    } else {
      loss_rows[row0 + i] = ignored ? 0.0f : lse - x[label];
    }
  }
  // Per-row constants: g = a * exp(x - lse) - b at the label, with a = 0 on ignored rows.
  const float a = bad ? NAN : ignored ? 0.0f : scale;
  __nv_bfloat16* d = dlogits + i * V;
  for (int64_t j = threadIdx.x; j < nv; j += blockDim.x) {
    float v[VEC], g[VEC];
    if constexpr (VEC == 4) {
      const float4 q = reinterpret_cast<const float4*>(x)[j];
      v[0] = q.x, v[1] = q.y, v[2] = q.z, v[3] = q.w;
    } else {
      v[0] = x[j];
    }
#pragma unroll
    for (int k = 0; k < VEC; ++k) {
      g[k] = a * __expf(v[k] - lse);
      if (j * VEC + k == label) g[k] -= a;
    }
    if constexpr (VEC == 4) {
      __nv_bfloat162 lo = __floats2bfloat162_rn(g[0], g[1]), hi = __floats2bfloat162_rn(g[2], g[3]);
      uint2 packed;
      packed.x = *reinterpret_cast<const uint32_t*>(&lo);
      packed.y = *reinterpret_cast<const uint32_t*>(&hi);
      reinterpret_cast<uint2*>(d)[j] = packed;
    } else {
      d[j] = __float2bfloat16_rn(g[0]);
    }
  }
}

// loss_sum[0] += sum of loss_rows[0, T), summed in fp64 in a fixed order (one block).
__global__ void loss_sum_kernel(const float* __restrict__ loss_rows, int64_t T, float* __restrict__ loss_sum) {
  __shared__ double part[1024];
  double acc = 0.0;
  for (int64_t t = threadIdx.x; t < T; t += blockDim.x) acc += double(loss_rows[t]);
  part[threadIdx.x] = acc;
  __syncthreads();
  for (int w = blockDim.x / 2; w > 0; w >>= 1) {
    if (int(threadIdx.x) < w) part[threadIdx.x] += part[threadIdx.x + w];
    __syncthreads();
  }
  if (threadIdx.x == 0) loss_sum[0] += float(part[0]);
}

DeferredError& label_error() {
  static DeferredError e;
  return e;
}
int64_t g_last_V = 0;  // V of the latest call, for a deferred message

const __nv_bfloat16* bf16_in(const Tensor& t) {
  return static_cast<const __nv_bfloat16*>(t.raw());
}

// Rows of one group: MOETRAIN_LM_HEAD_GROUP_ROWS when set (> 0), else what the byte budget allows.
int64_t group_rows_for(int64_t V, int64_t chunk_rows) {
  const char* env = std::getenv("MOETRAIN_LM_HEAD_GROUP_ROWS");
  int64_t rows = env && *env ? std::atoll(env) : 0;
  if (rows <= 0) rows = kDefaultGroupBytes / (2 * std::max<int64_t>(V, 1));
  return std::max(rows, chunk_rows);
}

}  // namespace

void lm_head_cross_entropy(const Tensor& hn_TD, const Tensor& w_VD, const Tensor& labels_T, float scale,
                           int64_t chunk_rows, Tensor& loss_sum, Tensor& dhn_TD, Tensor& dw_VD, bool accumulate_dw) {
  const char* op = "lm_head_cross_entropy";
  unsigned long long key;
  if (label_error().take(&key, op))
    MT_THROW(op, ": label ", DeferredError::value_of(key), " at row ", DeferredError::index_of(key),
             " (of an earlier call, found on the device) is out of range: labels must be in [0, ", g_last_V,
             ") or -100 (ignored)");
  // Dtypes and device here; the shapes are op_checks.h's, checked by the dispatch.
  check_cuda(hn_TD, DType::BF16, "lm_head_cross_entropy hn_TD");
  check_cuda(w_VD, DType::BF16, "lm_head_cross_entropy w_VD");
  check_cuda(labels_T, DType::I64, "lm_head_cross_entropy labels_T");
  check_cuda(loss_sum, DType::F32, "lm_head_cross_entropy loss_sum");
  check_cuda(dhn_TD, DType::BF16, "lm_head_cross_entropy dhn_TD");
  check_cuda(dw_VD, DType::F32, "lm_head_cross_entropy dw_VD");
  const int64_t T = hn_TD.size(0), D = hn_TD.size(1), V = w_VD.size(0);
  if (T == 0) {
    if (!accumulate_dw) dw_VD.zero_();  // no group writes it
    return;
  }
  MT_CHECK(T <= INT32_MAX, "lm_head_cross_entropy: T (", T, ") exceeds the i32 row range of the error record");
  g_last_V = V;
  if (chunk_rows <= 0) chunk_rows = std::max<int64_t>(1, kDefaultChunkBytes / (4 * std::max<int64_t>(V, 1)));
  chunk_rows = std::min(chunk_rows, T);
  MT_CHECK(chunk_rows < (int64_t(1) << 31), "lm_head_cross_entropy: chunk_rows (", chunk_rows, ") too large");
  // Groups of equal size (up to one row), so that the last one is not a sliver.
  const int64_t max_group = std::min(group_rows_for(V, chunk_rows), T);
  const int64_t groups = (T + max_group - 1) / max_group;
  const int64_t group_rows = (T + groups - 1) / groups;

  static DeviceScratch logits_buf, dlogits_buf, loss_rows_buf;
  float* logits = logits_buf.as<float>(chunk_rows * V, op);
  __nv_bfloat16* dlogits = dlogits_buf.as<__nv_bfloat16>(group_rows * V, op);
  float* loss_rows = loss_rows_buf.as<float>(T, op);
  const __nv_bfloat16* hn = bf16_in(hn_TD);
  const __nv_bfloat16* w = bf16_in(w_VD);
  __nv_bfloat16* dhn = static_cast<__nv_bfloat16*>(dhn_TD.raw());
  float* dw = dw_VD.data<float>();
  unsigned long long* err = label_error().device_word(op);
  const bool vec4 = V % 4 == 0;  // logits and dlogits rows are then 16- and 8-byte aligned (cudaMalloc bases)
  for (int64_t g0 = 0; g0 < T; g0 += group_rows) {
    const int64_t ng = std::min(group_rows, T - g0);
    for (int64_t t0 = g0; t0 < g0 + ng; t0 += chunk_rows) {
      const int64_t n = std::min(chunk_rows, g0 + ng - t0);
      gemm("lm_head_cross_entropy logits", false, true, n, V, D, hn + t0 * D, D, w, D, 0.0f, logits, DType::F32, V);
      __nv_bfloat16* d = dlogits + (t0 - g0) * V;
      if (vec4)
        ce_rows_kernel<4><<<unsigned(n), kCeThreads, 0, stream()>>>(logits, V, labels_T.data<int64_t>(), scale, t0,
                                                                    loss_rows, d, err);
      else
        ce_rows_kernel<1><<<unsigned(n), kCeThreads, 0, stream()>>>(logits, V, labels_T.data<int64_t>(), scale, t0,
                                                                    loss_rows, d, err);
      MT_CUDA_LAUNCH_CHECK(op);
    }
    gemm("lm_head_cross_entropy dhn", false, false, ng, D, V, dlogits, V, w, D, 0.0f, dhn + g0 * D, DType::BF16, D);
    const float beta = accumulate_dw || g0 > 0 ? 1.0f : 0.0f;
    gemm("lm_head_cross_entropy dw", true, false, V, D, ng, dlogits, V, hn + g0 * D, D, beta, dw, DType::F32, D);
  }
  loss_sum_kernel<<<1, 1024, 0, stream()>>>(loss_rows, T, loss_sum.data<float>());
  MT_CUDA_LAUNCH_CHECK(op);
  label_error().publish(op);
}

}  // namespace mt::cuda
