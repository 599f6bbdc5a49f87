// Grouped GEMMs of the MoE experts, with the group sizes read on the device (no host round trip),
// and the two paths of experts_fwd / experts_bwd that use them or not.
//
// Groups are the experts' row ranges of the dispatched rows: expert e owns rows [off[e], off[e+1])
// of offsets_E1 (device i64 [E+1]). The host passes E and the fixed dimensions only; a small kernel
// turns the offsets into per-expert problem shapes and pointers, and a CUTLASS sm90 grouped GEMM
// (TMA, warp-specialized, persistent) runs all experts in one launch (grouped_gemm_cutlass.cu).
// Builds without the CUTLASS headers compile grouped_gemm_fallback.cu instead, where
// grouped_gemm_available() is false and the experts take the per-expert cuBLASLt reference path.
//
// Everything is row-major, bf16 inputs, f32 accumulation, on mt::cuda::stream(), no host sync.
// Requirements (checked, mt::Error otherwise): every column count a multiple of 8 and every base
// pointer 16-byte aligned (TMA moves 16-byte aligned rows), R < 2^31.
// Offsets that are not non-decreasing from 0 to R are reported by a later call of these functions
// (a deferred device-side check, as for the dispatch plan); the call that sees them computes
// nothing for the offending experts.
#pragma once
#include <cuda_bf16.h>

#include <cstdint>
#include <functional>
#include <initializer_list>
#include <string>

#include "core/tensor.h"

namespace mt::cuda {

// True when this build has the CUTLASS kernels and the current GPU runs them (compute capability 9.0).
bool grouped_gemm_available();

// The tile configuration of a rows-grouped GEMM (grouped_gemm_cutlass_impl.cuh describes them):
//   large    128x256x64, cooperative: the training shapes (hundreds to thousands of rows per expert);
//   m64n256  64x256x64, pingpong, TN only: few rows per expert (decode: 16 in bench-4L);
//   m64n128  64x128x64, pingpong, TN only: the same with half-width tiles (twice the tiles).
// The rows per expert live on the device (and CUDA graphs capture these calls), so automatic decides
// from what the host knows, with no sync: a TN call (b_is_nk) with R <= kSmallRowsPerExpert * E rows
// (on average at most one 64-row tile per expert) takes m64n256, anything else large. The NN product
// (the backward's dh, dxp) always runs large.
// The tiles compute the same bits (the same K order, no split-K), so the batch-invariant mode takes them too.
// MOETRAIN_GROUPED_SMALL (read at every call, for A/B runs) overrides automatic for TN calls:
// unset or "auto" as above, "0" large, "1" m64n256, "64x256" / "64x128" that tile.
enum class RowsTile { automatic, large, m64n256, m64n128 };
constexpr int64_t kSmallRowsPerExpert = 64;

// The tile a call with these arguments runs (automatic resolved as above; an explicit tile as given).
// Throws for a bad MOETRAIN_GROUPED_SMALL (naming it, its value and the allowed ones) and for a
// small tile asked of an NN product.
RowsTile grouped_rows_tile(int64_t E, int64_t R, bool b_is_nk, RowsTile tile = RowsTile::automatic);
// "large", "m64n256", "m64n128" or "automatic".
const char* rows_tile_name(RowsTile tile);

// For each expert e with rows [r0, r1) = [off[e], off[e+1]) and M_e = r1 - r0:
//   C[r0:r1, 0:N] = A[r0:r1, 0:K] @ op(B_e)   (bf16, =)
// A is [R, K], C is [R, N]; B_e = B + e*N*K is stored [N, K] when b_is_nk (op(B_e) = B_e^T, the "TN"
// case of gu = xp @ w_gate_up[e]^T) or [K, N] otherwise (op(B_e) = B_e, as in dxp = dgu @ w_gate_up[e]).
// tile: as grouped_rows_tile resolves it; the tiles differ in speed, not in what they compute (f32
// accumulation over K, no split-K, one bf16 rounding of C).
void grouped_gemm_rows(const char* op, int64_t E, const int64_t* offsets_E1, int64_t R, int64_t N, int64_t K,
                       const __nv_bfloat16* A, const __nv_bfloat16* B, bool b_is_nk, __nv_bfloat16* C,
                       RowsTile tile = RowsTile::automatic);

// For each expert e with rows [r0, r1):  W_e += A[r0:r1, 0:M]^T @ B[r0:r1, 0:N]   (f32 +=)
// A is [R, M], B is [R, N], W_e = W + e*M*N is [M, N] f32. Experts without rows keep W_e untouched.
// With accumulate false it is = instead (C is not read), and experts without rows get W_e = 0.
// ctas: the persistent grid (0: one CTA per SM; otherwise 1 to the SM count, an error beyond). Fewer
// CTAs leave SMs to work on another stream (core/streams.h, WgradScope); the result is the same bits
// (every tile is computed whole by one CTA, no split-K).
void grouped_gemm_wgrad(const char* op, int64_t E, const int64_t* offsets_E1, int64_t R, int64_t M, int64_t N,
                        const __nv_bfloat16* A, const __nv_bfloat16* B, float* W, bool accumulate = true, int ctas = 0);

// ---- the experts' paths (experts.cu); experts_fwd / experts_bwd pick one per call ----
// MOETRAIN_EXPERTS=reference forces the reference path, =grouped makes an unusable grouped path an
// error; unset or "auto" takes the grouped path whenever experts_grouped_unsupported() is empty.

// Why the grouped path cannot run experts of these dimensions on these tensors ("" when it can): no
// CUTLASS kernels for this build or GPU, D or F not a multiple of 8, or a tensor not 16-byte aligned.
std::string experts_grouped_unsupported(int64_t D, int64_t F, std::initializer_list<const Tensor*> tensors);

// Same contracts as experts_fwd / experts_bwd (ops.h). The reference path copies offsets_E1 to the
// host (one stream synchronisation per call) and runs one cuBLASLt GEMM per expert and product.
void experts_fwd_reference(const Tensor& xp_RD, const Tensor& offsets_E1, const Tensor& w_gate_up_E2FD,
                           const Tensor& w_down_EDF, Tensor& gu_R2F, Tensor& h_RF, Tensor& yp_RD);
void experts_bwd_reference(const Tensor& dyp_RD, const Tensor& xp_RD, const Tensor& offsets_E1,
                           const Tensor& w_gate_up_E2FD, const Tensor& w_down_EDF, const Tensor& gu_R2F,
                           const Tensor& h_RF, Tensor& dxp_RD, Tensor& dw_gate_up_E2FD, Tensor& dw_down_EDF,
                           bool accumulate_dw = true);
// The grouped path: the grouped GEMMs above, no host synchronisation. Throws when unsupported.
void experts_fwd_grouped(const Tensor& xp_RD, const Tensor& offsets_E1, const Tensor& w_gate_up_E2FD,
                         const Tensor& w_down_EDF, Tensor& gu_R2F, Tensor& h_RF, Tensor& yp_RD);
// The batch-invariant mode's forward on invariant.cuh's GEMM: what experts_fwd runs while core/determinism.h's
// batch_invariant() is on and the grouped GEMMs cannot run (otherwise they run, at their one large tile).
void experts_fwd_invariant(const Tensor& xp_RD, const Tensor& offsets_E1, const Tensor& w_gate_up_E2FD,
                           const Tensor& w_down_EDF, Tensor& gu_R2F, Tensor& h_RF, Tensor& yp_RD);
// after_dx (ops::experts_bwd) runs between the input gradient and the weight gradients.
void experts_bwd_grouped(const Tensor& dyp_RD, const Tensor& xp_RD, const Tensor& offsets_E1,
                         const Tensor& w_gate_up_E2FD, const Tensor& w_down_EDF, const Tensor& gu_R2F,
                         const Tensor& h_RF, Tensor& dxp_RD, Tensor& dw_gate_up_E2FD, Tensor& dw_down_EDF,
                         bool accumulate_dw = true, const std::function<void()>& after_dx = {});

}  // namespace mt::cuda
