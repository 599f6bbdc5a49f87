// Row-major single-precision GEMM for the CPU backend, over OpenBLAS (or plain loops without a BLAS).
// Every CPU op that multiplies matrices goes through here so that the BLAS choice lives in one file.
#pragma once
#include <cstdint>

namespace mt::cpu {

// C[M,N] = alpha * op(A) @ op(B) + beta * C, all row-major.
// op(A) is [M,K]: A is stored [M,K] (lda >= K) or, when trans_a, [K,M] (lda >= M).
// op(B) is [K,N]: B is stored [K,N] (ldb >= N) or, when trans_b, [N,K] (ldb >= K).
// beta == 0 overwrites C (garbage/NaN in C is ignored, as BLAS promises). Sizes of 0 are allowed:
// with K == 0 the product is zero, so C = beta * C.
void sgemm(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha, const float* A, int64_t lda,
           const float* B, int64_t ldb, float beta, float* C, int64_t ldc);

// The build's BLAS: gemm_openblas.cpp or gemm_noblas.cpp (checked arguments, K > 0, M, N > 0).
void sgemm_backend(bool trans_a, bool trans_b, int M, int N, int K, float alpha, const float* A, int lda,
                   const float* B, int ldb, float beta, float* C, int ldc);
// The same in plain loops: each row of C from its own row of A, k in order (no blocking), so a row's bits do not
// depend on M: the build without a BLAS, and the batch-invariant mode (core/determinism.h).
void sgemm_rows(bool trans_a, bool trans_b, int M, int N, int K, float alpha, const float* A, int lda, const float* B,
                int ldb, float beta, float* C, int ldc);
// Threads the BLAS may use (0 = its default); a no-op without a threaded BLAS.
void set_blas_threads(int threads);
const char* blas_name();

}  // namespace mt::cpu
