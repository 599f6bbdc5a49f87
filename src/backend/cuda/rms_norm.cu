// CUDA RMSNorm over the last dim, the same function as backend/cpu/rms_norm.cpp:
// y = w * (x * rstd), rstd = 1/sqrt(mean(x^2) + eps), with y in bf16, the gain w, rstd and dw in f32
// (the gains are read from the fp32 master weights: a bf16 copy of a gain near 1 cannot move by less
// than 2^-8, so small updates would reach the forward only in jumps), and x, dx and dy each bf16 or
// f32 (an f32 residual stream keeps x and dx in f32, the gradients summed from several GEMMs arrive
// in f32; the per-head q/k norms use bf16). Row sums are accumulated in f32 (rstd itself is formed
// in double from that sum, as the CPU does, and rounded to f32 once); the backward uses the saved
// rstd as is.
//
// Launch: a group of G lanes per row, G = 32 (a warp) for long rows and G = 4 for short ones such as
// the per-head q/k norms (Hd = 16..128), so that one warp covers 8 short rows instead of idling. Rows
// are read with vector accesses (16 bytes of the widest of x, y, dy and dx: 8 elements when all are
// bf16, else 4) when D is a multiple of the width and the bases are 16-byte aligned. The gain (D
// floats, L1-resident) is read element by element, so it does not narrow the rows' accesses.
// Backward: dw (+=) is folded across the groups of a warp with shuffles, across the warps of a block in
// shared memory, and across blocks with one float atomicAdd per column and block (so dw's last bits
// depend on the order in which blocks finish).
// The fused residual ops: add_rms_norm_fwd is the forward kernel with h += x folded into its first pass
// (the sum written back to h, the second pass reading it again); add_rms_norm_bwd is the backward kernel
// with dx += dres folded into its dx write. Both use the same launch, lanes and f32 operations as the
// unfused pair (the adds as __fadd_rn, as add_'s kernel does), so they give the same bits.
// Deterministic mode (core/determinism.h): the backward kernel writes dx only, and dw is two more
// kernels: block (column chunk, row part) sums its fixed rows [part * rows_per_part, ...) of dy * xn per
// column in row order into an f32 partial [parts, D], then a second kernel adds each column's parts in
// a fixed order (fp64). The number of parts depends on N and D only, not on the GPU, so the bits are the same on any
// GPU. Cost: x and dy are read a second time (the dw pass), plus 2 * parts * D floats of partials.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <string>
#include <utility>

#include "backend/cuda/common.cuh"
#include "backend/cuda/cuda_ops.h"
#include "backend/cuda/gemm.cuh"
#include "core/determinism.h"

namespace mt::cuda {

namespace {

using bf16 = __nv_bfloat16;

constexpr int kThreads = 256;
constexpr int kMaxD = 12288;  // dw's per-block shared accumulator is D floats (48 KiB at most)

template <class T, int N>
struct alignas(sizeof(T) * N) Pack {
  T v[N];
};

inline bool aligned16(const void* p) {
  return reinterpret_cast<uintptr_t>(p) % 16 == 0;
}

// Elements per vector access: 16 bytes of the widest of the element types.
template <class... Ts>
constexpr int kVecOf = int(16 / std::max({sizeof(Ts)...}));

// Sum over the G lanes of a group (G divides 32; every lane of the warp must call this).
template <int G>
__device__ __forceinline__ float group_sum(float v) {
#pragma unroll
  for (int o = G / 2; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

template <class TX, int G, int VEC>
__global__ void rms_norm_fwd_kernel(const TX* __restrict__ x, const float* __restrict__ w, float eps,
                                    bf16* __restrict__ y, float* __restrict__ rstd, int64_t N, int D) {
  using PX = Pack<TX, VEC>;
  using P = Pack<bf16, VEC>;
  const int lane_g = threadIdx.x % G;
  const int64_t row = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) / G;
  const bool valid = row < N;
  const int chunks = D / VEC;
  const PX* xr = reinterpret_cast<const PX*>(x + (valid ? row : 0) * D);
  float ss = 0.0f;
  if (valid)
    for (int c = lane_g; c < chunks; c += G) {
      const PX a = xr[c];
#pragma unroll
      for (int j = 0; j < VEC; ++j) {
        const float f = to_f32(a.v[j]);
        ss += f * f;
      }
    }
  ss = group_sum<G>(ss);
  if (!valid) return;
  const float r = float(1.0 / sqrt(double(ss) / double(D) + double(eps)));
  if (lane_g == 0) rstd[row] = r;
  P* yr = reinterpret_cast<P*>(y + row * D);
  for (int c = lane_g; c < chunks; c += G) {
    const PX a = xr[c];
    P out;
#pragma unroll
    for (int j = 0; j < VEC; ++j) out.v[j] = __float2bfloat16_rn(w[c * VEC + j] * (to_f32(a.v[j]) * r));
    yr[c] = out;
  }
}

// rms_norm_fwd_kernel with the residual add first: h += x (h f32), then the norm of the new h.
template <class TX, int G, int VEC>
__global__ void add_rms_norm_fwd_kernel(float* __restrict__ h, const TX* __restrict__ x, const float* __restrict__ w,
                                        float eps, bf16* __restrict__ y, float* __restrict__ rstd, int64_t N, int D) {
  using PH = Pack<float, VEC>;
  using PX = Pack<TX, VEC>;
  using P = Pack<bf16, VEC>;
  const int lane_g = threadIdx.x % G;
  const int64_t row = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) / G;
  const bool valid = row < N;
  const int chunks = D / VEC;
  PH* hr = reinterpret_cast<PH*>(h + (valid ? row : 0) * D);
  const PX* xr = reinterpret_cast<const PX*>(x + (valid ? row : 0) * D);
  float ss = 0.0f;
  if (valid)
    for (int c = lane_g; c < chunks; c += G) {
      PH a = hr[c];
      const PX b = xr[c];
#pragma unroll
      for (int j = 0; j < VEC; ++j) {
        const float f = __fadd_rn(a.v[j], to_f32(b.v[j]));
        a.v[j] = f;
        ss += f * f;
      }
      hr[c] = a;
    }
  ss = group_sum<G>(ss);
  if (!valid) return;
  const float r = float(1.0 / sqrt(double(ss) / double(D) + double(eps)));
  if (lane_g == 0) rstd[row] = r;
  P* yr = reinterpret_cast<P*>(y + row * D);
  for (int c = lane_g; c < chunks; c += G) {  // the chunks this lane wrote above
    const PH a = hr[c];
    P out;
#pragma unroll
    for (int j = 0; j < VEC; ++j) out.v[j] = __float2bfloat16_rn(w[c * VEC + j] * (a.v[j] * r));
    yr[c] = out;
  }
}

// Grid-stride over groups of rows; see the file comment for how dw is reduced. dres (f32, may be null):
// added to dx (add_rms_norm_bwd, whose dx is f32).
template <class TDY, class TX, class TDX, int G, int VEC>
__global__ void rms_norm_bwd_kernel(const TDY* __restrict__ dy, const TX* __restrict__ x, const float* __restrict__ w,
                                    const float* __restrict__ rstd, const float* __restrict__ dres,
                                    TDX* __restrict__ dx, float* __restrict__ dw, int64_t N, int D) {
  using PDY = Pack<TDY, VEC>;
  using PX = Pack<TX, VEC>;
  using PDX = Pack<TDX, VEC>;
  using PR = Pack<float, VEC>;
  extern __shared__ float s_dw[];  // [D]; unused when dw is null (deterministic mode: dx only)
  const bool with_dw = dw != nullptr;
  if (with_dw)
    for (int d = threadIdx.x; d < D; d += blockDim.x) s_dw[d] = 0.0f;
  __syncthreads();

  const int lane = threadIdx.x % 32, lane_g = threadIdx.x % G;
  const int groups = blockDim.x / G;
  const int chunks = D / VEC;
  // row0 is the same for the whole block, so every lane runs the same iterations (the shuffles need it).
  for (int64_t row0 = int64_t(blockIdx.x) * groups; row0 < N; row0 += int64_t(gridDim.x) * groups) {
    const int64_t row = row0 + threadIdx.x / G;
    const bool valid = row < N;
    const int64_t base = (valid ? row : 0) * D;
    const PX* xr = reinterpret_cast<const PX*>(x + base);
    const PDY* dyr = reinterpret_cast<const PDY*>(dy + base);
    PDX* dxr = reinterpret_cast<PDX*>(dx + base);
    const PR* dresr = reinterpret_cast<const PR*>(dres + (dres ? base : 0));
    const float r = valid ? rstd[row] : 0.0f;

    float dot = 0.0f;  // sum_d dy*w*xn
    if (valid)
      for (int c = lane_g; c < chunks; c += G) {
        const PX a = xr[c];
        const PDY g = dyr[c];
#pragma unroll
        for (int j = 0; j < VEC; ++j) dot += to_f32(g.v[j]) * w[c * VEC + j] * (to_f32(a.v[j]) * r);
      }
    const float mean_dot = group_sum<G>(dot) / float(D);

    for (int c0 = 0; c0 < chunks; c0 += G) {
      const int c = c0 + lane_g;
      float part[VEC];
      if (valid && c < chunks) {
        const PX a = xr[c];
        const PDY g = dyr[c];
        PR res{};
        if (dres) res = dresr[c];
        PDX out;
#pragma unroll
        for (int j = 0; j < VEC; ++j) {
          const float xn = to_f32(a.v[j]) * r;
          const float gy = to_f32(g.v[j]);
          float v = r * (gy * w[c * VEC + j] - xn * mean_dot);
          if (dres) v = __fadd_rn(v, res.v[j]);
          out.v[j] = from_f32<TDX>(v);
          part[j] = gy * xn;
        }
        dxr[c] = out;
      } else {
#pragma unroll
        for (int j = 0; j < VEC; ++j) part[j] = 0.0f;
      }
      // Lanes of a warp with the same lane_g hold the same columns: fold them before shared memory.
#pragma unroll
      for (int o = G; o < 32; o <<= 1)
#pragma unroll
        for (int j = 0; j < VEC; ++j) part[j] += __shfl_xor_sync(0xffffffffu, part[j], o);
      if (with_dw && lane < G && c < chunks)
#pragma unroll
        for (int j = 0; j < VEC; ++j) atomicAdd(&s_dw[c * VEC + j], part[j]);
    }
  }
  if (!with_dw) return;  // uniform over the block
  __syncthreads();
  for (int d = threadIdx.x; d < D; d += blockDim.x) atomicAdd(&dw[d], s_dw[d]);
}

// Deterministic dw, pass 1: thread (column d, part p) sums dy * (x * rstd) over rows
// [p * rows_per_part, min(N, (p + 1) * rows_per_part)) in row order, in f32, into partial[p, d].
// Consecutive threads read consecutive columns of a row (coalesced).
template <class TDY, class TX>
__global__ void rms_norm_dw_partial_kernel(const TDY* __restrict__ dy, const TX* __restrict__ x,
                                           const float* __restrict__ rstd, float* __restrict__ partial, int64_t N,
                                           int D, int64_t rows_per_part) {
  const int d = int(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t p = blockIdx.y;
  if (d >= D) return;
  const int64_t r0 = p * rows_per_part, r1 = r0 + rows_per_part < N ? r0 + rows_per_part : N;
  float acc = 0.0f;
#pragma unroll 4
  for (int64_t r = r0; r < r1; ++r) acc += to_f32(dy[r * D + d]) * (to_f32(x[r * D + d]) * rstd[r]);
  partial[p * D + d] = acc;
}

constexpr int kFinishCols = 32, kFinishGroups = 8;  // pass 2's block: 32 columns x 8 groups of parts

// Deterministic dw, pass 2: dw[d] (+)= the parts of column d in a fixed order, in fp64, rounded once:
// group y (threadIdx.y) sums parts y, y + 8, y + 16, ... in order, then the 8 group sums are added in
// order. Block (column tile of 32); many parts per column (2048 at D = 128) need the 8 groups to keep
// enough loads in flight.
__global__ void rms_norm_dw_finish_kernel(const float* __restrict__ partial, int64_t parts, int D, bool accumulate,
                                          float* __restrict__ dw) {
  __shared__ double s_sum[kFinishGroups][kFinishCols];
  const int d = int(blockIdx.x) * kFinishCols + int(threadIdx.x);
  double acc = 0.0;
  if (d < D)
#pragma unroll 8
    for (int64_t p = threadIdx.y; p < parts; p += kFinishGroups) acc += double(partial[p * D + d]);
  s_sum[threadIdx.y][threadIdx.x] = acc;
  __syncthreads();
  if (threadIdx.y != 0 || d >= D) return;
  double total = 0.0;
  for (int g = 0; g < kFinishGroups; ++g) total += s_sum[g][threadIdx.x];
  dw[d] = accumulate ? dw[d] + float(total) : float(total);
}

struct Launch {
  int g;
  bool vec;
};

// Lanes per row, and whether rows of D elements at the given bases take vec_width-wide accesses.
Launch pick_launch(int64_t D, int vec_width, std::initializer_list<const void*> bases) {
  bool aligned = D % vec_width == 0;
  for (const void* p : bases) aligned = aligned && aligned16(p);
  const int vec = aligned ? vec_width : 1;
  return {D / vec >= 32 ? 32 : 4, aligned};
}

// Calls f.template operator()<G, VEC>() for the chosen launch, VEC being VW or 1.
template <int VW, class F>
void dispatch_launch(Launch l, F&& f) {
  if (l.g == 32 && l.vec)
    f.template operator()<32, VW>();
  else if (l.g == 32)
    f.template operator()<32, 1>();
  else if (l.vec)
    f.template operator()<4, VW>();
  else
    f.template operator()<4, 1>();
}

// Calls f(float{}) or f(bf16{}) for dt (bf16 or f32, checked before).
template <class F>
void dispatch_float(DType dt, F&& f) {
  if (dt == DType::F32)
    f(float{});
  else
    f(bf16{});
}

int sm_count() {
  static const int n = [] {
    int dev = 0, count = 0;
    MT_CUDA_CHECK("rms_norm", cudaGetDevice(&dev));
    MT_CUDA_CHECK("rms_norm", cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, dev));
    return count;
  }();
  return n;
}

// Checks x_ND (2-D bf16 or f32; named x_role in errors), w_D (f32 [D]) and rstd_N (f32 [N]) on CUDA;
// returns {N, D}.
std::pair<int64_t, int64_t> check_norm_args(const Tensor& x_ND, const Tensor& w_D, const Tensor& rstd_N, const char* op,
                                            const char* x_role = "x_ND") {
  if (x_ND.dim() != 2) MT_THROW(op, " ", x_role, " must be 2-D, got shape ", shape_str(x_ND.shape()));
  const int64_t N = x_ND.size(0), D = x_ND.size(1);
  check_cuda_bf16_or_f32(x_ND, {N, D}, str(op, " ", x_role).c_str());
  check_cuda(w_D, str(op, " w_D").c_str());
  MT_CHECK(w_D.dtype() == DType::F32, op, " w_D must be f32 (the gain is read from the fp32 master weights), got ",
           w_D.desc());
  check_shape(w_D, {D}, str(op, " w_D").c_str());
  check_cuda(rstd_N, DType::F32, {N}, str(op, " rstd_N").c_str());
  if (D > kMaxD) MT_THROW(op, ": D (", D, ") is above the CUDA kernel's limit of ", kMaxD);
  return {N, D};
}

// The deterministic dw's split of N rows into parts: a fixed function of (N, D) so that the bits do not
// depend on the GPU. About 2048 blocks in all (enough to fill any current GPU), at least 32 rows a part.
struct DwSplit {
  int threads;
  int64_t col_blocks, parts, rows_per_part;
};
DwSplit dw_split(int64_t N, int64_t D) {
  DwSplit s;
  s.threads = int(std::min<int64_t>(kThreads, (D + 31) / 32 * 32));
  s.col_blocks = (D + s.threads - 1) / s.threads;
  const int64_t max_parts = std::max<int64_t>(1, 2048 / s.col_blocks);
  const int64_t parts_wanted = std::min<int64_t>(max_parts, (N + 31) / 32);
  s.rows_per_part = (N + parts_wanted - 1) / parts_wanted;
  s.parts = (N + s.rows_per_part - 1) / s.rows_per_part;
  return s;
}

template <class TDY, class TX>
void rms_norm_dw_deterministic(const TDY* dy, const TX* x, const float* rstd, int64_t N, int64_t D, bool accumulate,
                               float* dw) {
  const char* op = "rms_norm_bwd (deterministic dw)";
  const DwSplit s = dw_split(N, D);
  static DeviceScratch partial_buf;
  float* partial = partial_buf.as<float>(s.parts * D, op);
  rms_norm_dw_partial_kernel<TDY, TX><<<dim3(unsigned(s.col_blocks), unsigned(s.parts)), s.threads, 0, stream()>>>(
      dy, x, rstd, partial, N, int(D), s.rows_per_part);
  MT_CUDA_LAUNCH_CHECK(op);
  rms_norm_dw_finish_kernel<<<unsigned((D + kFinishCols - 1) / kFinishCols), dim3{kFinishCols, kFinishGroups}, 0,
                              stream()>>>(partial, s.parts, int(D), accumulate, dw);
  MT_CUDA_LAUNCH_CHECK(op);
}

}  // namespace

void rms_norm_fwd(const Tensor& x_ND, const Tensor& w_D, float eps, Tensor& y_ND, Tensor& rstd_N) {
  const auto [N, D] = check_norm_args(x_ND, w_D, rstd_N, "rms_norm_fwd");
  if (!(eps >= 0.0f)) MT_THROW("rms_norm_fwd: eps (", eps, ") must be >= 0");
  check_cuda(y_ND, DType::BF16, {N, D}, "rms_norm_fwd y_ND");
  if (N == 0) return;
  const float* w = w_D.data<float>();
  auto* y = static_cast<bf16*>(y_ND.raw());
  float* rstd = rstd_N.data<float>();
  dispatch_float(x_ND.dtype(), [&](auto x_tag) {
    using TX = decltype(x_tag);
    const auto* x = static_cast<const TX*>(x_ND.raw());
    constexpr int VW = kVecOf<TX, bf16>;
    dispatch_launch<VW>(pick_launch(D, VW, {x, y}), [&]<int G, int VEC>() {
      const int64_t rows_per_block = kThreads / G;
      const unsigned grid = unsigned((N + rows_per_block - 1) / rows_per_block);
      rms_norm_fwd_kernel<TX, G, VEC><<<grid, kThreads, 0, stream()>>>(x, w, eps, y, rstd, N, int(D));
    });
  });
  MT_CUDA_LAUNCH_CHECK("rms_norm_fwd");
}

void add_rms_norm_fwd(Tensor& h_ND, const Tensor& x_ND, const Tensor& w_D, float eps, Tensor& y_ND, Tensor& rstd_N) {
  const char* op = "add_rms_norm_fwd";
  const auto [N, D] = check_norm_args(h_ND, w_D, rstd_N, op, "h_ND");
  MT_CHECK(h_ND.dtype() == DType::F32, op, " h_ND must be f32 (the residual stream the add writes), got ", h_ND.desc());
  if (!(eps >= 0.0f)) MT_THROW(op, ": eps (", eps, ") must be >= 0");
  check_cuda_bf16_or_f32(x_ND, {N, D}, "add_rms_norm_fwd x_ND");
  check_cuda(y_ND, DType::BF16, {N, D}, "add_rms_norm_fwd y_ND");
  if (N == 0) return;
  const float* w = w_D.data<float>();
  float* h = h_ND.data<float>();
  auto* y = static_cast<bf16*>(y_ND.raw());
  float* rstd = rstd_N.data<float>();
  dispatch_float(x_ND.dtype(), [&](auto x_tag) {
    using TX = decltype(x_tag);
    const auto* x = static_cast<const TX*>(x_ND.raw());
    constexpr int VW = kVecOf<float, TX, bf16>;
    dispatch_launch<VW>(pick_launch(D, VW, {h, x, y}), [&]<int G, int VEC>() {
      const int64_t rows_per_block = kThreads / G;
      const unsigned grid = unsigned((N + rows_per_block - 1) / rows_per_block);
      add_rms_norm_fwd_kernel<TX, G, VEC><<<grid, kThreads, 0, stream()>>>(h, x, w, eps, y, rstd, N, int(D));
    });
  });
  MT_CUDA_LAUNCH_CHECK(op);
}

namespace {

// rms_norm_bwd, and add_rms_norm_bwd when dres_ND is given (then dx must be f32).
void norm_bwd(const char* op, const Tensor& dy_ND, const Tensor& x_ND, const Tensor& w_D, const Tensor& rstd_N,
              const Tensor* dres_ND, Tensor& dx_ND, Tensor& dw_D, bool accumulate_dw) {
  const auto [N, D] = check_norm_args(x_ND, w_D, rstd_N, op);
  check_cuda_bf16_or_f32(dy_ND, {N, D}, str(op, " dy_ND").c_str());
  check_cuda_bf16_or_f32(dx_ND, {N, D}, str(op, " dx_ND").c_str());
  check_cuda(dw_D, DType::F32, {D}, str(op, " dw_D").c_str());
  if (dres_ND) {
    check_cuda(*dres_ND, DType::F32, {N, D}, str(op, " dres_ND").c_str());
    MT_CHECK(dx_ND.dtype() == DType::F32, op, " dx_ND must be f32 (the residual stream's gradient), got ",
             dx_ND.desc());
  }
  const float* dres = dres_ND ? dres_ND->data<float>() : nullptr;
  const bool det = deterministic();
  // dw is summed with atomics across blocks, so = starts from a cleared vector (D floats); likewise with no rows.
  if (!accumulate_dw && D > 0 && (!det || N == 0))
    MT_CUDA_CHECK(op, cudaMemsetAsync(dw_D.raw(), 0, size_t(D) * sizeof(float), stream()));
  if (N == 0 || D == 0) return;
  const float* w = w_D.data<float>();
  dispatch_float(dy_ND.dtype(), [&](auto dy_tag) {
    dispatch_float(x_ND.dtype(), [&](auto x_tag) {
      dispatch_float(dx_ND.dtype(), [&](auto dx_tag) {
        using TDY = decltype(dy_tag);
        using TX = decltype(x_tag);
        using TDX = decltype(dx_tag);
        const auto* dy = static_cast<const TDY*>(dy_ND.raw());
        const auto* x = static_cast<const TX*>(x_ND.raw());
        auto* dx = static_cast<TDX*>(dx_ND.raw());
        constexpr int VW = kVecOf<TDY, TX, TDX>;
        dispatch_launch<VW>(pick_launch(D, VW, {dy, x, dx, dres}), [&]<int G, int VEC>() {
          const int64_t rows_per_block = kThreads / G;
          // Enough blocks to fill the GPU; more would only add dw atomics.
          const int64_t blocks =
              std::min<int64_t>((N + rows_per_block - 1) / rows_per_block, int64_t(sm_count()) * 8);
          rms_norm_bwd_kernel<TDY, TX, TDX, G, VEC>
              <<<unsigned(blocks), kThreads, det ? 0 : size_t(D) * sizeof(float), stream()>>>(
                  dy, x, w, rstd_N.data<float>(), dres, dx, det ? nullptr : dw_D.data<float>(), N, int(D));
        });
        MT_CUDA_LAUNCH_CHECK(op);
        if (det) rms_norm_dw_deterministic(dy, x, rstd_N.data<float>(), N, D, accumulate_dw, dw_D.data<float>());
      });
    });
  });
}

}  // namespace

void rms_norm_bwd(const Tensor& dy_ND, const Tensor& x_ND, const Tensor& w_D, const Tensor& rstd_N, Tensor& dx_ND,
                  Tensor& dw_D, bool accumulate_dw) {
  norm_bwd("rms_norm_bwd", dy_ND, x_ND, w_D, rstd_N, nullptr, dx_ND, dw_D, accumulate_dw);
}

void add_rms_norm_bwd(const Tensor& dy_ND, const Tensor& x_ND, const Tensor& w_D, const Tensor& rstd_N,
                      const Tensor& dres_ND, Tensor& dx_ND, Tensor& dw_D, bool accumulate_dw) {
  norm_bwd("add_rms_norm_bwd", dy_ND, x_ND, w_D, rstd_N, &dres_ND, dx_ND, dw_D, accumulate_dw);
}

}  // namespace mt::cuda
