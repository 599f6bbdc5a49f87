// CUDA causal grouped-query attention: the reference kernels and what attention_fwd/bwd chose.
// Host declarations only (tests include this from plain C++).
//
// mt::cuda::attention_fwd/bwd (cuda_ops.h) run cuDNN's fused SDPA (attention.cu) and fall back to
// the reference kernels here (attention_ref.cu) when cuDNN cannot run a shape or when the
// environment says MOETRAIN_ATTENTION=ref. The choice is made once per shape and kept, so that
// attention_bwd reads the statistics that attention_fwd of the same shape wrote.
//
// Saved statistics (lse_TH, f32, T*H values): the natural-log log-sum-exp of the scaled scores of
// each (token, query head), as on the CPU. Their order in the buffer is the plan's StatsLayout:
// [T, H] (= [B, S, H], the CPU's order) wherever cuDNN accepts it (9.26 on), else cuDNN's own
// [B, H, S] (cuDNN 9.14 and 9.19 on an H200: [B, H, S]). Either way the buffer holds T*H floats.
#pragma once
#include <cstdint>
#include <string>

#include "core/tensor.h"
#include "ops/attention_shapes.h"

namespace mt::cuda {

enum class StatsLayout {
  TH,   // lse[(b*S + s)*H + h]: the CPU's order
  BHS,  // lse[(b*H + h)*S + s]: cuDNN's natural order
};

enum class AttentionBackend { cudnn, reference };

struct AttentionPlanInfo {
  AttentionBackend backend;
  StatsLayout stats;
  std::string reason;  // why this backend (the cuDNN error when it fell back)
};

// The path attention_fwd/bwd take for this shape; decides it (building the cuDNN graphs) on first
// use. MOETRAIN_ATTENTION: unset or "auto" = cuDNN when supported, "ref" = reference kernels,
// "cudnn" = cuDNN or an error.
AttentionPlanInfo attention_plan_info(int64_t B, int64_t S, int64_t H, int64_t G, int64_t Hd);

// Reference kernels, same arguments and contracts as attention_fwd/bwd (bf16 q, k, v, out, dout,
// dq, dk, dv; f32 lse), with the statistics in `stats` order. f32 math throughout; deterministic
// (no atomics). Correct for any Hd; meant for tests, small shapes and as the fallback. doc_start_T:
// packed rows (ops.h), i32 [T] on CUDA; the packed path of attention_fwd/bwd (cuDNN is not used there).
void attention_ref_fwd(const Tensor& q_THHd, const Tensor& k_TGHd, const Tensor& v_TGHd, int64_t B, int64_t S,
                       Tensor& out_THHd, Tensor& lse_TH, StatsLayout stats = StatsLayout::TH,
                       const Tensor* doc_start_T = nullptr);
void attention_ref_bwd(const Tensor& dout_THHd, const Tensor& q_THHd, const Tensor& k_TGHd, const Tensor& v_TGHd,
                       const Tensor& out_THHd, const Tensor& lse_TH, int64_t B, int64_t S, Tensor& dq_THHd,
                       Tensor& dk_TGHd, Tensor& dv_TGHd, StatsLayout stats = StatsLayout::TH,
                       const Tensor* doc_start_T = nullptr);

namespace detail {
using AttnDims = ops::AttentionDims;
// Checks q, k, v's device and dtype (bf16) here, their shapes by the shared ops::check_attention_shapes,
// and returns the dims; `op` names the caller.
AttnDims check_attention_inputs(const Tensor& q_THHd, const Tensor& k_TGHd, const Tensor& v_TGHd, int64_t B, int64_t S,
                                const char* op);
}  // namespace detail

}  // namespace mt::cuda
