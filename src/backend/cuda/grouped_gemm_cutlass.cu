// The grouped GEMMs of grouped_gemm.cuh on CUTLASS: argument checks, the deferred report of bad
// offsets, and dispatch to the kernels (grouped_gemm_cutlass_{tn,nn,wgrad,tn_m64n256,tn_m64n128}.cu;
// the TN product's tile as grouped_gemm_tile.cu chooses it). Compiled only when CMake finds the
// CUTLASS headers; grouped_gemm_fallback.cu replaces it otherwise.
#include <algorithm>
#include <climits>
#include <initializer_list>
#include <utility>

#include "backend/cuda/common.cuh"
#include "backend/cuda/gemm.cuh"
#include "backend/cuda/grouped_gemm.cuh"
#include "backend/cuda/grouped_gemm_cutlass.cuh"

namespace mt::cuda {

namespace {

// Bad offsets found by the setup kernels: the lowest expert index, its (clamped) row count.
DeferredError& offsets_error() {
  static DeferredError e;
  return e;
}

void check_earlier_offsets(const char* op) {
  unsigned long long key;
  if (!offsets_error().take(&key, op)) return;
  MT_THROW(op, ": offsets_E1 given to an earlier grouped GEMM were not non-decreasing from 0 to R: expert ",
           DeferredError::index_of(key), " got ", DeferredError::value_of(key),
           " rows (found on the device; that call computed nothing for the expert)");
}

bool aligned16(const void* p) {
  return reinterpret_cast<uintptr_t>(p) % 16 == 0;
}

// Shared checks; returns the deferred error word for the setup kernel.
unsigned long long* check_args(const char* op, int64_t E, const int64_t* offsets_E1, int64_t R,
                               std::initializer_list<std::pair<const char*, int64_t>> dims,
                               std::initializer_list<std::pair<const char*, const void*>> ptrs) {
  MT_CHECK(grouped_gemm_available(), op,
           ": the CUTLASS grouped GEMM needs a GPU of compute capability 9.0 (H100/H200); use the reference path");
  MT_CHECK(E >= 1 && E <= INT_MAX, op, ": the expert count E (", E, ") must be in [1, ", INT_MAX, "]");
  MT_CHECK(R >= 0 && R <= INT_MAX, op, ": the row count R (", R, ") must be in [0, ", INT_MAX, "]");
  MT_CHECK(offsets_E1 != nullptr, op, ": offsets_E1 is null");
  for (const auto& [name, v] : dims)
    MT_CHECK(v > 0 && v <= INT_MAX && v % 8 == 0, op, ": ", name, " (", v,
             ") must be a positive multiple of 8 (16-byte rows for TMA) below 2^31");
  for (const auto& [name, p] : ptrs)
    MT_CHECK(p != nullptr && aligned16(p), op, ": ", name, " (", p, ") must be a 16-byte aligned device pointer");
  check_earlier_offsets(op);
  return offsets_error().device_word(op);
}

// With =, experts without rows (or with bad offsets, which get no tiles either) must read 0.
// grid (x: blocks over one expert's M*N floats, y: experts).
__global__ void zero_empty_experts_kernel(const int64_t* off, int64_t R, int64_t MN, float* W) {
  const int e = int(blockIdx.y), E = int(gridDim.y);
  const int64_t r0 = off[e], r1 = off[e + 1];
  const bool ok = 0 <= r0 && r0 <= r1 && r1 <= R && (e != 0 || r0 == 0) && (e != E - 1 || r1 == R);
  if (ok && r1 > r0) return;
  float4* w = reinterpret_cast<float4*>(W + int64_t(e) * MN);  // MN % 4 == 0: M, N are multiples of 8
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < MN / 4; i += int64_t(gridDim.x) * blockDim.x)
    w[i] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
}

}  // namespace

bool grouped_gemm_available() {
  static const bool ok = [] {
    int dev = 0, major = 0, minor = 0;
    if (cudaGetDevice(&dev) != cudaSuccess ||
        cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess ||
        cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev) != cudaSuccess) {
      cudaGetLastError();  // leave no sticky error behind for the next check
      return false;
    }
    return major == 9 && minor == 0;  // the kernels are built for sm_90a only
  }();
  return ok;
}

void grouped_gemm_rows(const char* op, int64_t E, const int64_t* offsets_E1, int64_t R, int64_t N, int64_t K,
                       const __nv_bfloat16* A, const __nv_bfloat16* B, bool b_is_nk, __nv_bfloat16* C, RowsTile tile) {
  unsigned long long* err = check_args(op, E, offsets_E1, R, {{"N", N}, {"K", K}}, {{"A", A}, {"B", B}, {"C", C}});
  const RowsTile run = grouped_rows_tile(E, R, b_is_nk, tile);
  if (R == 0) return;
  const grouped::RowsProblem p{int(E), offsets_E1, R, int(N), int(K), A, B, C, err};
  if (!b_is_nk)
    grouped::run_rows_nn(op, p);
  else if (run == RowsTile::m64n256)
    grouped::run_rows_tn_m64n256(op, p);
  else if (run == RowsTile::m64n128)
    grouped::run_rows_tn_m64n128(op, p);
  else
    grouped::run_rows_tn(op, p);
  offsets_error().publish(op);
}

void grouped_gemm_wgrad(const char* op, int64_t E, const int64_t* offsets_E1, int64_t R, int64_t M, int64_t N,
                        const __nv_bfloat16* A, const __nv_bfloat16* B, float* W, bool accumulate, int ctas) {
  unsigned long long* err = check_args(op, E, offsets_E1, R, {{"M", M}, {"N", N}}, {{"A", A}, {"B", B}, {"W", W}});
  const int sms = grouped::device_sm_count(op);
  MT_CHECK(ctas >= 0 && ctas <= sms, op, ": ctas (", ctas, ") must be in [0, ", sms,
           "] (0: one CTA per SM; MOETRAIN_WGRAD_SMS sets it for the experts' weight gradients)");
  if (!accumulate) {
    MT_CHECK(E <= 65535, op, ": E (", E, ") exceeds the grid's y range");
    const int64_t MN = M * N;
    const unsigned bx = unsigned(std::min<int64_t>((MN / 4 + 255) / 256, 64));
    zero_empty_experts_kernel<<<dim3(bx, unsigned(E)), 256, 0, stream()>>>(offsets_E1, R, MN, W);
    MT_CUDA_LAUNCH_CHECK(op);
  }
  if (R == 0) return;
  grouped::GridCap cap(ctas);
  grouped::run_wgrad(
      op, grouped::WgradProblem{int(E), offsets_E1, R, int(M), int(N), A, B, W, err, accumulate ? 1.0f : 0.0f});
  offsets_error().publish(op);
}

namespace grouped {

namespace {
thread_local int t_grid_cap = 0;  // GridCap's: the persistent grid of the launch under way (0: none)
}  // namespace

GridCap::GridCap(int ctas) : prev_(t_grid_cap) {
  t_grid_cap = ctas;
}
GridCap::~GridCap() {
  t_grid_cap = prev_;
}

int device_sm_count(const char* op) {
  static const int n = [op] {
    int dev = 0, count = 0;
    MT_CUDA_CHECK(op, cudaGetDevice(&dev));
    MT_CUDA_CHECK(op, cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, dev));
    return count;
  }();
  return n;
}

// What launch_grouped gives CUTLASS as hw_info.sm_count: its persistent scheduler launches that many
// CTAs. The device's SMs, or fewer under a GridCap (grouped_gemm_wgrad's ctas).
int sm_count(const char* op) {
  const int n = device_sm_count(op);
  return t_grid_cap > 0 && t_grid_cap < n ? t_grid_cap : n;
}

}  // namespace grouped

}  // namespace mt::cuda
