// The rows-grouped CUTLASS GEMM with B_e stored [N, K] on the small 64x256x64 pingpong tile: the experts'
// forward (gu = xp @ w_gate_up[e]^T, yp = h @ w_down[e]^T) when rows per expert are few (decode).
// One instantiation per file so that the CUTLASS kernels compile in parallel.
#include "backend/cuda/grouped_gemm_cutlass_impl.cuh"

namespace mt::cuda::grouped {

void run_rows_tn_m64n256(const char* op, const RowsProblem& p) {
  using G = GroupedGemm<cutlass::layout::RowMajor, cutlass::layout::ColumnMajor, void, Bf16, SmallTile<256>>;
  run_rows<G>(op, p, p.K);
}

}  // namespace mt::cuda::grouped
