// TEMPORARY: weak fallbacks for CUDA ops not written yet; each real definition overrides one.
#include "backend/cuda/cuda_ops.h"
#pragma GCC diagnostic ignored "-Wunused-parameter"
namespace mt::cuda {
__attribute__((weak)) void linear_fwd(const Tensor& x_TI, const Tensor& w_OI, Tensor& y_TO) { MT_THROW("op linear_fwd has no CUDA implementation yet"); }
__attribute__((weak)) void linear_bwd(const Tensor& dy_TO, const Tensor& x_TI, const Tensor& w_OI, Tensor* dx_TI, bool accumulate_dx, Tensor& dw_OI) { MT_THROW("op linear_bwd has no CUDA implementation yet"); }
__attribute__((weak)) void embedding_fwd(const Tensor& ids_T, const Tensor& table_VD, Tensor& out_TD) { MT_THROW("op embedding_fwd has no CUDA implementation yet"); }
__attribute__((weak)) void embedding_bwd(const Tensor& ids_T, const Tensor& dout_TD, Tensor& dtable_VD) { MT_THROW("op embedding_bwd has no CUDA implementation yet"); }
__attribute__((weak)) void rms_norm_fwd(const Tensor& x_ND, const Tensor& w_D, float eps, Tensor& y_ND, Tensor& rstd_N) { MT_THROW("op rms_norm_fwd has no CUDA implementation yet"); }
__attribute__((weak)) void rms_norm_bwd(const Tensor& dy_ND, const Tensor& x_ND, const Tensor& w_D, const Tensor& rstd_N, Tensor& dx_ND, Tensor& dw_D) { MT_THROW("op rms_norm_bwd has no CUDA implementation yet"); }
__attribute__((weak)) void rope_fwd(Tensor& x_TNHd, const Tensor& pos_T, float theta) { MT_THROW("op rope_fwd has no CUDA implementation yet"); }
__attribute__((weak)) void rope_bwd(Tensor& dx_TNHd, const Tensor& pos_T, float theta) { MT_THROW("op rope_bwd has no CUDA implementation yet"); }
__attribute__((weak)) void attention_fwd(const Tensor& q_THHd, const Tensor& k_TGHd, const Tensor& v_TGHd, int64_t B, int64_t S, Tensor& out_THHd, Tensor& lse_TH) { MT_THROW("op attention_fwd has no CUDA implementation yet"); }
__attribute__((weak)) void attention_bwd(const Tensor& dout_THHd, const Tensor& q_THHd, const Tensor& k_TGHd, const Tensor& v_TGHd, const Tensor& out_THHd, const Tensor& lse_TH, int64_t B, int64_t S, Tensor& dq_THHd, Tensor& dk_TGHd, Tensor& dv_TGHd) { MT_THROW("op attention_bwd has no CUDA implementation yet"); }
__attribute__((weak)) void router_fwd(const Tensor& logits_TE, int64_t K, bool norm_topk, Tensor& probs_TE, Tensor& topk_idx_TK, Tensor& topk_w_TK) { MT_THROW("op router_fwd has no CUDA implementation yet"); }
__attribute__((weak)) void router_bwd(const Tensor& dtopk_w_TK, const Tensor* dprobs_TE, const Tensor& probs_TE, const Tensor& topk_idx_TK, bool norm_topk, Tensor& dlogits_TE) { MT_THROW("op router_bwd has no CUDA implementation yet"); }
__attribute__((weak)) void expert_counts(const Tensor& topk_idx_TK, int64_t E, Tensor& counts_E) { MT_THROW("op expert_counts has no CUDA implementation yet"); }
__attribute__((weak)) void prob_column_sums(const Tensor& probs_TE, Tensor& sums_E) { MT_THROW("op prob_column_sums has no CUDA implementation yet"); }
__attribute__((weak)) double aux_loss_value(const Tensor& counts_E, const Tensor& sums_E, int64_t N) { MT_THROW("op aux_loss_value has no CUDA implementation yet"); }
__attribute__((weak)) void aux_loss_bwd(const Tensor& counts_E, int64_t N, float dloss, Tensor& dprobs_TE) { MT_THROW("op aux_loss_bwd has no CUDA implementation yet"); }
__attribute__((weak)) void make_dispatch_plan(const Tensor& topk_idx_TK, int64_t E, Tensor& offsets_E1, Tensor& assign_of_row_R, Tensor& row_of_assign_TK) { MT_THROW("op make_dispatch_plan has no CUDA implementation yet"); }
__attribute__((weak)) void permute_fwd(const Tensor& x_TD, const Tensor& assign_of_row_R, int64_t K, Tensor& xp_RD) { MT_THROW("op permute_fwd has no CUDA implementation yet"); }
__attribute__((weak)) void permute_bwd(const Tensor& dxp_RD, const Tensor& assign_of_row_R, int64_t K, Tensor& dx_TD) { MT_THROW("op permute_bwd has no CUDA implementation yet"); }
__attribute__((weak)) void unpermute_fwd(const Tensor& yp_RD, const Tensor& row_of_assign_TK, const Tensor& w_TK, Tensor& y_TD) { MT_THROW("op unpermute_fwd has no CUDA implementation yet"); }
__attribute__((weak)) void unpermute_bwd(const Tensor& dy_TD, const Tensor& yp_RD, const Tensor& row_of_assign_TK, const Tensor& w_TK, Tensor& dyp_RD, Tensor& dw_TK) { MT_THROW("op unpermute_bwd has no CUDA implementation yet"); }
__attribute__((weak)) void swiglu_fwd(const Tensor& gu_N2F, Tensor& h_NF) { MT_THROW("op swiglu_fwd has no CUDA implementation yet"); }
__attribute__((weak)) void swiglu_bwd(const Tensor& dh_NF, const Tensor& gu_N2F, Tensor& dgu_N2F) { MT_THROW("op swiglu_bwd has no CUDA implementation yet"); }
__attribute__((weak)) void experts_fwd(const Tensor& xp_RD, const Tensor& offsets_E1, const Tensor& w_gate_up_E2FD, const Tensor& w_down_EDF, Tensor& gu_R2F, Tensor& h_RF, Tensor& yp_RD) { MT_THROW("op experts_fwd has no CUDA implementation yet"); }
__attribute__((weak)) void experts_bwd(const Tensor& dyp_RD, const Tensor& xp_RD, const Tensor& offsets_E1, const Tensor& w_gate_up_E2FD, const Tensor& w_down_EDF, const Tensor& gu_R2F, const Tensor& h_RF, Tensor& dxp_RD, Tensor& dw_gate_up_E2FD, Tensor& dw_down_EDF) { MT_THROW("op experts_bwd has no CUDA implementation yet"); }
__attribute__((weak)) void experts_ref_fwd(const Tensor& x_TD, const Tensor& topk_idx_TK, const Tensor& topk_w_TK, const Tensor& w_gate_up_E2FD, const Tensor& w_down_EDF, Tensor& y_TD) { MT_THROW("op experts_ref_fwd has no CUDA implementation yet"); }
__attribute__((weak)) void experts_ref_bwd(const Tensor& dy_TD, const Tensor& x_TD, const Tensor& topk_idx_TK, const Tensor& topk_w_TK, const Tensor& w_gate_up_E2FD, const Tensor& w_down_EDF, Tensor& dx_TD, Tensor& dtopk_w_TK, Tensor& dw_gate_up_E2FD, Tensor& dw_down_EDF) { MT_THROW("op experts_ref_bwd has no CUDA implementation yet"); }
__attribute__((weak)) double cross_entropy_fwd(const Tensor& logits_TV, const Tensor& labels_T, Tensor& lse_T, int64_t* n_valid) { MT_THROW("op cross_entropy_fwd has no CUDA implementation yet"); }
__attribute__((weak)) void cross_entropy_bwd(const Tensor& logits_TV, const Tensor& labels_T, const Tensor& lse_T, float scale, Tensor& dlogits_TV) { MT_THROW("op cross_entropy_bwd has no CUDA implementation yet"); }
__attribute__((weak)) void lm_head_cross_entropy(const Tensor& hn_TD, const Tensor& w_VD, const Tensor& labels_T, float scale, int64_t chunk_rows, Tensor& loss_sum, Tensor& dhn_TD, Tensor& dw_VD) { MT_THROW("op lm_head_cross_entropy has no CUDA implementation yet"); }
__attribute__((weak)) void adamw_step(Tensor& p, const Tensor& g, Tensor& m, Tensor& v, const AdamWHyper& h, float grad_scale, Tensor* p_compute) { MT_THROW("op adamw_step has no CUDA implementation yet"); }
__attribute__((weak)) double sum_squares(const Tensor& x) { MT_THROW("op sum_squares has no CUDA implementation yet"); }
__attribute__((weak)) void scale_(Tensor& x, float s) { MT_THROW("op scale_ has no CUDA implementation yet"); }
__attribute__((weak)) void add_(Tensor& y, const Tensor& x, float alpha) { MT_THROW("op add_ has no CUDA implementation yet"); }
__attribute__((weak)) bool all_finite(const Tensor& x) { MT_THROW("op all_finite has no CUDA implementation yet"); }
__attribute__((weak)) void copy_cast(const Tensor& src, Tensor& dst) { MT_THROW("op copy_cast has no CUDA implementation yet"); }
}  // namespace mt::cuda
