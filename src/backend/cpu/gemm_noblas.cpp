// sgemm in plain loops, for machines without a BLAS (e.g. a GPU machine that only runs the CPU
// reference in tests). Correct and cache-friendly enough for test sizes; not for training on CPU.
#include <algorithm>
#include <cstddef>
#include <vector>

#include "backend/cpu/gemm.h"

namespace mt::cpu {

void sgemm_backend(bool trans_a, bool trans_b, int M, int N, int K, float alpha, const float* A, int lda,
                   const float* B, int ldb, float beta, float* C, int ldc) {
  std::vector<float> row(size_t(N), 0.0f);
  for (int i = 0; i < M; ++i) {
    std::fill(row.begin(), row.end(), 0.0f);
    for (int k = 0; k < K; ++k) {
      const float a = trans_a ? A[size_t(k) * lda + i] : A[size_t(i) * lda + k];
      if (trans_b)
        for (int j = 0; j < N; ++j) row[size_t(j)] += a * B[size_t(j) * ldb + k];
      else
        for (int j = 0; j < N; ++j) row[size_t(j)] += a * B[size_t(k) * ldb + j];
    }
    float* c = C + size_t(i) * ldc;
    for (int j = 0; j < N; ++j) c[j] = alpha * row[size_t(j)] + (beta == 0.0f ? 0.0f : beta * c[j]);
  }
}

void set_blas_threads(int) {}

const char* blas_name() { return "loops (no BLAS)"; }

}  // namespace mt::cpu
