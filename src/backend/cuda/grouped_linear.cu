// CUDA grouped linear layers: one weight per expert over the experts' contiguous dispatched rows, the
// group sizes read from offsets_E1 on the device (no host synchronisation, so CUDA graphs capture them).
// Contract (ops.h): y = (or +=) alpha x w[e]^T; dx = (or +=) alpha dy w[e]; dw[e] += alpha dy^T x.
//
// Two kernels:
//   - bf16 weights with bf16 rows, alpha 1 and = (the base's experts): the CUTLASS grouped GEMMs of
//     grouped_gemm.cuh when this build and GPU have them and the shapes suit them;
//   - everything else (the adapters' f32 weights, any mix of bf16 and f32 rows, +=): a tiled fp32 kernel
//     here. A block owns a 64 x 64 tile of one expert's rows (or, for dw, of one expert's weight) and
//     walks the reduction in steps of 16 through shared memory; each thread keeps a 4 x 4 block of f32
//     sums. The rows' tiles are numbered expert by expert (ceil(n_e / 64) each), so the grid has at most
//     ceil(R / 64) + E of them and a block finds its expert by walking the offsets. The low-rank
//     products of LoRA are a few percent of the base's FLOPs; this kernel is simple rather than fast.
#include <algorithm>
#include <initializer_list>
#include <type_traits>

#include "backend/cuda/common.cuh"
#include "backend/cuda/cuda_ops.h"
#include "backend/cuda/grouped_gemm.cuh"
#include "backend/cuda/invariant.h"
#include "core/determinism.h"

namespace mt::cuda {

namespace {

constexpr int kTile = 64, kStep = 16, kThreads = 256;

__device__ __forceinline__ float ld(const float* p, int64_t i) { return p[i]; }
__device__ __forceinline__ float ld(const __nv_bfloat16* p, int64_t i) { return __bfloat162float(p[i]); }
__device__ __forceinline__ void st(float* p, int64_t i, float v, bool acc) { p[i] = acc ? p[i] + v : v; }
__device__ __forceinline__ void st(__nv_bfloat16* p, int64_t i, float v, bool acc) {
  p[i] = __float2bfloat16_rn(acc ? __bfloat162float(p[i]) + v : v);
}

// y[r, j] (=, or += when acc) alpha * sum_k x[r, k] W_e(k, j) for the rows r of expert e. w_nk: expert e's
// weight is [J, Kr] (W_e(k, j) = w[e][j][k], the forward's x w^T); otherwise [Kr, J] (w[e][k][j], dy w).
template <class TX, class TW, class TY, bool w_nk>
__global__ void __launch_bounds__(kThreads)
    grouped_rows_kernel(const TX* __restrict__ x, const TW* __restrict__ w, TY* __restrict__ y,
                        const int64_t* __restrict__ off, int E, int64_t J, int64_t Kr, float alpha, bool acc) {
  __shared__ float xs[kStep][kTile + 4];  // [k][row]
  __shared__ float ws[kStep][kTile + 4];  // [k][j]
  __shared__ int s_e;
  __shared__ int64_t s_r0, s_r1;
  if (threadIdx.x == 0) {  // this block's (expert, row tile): tiles numbered expert by expert
    int64_t t = blockIdx.y;
    s_e = -1;
    for (int e = 0; e < E; ++e) {
      const int64_t n = max(off[e + 1] - off[e], int64_t(0)), tiles = (n + kTile - 1) / kTile;
      if (t < tiles) {
        s_e = e;
        s_r0 = off[e] + t * kTile;
        s_r1 = min(off[e + 1], s_r0 + kTile);
        break;
      }
      t -= tiles;
    }
  }
  __syncthreads();
  if (s_e < 0) return;
  const int e = s_e;
  const int64_t r0 = s_r0, r1 = s_r1, j0 = int64_t(blockIdx.x) * kTile;
  const TW* we = w + int64_t(e) * J * Kr;
  const int tx = threadIdx.x % 16, ty = threadIdx.x / 16;
  float sum[4][4] = {};
  for (int64_t k0 = 0; k0 < Kr; k0 += kStep) {
    for (int q = 0; q < kTile * kStep / kThreads; ++q) {
      const int i = threadIdx.x + q * kThreads;
      {  // x: k fastest (a row's consecutive columns)
        const int rr = i / kStep, kk = i % kStep;
        const int64_t r = r0 + rr, k = k0 + kk;
        xs[kk][rr] = r < r1 && k < Kr ? ld(x, r * Kr + k) : 0.0f;
      }
      if (w_nk) {  // w[e] [J, Kr]: k fastest
        const int jj = i / kStep, kk = i % kStep;
        const int64_t j = j0 + jj, k = k0 + kk;
        ws[kk][jj] = j < J && k < Kr ? ld(we, j * Kr + k) : 0.0f;
      } else {  // w[e] [Kr, J]: j fastest
        const int kk = i / kTile, jj = i % kTile;
        const int64_t j = j0 + jj, k = k0 + kk;
        ws[kk][jj] = j < J && k < Kr ? ld(we, k * J + j) : 0.0f;
      }
    }
    __syncthreads();
#pragma unroll
    for (int kk = 0; kk < kStep; ++kk) {
      float a[4], b[4];
#pragma unroll
      for (int u = 0; u < 4; ++u) {
        a[u] = xs[kk][ty * 4 + u];
        b[u] = ws[kk][tx * 4 + u];
      }
#pragma unroll
      for (int u = 0; u < 4; ++u)
#pragma unroll
        for (int v = 0; v < 4; ++v) sum[u][v] = fmaf(a[u], b[v], sum[u][v]);
    }
    __syncthreads();
  }
  for (int u = 0; u < 4; ++u) {
    const int64_t r = r0 + ty * 4 + u;
    if (r >= r1) break;
    for (int v = 0; v < 4; ++v) {
      const int64_t j = j0 + tx * 4 + v;
      if (j < J) st(y, r * J + j, alpha * sum[u][v], acc);
    }
  }
}

// dw[e][n][k] += alpha * sum over expert e's rows r of dy[r, n] x[r, k]. Grid (ceil(K / 64), ceil(N / 64), E).
template <class TD, class TX>
__global__ void __launch_bounds__(kThreads)
    grouped_wgrad_kernel(const TD* __restrict__ dy, const TX* __restrict__ x, float* __restrict__ dw,
                         const int64_t* __restrict__ off, int64_t N, int64_t K, float alpha) {
  __shared__ float ds[kStep][kTile + 4];  // [row][n]
  __shared__ float xs[kStep][kTile + 4];  // [row][k]
  const int e = blockIdx.z;
  const int64_t rb = off[e], re = off[e + 1];
  if (re <= rb) return;
  const int64_t n0 = int64_t(blockIdx.y) * kTile, k0 = int64_t(blockIdx.x) * kTile;
  const int tx = threadIdx.x % 16, ty = threadIdx.x / 16;
  float sum[4][4] = {};
  for (int64_t r0 = rb; r0 < re; r0 += kStep) {
    for (int q = 0; q < kTile * kStep / kThreads; ++q) {
      const int i = threadIdx.x + q * kThreads, rr = i / kTile, cc = i % kTile;
      const int64_t r = r0 + rr;
      ds[rr][cc] = r < re && n0 + cc < N ? ld(dy, r * N + n0 + cc) : 0.0f;
      xs[rr][cc] = r < re && k0 + cc < K ? ld(x, r * K + k0 + cc) : 0.0f;
    }
    __syncthreads();
#pragma unroll
    for (int rr = 0; rr < kStep; ++rr) {
      float a[4], b[4];
#pragma unroll
      for (int u = 0; u < 4; ++u) {
        a[u] = ds[rr][ty * 4 + u];
        b[u] = xs[rr][tx * 4 + u];
      }
#pragma unroll
      for (int u = 0; u < 4; ++u)
#pragma unroll
        for (int v = 0; v < 4; ++v) sum[u][v] = fmaf(a[u], b[v], sum[u][v]);
    }
    __syncthreads();
  }
  float* dwe = dw + int64_t(e) * N * K;
  for (int u = 0; u < 4; ++u) {
    const int64_t n = n0 + ty * 4 + u;
    if (n >= N) break;
    for (int v = 0; v < 4; ++v) {
      const int64_t k = k0 + tx * 4 + v;
      if (k < K) dwe[n * K + k] += alpha * sum[u][v];
    }
  }
}

// Calls f with a typed pointer of t (bf16 or f32): an input's, or an output's.
template <class F>
void with_in(const Tensor& t, F&& f) {
  if (t.dtype() == DType::F32)
    f(static_cast<const float*>(t.raw()));
  else
    f(static_cast<const __nv_bfloat16*>(t.raw()));
}
template <class F>
void with_out(const Tensor& t, F&& f) {
  if (t.dtype() == DType::F32)
    f(static_cast<float*>(t.raw()));
  else
    f(static_cast<__nv_bfloat16*>(t.raw()));
}
template <class P>
using elem_t = std::remove_cv_t<std::remove_pointer_t<P>>;

// The rows kernel over y (J columns) from x (Kr columns), expert e's weight [J, Kr] (w_nk) or [Kr, J].
void launch_rows(const Tensor& x, const Tensor& w, Tensor& y, const Tensor& offsets, int64_t J, int64_t Kr,
                 bool w_nk, float alpha, bool acc, const char* op) {
  const int64_t E = w.size(0), R = x.size(0);
  const int64_t tiles = (R + kTile - 1) / kTile + E;
  MT_CHECK(tiles <= 65535, op, ": ", R, " rows over ", E, " experts need ", tiles,
           " row tiles, more than a grid holds (65,535)");
  const dim3 grid(unsigned((J + kTile - 1) / kTile), unsigned(tiles));
  const int64_t* off = offsets.data<int64_t>();
  with_in(x, [&](auto px) {
    with_in(w, [&](auto pw) {
      with_out(y, [&](auto py) {
        using TX = elem_t<decltype(px)>;
        using TW = elem_t<decltype(pw)>;
        using TY = elem_t<decltype(py)>;
        if (w_nk)
          grouped_rows_kernel<TX, TW, TY, true>
              <<<grid, kThreads, 0, stream()>>>(px, pw, py, off, int(E), J, Kr, alpha, acc);
        else
          grouped_rows_kernel<TX, TW, TY, false>
              <<<grid, kThreads, 0, stream()>>>(px, pw, py, off, int(E), J, Kr, alpha, acc);
      });
    });
  });
  MT_CUDA_LAUNCH_CHECK(op);
}

void launch_wgrad(const Tensor& dy, const Tensor& x, Tensor& dw, const Tensor& offsets, float alpha, const char* op) {
  const int64_t E = dw.size(0), N = dw.size(1), K = dw.size(2);
  MT_CHECK(E <= 65535 && (N + kTile - 1) / kTile <= 65535, op, ": weights [", E, ", ", N, ", ", K,
           "] exceed the grid (65,535 experts or row tiles)");
  const dim3 grid(unsigned((K + kTile - 1) / kTile), unsigned((N + kTile - 1) / kTile), unsigned(E));
  const int64_t* off = offsets.data<int64_t>();
  with_in(dy, [&](auto pd) {
    with_in(x, [&](auto px) {
      using TD = elem_t<decltype(pd)>;
      using TX = elem_t<decltype(px)>;
      grouped_wgrad_kernel<TD, TX><<<grid, kThreads, 0, stream()>>>(pd, px, dw.data<float>(), off, N, K, alpha);
    });
  });
  MT_CUDA_LAUNCH_CHECK(op);
}

// Whether the CUTLASS grouped GEMM can run a product of these tensors: all bf16, the column counts
// multiples of 8 and every pointer 16-byte aligned (grouped_gemm.cuh), on a build and GPU that have it.
bool cutlass_suits(std::initializer_list<const Tensor*> ts, std::initializer_list<int64_t> cols) {
  if (!grouped_gemm_available()) return false;
  for (int64_t c : cols)
    if (c % 8 != 0) return false;
  for (const Tensor* t : ts)
    if (t->dtype() != DType::BF16 || (t->numel() > 0 && reinterpret_cast<uintptr_t>(t->raw()) % 16 != 0)) return false;
  return true;
}

const __nv_bfloat16* bf16c(const Tensor& t) { return static_cast<const __nv_bfloat16*>(t.raw()); }

}  // namespace

void grouped_linear_fwd(const Tensor& x_RK, const Tensor& offsets_E1, const Tensor& w_ENK, float alpha, Tensor& y_RN,
                        bool accumulate) {
  const char* op = "grouped_linear_fwd";
  check_cuda_bf16_or_f32(x_RK, "grouped_linear_fwd x_RK");
  check_cuda_bf16_or_f32(w_ENK, "grouped_linear_fwd w_ENK");
  check_cuda_bf16_or_f32(y_RN, "grouped_linear_fwd y_RN");
  check_cuda(offsets_E1, DType::I64, "grouped_linear_fwd offsets_E1");
  const int64_t E = w_ENK.size(0), N = w_ENK.size(1), K = w_ENK.size(2), R = x_RK.size(0);
  if (R == 0 || N == 0) return;
  if (alpha == 1.0f && !accumulate && cutlass_suits({&x_RK, &w_ENK, &y_RN}, {N, K})) {
    // The batch-invariant mode too: the tiles give the same bits (grouped_rows_tile).
    grouped_gemm_rows(op, E, offsets_E1.data<int64_t>(), R, N, K, bf16c(x_RK), bf16c(w_ENK), true,
                      static_cast<__nv_bfloat16*>(y_RN.raw()));
    return;
  }
  if (batch_invariant() && x_RK.dtype() == w_ENK.dtype()) {  // invariant.cuh
    invariant_gemm_nt(op, R, N, K, x_RK.raw(), K, w_ENK.raw(), K, w_ENK.dtype(), alpha, accumulate ? 1.0f : 0.0f,
                      nullptr, y_RN.raw(), y_RN.dtype(), N, E, offsets_E1.data<int64_t>(), N * K);
    return;
  }
  launch_rows(x_RK, w_ENK, y_RN, offsets_E1, N, K, true, alpha, accumulate, op);
}

void grouped_linear_bwd(const Tensor& dy_RN, const Tensor& x_RK, const Tensor& offsets_E1, const Tensor& w_ENK,
                        float alpha, Tensor* dx_RK, bool accumulate_dx, Tensor& dw_ENK) {
  const char* op = "grouped_linear_bwd";
  check_cuda_bf16_or_f32(dy_RN, "grouped_linear_bwd dy_RN");
  check_cuda_bf16_or_f32(x_RK, "grouped_linear_bwd x_RK");
  check_cuda_bf16_or_f32(w_ENK, "grouped_linear_bwd w_ENK");
  check_cuda(offsets_E1, DType::I64, "grouped_linear_bwd offsets_E1");
  if (dx_RK) check_cuda_bf16_or_f32(*dx_RK, "grouped_linear_bwd dx_RK");
  if (dw_ENK.defined()) check_cuda(dw_ENK, DType::F32, "grouped_linear_bwd dw_ENK");
  const int64_t E = w_ENK.size(0), N = w_ENK.size(1), K = w_ENK.size(2), R = x_RK.size(0);
  if (R == 0) return;
  const int64_t* off = offsets_E1.data<int64_t>();
  if (dx_RK && K > 0) {
    if (alpha == 1.0f && !accumulate_dx && cutlass_suits({&dy_RN, &w_ENK, dx_RK}, {N, K}))
      grouped_gemm_rows(op, E, off, R, K, N, bf16c(dy_RN), bf16c(w_ENK), false,
                        static_cast<__nv_bfloat16*>(dx_RK->raw()));
    else
      launch_rows(dy_RN, w_ENK, *dx_RK, offsets_E1, K, N, false, alpha, accumulate_dx, op);
  }
  if (dw_ENK.defined() && N > 0 && K > 0) {
    if (alpha == 1.0f && cutlass_suits({&dy_RN, &x_RK}, {N, K}))
      grouped_gemm_wgrad(op, E, off, R, N, K, bf16c(dy_RN), bf16c(x_RK), dw_ENK.data<float>(), true);
    else
      launch_wgrad(dy_RN, x_RK, dw_ENK, offsets_E1, alpha, op);
  }
}

}  // namespace mt::cuda
