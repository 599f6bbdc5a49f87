// CUDA dropless token dispatch: the plan (a stable sort of the T*K assignments by expert, with CUB's
// radix sort), the permutation of token rows into expert-contiguous rows and the weighted
// un-permutation back to tokens (whose token-side rows, unpermute's y and dy, may be bf16 or f32, so
// that an f32 residual stream needs no cast). Same contracts as the CPU reference (backend/cpu/moe_dispatch.cpp);
// the plan is bit-identical to it. Every op is deterministic: no atomics on data, sums over a token's
// K rows run in k order in f32. Nothing synchronises the host; bad expert ids surface as described
// in moe_dispatch.cuh. Indices that a valid plan never produces (a row or an assignment out of
// range) are skipped rather than dereferenced, so a corrupt plan cannot write out of bounds.
// Shapes and scalar arguments are checked by the dispatch (ops/op_checks.h); device, dtypes and this
// backend's index and grid limits here.
#include <algorithm>
#include <cub/device/device_radix_sort.cuh>
#include <initializer_list>
#include <limits>
#include <type_traits>

#include "backend/cuda/cuda_ops.h"

#include "backend/cuda/gemm.cuh"
#include "backend/cuda/moe_dispatch.cuh"

namespace mt::cuda {

namespace {

// ---- bf16 rows as f32, 8 elements (16 bytes) at a time when the layout allows, else 1 ----
template <int V>
__device__ __forceinline__ void load_row(const __nv_bfloat16* p, float (&out)[V]) {
  if constexpr (V == 8) {
    const uint4 raw = *reinterpret_cast<const uint4*>(p);
    const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&raw);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float2 f = __bfloat1622float2(h[i]);
      out[2 * i] = f.x;
      out[2 * i + 1] = f.y;
    }
  } else {
    out[0] = __bfloat162float(*p);
  }
}

template <int V>
__device__ __forceinline__ void store_row(__nv_bfloat16* p, const float (&in)[V]) {
  if constexpr (V == 8) {
    uint4 raw;
    __nv_bfloat162* h = reinterpret_cast<__nv_bfloat162*>(&raw);
#pragma unroll
    for (int i = 0; i < 4; ++i) h[i] = __floats2bfloat162_rn(in[2 * i], in[2 * i + 1]);
    *reinterpret_cast<uint4*>(p) = raw;
  } else {
    p[0] = __float2bfloat16_rn(in[0]);
  }
}

// The same for f32 rows (two 16-byte accesses for 8 elements), for the f32 residual stream.
template <int V>
__device__ __forceinline__ void load_row(const float* p, float (&out)[V]) {
  if constexpr (V == 8) {
    const float4 a = reinterpret_cast<const float4*>(p)[0], b = reinterpret_cast<const float4*>(p)[1];
    out[0] = a.x, out[1] = a.y, out[2] = a.z, out[3] = a.w;
    out[4] = b.x, out[5] = b.y, out[6] = b.z, out[7] = b.w;
  } else {
    out[0] = *p;
  }
}

template <int V>
__device__ __forceinline__ void store_row(float* p, const float (&in)[V]) {
  if constexpr (V == 8) {
    reinterpret_cast<float4*>(p)[0] = make_float4(in[0], in[1], in[2], in[3]);
    reinterpret_cast<float4*>(p)[1] = make_float4(in[4], in[5], in[6], in[7]);
  } else {
    p[0] = in[0];
  }
}

template <int V>
__device__ __forceinline__ void fill(float (&v)[V], float x) {
#pragma unroll
  for (int i = 0; i < V; ++i) v[i] = x;
}

bool aligned16(const void* p) {
  return reinterpret_cast<uintptr_t>(p) % 16 == 0;
}

// 8-wide access needs D % 8 == 0 and 16-byte aligned bases (rows then stay aligned).
bool use_vec8(int64_t D, std::initializer_list<const void*> ptrs) {
  if (D % 8 != 0) return false;
  for (const void* p : ptrs)
    if (!aligned16(p)) return false;
  return true;
}

constexpr int kRowThreads = 128;

__device__ float block_sum(float v) {
  __shared__ float warp_sums[32];
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = (blockDim.x + 31) / 32;
  __syncthreads();  // warp_sums may still be read by a previous call
  if (lane == 0) warp_sums[warp] = v;
  __syncthreads();
  v = lane < warps ? warp_sums[lane] : 0.0f;
  if (warp == 0) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  }
  return v;  // valid in thread 0
}

// ---- plan ----

// Keys (expert ids, clamped into [0, E) so the sort and every later kernel stay in bounds) and values
// (the assignment index); an id out of range is recorded in the deferred error.
__global__ void plan_prepare_kernel(const int32_t* __restrict__ idx, int64_t R, int32_t E, uint32_t* __restrict__ keys,
                                    int32_t* __restrict__ vals, unsigned long long* err) {
  for (int64_t a = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; a < R; a += int64_t(gridDim.x) * blockDim.x) {
    int32_t e = idx[a];
    if (e < 0 || e >= E) {
      atomicMin(err, deferred_error_key(a, e));
      e = e < 0 ? 0 : E - 1;
    }
    keys[a] = uint32_t(e);
    vals[a] = int32_t(a);
  }
}

// offsets[e] = first sorted row whose expert is >= e (a lower bound), for e in [0, E].
__global__ void plan_offsets_kernel(const uint32_t* __restrict__ sorted_keys, int64_t R, int64_t E,
                                    int64_t* __restrict__ offsets) {
  const int64_t e = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (e > E) return;
  int64_t lo = 0, hi = R;
  while (lo < hi) {
    const int64_t mid = (lo + hi) / 2;
    if (int64_t(sorted_keys[mid]) < e)
      lo = mid + 1;
    else
      hi = mid;
  }
  offsets[e] = lo;
}

// out[in[r]] = r for every r whose in[r] lies in [0, n): the inverse permutation.
__global__ void invert_kernel(const int32_t* __restrict__ in, int64_t R, int64_t n, int32_t* __restrict__ out) {
  for (int64_t r = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; r < R; r += int64_t(gridDim.x) * blockDim.x) {
    const int64_t a = in[r];
    if (a >= 0 && a < n) out[a] = int32_t(r);
  }
}

unsigned grid_for(int64_t n, int threads) {
  return unsigned(std::min<int64_t>(blocks_for(n, threads), 1 << 16));
}

// ---- permutation ----

// xp[r] = x[assign[r] / K]; a row with an assignment out of range is zeroed.
template <int V>
__global__ void permute_fwd_kernel(const __nv_bfloat16* __restrict__ x, const int32_t* __restrict__ assign, int64_t TK,
                                   int64_t K, int64_t D, __nv_bfloat16* __restrict__ xp) {
  const int64_t r = blockIdx.x;
  const int64_t a = assign[r];
  const bool ok = a >= 0 && a < TK;
  const __nv_bfloat16* src = x + (ok ? a / K : 0) * D;
  __nv_bfloat16* dst = xp + r * D;
  for (int64_t j = int64_t(threadIdx.x) * V; j < D; j += int64_t(blockDim.x) * V) {
    float v[V];
    if (ok)
      load_row<V>(src + j, v);
    else
      fill(v, 0.0f);
    store_row<V>(dst + j, v);
  }
}

// dx[t] += sum over k (in order) of dxp[inv[t*K + k]], in f32; inv[a] < 0 means no row. TDX is bf16
// or float (an f32 dx is the FFN norm's input gradient, which the router's adds to).
template <class TDX, int V>
__global__ void permute_bwd_kernel(const __nv_bfloat16* __restrict__ dxp, const int32_t* __restrict__ inv, int64_t K,
                                   int64_t D, TDX* __restrict__ dx) {
  const int64_t t = blockIdx.x;
  for (int64_t j = int64_t(threadIdx.x) * V; j < D; j += int64_t(blockDim.x) * V) {
    float acc[V];
    load_row<V>(dx + t * D + j, acc);
    for (int64_t k = 0; k < K; ++k) {
      const int64_t r = inv[t * K + k];
      if (r < 0) continue;
      float v[V];
      load_row<V>(dxp + r * D + j, v);
#pragma unroll
      for (int i = 0; i < V; ++i) acc[i] += v[i];
    }
    store_row<V>(dx + t * D + j, acc);
  }
}

// y[t] = sum over k (in order) of w[t,k] * yp[row[t,k]], in f32 without FMA contraction: the CPU's
// operations exactly, so an f32 y equals the CPU's and a bf16 y is its rounding. TY is bf16 or float.
template <class TY, int V>
__global__ void unpermute_fwd_kernel(const __nv_bfloat16* __restrict__ yp, const int32_t* __restrict__ row,
                                     const float* __restrict__ w, int64_t R, int64_t K, int64_t D, TY* __restrict__ y) {
  const int64_t t = blockIdx.x;
  for (int64_t j = int64_t(threadIdx.x) * V; j < D; j += int64_t(blockDim.x) * V) {
    float acc[V];
    fill(acc, 0.0f);
    for (int64_t k = 0; k < K; ++k) {
      const int64_t r = row[t * K + k];
      if (r < 0 || r >= R) continue;
      const float wk = w[t * K + k];
      float v[V];
      load_row<V>(yp + r * D + j, v);
#pragma unroll
      for (int i = 0; i < V; ++i) acc[i] = __fadd_rn(acc[i], __fmul_rn(wk, v[i]));
    }
    store_row<V>(y + t * D + j, acc);
  }
}

// One block per assignment a = t*K + k: dyp[row] = w[a] * dy[t]; dw[a] = <dy[t], yp[row]> in f32.
// TDY (dy's element type) is bf16 or float. A null dyp skips the rows, a null yp the dot products
// (the weighted permute of score_before_experts uses one half each).
template <class TDY, int V>
__global__ void unpermute_bwd_kernel(const TDY* __restrict__ dy, const __nv_bfloat16* __restrict__ yp,
                                     const int32_t* __restrict__ row, const float* __restrict__ w, int64_t R, int64_t K,
                                     int64_t D, __nv_bfloat16* __restrict__ dyp, float* __restrict__ dw) {
  const int64_t a = blockIdx.x, t = a / K;
  const int64_t r = row[a];
  if (r < 0 || r >= R) {  // uniform over the block: every thread leaves before any barrier
    if (threadIdx.x == 0 && yp) dw[a] = 0.0f;
    return;
  }
  const float wk = w[a];
  float dot = 0.0f;
  for (int64_t j = int64_t(threadIdx.x) * V; j < D; j += int64_t(blockDim.x) * V) {
    float g[V], v[V], out[V];
    load_row<V>(dy + t * D + j, g);
    if (yp) {
      load_row<V>(yp + r * D + j, v);
#pragma unroll
      for (int i = 0; i < V; ++i) dot += g[i] * v[i];
    }
    if (dyp) {
#pragma unroll
      for (int i = 0; i < V; ++i) out[i] = wk * g[i];
      store_row<V>(dyp + r * D + j, out);
    }
  }
  if (!yp) return;  // uniform over the block
  dot = block_sum(dot);
  if (threadIdx.x == 0) dw[a] = dot;
}

const __nv_bfloat16* bf16_in(const Tensor& t) {
  return static_cast<const __nv_bfloat16*>(t.raw());
}
__nv_bfloat16* bf16_out(Tensor& t) {
  return static_cast<__nv_bfloat16*>(t.raw());
}

// Calls f(float{}) or f(__nv_bfloat16{}) for dt (bf16 or f32, checked before).
template <class F>
void dispatch_float(DType dt, F&& f) {
  if (dt == DType::F32)
    f(float{});
  else
    f(__nv_bfloat16{});
}

DeferredError& plan_error() {
  static DeferredError e;
  return e;
}
// K and E of the latest plan, to name the token and the allowed range in a deferred message (they are
// the same for every layer of a model).
int64_t g_plan_K = 1, g_plan_E = 0;

}  // namespace

void check_dispatch_plan_errors(const char* op) {
  unsigned long long key;
  if (!plan_error().take(&key, op)) return;
  const int64_t a = DeferredError::index_of(key);
  MT_THROW(op, ": make_dispatch_plan saw token ", a / g_plan_K, " choice ", a % g_plan_K, " with expert id ",
           DeferredError::value_of(key), ", expected a value in [0, ", g_plan_E,
           ") (found on the device; the plan of that call was computed with the id clamped into range)");
}

void make_dispatch_plan(const Tensor& topk_idx_TK, int64_t E, Tensor& offsets_E1, Tensor& assign_of_row_R,
                        Tensor& row_of_assign_TK) {
  const char* op = "make_dispatch_plan";
  check_dispatch_plan_errors(op);  // an earlier call's bad ids, if their record has landed
  check_cuda(topk_idx_TK, DType::I32, "make_dispatch_plan topk_idx_TK");
  if (E > std::numeric_limits<int32_t>::max()) MT_THROW("make_dispatch_plan: expert count E (", E, ") exceeds i32");
  const int64_t K = topk_idx_TK.size(1), R = topk_idx_TK.numel();
  check_cuda(offsets_E1, DType::I64, "make_dispatch_plan offsets_E1");
  check_cuda(assign_of_row_R, DType::I32, "make_dispatch_plan assign_of_row_R");
  check_cuda(row_of_assign_TK, DType::I32, "make_dispatch_plan row_of_assign_TK");
  g_plan_K = std::max<int64_t>(K, 1);
  g_plan_E = E;

  static DeviceScratch keys_in_buf, keys_out_buf, vals_buf, cub_buf;
  uint32_t* keys_in = keys_in_buf.as<uint32_t>(R, op);
  uint32_t* keys_out = keys_out_buf.as<uint32_t>(R, op);
  int32_t* vals = vals_buf.as<int32_t>(R, op);
  int32_t* assign = assign_of_row_R.data<int32_t>();
  if (R > 0) {
    plan_prepare_kernel<<<grid_for(R, 256), 256, 0, stream()>>>(topk_idx_TK.data<int32_t>(), R, int32_t(E), keys_in,
                                                                vals, plan_error().device_word(op));
    MT_CUDA_LAUNCH_CHECK(op);
    int end_bit = 1;
    while ((int64_t(1) << end_bit) < E) ++end_bit;
    size_t temp_bytes = 0;
    MT_CUDA_CHECK(op, cub::DeviceRadixSort::SortPairs(nullptr, temp_bytes, keys_in, keys_out, vals, assign, int(R), 0,
                                                      end_bit, stream()));
    void* temp = cub_buf.get(temp_bytes, op);
    MT_CUDA_CHECK(op, cub::DeviceRadixSort::SortPairs(temp, temp_bytes, keys_in, keys_out, vals, assign, int(R), 0,
                                                      end_bit, stream()));
    plan_error().publish(op);
  }
  plan_offsets_kernel<<<blocks_for(E + 1, 128), 128, 0, stream()>>>(keys_out, R, E, offsets_E1.data<int64_t>());
  MT_CUDA_LAUNCH_CHECK(op);
  if (R > 0) {
    invert_kernel<<<grid_for(R, 256), 256, 0, stream()>>>(assign, R, R, row_of_assign_TK.data<int32_t>());
    MT_CUDA_LAUNCH_CHECK(op);
  }
}

void permute_fwd(const Tensor& x_TD, const Tensor& assign_of_row_R, int64_t K, Tensor& xp_RD) {
  check_cuda(x_TD, DType::BF16, "permute_fwd x_TD");
  check_cuda(assign_of_row_R, DType::I32, "permute_fwd assign_of_row_R");
  check_cuda(xp_RD, DType::BF16, "permute_fwd xp_RD");
  const int64_t T = x_TD.size(0), D = x_TD.size(1), R = assign_of_row_R.size(0);
  if (R == 0 || D == 0) return;
  MT_CHECK(R < (int64_t(1) << 31), "permute_fwd: R (", R, ") exceeds the grid size");
  const __nv_bfloat16* x = bf16_in(x_TD);
  __nv_bfloat16* xp = bf16_out(xp_RD);
  if (use_vec8(D, {x, xp}))
    permute_fwd_kernel<8>
        <<<unsigned(R), kRowThreads, 0, stream()>>>(x, assign_of_row_R.data<int32_t>(), T * K, K, D, xp);
  else
    permute_fwd_kernel<1>
        <<<unsigned(R), kRowThreads, 0, stream()>>>(x, assign_of_row_R.data<int32_t>(), T * K, K, D, xp);
  MT_CUDA_LAUNCH_CHECK("permute_fwd");
}

void permute_bwd(const Tensor& dxp_RD, const Tensor& assign_of_row_R, int64_t K, Tensor& dx_TD) {
  const char* op = "permute_bwd";
  check_cuda(dxp_RD, DType::BF16, "permute_bwd dxp_RD");
  check_cuda(assign_of_row_R, DType::I32, "permute_bwd assign_of_row_R");
  check_cuda_bf16_or_f32(dx_TD, "permute_bwd dx_TD");
  const int64_t R = dxp_RD.size(0), D = dxp_RD.size(1), T = dx_TD.size(0);
  MT_CHECK(T * K <= std::numeric_limits<int32_t>::max(), "permute_bwd: T*K (", T * K, ") exceeds i32");
  if (T == 0 || D == 0) return;
  // A gather per token over the inverse permutation instead of a scatter-add: deterministic, no atomics.
  static DeviceScratch inv_buf;
  int32_t* inv = inv_buf.as<int32_t>(T * K, op);
  MT_CUDA_CHECK(op, cudaMemsetAsync(inv, 0xff, size_t(T * K) * sizeof(int32_t), stream()));  // -1: no row
  if (R > 0) {
    invert_kernel<<<grid_for(R, 256), 256, 0, stream()>>>(assign_of_row_R.data<int32_t>(), R, T * K, inv);
    MT_CUDA_LAUNCH_CHECK(op);
  }
  MT_CHECK(T < (int64_t(1) << 31), "permute_bwd: T (", T, ") exceeds the grid size");
  const __nv_bfloat16* dxp = bf16_in(dxp_RD);
  auto launch = [&](auto* dx) {
    using TDX = std::remove_pointer_t<decltype(dx)>;
    if (use_vec8(D, {dxp, dx}))
      permute_bwd_kernel<TDX, 8><<<unsigned(T), kRowThreads, 0, stream()>>>(dxp, inv, K, D, dx);
    else
      permute_bwd_kernel<TDX, 1><<<unsigned(T), kRowThreads, 0, stream()>>>(dxp, inv, K, D, dx);
  };
  if (dx_TD.dtype() == DType::F32)
    launch(dx_TD.data<float>());
  else
    launch(bf16_out(dx_TD));
  MT_CUDA_LAUNCH_CHECK(op);
}

void unpermute_fwd(const Tensor& yp_RD, const Tensor& row_of_assign_TK, const Tensor& w_TK, Tensor& y_TD) {
  check_cuda(yp_RD, DType::BF16, "unpermute_fwd yp_RD");
  check_cuda(row_of_assign_TK, DType::I32, "unpermute_fwd row_of_assign_TK");
  check_cuda(w_TK, DType::F32, "unpermute_fwd w_TK");
  check_cuda_bf16_or_f32(y_TD, "unpermute_fwd y_TD");
  const int64_t R = yp_RD.size(0), D = yp_RD.size(1);
  const int64_t T = row_of_assign_TK.size(0), K = row_of_assign_TK.size(1);
  if (T == 0 || D == 0) return;
  MT_CHECK(T < (int64_t(1) << 31), "unpermute_fwd: T (", T, ") exceeds the grid size");
  const __nv_bfloat16* yp = bf16_in(yp_RD);
  const int32_t* row = row_of_assign_TK.data<int32_t>();
  const float* w = w_TK.data<float>();
  dispatch_float(y_TD.dtype(), [&](auto tag) {
    using TY = decltype(tag);
    TY* y = static_cast<TY*>(y_TD.raw());
    if (use_vec8(D, {yp, y}))
      unpermute_fwd_kernel<TY, 8><<<unsigned(T), kRowThreads, 0, stream()>>>(yp, row, w, R, K, D, y);
    else
      unpermute_fwd_kernel<TY, 1><<<unsigned(T), kRowThreads, 0, stream()>>>(yp, row, w, R, K, D, y);
  });
  MT_CUDA_LAUNCH_CHECK("unpermute_fwd");
}

void unpermute_bwd(const Tensor& dy_TD, const Tensor& yp_RD, const Tensor& row_of_assign_TK, const Tensor& w_TK,
                   Tensor& dyp_RD, Tensor& dw_TK) {
  const char* op = "unpermute_bwd";
  // Either half may be skipped: yp_RD undefined = no dot products (dw_TK untouched), dyp_RD undefined =
  // no rows written (the dispatch checks that one is given).
  const bool rows = dyp_RD.defined(), dots = yp_RD.defined();
  check_cuda_bf16_or_f32(dy_TD, "unpermute_bwd dy_TD");
  if (dots) check_cuda(yp_RD, DType::BF16, "unpermute_bwd yp_RD");
  check_cuda(row_of_assign_TK, DType::I32, "unpermute_bwd row_of_assign_TK");
  check_cuda(w_TK, DType::F32, "unpermute_bwd w_TK");
  if (rows) check_cuda(dyp_RD, DType::BF16, "unpermute_bwd dyp_RD");
  if (dots) check_cuda(dw_TK, DType::F32, "unpermute_bwd dw_TK");
  const Tensor& rd = dots ? yp_RD : dyp_RD;
  const int64_t T = dy_TD.size(0), D = dy_TD.size(1), R = rd.size(0), K = row_of_assign_TK.size(1);
  // A row no assignment points at (possible only with a plan that is not a bijection) gets zero, not garbage.
  if (rows && R != T * K && R * D > 0) MT_CUDA_CHECK(op, cudaMemsetAsync(dyp_RD.raw(), 0, dyp_RD.nbytes(), stream()));
  if (T * K == 0) return;
  if (D == 0) {
    if (dots) MT_CUDA_CHECK(op, cudaMemsetAsync(dw_TK.raw(), 0, dw_TK.nbytes(), stream()));
    return;
  }
  MT_CHECK(T * K < (int64_t(1) << 31), "unpermute_bwd: T*K (", T * K, ") exceeds the grid size");
  const __nv_bfloat16* yp = dots ? bf16_in(yp_RD) : nullptr;
  __nv_bfloat16* dyp = rows ? bf16_out(dyp_RD) : nullptr;
  const int32_t* row = row_of_assign_TK.data<int32_t>();
  const float* w = w_TK.data<float>();
  float* dw = dots ? dw_TK.data<float>() : nullptr;
  dispatch_float(dy_TD.dtype(), [&](auto tag) {
    using TDY = decltype(tag);
    const TDY* dy = static_cast<const TDY*>(dy_TD.raw());
    if (use_vec8(D, {dy, yp, dyp}))
      unpermute_bwd_kernel<TDY, 8><<<unsigned(T * K), kRowThreads, 0, stream()>>>(dy, yp, row, w, R, K, D, dyp, dw);
    else
      unpermute_bwd_kernel<TDY, 1><<<unsigned(T * K), kRowThreads, 0, stream()>>>(dy, yp, row, w, R, K, D, dyp, dw);
  });
  MT_CUDA_LAUNCH_CHECK(op);
}

}  // namespace mt::cuda
