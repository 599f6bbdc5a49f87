// Row-major sgemm (see gemm.h): argument checks here, the multiplication in the BLAS the build chose
// (gemm_openblas.cpp, or gemm_noblas.cpp where no BLAS is installed). Dimensions are checked
// against int, the index type of the CBLAS interface, so that a huge matrix fails loudly.
#include "backend/cpu/gemm.h"

#include <algorithm>
#include <climits>
#include <vector>

#include "core/determinism.h"
#include "core/error.h"

namespace mt::cpu {

void sgemm_rows(bool trans_a, bool trans_b, int M, int N, int K, float alpha, const float* A, int lda, const float* B,
                int ldb, float beta, float* C, int ldc) {
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

void sgemm(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha, const float* A, int64_t lda,
           const float* B, int64_t ldb, float beta, float* C, int64_t ldc) {
  MT_CHECK(M >= 0 && N >= 0 && K >= 0, "sgemm sizes M=", M, " N=", N, " K=", K);
  for (int64_t d : {M, N, K, lda, ldb, ldc})
    MT_CHECK(d <= INT_MAX, "sgemm dimension ", d, " exceeds the BLAS int range");
  if (M == 0 || N == 0) return;
  MT_CHECK(ldc >= N, "sgemm ldc=", ldc, " < N=", N);
  MT_CHECK(lda >= (trans_a ? M : K) && lda >= 1, "sgemm lda=", lda, " too small");
  MT_CHECK(ldb >= (trans_b ? K : N) && ldb >= 1, "sgemm ldb=", ldb, " too small");
  if (K == 0) {
    // BLAS would do this too, but some builds read A/B anyway; do it by hand to be safe.
    for (int64_t i = 0; i < M; ++i)
      for (int64_t j = 0; j < N; ++j) C[i * ldc + j] = beta == 0.0f ? 0.0f : beta * C[i * ldc + j];
    return;
  }
  if (batch_invariant()) {  // core/determinism.h: each row of C from its row of A, k in order
    sgemm_rows(trans_a, trans_b, int(M), int(N), int(K), alpha, A, int(lda), B, int(ldb), beta, C, int(ldc));
    return;
  }
  sgemm_backend(trans_a, trans_b, int(M), int(N), int(K), alpha, A, int(lda), B, int(ldb), beta, C, int(ldc));
}

}  // namespace mt::cpu
