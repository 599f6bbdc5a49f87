// sgemm in plain loops, for machines without a BLAS (e.g. a GPU machine that only runs the CPU
// reference in tests). Correct and cache-friendly enough for test sizes; not for training on CPU.
#include "backend/cpu/gemm.h"

namespace mt::cpu {

void sgemm_backend(bool trans_a, bool trans_b, int M, int N, int K, float alpha, const float* A, int lda,
                   const float* B, int ldb, float beta, float* C, int ldc) {
  sgemm_rows(trans_a, trans_b, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
}

void set_blas_threads(int) {}

const char* blas_name() { return "loops (no BLAS)"; }

}  // namespace mt::cpu
