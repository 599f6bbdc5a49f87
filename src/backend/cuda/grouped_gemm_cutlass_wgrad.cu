// The K-grouped CUTLASS GEMM of the expert weight gradients, f32 +=: dw_down[e] += dyp^T @ h,
// dw_gate_up[e] += dgu^T @ xp over expert e's rows. One instantiation per file (parallel compiles).
#include "backend/cuda/grouped_gemm_cutlass_impl.cuh"

namespace mt::cuda::grouped {

void run_wgrad(const char* op, const WgradProblem& p) {
  using G = GroupedGemm<cutlass::layout::ColumnMajor, cutlass::layout::RowMajor, float, float>;
  run_wgrad_impl<G>(op, p);
}

}  // namespace mt::cuda::grouped
