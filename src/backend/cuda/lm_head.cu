// CUDA LM head, the three ops of ops.h with the same contracts as the CPU reference (backend/cpu/lm_head.cpp):
//   lm_head_cross_entropy: loss_sum += sum over labels != -100 of (lse - logit[label]), dhn = dlogits @ w (=),
//     dw += dlogits^T @ hn (= on request), with dlogits = scale * (softmax - onehot);
//   lm_head_logprobs: logp = logit[label] - lse and, on request, entropy = sum_v p_v (lse - logit_v);
//   lm_head_objective_bwd: dlogits = g (onehot - p) - h p (logit - lse + H) from per-row g = dL/dlogp and
//     h = dL/dH, then the same dhn and dw as the cross-entropy.
//
// Rows are processed in groups, each group in chunks:
//   per chunk: f32 logits = hn @ w^T (cuBLASLt), then one block per row computes max and sum-exp in
//     one pass (online softmax, f32), then what the op needs from the row: its loss term or log-prob,
//     the entropy (a second pass over the row, only when asked for) and the row's bf16 dlogits;
//   per group: dhn = dlogits @ w and dw += dlogits^T @ hn over all the group's rows.
// One row kernel serves the three ops (templated on the op); the logprobs op has no gradients, so its
// rows form a single group of chunks.
// Why two levels: f32 logits are 4 B per vocabulary entry, so a chunk stays small (<= 256 MiB), but
// every dw GEMM reads and writes all of dw (V*D f32: 1.24 GB at V = 151,936, D = 2048). Keeping the
// bf16 dlogits of a whole group (<= 1.25 GiB: 4,416 rows at that V) makes that one dw pass per group
// instead of one per chunk (10 per 4,096 tokens before), and gives the dhn and dw GEMMs a full
// K = group rows / M = group rows instead of a few hundred. MOETRAIN_LM_HEAD_GROUP_ROWS overrides
// the group size (tests use it to cover several groups; 0 or unset = by the byte budget).
//
// Per-row losses go to a [T] buffer that one block sums in fp64 at the end, so the result is
// deterministic and no host synchronisation happens. Buffers are cached across calls and shared by
// the three ops (they all run on stream()).
//
// Labels: -100 is ignored; any other label outside [0, V) makes that row's outputs (loss, log-prob,
// entropy, gradients) NaN (so the loss and the gradient norm cannot pass unnoticed) and is recorded in
// a deferred error, one record per op, that the next call of any of the three ops throws, naming the
// row, the label and the op that found it (gemm.cuh, DeferredError).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>

#include "backend/cuda/cuda_ops.h"
#include "backend/cuda/gemm.cuh"
#include "backend/cuda/invariant.h"
#include "core/determinism.h"

namespace mt::cuda {

namespace {

constexpr int64_t kIgnoreIndex = -100;
constexpr int kRowThreads = 512;
constexpr int64_t kDefaultChunkBytes = int64_t(256) << 20;   // f32 logits of one chunk
constexpr int64_t kDefaultGroupBytes = int64_t(1280) << 20;  // bf16 dlogits of one group

enum class Mode { kCrossEntropy, kLogprobs, kObjective };

// What one launch of the row kernel reads and writes; a mode leaves the fields it does not use null.
struct RowArgs {
  const int64_t* labels;    // [T]
  int64_t row0;             // the chunk's first row
  float scale;              // cross-entropy: dlogits = scale (p - onehot)
  float* loss_rows;         // cross-entropy: [T], lse - logit[label]
  float* logp;              // logprobs: [T]
  float* entropy;           // logprobs: [T], or null
  const float* dlogp;       // objective: [T], g
  const float* dentropy;    // objective: [T] h, or null (no entropy term)
  __nv_bfloat16* dlogits;   // cross-entropy and objective: the chunk's rows of the group's buffer
  unsigned long long* err;  // the op's deferred label error
};

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

// Elements [j * VEC, j * VEC + VEC) of an f32 row; VEC = 4 is one 16-byte load (16-byte aligned rows).
template <int VEC>
__device__ __forceinline__ void load(const float* __restrict__ x, int64_t j, float (&v)[VEC]) {
  if constexpr (VEC == 4) {
    const float4 q = reinterpret_cast<const float4*>(x)[j];
    v[0] = q.x, v[1] = q.y, v[2] = q.z, v[3] = q.w;
  } else {
    v[0] = x[j];
  }
}

// log sum_v exp(x_v) of the block's row, returned to every thread: one pass of online softmax (f32).
template <int VEC>
__device__ float row_lse(const float* __restrict__ x, int64_t nv) {
  __shared__ float sm[32], ss[32];
  __shared__ float s_lse;
  float m = -INFINITY, s = 0.0f;
  for (int64_t j = threadIdx.x; j < nv; j += blockDim.x) {
    float v[VEC];
    load<VEC>(x, j, v);
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
  return s_lse;
}

// The entropy of the block's row, H = -sum_v p_v log p_v = sum_v p_v (lse - x_v) (non-negative terms, so
// no cancellation), returned to every thread: a second pass over the row, mostly from L2.
template <int VEC>
__device__ float row_entropy(const float* __restrict__ x, int64_t nv, float lse) {
  __shared__ float part[32];
  __shared__ float s_h;
  float acc = 0.0f;
  for (int64_t j = threadIdx.x; j < nv; j += blockDim.x) {
    float v[VEC];
    load<VEC>(x, j, v);
#pragma unroll
    for (int k = 0; k < VEC; ++k) acc += __expf(v[k] - lse) * (lse - v[k]);
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = (blockDim.x + 31) / 32;
  if (lane == 0) part[warp] = acc;
  __syncthreads();
  if (warp == 0) {
    acc = lane < warps ? part[lane] : 0.0f;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
    if (lane == 0) s_h = acc;
  }
  __syncthreads();
  return s_h;
}

// One block per row of the chunk. VEC = 4 moves 16-byte f32 loads and 8-byte bf16 stores (V % 4 == 0
// and 16-byte aligned rows); the pass is memory-bound: it reads the f32 row twice (three times with the
// entropy; the later reads mostly from L2) and writes the bf16 row once. Every thread of a block sees
// the same label, so the branches on it are uniform and the block reductions inside them are safe.
template <int VEC, Mode M>
__global__ void lm_head_rows_kernel(const float* __restrict__ logits, int64_t V, RowArgs a) {
  const int64_t i = blockIdx.x, t = a.row0 + i;
  const float* x = logits + i * V;
  const int64_t nv = V / VEC;
  const float lse = row_lse<VEC>(x, nv);
  const int64_t label = a.labels[t];
  const bool ignored = label == kIgnoreIndex;
  const bool bad = !ignored && (label < 0 || label >= V);
  if (threadIdx.x == 0 && bad) {
    const int32_t shown = label > INT32_MAX ? INT32_MAX : label < INT32_MIN ? INT32_MIN : int32_t(label);
    atomicMin(a.err, deferred_error_key(t, shown));
  }
  const bool want_entropy = M == Mode::kLogprobs    ? a.entropy != nullptr
                            : M == Mode::kObjective ? a.dentropy != nullptr
                                                    : false;
  const float H = want_entropy && !ignored && !bad ? row_entropy<VEC>(x, nv, lse) : 0.0f;
  if constexpr (M == Mode::kLogprobs) {
    if (threadIdx.x == 0) {
      a.logp[t] = bad ? NAN : ignored ? 0.0f : x[label] - lse;
      if (a.entropy) a.entropy[t] = bad ? NAN : H;  // 0 on ignored rows
    }
  } else {
    // dlogits_v = c (p_v - onehot_v) - h p_v (x_v - lse + H), c = scale (cross-entropy) or -g (objective).
    float c, h = 0.0f;
    if constexpr (M == Mode::kCrossEntropy) {
      if (threadIdx.x == 0) a.loss_rows[t] = bad ? NAN : ignored ? 0.0f : lse - x[label];
      c = a.scale;
    } else {
      c = -a.dlogp[t];
      if (want_entropy && !ignored) h = a.dentropy[t];
    }
    c = bad ? NAN : ignored ? 0.0f : c;
    __nv_bfloat16* d = a.dlogits + i * V;
    for (int64_t j = threadIdx.x; j < nv; j += blockDim.x) {
      float v[VEC], g[VEC];
      load<VEC>(x, j, v);
#pragma unroll
      for (int k = 0; k < VEC; ++k) {
        const float p = __expf(v[k] - lse);
        g[k] = c * p;
        if (j * VEC + k == label) g[k] -= c;
        if (M == Mode::kObjective && want_entropy) g[k] -= h * p * (v[k] - lse + H);
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

// Per op: its name, its GEMMs' names (for error messages) and its deferred label error with the V of
// its latest call (for the message).
struct OpInfo {
  const char *name, *logits_gemm, *dhn_gemm, *dw_gemm;
  DeferredError label_error;
  int64_t last_V = 0;
};
OpInfo& info(Mode m) {
  static OpInfo ops[3] = {{"lm_head_cross_entropy", "lm_head_cross_entropy logits", "lm_head_cross_entropy dhn",
                           "lm_head_cross_entropy dw"},
                          {"lm_head_logprobs", "lm_head_logprobs logits", nullptr, nullptr},
                          {"lm_head_objective_bwd", "lm_head_objective_bwd logits", "lm_head_objective_bwd dhn",
                           "lm_head_objective_bwd dw"}};
  return ops[int(m)];
}

// Throws, as `op`, a bad label that an earlier call of any of the three ops found on the device.
void throw_deferred_label_error(const char* op) {
  for (Mode m : {Mode::kCrossEntropy, Mode::kLogprobs, Mode::kObjective}) {
    unsigned long long key;
    if (info(m).label_error.take(&key, op))
      MT_THROW(op, ": label ", DeferredError::value_of(key), " at row ", DeferredError::index_of(key),
               " (of an earlier ", info(m).name, " call, found on the device) is out of range: labels must be in [0, ",
               info(m).last_V, ") or -100 (ignored)");
  }
}

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

// Scratch shared by the three ops: one chunk's f32 logits and one group's bf16 dlogits.
DeviceScratch& logits_scratch() {
  static DeviceScratch s;
  return s;
}
DeviceScratch& dlogits_scratch() {
  static DeviceScratch s;
  return s;
}

// hn and w bf16, labels i64, all on CUDA (the shapes are op_checks.h's, checked by the dispatch).
void check_inputs(const Tensor& hn_TD, const Tensor& w_VD, const Tensor& labels_T, const char* op) {
  check_cuda(hn_TD, DType::BF16, str(op, " hn_TD").c_str());
  check_cuda(w_VD, DType::BF16, str(op, " w_VD").c_str());
  check_cuda(labels_T, DType::I64, str(op, " labels_T").c_str());
}

// The body of the three ops (the file's header describes it): the caller has checked the arguments
// and filled the per-op fields of `a` (row0, dlogits and err are set here). With gradients (all but
// the logprobs op) dhn = dlogits @ w and dw += (or = unless accumulate_dw) dlogits^T @ hn. Nothing
// happens for T == 0 (the caller handles dw then).
template <Mode M>
void run_rows(const Tensor& hn_TD, const Tensor& w_VD, int64_t chunk_rows, RowArgs a, Tensor* dhn_TD, Tensor* dw_VD,
              bool accumulate_dw) {
  constexpr bool kGrads = M != Mode::kLogprobs;
  OpInfo& op = info(M);
  const int64_t T = hn_TD.size(0), D = hn_TD.size(1), V = w_VD.size(0);
  MT_CHECK(T <= INT32_MAX, op.name, ": T (", T, ") exceeds the i32 row range of the error record");
  op.last_V = V;
  if (chunk_rows <= 0) chunk_rows = std::max<int64_t>(1, kDefaultChunkBytes / (4 * std::max<int64_t>(V, 1)));
  chunk_rows = std::min(chunk_rows, T);
  MT_CHECK(chunk_rows < (int64_t(1) << 31), op.name, ": chunk_rows (", chunk_rows, ") too large");
  // Groups of equal size (up to one row), so that the last one is not a sliver.
  const int64_t max_group = kGrads ? std::min(group_rows_for(V, chunk_rows), T) : T;
  const int64_t groups = (T + max_group - 1) / max_group;
  const int64_t group_rows = (T + groups - 1) / groups;

  float* logits = logits_scratch().as<float>(chunk_rows * V, op.name);
  __nv_bfloat16* dlogits = kGrads ? dlogits_scratch().as<__nv_bfloat16>(group_rows * V, op.name) : nullptr;
  const __nv_bfloat16* hn = bf16_in(hn_TD);
  const __nv_bfloat16* w = bf16_in(w_VD);
  a.err = op.label_error.device_word(op.name);
  const bool vec4 = V % 4 == 0;  // logits and dlogits rows are then 16- and 8-byte aligned (cudaMalloc bases)
  for (int64_t g0 = 0; g0 < T; g0 += group_rows) {
    const int64_t ng = std::min(group_rows, T - g0);
    for (int64_t t0 = g0; t0 < g0 + ng; t0 += chunk_rows) {
      const int64_t n = std::min(chunk_rows, g0 + ng - t0);
      gemm(op.logits_gemm, false, true, n, V, D, hn + t0 * D, D, w, D, 0.0f, logits, DType::F32, V);
      a.row0 = t0;
      a.dlogits = kGrads ? dlogits + (t0 - g0) * V : nullptr;
      if (vec4)
        lm_head_rows_kernel<4, M><<<unsigned(n), kRowThreads, 0, stream()>>>(logits, V, a);
      else
        lm_head_rows_kernel<1, M><<<unsigned(n), kRowThreads, 0, stream()>>>(logits, V, a);
      MT_CUDA_LAUNCH_CHECK(op.name);
      // The batch-invariant mode: the log-probs by the sampler's row function (invariant.cuh), bit for bit its.
      if (M == Mode::kLogprobs && batch_invariant()) invariant_logprobs(logits, V, n, V, a.labels + t0, a.logp + t0);
    }
    if constexpr (kGrads) {
      __nv_bfloat16* dhn = static_cast<__nv_bfloat16*>(dhn_TD->raw());
      gemm(op.dhn_gemm, false, false, ng, D, V, dlogits, V, w, D, 0.0f, dhn + g0 * D, DType::BF16, D);
      const float beta = accumulate_dw || g0 > 0 ? 1.0f : 0.0f;
      gemm(op.dw_gemm, true, false, V, D, ng, dlogits, V, hn + g0 * D, D, beta, dw_VD->data<float>(), DType::F32, D);
    }
  }
}

RowArgs no_args(const Tensor& labels_T) {
  RowArgs a{};
  a.labels = labels_T.data<int64_t>();
  return a;
}

}  // namespace

void lm_head_cross_entropy(const Tensor& hn_TD, const Tensor& w_VD, const Tensor& labels_T, float scale,
                           int64_t chunk_rows, Tensor& loss_sum, Tensor& dhn_TD, Tensor& dw_VD, bool accumulate_dw) {
  const char* op = "lm_head_cross_entropy";
  throw_deferred_label_error(op);
  check_inputs(hn_TD, w_VD, labels_T, op);
  check_cuda(loss_sum, DType::F32, "lm_head_cross_entropy loss_sum");
  check_cuda(dhn_TD, DType::BF16, "lm_head_cross_entropy dhn_TD");
  check_cuda(dw_VD, DType::F32, "lm_head_cross_entropy dw_VD");
  const int64_t T = hn_TD.size(0);
  if (T == 0) {
    if (!accumulate_dw) dw_VD.zero_();  // no group writes it
    return;
  }
  static DeviceScratch loss_rows_buf;
  RowArgs a = no_args(labels_T);
  a.scale = scale;
  a.loss_rows = loss_rows_buf.as<float>(T, op);
  run_rows<Mode::kCrossEntropy>(hn_TD, w_VD, chunk_rows, a, &dhn_TD, &dw_VD, accumulate_dw);
  loss_sum_kernel<<<1, 1024, 0, stream()>>>(a.loss_rows, T, loss_sum.data<float>());
  MT_CUDA_LAUNCH_CHECK(op);
  info(Mode::kCrossEntropy).label_error.publish(op);
}

void lm_head_logprobs(const Tensor& hn_TD, const Tensor& w_VD, const Tensor& labels_T, int64_t chunk_rows,
                      Tensor& logp_T, Tensor* entropy_T) {
  const char* op = "lm_head_logprobs";
  throw_deferred_label_error(op);
  check_inputs(hn_TD, w_VD, labels_T, op);
  check_cuda(logp_T, DType::F32, "lm_head_logprobs logp_T");
  if (entropy_T) check_cuda(*entropy_T, DType::F32, "lm_head_logprobs entropy_T");
  if (hn_TD.size(0) == 0) return;
  RowArgs a = no_args(labels_T);
  a.logp = logp_T.data<float>();
  a.entropy = entropy_T ? entropy_T->data<float>() : nullptr;
  run_rows<Mode::kLogprobs>(hn_TD, w_VD, chunk_rows, a, nullptr, nullptr, false);
  info(Mode::kLogprobs).label_error.publish(op);
}

void lm_head_objective_bwd(const Tensor& hn_TD, const Tensor& w_VD, const Tensor& labels_T, const Tensor& dlogp_T,
                           const Tensor* dentropy_T, int64_t chunk_rows, Tensor& dhn_TD, Tensor& dw_VD,
                           bool accumulate_dw) {
  const char* op = "lm_head_objective_bwd";
  throw_deferred_label_error(op);
  check_inputs(hn_TD, w_VD, labels_T, op);
  check_cuda(dlogp_T, DType::F32, "lm_head_objective_bwd dlogp_T");
  if (dentropy_T) check_cuda(*dentropy_T, DType::F32, "lm_head_objective_bwd dentropy_T");
  check_cuda(dhn_TD, DType::BF16, "lm_head_objective_bwd dhn_TD");
  check_cuda(dw_VD, DType::F32, "lm_head_objective_bwd dw_VD");
  if (hn_TD.size(0) == 0) {
    if (!accumulate_dw) dw_VD.zero_();  // no group writes it
    return;
  }
  RowArgs a = no_args(labels_T);
  a.dlogp = dlogp_T.data<float>();
  a.dentropy = dentropy_T ? dentropy_T->data<float>() : nullptr;
  run_rows<Mode::kObjective>(hn_TD, w_VD, chunk_rows, a, &dhn_TD, &dw_VD, accumulate_dw);
  info(Mode::kObjective).label_error.publish(op);
}

}  // namespace mt::cuda
