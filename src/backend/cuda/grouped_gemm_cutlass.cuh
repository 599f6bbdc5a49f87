// Internal interface between grouped_gemm_cutlass.cu (argument checks, deferred offset errors, the tile
// choice) and the kernel files (one CUTLASS instantiation each, so that they compile in parallel):
//   grouped_gemm_cutlass_tn.cu     rows-grouped, B_e stored [N, K]   (gu = xp @ Wgu^T, yp = h @ Wd^T)
//   grouped_gemm_cutlass_nn.cu     rows-grouped, B_e stored [K, N]   (dh = dyp @ Wd, dxp = dgu @ Wgu)
//   grouped_gemm_cutlass_wgrad.cu  K-grouped, f32 +=                 (dWd += dyp^T h, dWgu += dgu^T xp)
//   grouped_gemm_cutlass_tn_m64n256.cu, _tn_m64n128.cu   the TN product on 64-row pingpong tiles (few
//                                  rows per expert: the experts' forward at decode)
// Each run_* launches a setup kernel that writes the per-expert problem shapes, pointers and strides
// from the offsets into device scratch, then the grouped GEMM, both on mt::cuda::stream().
#pragma once
#include <cuda_bf16.h>

#include <cstdint>

namespace mt::cuda::grouped {

struct RowsProblem {
  int E;
  const int64_t* off;  // device [E+1]
  int64_t R;
  int N, K;
  const __nv_bfloat16* A;   // [R, K]
  const __nv_bfloat16* B;   // E blocks of [N, K] (tn) or [K, N] (nn)
  __nv_bfloat16* C;         // [R, N]
  unsigned long long* err;  // deferred error word: lowest expert with bad offsets
};

struct WgradProblem {
  int E;
  const int64_t* off;  // device [E+1]
  int64_t R;
  int M, N;
  const __nv_bfloat16* A;  // [R, M]
  const __nv_bfloat16* B;  // [R, N]
  float* W;                // E blocks of [M, N]: W = A^T B + beta * W
  unsigned long long* err;
  float beta;  // 1 (+=) or 0 (=, W not read)
};

void run_rows_tn(const char* op, const RowsProblem& p);
void run_rows_tn_m64n256(const char* op, const RowsProblem& p);
void run_rows_tn_m64n128(const char* op, const RowsProblem& p);
void run_rows_nn(const char* op, const RowsProblem& p);
void run_wgrad(const char* op, const WgradProblem& p);

// The persistent grid size of the grouped kernels: the SM count of the current device (cached), or
// less while a GridCap is alive on this thread. device_sm_count: the SM count itself.
int sm_count(const char* op);
int device_sm_count(const char* op);
// While alive, sm_count() returns at most ctas (0: no cap). grouped_gemm_wgrad's ctas argument.
class GridCap {
 public:
  explicit GridCap(int ctas);
  ~GridCap();
  GridCap(const GridCap&) = delete;
  GridCap& operator=(const GridCap&) = delete;

 private:
  int prev_;
};

}  // namespace mt::cuda::grouped
