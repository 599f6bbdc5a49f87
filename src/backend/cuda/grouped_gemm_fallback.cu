// The grouped GEMMs of grouped_gemm.cuh in a build without the CUTLASS headers: unavailable, so
// experts_fwd / experts_bwd take their per-expert cuBLASLt reference path (experts.cu). Compiled
// instead of grouped_gemm_cutlass*.cu (CMakeLists.txt decides).
#include "backend/cuda/grouped_gemm.cuh"

namespace mt::cuda {

namespace {
[[noreturn]] void no_cutlass(const char* op) {
  MT_THROW(op,
           ": this moetrain was built without the CUTLASS headers, so there is no grouped GEMM "
           "(scripts/device_deps.sh or scripts/install_deps.sh provide them; then re-run cmake)");
}
}  // namespace

bool grouped_gemm_available() {
  return false;
}

void grouped_gemm_rows(const char* op, int64_t, const int64_t*, int64_t, int64_t, int64_t, const __nv_bfloat16*,
                       const __nv_bfloat16*, bool, __nv_bfloat16*, RowsTile) {
  no_cutlass(op);
}

void grouped_gemm_wgrad(const char* op, int64_t, const int64_t*, int64_t, int64_t, int64_t, const __nv_bfloat16*,
                        const __nv_bfloat16*, float*, bool, int) {
  no_cutlass(op);
}

}  // namespace mt::cuda
