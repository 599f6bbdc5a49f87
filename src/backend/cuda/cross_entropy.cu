// CUDA cross-entropy over vocabulary rows with ignore index -100, the same function as
// backend/cpu/cross_entropy.cpp, for f32 (what the model passes) or bf16 logits.
//
// Forward: one block per row (grid-stride over rows); each thread keeps an online (max, sum of exp)
// pair in f32 with full-precision expf over its strided elements, the block merges the pairs, and
// lse = max + log(sum) is formed in fp64 and saved rounded to f32. Each block adds its rows'
// (lse - logit[label]) in fp64 and a fixed order; the host adds the block partials in a fixed order,
// so the returned sum is deterministic. cross_entropy_fwd returns host values: it copies the block
// partials to the host and synchronises the stream. Labels are checked on the device and a bad one is
// reported after that synchronisation with its row and value, as the CPU does (lse_T is written anyway).
// The partials live in per-process device scratch: do not call it from two host threads at once.
//
// Backward: one block per row; dlogits = scale * (exp(logit - lse) - onehot), 0 on ignored rows. It does
// not synchronise, so an out-of-range label (which the forward would have rejected) only loses its
// one-hot term.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "backend/cuda/common.cuh"
#include "backend/cuda/cuda_ops.h"

namespace mt::cuda {

namespace {

constexpr int64_t kIgnoreIndex = -100;
constexpr int kThreads = 512;
constexpr int kMaxBlocks = 1024;
constexpr int64_t kMaxBwdGrid = int64_t(1) << 20;

__device__ double g_ce_loss[kMaxBlocks];
__device__ long long g_ce_valid[kMaxBlocks];
__device__ unsigned long long g_ce_bad_row;

template <class T, int N>
struct alignas(sizeof(T) * N) Pack {
  T v[N];
};

inline bool aligned16(const void* p) {
  return reinterpret_cast<uintptr_t>(p) % 16 == 0;
}

// Online softmax statistics: m the running max, s the sum of exp(x - m); s == 0 means "no elements yet".
__device__ __forceinline__ void online_add(float& m, float& s, float x) {
  if (x > m) {
    s = s * expf(m - x) + 1.0f;  // m = -inf at first: expf(-inf) = 0
    m = x;
  } else if (m != -INFINITY) {
    s += expf(x - m);
  }
}

__device__ __forceinline__ void online_merge(float& m, float& s, float m2, float s2) {
  if (s2 == 0.0f) return;
  if (s == 0.0f) {
    m = m2;
    s = s2;
    return;
  }
  const float mn = fmaxf(m, m2);
  s = s * expf(m - mn) + s2 * expf(m2 - mn);
  m = mn;
}

// Merges the (m, s) pairs of the block; the result is valid in thread 0.
__device__ void block_merge(float& m, float& s) {
  __shared__ float s_m[32], s_s[32];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  for (int o = 16; o > 0; o >>= 1) {
    const float m2 = __shfl_xor_sync(0xffffffffu, m, o), s2 = __shfl_xor_sync(0xffffffffu, s, o);
    online_merge(m, s, m2, s2);
  }
  if (lane == 0) {
    s_m[warp] = m;
    s_s[warp] = s;
  }
  __syncthreads();
  if (warp == 0) {
    const bool have = lane < int(blockDim.x / 32);
    m = have ? s_m[lane] : -INFINITY;
    s = have ? s_s[lane] : 0.0f;
    for (int o = 16; o > 0; o >>= 1) {
      const float m2 = __shfl_xor_sync(0xffffffffu, m, o), s2 = __shfl_xor_sync(0xffffffffu, s, o);
      online_merge(m, s, m2, s2);
    }
  }
  __syncthreads();  // s_m/s_s may be reused by the next row
}

template <class T, int VEC>
__global__ void ce_fwd_kernel(const T* __restrict__ logits, const int64_t* __restrict__ labels,
                              float* __restrict__ lse_out, int64_t rows, int64_t V, double* __restrict__ part_loss,
                              long long* __restrict__ part_valid, unsigned long long* __restrict__ bad_row) {
  using P = Pack<T, VEC>;
  double loss = 0;
  long long valid = 0;
  const int64_t chunks = V / VEC;
  for (int64_t t = blockIdx.x; t < rows; t += gridDim.x) {
    const T* row = logits + t * V;
    float m = -INFINITY, s = 0.0f;
    for (int64_t c = threadIdx.x; c < chunks; c += blockDim.x) {
      const P a = reinterpret_cast<const P*>(row)[c];
#pragma unroll
      for (int j = 0; j < VEC; ++j) online_add(m, s, to_f32(a.v[j]));
    }
    for (int64_t j = chunks * VEC + threadIdx.x; j < V; j += blockDim.x) online_add(m, s, to_f32(row[j]));
    block_merge(m, s);
    if (threadIdx.x == 0) {
      const double lse = double(m) + log(double(s));
      lse_out[t] = float(lse);
      const int64_t label = labels[t];
      if (label != kIgnoreIndex) {
        if (label < 0 || label >= V) {
          atomicMin(bad_row, static_cast<unsigned long long>(t));
        } else {
          loss += lse - double(to_f32(row[label]));
          ++valid;
        }
      }
    }
  }
  if (threadIdx.x == 0) {
    part_loss[blockIdx.x] = loss;
    part_valid[blockIdx.x] = valid;
  }
}

template <class T, int VEC>
__global__ void ce_bwd_kernel(const T* __restrict__ logits, const int64_t* __restrict__ labels,
                              const float* __restrict__ lse, float scale, T* __restrict__ dlogits, int64_t rows,
                              int64_t V) {
  using P = Pack<T, VEC>;
  const int64_t chunks = V / VEC;
  for (int64_t t = blockIdx.x; t < rows; t += gridDim.x) {
    const T* row = logits + t * V;
    T* drow = dlogits + t * V;
    const int64_t label = labels[t];
    const bool ignored = label == kIgnoreIndex;
    const float l = lse[t];
    // Element j's gradient; the one-hot term only for the (valid) label column.
    auto grad = [&](float x, int64_t j) -> float {
      if (ignored) return 0.0f;
      const float p = expf(x - l);
      return __fmul_rn(scale, j == label ? __fsub_rn(p, 1.0f) : p);
    };
    for (int64_t c = threadIdx.x; c < chunks; c += blockDim.x) {
      const P a = reinterpret_cast<const P*>(row)[c];
      P out;
#pragma unroll
      for (int j = 0; j < VEC; ++j) out.v[j] = from_f32<T>(grad(to_f32(a.v[j]), c * VEC + j));
      reinterpret_cast<P*>(drow)[c] = out;
    }
    for (int64_t j = chunks * VEC + threadIdx.x; j < V; j += blockDim.x) drow[j] = from_f32<T>(grad(to_f32(row[j]), j));
  }
}

// Checks that logits_TV (f32 or bf16), labels_T (i64) and lse_T (f32) are on CUDA with these dtypes (the
// shapes are op_checks.h's, checked by the dispatch).
void check_ce_args(const Tensor& logits_TV, const Tensor& labels_T, const Tensor& lse_T, const char* op) {
  check_cuda_bf16_or_f32(logits_TV, str(op, " logits_TV").c_str());
  check_cuda(labels_T, DType::I64, str(op, " labels_T").c_str());
  check_cuda(lse_T, DType::F32, str(op, " lse_T").c_str());
}

// Calls f(float{}) or f(__nv_bfloat16{}) for the logits dtype.
template <class F>
void dispatch_logits(DType dt, F&& f) {
  if (dt == DType::F32)
    f(float{});
  else
    f(__nv_bfloat16{});
}

}  // namespace

double cross_entropy_fwd(const Tensor& logits_TV, const Tensor& labels_T, Tensor& lse_T, int64_t* n_valid) {
  check_ce_args(logits_TV, labels_T, lse_T, "cross_entropy_fwd");
  const int64_t T = logits_TV.size(0), V = logits_TV.size(1);
  if (T == 0) {
    if (n_valid) *n_valid = 0;
    return 0.0;
  }
  double* part_loss = nullptr;
  long long* part_valid = nullptr;
  unsigned long long* bad_row = nullptr;
  MT_CUDA_CHECK("cross_entropy_fwd", cudaGetSymbolAddress(reinterpret_cast<void**>(&part_loss), g_ce_loss));
  MT_CUDA_CHECK("cross_entropy_fwd", cudaGetSymbolAddress(reinterpret_cast<void**>(&part_valid), g_ce_valid));
  MT_CUDA_CHECK("cross_entropy_fwd", cudaGetSymbolAddress(reinterpret_cast<void**>(&bad_row), g_ce_bad_row));
  MT_CUDA_CHECK("cross_entropy_fwd", cudaMemsetAsync(bad_row, 0xff, sizeof(unsigned long long), stream()));

  const unsigned grid = unsigned(std::min<int64_t>(T, kMaxBlocks));
  dispatch_logits(logits_TV.dtype(), [&](auto tag) {
    using T_ = decltype(tag);
    constexpr int kVec = int(16 / sizeof(T_));
    const T_* logits = static_cast<const T_*>(logits_TV.raw());
    if (V % kVec == 0 && aligned16(logits))
      ce_fwd_kernel<T_, kVec><<<grid, kThreads, 0, stream()>>>(logits, labels_T.data<int64_t>(), lse_T.data<float>(), T,
                                                               V, part_loss, part_valid, bad_row);
    else
      ce_fwd_kernel<T_, 1><<<grid, kThreads, 0, stream()>>>(logits, labels_T.data<int64_t>(), lse_T.data<float>(), T, V,
                                                            part_loss, part_valid, bad_row);
  });
  MT_CUDA_LAUNCH_CHECK("cross_entropy_fwd");

  std::vector<double> loss(grid);
  std::vector<long long> valid(grid);
  unsigned long long bad = 0;
  MT_CUDA_CHECK("cross_entropy_fwd",
                cudaMemcpyAsync(loss.data(), part_loss, grid * sizeof(double), cudaMemcpyDeviceToHost, stream()));
  MT_CUDA_CHECK("cross_entropy_fwd",
                cudaMemcpyAsync(valid.data(), part_valid, grid * sizeof(long long), cudaMemcpyDeviceToHost, stream()));
  MT_CUDA_CHECK("cross_entropy_fwd", cudaMemcpyAsync(&bad, bad_row, sizeof(bad), cudaMemcpyDeviceToHost, stream()));
  sync("cross_entropy_fwd");
  if (bad != ~0ull) {
    int64_t label = 0;
    MT_CUDA_CHECK("cross_entropy_fwd",
                  cudaMemcpy(&label, labels_T.data<int64_t>() + bad, sizeof(label), cudaMemcpyDeviceToHost));
    MT_THROW("cross_entropy_fwd: label ", label, " at row ", bad, " is out of range: labels must be in [0, ", V,
             ") or ", kIgnoreIndex, " (ignored)");
  }
  double sum = 0;
  int64_t count = 0;
  for (unsigned b = 0; b < grid; ++b) {
    sum += loss[b];
    count += valid[b];
  }
  if (n_valid) *n_valid = count;
  return sum;
}

void cross_entropy_bwd(const Tensor& logits_TV, const Tensor& labels_T, const Tensor& lse_T, float scale,
                       Tensor& dlogits_TV) {
  check_ce_args(logits_TV, labels_T, lse_T, "cross_entropy_bwd");
  const int64_t T = logits_TV.size(0), V = logits_TV.size(1);
  check_cuda(dlogits_TV, logits_TV.dtype(), "cross_entropy_bwd dlogits_TV");
  if (T == 0 || V == 0) return;
  const unsigned grid = unsigned(std::min<int64_t>(T, kMaxBwdGrid));
  dispatch_logits(logits_TV.dtype(), [&](auto tag) {
    using T_ = decltype(tag);
    constexpr int kVec = int(16 / sizeof(T_));
    const T_* logits = static_cast<const T_*>(logits_TV.raw());
    T_* dlogits = static_cast<T_*>(dlogits_TV.raw());
    if (V % kVec == 0 && aligned16(logits) && aligned16(dlogits))
      ce_bwd_kernel<T_, kVec><<<grid, kThreads, 0, stream()>>>(logits, labels_T.data<int64_t>(), lse_T.data<float>(),
                                                               scale, dlogits, T, V);
    else
      ce_bwd_kernel<T_, 1><<<grid, kThreads, 0, stream()>>>(logits, labels_T.data<int64_t>(), lse_T.data<float>(),
                                                            scale, dlogits, T, V);
  });
  MT_CUDA_LAUNCH_CHECK("cross_entropy_bwd");
}

}  // namespace mt::cuda
