// The rows-grouped CUTLASS GEMM with B_e stored [N, K]: gu = xp @ w_gate_up[e]^T, yp = h @ w_down[e]^T.
// One instantiation per file so that the three CUTLASS kernels compile in parallel.
#include "backend/cuda/grouped_gemm_cutlass_impl.cuh"

namespace mt::cuda::grouped {

void run_rows_tn(const char* op, const RowsProblem& p) {
  using G = GroupedGemm<cutlass::layout::RowMajor, cutlass::layout::ColumnMajor, void, Bf16>;
  run_rows<G>(op, p, p.K);
}

}  // namespace mt::cuda::grouped
