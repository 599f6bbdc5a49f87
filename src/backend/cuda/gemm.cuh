// cuBLASLt GEMM for the CUDA backend, plus two host-side helpers shared by the GEMM-based ops
// (linear, MoE dispatch, experts, LM head): reusable device scratch buffers and deferred device errors.
//
// gemm() promises: row-major C[M,N] = alpha * op(A) @ op(B) + beta * C with A, B bf16, f32 accumulation
// (CUBLAS_COMPUTE_32F) and C bf16 or f32, on mt::cuda::stream(), without host synchronisation. Matmul
// descriptors and the heuristic's algorithm are cached per (shape, transposes, leading dims, C dtype,
// pointer alignment), so a repeated shape costs one cublasLtMatmul call. In the batch-invariant mode
// (core/determinism.h) C = A B^T runs one algorithm, K unsplit, for every M of its (N, K) (gemm.cu).
#pragma once
#include <cstdint>

#include "backend/cuda/common.cuh"

namespace mt::cuda {

// C[M,N] = alpha * op(A) @ op(B) + beta * C, all row-major.
// op(A) is [M,K]: A is stored [M,K] (lda >= K) or, when trans_a, [K,M] (lda >= M).
// op(B) is [K,N]: B is stored [K,N] (ldb >= N) or, when trans_b, [N,K] (ldb >= K).
// c_dtype is DType::BF16 or DType::F32. beta == 0 ignores C's old contents; beta == 1 accumulates
// (for a bf16 C the sum is rounded to bf16 once, in the epilogue). M or N == 0 does nothing; K == 0
// gives C = beta * C (beta must then be 0 or 1). `op` names the caller in error messages.
void gemm(const char* op, bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, const __nv_bfloat16* A,
          int64_t lda, const __nv_bfloat16* B, int64_t ldb, float beta, void* C, DType c_dtype, int64_t ldc,
          float alpha = 1.0f);
// D[M,N] = op(A) @ op(B) + C, row-major, with C and D of one dtype (bf16 or f32) and leading dim ldc: the
// add in cuBLASLt's epilogue (beta = 1, C read, D written), e.g. a GEMM whose output joins the f32
// residual stream. C may be D (then it is gemm with beta = 1); otherwise they must not overlap.
void gemm_add(const char* op, bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, const __nv_bfloat16* A,
              int64_t lda, const __nv_bfloat16* B, int64_t ldb, const void* C, void* D, DType dtype, int64_t ldc);
// The same with f32 operands, computed in true fp32 (no TF32): for the few small GEMMs whose inputs
// must not be rounded to bf16 (the MoE router).
void gemm(const char* op, bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, const float* A, int64_t lda,
          const float* B, int64_t ldb, float beta, void* C, DType c_dtype, int64_t ldc, float alpha = 1.0f);

// A device buffer that grows on demand and is reused by later calls of one op. Reuse is safe because
// every op runs on stream(): the next call's writes are ordered after this call's reads. Growing
// frees the old buffer with cudaFree, which waits for the device; a steady state allocates nothing.
// The memory is never returned (the process exit releases it), so destruction order cannot matter.
class DeviceScratch {
 public:
  void* get(size_t bytes, const char* op);
  template <class T>
  T* as(int64_t n, const char* op) {
    return static_cast<T*>(get(size_t(n) * sizeof(T), op));
  }

 private:
  void* p_ = nullptr;
  size_t bytes_ = 0;
};

// A sticky error record that kernels write and the host reads without synchronising the stream.
// Kernels atomicMin a packed key (index << 32 | uint32 value) into device_word(), so the lowest
// failing index wins. publish() queues an asynchronous copy of the word into pinned host memory;
// take() reads that copy: it reports an error of any call whose copy has landed, so an error
// surfaces at a later call (or at once after a stream synchronisation). On an error, take()
// synchronises the stream, resets the record and returns the key.
class DeferredError {
 public:
  static constexpr unsigned long long kNone = ~0ull;
  unsigned long long* device_word(const char* op);
  void publish(const char* op);
  bool take(unsigned long long* key, const char* op);
  static int64_t index_of(unsigned long long key) { return int64_t(key >> 32); }
  static int32_t value_of(unsigned long long key) { return int32_t(uint32_t(key & 0xffffffffu)); }

 private:
  void init(const char* op);
  unsigned long long* dev_ = nullptr;
  volatile unsigned long long* host_ = nullptr;
};

__device__ __forceinline__ unsigned long long deferred_error_key(int64_t index, int32_t value) {
  return (static_cast<unsigned long long>(index) << 32) | static_cast<unsigned long long>(static_cast<uint32_t>(value));
}

}  // namespace mt::cuda
