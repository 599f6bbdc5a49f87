// CUDA AdamW and the gradient utilities the trainer needs (sum of squares, scale, axpy, finiteness,
// dtype copies), all on mt::cuda::stream().
//
// adamw_step performs exactly the CPU reference's f32 operations (backend/cpu/optim.cpp) in the same
// order, with the scalars (decay, bias corrections, step size) computed on the host in double as the
// CPU does. Every per-element operation uses the __f*_rn intrinsics, which the compiler never fuses
// into FMAs, so the f32 results are bitwise those of the CPU (which has no FMA contraction on x86-64).
// The bf16 compute copy is the round-to-nearest-even of the updated f32 value, written in the same pass.
//
// sum_squares and all_finite return host values: each does one device-to-host copy followed by a
// stream synchronisation. sum_squares accumulates in fp64 per thread and per block and sums the block
// partials on the host in a fixed order, so its result is deterministic. These two use per-process
// device scratch (a __device__ array), so they must not be called from two host threads at once.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <vector>

#include "backend/cuda/common.cuh"
#include "backend/cuda/cuda_ops.h"

namespace mt::cuda {

namespace {

constexpr int kThreads = 256;
constexpr int kMaxBlocks = 1024;  // grid cap of the grid-stride kernels (and the size of the partials)

__device__ double g_sum_squares_partials[kMaxBlocks];
__device__ int g_nonfinite_flag;

template <class T, int N>
struct alignas(sizeof(T) * N) Pack {
  T v[N];
};

// Elements per 16-byte vector access.
template <class T>
constexpr int kVec = int(16 / sizeof(T));

inline bool aligned16(const void* p) {
  return reinterpret_cast<uintptr_t>(p) % 16 == 0;
}

inline unsigned grid_for(int64_t n) {
  return unsigned(std::clamp<int64_t>((n + kThreads - 1) / kThreads, 1, kMaxBlocks));
}

__device__ __forceinline__ double warp_sum(double v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// Sum over the block; the result is valid in thread 0. blockDim.x must be a multiple of 32.
__device__ double block_sum(double v) {
  __shared__ double s_warp[32];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  v = warp_sum(v);
  if (lane == 0) s_warp[warp] = v;
  __syncthreads();
  v = threadIdx.x < blockDim.x / 32 ? s_warp[lane] : 0.0;
  if (warp == 0) v = warp_sum(v);
  return v;
}

// ---- AdamW ----

struct AdamWConsts {
  float grad_scale, decay, w1, one_minus_w1, b2, w2, bc2_sqrt, neg_step_size, eps;
};

// One element, in the CPU reference's order of operations (see the file comment).
__device__ __forceinline__ void adamw_elem(float& p, float g, float& m, float& v, const AdamWConsts& c) {
  const float gi = __fmul_rn(c.grad_scale, g);
  const float pi = __fmul_rn(p, c.decay);
  const float mi = c.w1 < 0.5f ? __fadd_rn(m, __fmul_rn(c.w1, __fsub_rn(gi, m)))
                               : __fsub_rn(gi, __fmul_rn(__fsub_rn(gi, m), c.one_minus_w1));
  const float vi = __fadd_rn(__fmul_rn(v, c.b2), __fmul_rn(__fmul_rn(c.w2, gi), gi));
  const float denom = __fadd_rn(__fdiv_rn(__fsqrt_rn(vi), c.bc2_sqrt), c.eps);
  m = mi;
  v = vi;
  p = __fadd_rn(pi, __fdiv_rn(__fmul_rn(c.neg_step_size, mi), denom));
}

// Grid-stride over float4 groups when `vec` (every base 16-byte aligned, p_compute 8-byte aligned),
// then over the remaining elements one at a time.
__global__ void adamw_kernel(float* p, const float* g, float* m, float* v, __nv_bfloat16* pc, int64_t n, bool vec,
                             AdamWConsts c) {
  const int64_t tid = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  int64_t done = 0;
  if (vec) {
    const int64_t n4 = n / 4;
    for (int64_t i = tid; i < n4; i += stride) {
      float4 P = reinterpret_cast<float4*>(p)[i];
      const float4 G = reinterpret_cast<const float4*>(g)[i];
      float4 M = reinterpret_cast<float4*>(m)[i];
      float4 V = reinterpret_cast<float4*>(v)[i];
      adamw_elem(P.x, G.x, M.x, V.x, c);
      adamw_elem(P.y, G.y, M.y, V.y, c);
      adamw_elem(P.z, G.z, M.z, V.z, c);
      adamw_elem(P.w, G.w, M.w, V.w, c);
      reinterpret_cast<float4*>(p)[i] = P;
      reinterpret_cast<float4*>(m)[i] = M;
      reinterpret_cast<float4*>(v)[i] = V;
      if (pc) {
        __nv_bfloat162* out = reinterpret_cast<__nv_bfloat162*>(pc + 4 * i);
        out[0] = __floats2bfloat162_rn(P.x, P.y);
        out[1] = __floats2bfloat162_rn(P.z, P.w);
      }
    }
    done = n4 * 4;
  }
  for (int64_t i = done + tid; i < n; i += stride) {
    float pi = p[i], mi = m[i], vi = v[i];
    adamw_elem(pi, g[i], mi, vi, c);
    p[i] = pi;
    m[i] = mi;
    v[i] = vi;
    if (pc) pc[i] = __float2bfloat16_rn(pi);
  }
}

// ---- elementwise utilities over f32 or bf16 ----

template <class T>
__global__ void sum_squares_kernel(const T* x, int64_t n, bool vec, double* partials) {
  const int64_t tid = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  double acc = 0;
  int64_t done = 0;
  if (vec) {
    using P = Pack<T, kVec<T>>;
    const int64_t np = n / kVec<T>;
    for (int64_t i = tid; i < np; i += stride) {
      const P a = reinterpret_cast<const P*>(x)[i];
#pragma unroll
      for (int j = 0; j < kVec<T>; ++j) {
        const double f = to_f32(a.v[j]);
        acc += f * f;
      }
    }
    done = np * kVec<T>;
  }
  for (int64_t i = done + tid; i < n; i += stride) {
    const double f = to_f32(x[i]);
    acc += f * f;
  }
  acc = block_sum(acc);
  if (threadIdx.x == 0) partials[blockIdx.x] = acc;
}

template <class T>
__global__ void scale_kernel(T* x, int64_t n, bool vec, float s) {
  const int64_t tid = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  int64_t done = 0;
  if (vec) {
    using P = Pack<T, kVec<T>>;
    const int64_t np = n / kVec<T>;
    for (int64_t i = tid; i < np; i += stride) {
      P a = reinterpret_cast<P*>(x)[i];
#pragma unroll
      for (int j = 0; j < kVec<T>; ++j) a.v[j] = from_f32<T>(__fmul_rn(to_f32(a.v[j]), s));
      reinterpret_cast<P*>(x)[i] = a;
    }
    done = np * kVec<T>;
  }
  for (int64_t i = done + tid; i < n; i += stride) x[i] = from_f32<T>(__fmul_rn(to_f32(x[i]), s));
}

// y += alpha * x with y and x of the same type, or y f32 and x bf16; VEC elements per access are 16
// bytes of the wider type.
template <class TY, class TX>
__global__ void add_kernel(TY* y, const TX* x, int64_t n, bool vec, float alpha) {
  constexpr int VEC = std::min(kVec<TY>, kVec<TX>);
  const int64_t tid = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  int64_t done = 0;
  if (vec) {
    using PY = Pack<TY, VEC>;
    using PX = Pack<TX, VEC>;
    const int64_t np = n / VEC;
    for (int64_t i = tid; i < np; i += stride) {
      PY a = reinterpret_cast<PY*>(y)[i];
      const PX b = reinterpret_cast<const PX*>(x)[i];
#pragma unroll
      for (int j = 0; j < VEC; ++j) a.v[j] = from_f32<TY>(__fadd_rn(to_f32(a.v[j]), __fmul_rn(alpha, to_f32(b.v[j]))));
      reinterpret_cast<PY*>(y)[i] = a;
    }
    done = np * VEC;
  }
  for (int64_t i = done + tid; i < n; i += stride)
    y[i] = from_f32<TY>(__fadd_rn(to_f32(y[i]), __fmul_rn(alpha, to_f32(x[i]))));
}

// Sets *flag when any element is NaN or +-Inf (a benign race: every writer stores 1).
template <class T>
__global__ void nonfinite_kernel(const T* x, int64_t n, bool vec, int* flag) {
  const int64_t tid = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  bool bad = false;
  int64_t done = 0;
  if (vec) {
    using P = Pack<T, kVec<T>>;
    const int64_t np = n / kVec<T>;
    for (int64_t i = tid; i < np; i += stride) {
      const P a = reinterpret_cast<const P*>(x)[i];
#pragma unroll
      for (int j = 0; j < kVec<T>; ++j) bad |= !isfinite(to_f32(a.v[j]));
    }
    done = np * kVec<T>;
  }
  for (int64_t i = done + tid; i < n; i += stride) bad |= !isfinite(to_f32(x[i]));
  if (bad) *flag = 1;
}

template <class S, class D>
__global__ void cast_kernel(const S* src, D* dst, int64_t n) {
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride)
    dst[i] = from_f32<D>(to_f32(src[i]));
}

// Calls f(float{}) or f(__nv_bfloat16{}) for the dtype of x (checked by check_cuda_bf16_or_f32).
template <class F>
void dispatch_float(DType dt, F&& f) {
  if (dt == DType::F32)
    f(float{});
  else
    f(__nv_bfloat16{});
}

}  // namespace

void adamw_step(Tensor& p, const Tensor& g, Tensor& m, Tensor& v, const AdamWHyper& h, float grad_scale,
                Tensor* p_compute) {
  // Shapes and hyper-parameters are checked once by the dispatch (ops/op_checks.h).
  check_cuda(p, DType::F32, "adamw_step p");
  check_cuda(g, DType::F32, "adamw_step g");
  check_cuda(m, DType::F32, "adamw_step m");
  check_cuda(v, DType::F32, "adamw_step v");
  if (p_compute) check_cuda(*p_compute, DType::BF16, "adamw_step p_compute");
  const int64_t n = p.numel();
  if (n == 0) return;

  // The scalars exactly as backend/cpu/optim.cpp computes them.
  const double lr = h.lr, b1 = h.beta1, b2 = h.beta2;
  AdamWConsts c;
  c.grad_scale = grad_scale;
  c.decay = float(1.0 - lr * double(h.weight_decay));
  c.w1 = float(1.0 - b1);
  c.one_minus_w1 = 1.0f - c.w1;
  c.b2 = float(b2);
  c.w2 = float(1.0 - b2);
  c.bc2_sqrt = float(std::sqrt(1.0 - std::pow(b2, double(h.step))));
  c.neg_step_size = float(-(lr / (1.0 - std::pow(b1, double(h.step)))));
  c.eps = h.eps;

  __nv_bfloat16* pc = p_compute ? static_cast<__nv_bfloat16*>(p_compute->raw()) : nullptr;
  const bool vec = aligned16(p.raw()) && aligned16(g.raw()) && aligned16(m.raw()) && aligned16(v.raw()) &&
                   (!pc || reinterpret_cast<uintptr_t>(pc) % 8 == 0);
  unsigned grid = grid_for(vec ? n / 4 : n);
  // On the side stream (the overlapped optimizer step) the grid may be capped so that the compute
  // stream's kernels find free SMs: MOETRAIN_OVERLAP_ADAMW_BLOCKS (unset or 0: no cap). An experiment
  // knob (bench/NOTES.md, the overlapped optimizer); the elementwise results do not depend on the grid.
  if (stream() != compute_stream()) {
    static const unsigned cap = [] {
      const char* e = std::getenv("MOETRAIN_OVERLAP_ADAMW_BLOCKS");
      const long v = e ? std::strtol(e, nullptr, 10) : 0;
      if (v < 0) MT_THROW("MOETRAIN_OVERLAP_ADAMW_BLOCKS '", e, "' must be a block count >= 0 (0: no cap)");
      return unsigned(v);
    }();
    if (cap > 0) grid = std::min(grid, cap);
  }
  adamw_kernel<<<grid, kThreads, 0, stream()>>>(p.data<float>(), g.data<float>(), m.data<float>(), v.data<float>(), pc,
                                                n, vec, c);
  MT_CUDA_LAUNCH_CHECK("adamw_step");
}

// Synchronises the stream: one device-to-host copy of the block partials.
double sum_squares(const Tensor& x) {
  check_cuda_bf16_or_f32(x, "sum_squares x");
  const int64_t n = x.numel();
  if (n == 0) return 0.0;
  double* partials = nullptr;
  MT_CUDA_CHECK("sum_squares", cudaGetSymbolAddress(reinterpret_cast<void**>(&partials), g_sum_squares_partials));
  unsigned grid = 0;
  dispatch_float(x.dtype(), [&](auto tag) {
    using T = decltype(tag);
    const T* px = static_cast<const T*>(x.raw());
    const bool vec = aligned16(px);
    grid = grid_for(vec ? n / kVec<T> : n);
    sum_squares_kernel<T><<<grid, kThreads, 0, stream()>>>(px, n, vec, partials);
  });
  MT_CUDA_LAUNCH_CHECK("sum_squares");
  std::vector<double> host(grid);
  MT_CUDA_CHECK("sum_squares",
                cudaMemcpyAsync(host.data(), partials, grid * sizeof(double), cudaMemcpyDeviceToHost, stream()));
  sync("sum_squares");
  double s = 0;
  for (double v : host) s += v;
  return s;
}

void scale_(Tensor& x, float s) {
  check_cuda_bf16_or_f32(x, "scale_ x");
  const int64_t n = x.numel();
  if (n == 0) return;
  dispatch_float(x.dtype(), [&](auto tag) {
    using T = decltype(tag);
    T* px = static_cast<T*>(x.raw());
    const bool vec = aligned16(px);
    scale_kernel<T><<<grid_for(vec ? n / kVec<T> : n), kThreads, 0, stream()>>>(px, n, vec, s);
  });
  MT_CUDA_LAUNCH_CHECK("scale_");
}

// Same dtypes, or y f32 with x bf16 (a bf16 branch output added into an f32 residual stream).
void add_(Tensor& y, const Tensor& x, float alpha) {
  check_cuda_bf16_or_f32(y, "add_ y");
  check_cuda(x, "add_ x");
  const bool mixed = y.dtype() == DType::F32 && x.dtype() == DType::BF16;
  MT_CHECK(x.dtype() == y.dtype() || mixed, "add_ x has dtype ", dtype_name(x.dtype()), ", expected ",
           y.dtype() == DType::F32 ? "f32 or bf16" : "bf16", " (y is ", dtype_name(y.dtype()), ")");
  check_shape(x, y.shape(), "add_ x");
  const int64_t n = y.numel();
  if (n == 0) return;
  auto launch = [&](auto y_tag, auto x_tag) {
    using TY = decltype(y_tag);
    using TX = decltype(x_tag);
    TY* py = static_cast<TY*>(y.raw());
    const TX* px = static_cast<const TX*>(x.raw());
    const bool vec = aligned16(py) && aligned16(px);
    constexpr int kV = std::min(kVec<TY>, kVec<TX>);
    add_kernel<TY, TX><<<grid_for(vec ? n / kV : n), kThreads, 0, stream()>>>(py, px, n, vec, alpha);
  };
  if (mixed)
    launch(float{}, __nv_bfloat16{});
  else
    dispatch_float(y.dtype(), [&](auto tag) { launch(tag, tag); });
  MT_CUDA_LAUNCH_CHECK("add_");
}

// Synchronises the stream: one device-to-host copy of the flag.
bool all_finite(const Tensor& x) {
  check_cuda_bf16_or_f32(x, "all_finite x");
  const int64_t n = x.numel();
  if (n == 0) return true;
  int* flag = nullptr;
  MT_CUDA_CHECK("all_finite", cudaGetSymbolAddress(reinterpret_cast<void**>(&flag), g_nonfinite_flag));
  MT_CUDA_CHECK("all_finite", cudaMemsetAsync(flag, 0, sizeof(int), stream()));
  dispatch_float(x.dtype(), [&](auto tag) {
    using T = decltype(tag);
    const T* px = static_cast<const T*>(x.raw());
    const bool vec = aligned16(px);
    nonfinite_kernel<T><<<grid_for(vec ? n / kVec<T> : n), kThreads, 0, stream()>>>(px, n, vec, flag);
  });
  MT_CUDA_LAUNCH_CHECK("all_finite");
  int host = 0;
  MT_CUDA_CHECK("all_finite", cudaMemcpyAsync(&host, flag, sizeof(int), cudaMemcpyDeviceToHost, stream()));
  sync("all_finite");
  return host == 0;
}

void copy_cast(const Tensor& src, Tensor& dst) {
  check_cuda(src, "copy_cast src");
  check_cuda(dst, "copy_cast dst");
  check_shape(dst, src.shape(), "copy_cast dst");
  const int64_t n = src.numel();
  if (src.dtype() == dst.dtype()) {
    if (n > 0)
      MT_CUDA_CHECK("copy_cast",
                    cudaMemcpyAsync(dst.raw(), src.raw(), src.nbytes(), cudaMemcpyDeviceToDevice, stream()));
    return;
  }
  const bool f32_to_bf16 = src.dtype() == DType::F32 && dst.dtype() == DType::BF16;
  const bool bf16_to_f32 = src.dtype() == DType::BF16 && dst.dtype() == DType::F32;
  if (!f32_to_bf16 && !bf16_to_f32)
    MT_THROW("copy_cast: cannot convert ", src.desc(), " to ", dst.desc(),
             ": the CUDA backend converts f32 <-> bf16 or copies tensors of one dtype");
  if (n == 0) return;
  if (f32_to_bf16)
    cast_kernel<<<grid_for(n), kThreads, 0, stream()>>>(src.data<float>(), static_cast<__nv_bfloat16*>(dst.raw()), n);
  else
    cast_kernel<<<grid_for(n), kThreads, 0, stream()>>>(static_cast<const __nv_bfloat16*>(src.raw()), dst.data<float>(),
                                                        n);
  MT_CUDA_LAUNCH_CHECK("copy_cast");
}

// Column blocks: one thread per element of the narrow [T, C] side.
template <class TY, class TX>
__global__ void add_cols_kernel(TY* y, const TX* x, int64_t T, int64_t O, int64_t C, int64_t col0, float alpha) {
  const int64_t n = T * C, stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    const int64_t t = i / C, c = i % C;
    TY& d = y[t * O + col0 + c];
    d = from_f32<TY>(__fadd_rn(to_f32(d), __fmul_rn(alpha, to_f32(x[i]))));
  }
}

template <class TY, class TX>
__global__ void copy_cols_kernel(const TX* x, TY* y, int64_t T, int64_t O, int64_t C, int64_t col0) {
  const int64_t n = T * C, stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride)
    y[i] = from_f32<TY>(to_f32(x[(i / C) * O + col0 + i % C]));
}

void add_cols_(Tensor& y_TO, const Tensor& x_TC, int64_t col0, float alpha) {
  check_cuda_bf16_or_f32(y_TO, "add_cols_ y_TO");
  check_cuda_bf16_or_f32(x_TC, "add_cols_ x_TC");
  const int64_t T = y_TO.size(0), O = y_TO.size(1), C = x_TC.size(1);
  if (T * C == 0) return;
  dispatch_float(y_TO.dtype(), [&](auto y_tag) {
    dispatch_float(x_TC.dtype(), [&](auto x_tag) {
      using TY = decltype(y_tag);
      using TX = decltype(x_tag);
      add_cols_kernel<TY, TX><<<grid_for(T * C), kThreads, 0, stream()>>>(
          static_cast<TY*>(y_TO.raw()), static_cast<const TX*>(x_TC.raw()), T, O, C, col0, alpha);
    });
  });
  MT_CUDA_LAUNCH_CHECK("add_cols_");
}

void copy_cols(const Tensor& x_TO, int64_t col0, Tensor& y_TC) {
  check_cuda_bf16_or_f32(x_TO, "copy_cols x_TO");
  check_cuda_bf16_or_f32(y_TC, "copy_cols y_TC");
  const int64_t T = x_TO.size(0), O = x_TO.size(1), C = y_TC.size(1);
  if (T * C == 0) return;
  dispatch_float(y_TC.dtype(), [&](auto y_tag) {
    dispatch_float(x_TO.dtype(), [&](auto x_tag) {
      using TY = decltype(y_tag);
      using TX = decltype(x_tag);
      copy_cols_kernel<TY, TX><<<grid_for(T * C), kThreads, 0, stream()>>>(
          static_cast<const TX*>(x_TO.raw()), static_cast<TY*>(y_TC.raw()), T, O, C, col0);
    });
  });
  MT_CUDA_LAUNCH_CHECK("copy_cols");
}

}  // namespace mt::cuda
