// The host side of the batch-invariant CUDA kernels (invariant.cuh says what they are and why).
#pragma once
#include <cstdint>

#include "core/tensor.h"

namespace mt::cuda {

// C[r, n] = alpha * sum_k A[r, k] B_g[n, k] (+ beta * C_src[r, n] when beta != 0; C_src may be C), r in [0, M),
// n in [0, N): A row-major [M, K] (lda), B_g row-major [N, K] (ldb). With offsets (device i64 [groups + 1],
// non-decreasing from 0 to M) row r belongs to the group g with offsets[g] <= r < offsets[g + 1] and reads
// B_g = B + g * b_group_stride (the experts); without, one group. ab_dtype bf16 (tensor cores) or f32 (CUDA cores);
// C bf16 or f32. On stream(), no host synchronisation, no allocation (CUDA graphs capture it).
void invariant_gemm_nt(const char* op, int64_t M, int64_t N, int64_t K, const void* A, int64_t lda, const void* B,
                       int64_t ldb, DType ab_dtype, float alpha, float beta, const void* C_src, void* C, DType c_dtype,
                       int64_t ldc, int64_t groups = 1, const int64_t* offsets = nullptr, int64_t b_group_stride = 0);

// Training attention in the mode: out [T, H, Hd] bf16 and lse (T*H f32, natural log) of q [T, H, Hd], k, v [T, G,
// Hd] (B rows of S tokens, causal, doc_start_T as ops.h's attention_fwd), each (token, head) by attend_row_warp over
// keys first..i, as the paged decode attention computes it. lse in [T, H] order, or with lse_bhs in [B, H, S] order
// (attention.cuh's StatsLayout: the order the shape's backward reads).
void invariant_attention_fwd(const Tensor& q_THHd, const Tensor& k_TGHd, const Tensor& v_TGHd, int64_t B, int64_t S,
                             Tensor& out_THHd, Tensor& lse_TH, const Tensor* doc_start_T, bool lse_bhs = false);

// logp[r] = x[r, label[r]] - log sum_v exp(x[r, v]) by row_logprob for the rows whose label is in [0, V) (others are
// left as they are): x f32 [R, V] with leading dim ld. Labels i64 (the LM head's) or i32 (the sampler's tokens).
void invariant_logprobs(const float* x, int64_t ld, int64_t R, int64_t V, const int64_t* labels, float* logp);
void invariant_logprobs(const float* x, int64_t ld, int64_t R, int64_t V, const int32_t* labels, float* logp);

}  // namespace mt::cuda
