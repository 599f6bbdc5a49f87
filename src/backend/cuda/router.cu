// CUDA MoE router (softmax, top-k with an optional balancing bias, optional renormalisation, and their
// backward), load-balancing aux loss pieces, router z-loss and the balancing-bias update: the same
// functions as backend/cpu/router.cpp, all in f32 storage.
//
// Numerics follow the CPU reference closely: the softmax exponentials, sums and dot products are
// computed in fp64 (cheap at E <= 1024 per token), so probabilities and gradients usually equal the
// CPU's bitwise and the top-k choice agrees with the CPU's except on exact-to-an-ulp near-ties. Top-k
// is K passes of a warp arg-max: larger probability first, ties to the lower expert id (as the CPU);
// NaN ranks below every number, so a NaN row still yields K distinct valid ids.
//
// Launch: one warp per token (4 warps per block) for router_fwd/router_bwd; the top-k bookkeeping is a
// per-lane bit mask, which limits E to 1024. Expert ids read by router_bwd and expert_counts are not
// checked on the host (that would need a synchronisation): an id outside [0, E) is skipped.
//
// expert_counts and prob_column_sums accumulate per block (shared-memory histogram; fp64 column sums)
// and add to the outputs with atomics. In deterministic mode (core/determinism.h) the float sums take
// no atomics: prob_column_sums and router_z_loss_fwd write one fp64 partial per block and a second
// kernel adds the partials in a fixed order (the counts are integers, so their atomics are exact).
// aux_loss_value returns a host value: it copies counts and sums (E values each) to the host and
// synchronises the stream.
//
// Shapes and scalar arguments are checked by the dispatch (ops/op_checks.h); device, dtypes and this
// backend's limits on E here.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "backend/cuda/common.cuh"
#include "backend/cuda/cuda_ops.h"
#include "backend/cuda/gemm.cuh"
#include "core/determinism.h"

namespace mt::cuda {

namespace {

constexpr int kWarps = 4;                // router_fwd/bwd: tokens per block
constexpr int kMaxExperts = 1024;        // 32 lanes x 32 bits of top-k bookkeeping
constexpr int kMaxCountExperts = 12288;  // expert_counts' shared histogram (48 KiB)
constexpr int kThreads = 256;

__device__ __forceinline__ double warp_sum(double v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

__device__ __forceinline__ float warp_max(float v) {
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// Whether candidate (va, ea) ranks before (vb, eb): a valid id before none (-1), a number before NaN,
// then the larger value, then the lower id. A total order, so every lane of a butterfly agrees.
__device__ __forceinline__ bool ranks_before(float va, int ea, float vb, int eb) {
  if (ea < 0) return false;
  if (eb < 0) return true;
  const bool na = isnan(va), nb = isnan(vb);
  if (na != nb) return nb;
  if (!na && va != vb) return va > vb;
  return ea < eb;
}

// With bias (aux-loss-free balancing) the arg-max runs over p + bias (one f32 add, as the CPU) and the
// chosen expert's weight is its unbiased probability, read back from shared memory.
__global__ void router_fwd_kernel(const float* __restrict__ logits, float* __restrict__ probs,
                                  int32_t* __restrict__ topk_idx, float* __restrict__ topk_w, int64_t T, int E, int K,
                                  bool norm_topk, const float* __restrict__ bias) {
  extern __shared__ float s_p_all[];  // [kWarps][E]
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  float* s_p = s_p_all + warp * E;
  const int64_t t = int64_t(blockIdx.x) * kWarps + warp;
  if (t >= T) return;  // the whole warp leaves together
  const float* l = logits + t * E;

  float mx = -INFINITY;
  for (int e = lane; e < E; e += 32) mx = fmaxf(mx, l[e]);
  mx = warp_max(mx);
  double sum = 0;
  for (int e = lane; e < E; e += 32) sum += exp(double(l[e]) - double(mx));
  sum = warp_sum(sum);
  for (int e = lane; e < E; e += 32) {
    const float p = float(exp(double(l[e]) - double(mx)) / sum);
    s_p[e] = p;
    probs[t * E + e] = p;
  }
  __syncwarp();

  uint32_t taken = 0;  // bit j: expert lane + 32*j is chosen
  double wsum = 0;
  for (int k = 0; k < K; ++k) {
    float best_v = 0.0f;
    int best_e = -1;
    for (int j = 0, e = lane; e < E; ++j, e += 32)
      if (!((taken >> j) & 1u)) {
        const float v = bias ? s_p[e] + bias[e] : s_p[e];
        if (ranks_before(v, e, best_v, best_e)) {
          best_v = v;
          best_e = e;
        }
      }
    for (int o = 16; o > 0; o >>= 1) {
      const float ov = __shfl_xor_sync(0xffffffffu, best_v, o);
      const int oe = __shfl_xor_sync(0xffffffffu, best_e, o);
      if (ranks_before(ov, oe, best_v, best_e)) {
        best_v = ov;
        best_e = oe;
      }
    }
    if (best_e >= 0 && lane == (best_e & 31)) taken |= 1u << (best_e >> 5);
    const float best_p = bias && best_e >= 0 ? s_p[best_e] : best_v;
    if (lane == 0) {
      topk_idx[t * K + k] = best_e;
      topk_w[t * K + k] = best_p;
    }
    wsum += best_p;  // in k order, as the CPU
  }
  if (norm_topk && lane == 0)
    for (int k = 0; k < K; ++k) topk_w[t * K + k] = float(double(topk_w[t * K + k]) / wsum);
}

__global__ void router_bwd_kernel(const float* __restrict__ dtopk_w, const float* __restrict__ dprobs,
                                  const float* __restrict__ probs, const int32_t* __restrict__ topk_idx,
                                  float* __restrict__ dlogits, int64_t T, int E, int K, bool norm_topk) {
  extern __shared__ double s_dP_all[];  // [kWarps][E]
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  double* s_dP = s_dP_all + warp * E;
  const int64_t t = int64_t(blockIdx.x) * kWarps + warp;
  if (t >= T) return;
  const float* p = probs + t * E;
  const float* dw = dtopk_w + t * K;
  const int32_t* it = topk_idx + t * K;

  for (int e = lane; e < E; e += 32) s_dP[e] = dprobs ? double(dprobs[t * E + e]) : 0.0;
  __syncwarp();
  if (lane == 0) {  // K is small; one lane keeps repeated ids (if any) race-free
    if (norm_topk) {
      // w_k = p_k / s with s = sum_j p_j, so dL/dp_k = (dW_k - sum_j dW_j w_j) / s.
      double s = 0, dot = 0;
      for (int k = 0; k < K; ++k)
        if (it[k] >= 0 && it[k] < E) s += p[it[k]];
      for (int k = 0; k < K; ++k)
        if (it[k] >= 0 && it[k] < E) dot += double(dw[k]) * (double(p[it[k]]) / s);
      for (int k = 0; k < K; ++k)
        if (it[k] >= 0 && it[k] < E) s_dP[it[k]] += (double(dw[k]) - dot) / s;
    } else {
      for (int k = 0; k < K; ++k)
        if (it[k] >= 0 && it[k] < E) s_dP[it[k]] += double(dw[k]);
    }
  }
  __syncwarp();
  double dot = 0;
  for (int e = lane; e < E; e += 32) dot += double(p[e]) * s_dP[e];
  dot = warp_sum(dot);
  for (int e = lane; e < E; e += 32) dlogits[t * E + e] = float(double(p[e]) * (s_dP[e] - dot));
}

// Shared-memory histogram per block, then one atomic per expert and block.
__global__ void expert_counts_kernel(const int32_t* __restrict__ idx, int64_t n, int E,
                                     unsigned long long* __restrict__ counts) {
  extern __shared__ unsigned int s_cnt[];  // [E]
  for (int e = threadIdx.x; e < E; e += blockDim.x) s_cnt[e] = 0;
  __syncthreads();
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const int e = idx[i];
    if (e >= 0 && e < E) atomicAdd(&s_cnt[e], 1u);
  }
  __syncthreads();
  for (int e = threadIdx.x; e < E; e += blockDim.x)
    if (s_cnt[e]) atomicAdd(&counts[e], static_cast<unsigned long long>(s_cnt[e]));
}

// Block b sums rows [b*rows_per_block, ...) of each column in fp64, then adds its partial with an atomic,
// or (partial non-null: deterministic mode) stores it in partial[b, e].
__global__ void prob_column_sums_kernel(const float* __restrict__ probs, int64_t T, int E, int64_t rows_per_block,
                                        float* __restrict__ sums, double* __restrict__ partial) {
  const int64_t r0 = int64_t(blockIdx.x) * rows_per_block, r1 = r0 + rows_per_block < T ? r0 + rows_per_block : T;
  for (int e = threadIdx.x; e < E; e += blockDim.x) {
    double acc = 0;
    for (int64_t r = r0; r < r1; ++r) acc += probs[r * E + e];
    if (partial)
      partial[int64_t(blockIdx.x) * E + e] = acc;
    else
      atomicAdd(&sums[e], float(acc));
  }
}

constexpr int kFinishCols = 32, kFinishGroups = 8;  // column_partials_finish's block: 32 experts x 8 groups

// sums[e] = f32(sums[e] + the blocks' partials of column e in a fixed order, in fp64): group y
// (threadIdx.y) adds blocks y, y + 8, ... in order, then the 8 group sums are added in order.
__global__ void column_partials_finish_kernel(const double* __restrict__ partial, int64_t blocks, int E,
                                              float* __restrict__ sums) {
  __shared__ double s_sum[kFinishGroups][kFinishCols];
  const int e = int(blockIdx.x) * kFinishCols + int(threadIdx.x);
  double acc = 0;
  if (e < E)
#pragma unroll 8
    for (int64_t b = threadIdx.y; b < blocks; b += kFinishGroups) acc += partial[b * E + e];
  s_sum[threadIdx.y][threadIdx.x] = acc;
  __syncthreads();
  if (threadIdx.y != 0 || e >= E) return;
  double total = 0;
  for (int g = 0; g < kFinishGroups; ++g) total += s_sum[g][threadIdx.x];
  sums[e] = float(double(sums[e]) + total);
}

// out[0] = f32(out[0] + sum of partial[0, n)), one block of kThreads: thread i sums i, i + kThreads, ...
// in order, then a shared-memory tree with fixed pairs. The same bits for the same partials, always.
__global__ void fixed_order_sum_kernel(const double* __restrict__ partial, int64_t n, float* __restrict__ out) {
  __shared__ double s[kThreads];
  double acc = 0;
  for (int64_t i = threadIdx.x; i < n; i += kThreads) acc += partial[i];
  s[threadIdx.x] = acc;
  __syncthreads();
  for (int half = kThreads / 2; half > 0; half >>= 1) {
    if (int(threadIdx.x) < half) s[threadIdx.x] += s[threadIdx.x + half];
    __syncthreads();
  }
  if (threadIdx.x == 0) out[0] = float(double(out[0]) + s[0]);
}

__global__ void aux_loss_bwd_kernel(const int64_t* __restrict__ counts, int64_t T, int E, int64_t N, float dloss,
                                    float* __restrict__ dprobs) {
  const int64_t total = T * E;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < total; i += int64_t(gridDim.x) * blockDim.x) {
    const int e = int(i % E);
    // The CPU's expression, rounded to f32 before the add.
    const float g = float(double(dloss) * double(E) * double(counts[e]) / (double(N) * double(N)));
    dprobs[i] += g;
  }
}

// One warp per token: lse in fp64 (as the CPU), lse^2 summed per block, one atomic per block, or
// (partial non-null: deterministic mode) the block's sum stored in partial[block].
__global__ void router_z_loss_fwd_kernel(const float* __restrict__ logits, float* __restrict__ lse, int64_t T, int E,
                                         float* __restrict__ zsum, double* __restrict__ partial) {
  __shared__ double s_z[kWarps];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t t = int64_t(blockIdx.x) * kWarps + warp;
  double z = 0;
  if (t < T) {
    const float* l = logits + t * E;
    float mx = -INFINITY;
    for (int e = lane; e < E; e += 32) mx = fmaxf(mx, l[e]);
    mx = warp_max(mx);
    double sum = 0;
    for (int e = lane; e < E; e += 32) sum += exp(double(l[e]) - double(mx));
    sum = warp_sum(sum);
    const double v = double(mx) + log(sum);
    if (lane == 0) lse[t] = float(v);
    z = v * v;
  }
  if (lane == 0) s_z[warp] = z;
  __syncthreads();
  if (threadIdx.x == 0) {
    double acc = 0;
    for (int w = 0; w < kWarps; ++w) acc += s_z[w];
    if (partial)
      partial[blockIdx.x] = acc;
    else
      atomicAdd(zsum, float(acc));
  }
}

__global__ void router_z_loss_bwd_kernel(const float* __restrict__ lse, const float* __restrict__ probs, int64_t T,
                                         int E, float scale, float* __restrict__ dlogits) {
  const int64_t total = T * E;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < total; i += int64_t(gridDim.x) * blockDim.x) {
    const double g = double(scale) * 2.0 * double(lse[i / E]);  // the CPU's expression
    dlogits[i] += float(g * double(probs[i]));
  }
}

// One block per layer row: the row total, then each expert's step. sign(mean - c) is computed as
// sign(total - E * c) in integers, as the CPU, so no rounding of the mean can flip it.
__global__ void router_bias_update_kernel(const int64_t* __restrict__ counts, int E, float rate,
                                          float* __restrict__ bias) {
  __shared__ long long s_total;
  const int64_t* c = counts + int64_t(blockIdx.x) * E;
  float* b = bias + int64_t(blockIdx.x) * E;
  if (threadIdx.x == 0) {
    long long total = 0;
    for (int e = 0; e < E; ++e) total += c[e];
    s_total = total;
  }
  __syncthreads();
  for (int e = threadIdx.x; e < E; e += blockDim.x) {
    const long long diff = s_total - (long long)E * c[e];
    const float s = diff > 0 ? 1.0f : diff < 0 ? -1.0f : 0.0f;
    b[e] += rate * s;
  }
}

void check_experts_limit(int64_t E, int64_t limit, const char* op) {
  if (E > limit) MT_THROW(op, ": expert count E (", E, ") is above the CUDA kernel's limit of ", limit);
}

unsigned token_blocks(int64_t T) {
  return unsigned((T + kWarps - 1) / kWarps);
}

}  // namespace

void router_fwd(const Tensor& logits_TE, int64_t K, bool norm_topk, Tensor& probs_TE, Tensor& topk_idx_TK,
                Tensor& topk_w_TK, const Tensor* bias_E) {
  check_cuda(logits_TE, DType::F32, "router_fwd logits_TE");
  const int64_t T = logits_TE.size(0), E = logits_TE.size(1);
  check_experts_limit(E, kMaxExperts, "router_fwd");
  check_cuda(probs_TE, DType::F32, "router_fwd probs_TE");
  check_cuda(topk_idx_TK, DType::I32, "router_fwd topk_idx_TK");
  check_cuda(topk_w_TK, DType::F32, "router_fwd topk_w_TK");
  if (bias_E) check_cuda(*bias_E, DType::F32, "router_fwd bias_E");
  if (T == 0) return;
  router_fwd_kernel<<<token_blocks(T), kWarps * 32, size_t(kWarps) * size_t(E) * sizeof(float), stream()>>>(
      logits_TE.data<float>(), probs_TE.data<float>(), topk_idx_TK.data<int32_t>(), topk_w_TK.data<float>(), T, int(E),
      int(K), norm_topk, bias_E ? bias_E->data<float>() : nullptr);
  MT_CUDA_LAUNCH_CHECK("router_fwd");
}

void router_bwd(const Tensor& dtopk_w_TK, const Tensor* dprobs_TE, const Tensor& probs_TE, const Tensor& topk_idx_TK,
                bool norm_topk, Tensor& dlogits_TE) {
  check_cuda(probs_TE, DType::F32, "router_bwd probs_TE");
  check_cuda(dtopk_w_TK, DType::F32, "router_bwd dtopk_w_TK");
  const int64_t T = probs_TE.size(0), E = probs_TE.size(1), K = dtopk_w_TK.size(1);
  check_experts_limit(E, kMaxExperts, "router_bwd");
  check_cuda(topk_idx_TK, DType::I32, "router_bwd topk_idx_TK");
  if (dprobs_TE) check_cuda(*dprobs_TE, DType::F32, "router_bwd dprobs_TE");
  check_cuda(dlogits_TE, DType::F32, "router_bwd dlogits_TE");
  if (T == 0 || E == 0) return;
  router_bwd_kernel<<<token_blocks(T), kWarps * 32, size_t(kWarps) * size_t(E) * sizeof(double), stream()>>>(
      dtopk_w_TK.data<float>(), dprobs_TE ? dprobs_TE->data<float>() : nullptr, probs_TE.data<float>(),
      topk_idx_TK.data<int32_t>(), dlogits_TE.data<float>(), T, int(E), int(K), norm_topk);
  MT_CUDA_LAUNCH_CHECK("router_bwd");
}

void expert_counts(const Tensor& topk_idx_TK, int64_t E, Tensor& counts_E) {
  check_cuda(topk_idx_TK, DType::I32, "expert_counts topk_idx_TK");
  check_experts_limit(E, kMaxCountExperts, "expert_counts");
  check_cuda(counts_E, DType::I64, "expert_counts counts_E");
  const int64_t n = topk_idx_TK.numel();
  if (n == 0) return;
  const unsigned grid = unsigned(std::clamp<int64_t>((n + kThreads - 1) / kThreads, 1, 264));
  // i64 counts are added as unsigned 64-bit: the same bits for non-negative sums.
  expert_counts_kernel<<<grid, kThreads, size_t(E) * sizeof(unsigned int), stream()>>>(
      topk_idx_TK.data<int32_t>(), n, int(E), reinterpret_cast<unsigned long long*>(counts_E.data<int64_t>()));
  MT_CUDA_LAUNCH_CHECK("expert_counts");
}

void prob_column_sums(const Tensor& probs_TE, Tensor& sums_E) {
  check_cuda(probs_TE, DType::F32, "prob_column_sums probs_TE");
  check_cuda(sums_E, DType::F32, "prob_column_sums sums_E");
  const int64_t T = probs_TE.size(0), E = probs_TE.size(1);
  if (T == 0 || E == 0) return;
  constexpr int64_t kRowsPerBlock = 32;
  const int64_t blocks = (T + kRowsPerBlock - 1) / kRowsPerBlock;
  const int threads = int(std::min<int64_t>(kThreads, (E + 31) / 32 * 32));
  double* partial = nullptr;
  if (deterministic()) {
    static DeviceScratch partial_buf;
    partial = partial_buf.as<double>(blocks * E, "prob_column_sums");
  }
  prob_column_sums_kernel<<<unsigned(blocks), threads, 0, stream()>>>(probs_TE.data<float>(), T, int(E), kRowsPerBlock,
                                                                      sums_E.data<float>(), partial);
  MT_CUDA_LAUNCH_CHECK("prob_column_sums");
  if (partial) {
    column_partials_finish_kernel<<<blocks_for(E, kFinishCols), dim3{kFinishCols, kFinishGroups}, 0, stream()>>>(
        partial, blocks, int(E), sums_E.data<float>());
    MT_CUDA_LAUNCH_CHECK("prob_column_sums");
  }
}

// Synchronises the stream: copies counts and sums (E values each) to the host and computes the CPU's
// expression there.
double aux_loss_value(const Tensor& counts_E, const Tensor& sums_E, int64_t N) {
  check_cuda(counts_E, DType::I64, "aux_loss_value counts_E");
  check_cuda(sums_E, DType::F32, "aux_loss_value sums_E");
  const int64_t E = counts_E.size(0);
  std::vector<int64_t> counts(static_cast<size_t>(E));
  std::vector<float> sums(static_cast<size_t>(E));
  if (E > 0) {
    MT_CUDA_CHECK("aux_loss_value", cudaMemcpyAsync(counts.data(), counts_E.raw(), size_t(E) * sizeof(int64_t),
                                                    cudaMemcpyDeviceToHost, stream()));
    MT_CUDA_CHECK("aux_loss_value", cudaMemcpyAsync(sums.data(), sums_E.raw(), size_t(E) * sizeof(float),
                                                    cudaMemcpyDeviceToHost, stream()));
    sync("aux_loss_value");
  }
  double acc = 0;
  for (size_t e = 0; e < size_t(E); ++e) acc += (double(counts[e]) / double(N)) * (double(sums[e]) / double(N));
  return double(E) * acc;
}

void aux_loss_bwd(const Tensor& counts_E, int64_t N, float dloss, Tensor& dprobs_TE) {
  check_cuda(counts_E, DType::I64, "aux_loss_bwd counts_E");
  check_cuda(dprobs_TE, DType::F32, "aux_loss_bwd dprobs_TE");
  const int64_t E = counts_E.size(0), T = dprobs_TE.size(0);
  if (T == 0 || E == 0) return;
  const unsigned grid = unsigned(std::clamp<int64_t>((T * E + kThreads - 1) / kThreads, 1, 4096));
  aux_loss_bwd_kernel<<<grid, kThreads, 0, stream()>>>(counts_E.data<int64_t>(), T, int(E), N, dloss,
                                                       dprobs_TE.data<float>());
  MT_CUDA_LAUNCH_CHECK("aux_loss_bwd");
}

void router_z_loss_fwd(const Tensor& logits_TE, Tensor& lse_T, Tensor& zsum) {
  check_cuda(logits_TE, DType::F32, "router_z_loss_fwd logits_TE");
  check_cuda(lse_T, DType::F32, "router_z_loss_fwd lse_T");
  check_cuda(zsum, DType::F32, "router_z_loss_fwd zsum");
  const int64_t T = logits_TE.size(0), E = logits_TE.size(1);
  if (T == 0 || E == 0) return;
  double* partial = nullptr;
  if (deterministic()) {
    static DeviceScratch partial_buf;
    partial = partial_buf.as<double>(token_blocks(T), "router_z_loss_fwd");
  }
  router_z_loss_fwd_kernel<<<token_blocks(T), kWarps * 32, 0, stream()>>>(logits_TE.data<float>(), lse_T.data<float>(),
                                                                          T, int(E), zsum.data<float>(), partial);
  MT_CUDA_LAUNCH_CHECK("router_z_loss_fwd");
  if (partial) {
    fixed_order_sum_kernel<<<1, kThreads, 0, stream()>>>(partial, token_blocks(T), zsum.data<float>());
    MT_CUDA_LAUNCH_CHECK("router_z_loss_fwd");
  }
}

void router_z_loss_bwd(const Tensor& lse_T, const Tensor& probs_TE, float scale, Tensor& dlogits_TE) {
  check_cuda(probs_TE, DType::F32, "router_z_loss_bwd probs_TE");
  check_cuda(lse_T, DType::F32, "router_z_loss_bwd lse_T");
  check_cuda(dlogits_TE, DType::F32, "router_z_loss_bwd dlogits_TE");
  const int64_t T = probs_TE.size(0), E = probs_TE.size(1);
  if (T == 0 || E == 0) return;
  const unsigned grid = unsigned(std::clamp<int64_t>((T * E + kThreads - 1) / kThreads, 1, 4096));
  router_z_loss_bwd_kernel<<<grid, kThreads, 0, stream()>>>(lse_T.data<float>(), probs_TE.data<float>(), T, int(E),
                                                            scale, dlogits_TE.data<float>());
  MT_CUDA_LAUNCH_CHECK("router_z_loss_bwd");
}

void router_bias_update(const Tensor& counts_LE, float rate, Tensor& bias_LE) {
  check_cuda(counts_LE, DType::I64, "router_bias_update counts_LE");
  check_cuda(bias_LE, DType::F32, "router_bias_update bias_LE");
  const int64_t L = counts_LE.size(0), E = counts_LE.size(1);
  if (L == 0 || E == 0) return;
  router_bias_update_kernel<<<unsigned(L), kThreads, 0, stream()>>>(counts_LE.data<int64_t>(), int(E), rate,
                                                                    bias_LE.data<float>());
  MT_CUDA_LAUNCH_CHECK("router_bias_update");
}

}  // namespace mt::cuda
