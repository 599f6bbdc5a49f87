// The rows-grouped CUTLASS GEMM with B_e stored [K, N]: dh = dyp @ w_down[e], dxp = dgu @ w_gate_up[e].
// One instantiation per file so that the three CUTLASS kernels compile in parallel.
#include "backend/cuda/grouped_gemm_cutlass_impl.cuh"

namespace mt::cuda::grouped {

void run_rows_nn(const char* op, const RowsProblem& p) {
  using G = GroupedGemm<cutlass::layout::RowMajor, cutlass::layout::RowMajor, void, Bf16>;
  run_rows<G>(op, p, p.N);
}

}  // namespace mt::cuda::grouped
