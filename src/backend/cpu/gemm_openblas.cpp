// sgemm through OpenBLAS (Debian's libopenblas-dev), chosen by CMake when it is installed.
#include <cblas.h>

#include "backend/cpu/gemm.h"

namespace mt::cpu {

void sgemm_backend(bool trans_a, bool trans_b, int M, int N, int K, float alpha, const float* A, int lda,
                   const float* B, int ldb, float beta, float* C, int ldc) {
  cblas_sgemm(CblasRowMajor, trans_a ? CblasTrans : CblasNoTrans, trans_b ? CblasTrans : CblasNoTrans, M, N, K, alpha,
              A, lda, B, ldb, beta, C, ldc);
}

void set_blas_threads(int threads) {
  if (threads > 0) openblas_set_num_threads(threads);
}

const char* blas_name() { return "openblas"; }

}  // namespace mt::cpu
