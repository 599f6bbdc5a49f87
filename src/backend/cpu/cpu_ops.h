// CPU reference implementations of every op in ops/ops.h, same signatures and contracts.
// Plain loops in fp32 with fp64 accumulation in reductions; GEMMs through OpenBLAS.
#pragma once
#include "ops/ops.h"

namespace mt::cpu {
using ops::AdamWHyper;

void linear_fwd(const Tensor& x_TI, const Tensor& w_OI, Tensor& y_TO);
void linear_bwd(const Tensor& dy_TO, const Tensor& x_TI, const Tensor& w_OI, Tensor* dx_TI, bool accumulate_dx,
                Tensor& dw_OI);
void embedding_fwd(const Tensor& ids_T, const Tensor& table_VD, Tensor& out_TD);
void embedding_bwd(const Tensor& ids_T, const Tensor& dout_TD, Tensor& dtable_VD);
void rms_norm_fwd(const Tensor& x_ND, const Tensor& w_D, float eps, Tensor& y_ND, Tensor& rstd_N);
void rms_norm_bwd(const Tensor& dy_ND, const Tensor& x_ND, const Tensor& w_D, const Tensor& rstd_N, Tensor& dx_ND,
                  Tensor& dw_D);
void rope_fwd(Tensor& x_TNHd, const Tensor& pos_T, float theta);
void rope_bwd(Tensor& dx_TNHd, const Tensor& pos_T, float theta);
void attention_fwd(const Tensor& q_THHd, const Tensor& k_TGHd, const Tensor& v_TGHd, int64_t B, int64_t S,
                   Tensor& out_THHd, Tensor& lse_TH);
void attention_bwd(const Tensor& dout_THHd, const Tensor& q_THHd, const Tensor& k_TGHd, const Tensor& v_TGHd,
                   const Tensor& out_THHd, const Tensor& lse_TH, int64_t B, int64_t S, Tensor& dq_THHd, Tensor& dk_TGHd,
                   Tensor& dv_TGHd);
void router_fwd(const Tensor& logits_TE, int64_t K, bool norm_topk, Tensor& probs_TE, Tensor& topk_idx_TK,
                Tensor& topk_w_TK);
void router_bwd(const Tensor& dtopk_w_TK, const Tensor* dprobs_TE, const Tensor& probs_TE, const Tensor& topk_idx_TK,
                bool norm_topk, Tensor& dlogits_TE);
void expert_counts(const Tensor& topk_idx_TK, int64_t E, Tensor& counts_E);
void prob_column_sums(const Tensor& probs_TE, Tensor& sums_E);
double aux_loss_value(const Tensor& counts_E, const Tensor& sums_E, int64_t N);
void aux_loss_bwd(const Tensor& counts_E, int64_t N, float dloss, Tensor& dprobs_TE);
void make_dispatch_plan(const Tensor& topk_idx_TK, int64_t E, Tensor& offsets_E1, Tensor& assign_of_row_R,
                        Tensor& row_of_assign_TK);
void permute_fwd(const Tensor& x_TD, const Tensor& assign_of_row_R, int64_t K, Tensor& xp_RD);
void permute_bwd(const Tensor& dxp_RD, const Tensor& assign_of_row_R, int64_t K, Tensor& dx_TD);
void unpermute_fwd(const Tensor& yp_RD, const Tensor& row_of_assign_TK, const Tensor& w_TK, Tensor& y_TD);
void unpermute_bwd(const Tensor& dy_TD, const Tensor& yp_RD, const Tensor& row_of_assign_TK, const Tensor& w_TK,
                   Tensor& dyp_RD, Tensor& dw_TK);
void swiglu_fwd(const Tensor& gu_N2F, Tensor& h_NF);
void swiglu_bwd(const Tensor& dh_NF, const Tensor& gu_N2F, Tensor& dgu_N2F);
void experts_fwd(const Tensor& xp_RD, const Tensor& offsets_E1, const Tensor& w_gate_up_E2FD, const Tensor& w_down_EDF,
                 Tensor& gu_R2F, Tensor& h_RF, Tensor& yp_RD);
void experts_bwd(const Tensor& dyp_RD, const Tensor& xp_RD, const Tensor& offsets_E1, const Tensor& w_gate_up_E2FD,
                 const Tensor& w_down_EDF, const Tensor& gu_R2F, const Tensor& h_RF, Tensor& dxp_RD,
                 Tensor& dw_gate_up_E2FD, Tensor& dw_down_EDF);
void experts_ref_fwd(const Tensor& x_TD, const Tensor& topk_idx_TK, const Tensor& topk_w_TK,
                     const Tensor& w_gate_up_E2FD, const Tensor& w_down_EDF, Tensor& y_TD);
void experts_ref_bwd(const Tensor& dy_TD, const Tensor& x_TD, const Tensor& topk_idx_TK, const Tensor& topk_w_TK,
                     const Tensor& w_gate_up_E2FD, const Tensor& w_down_EDF, Tensor& dx_TD, Tensor& dtopk_w_TK,
                     Tensor& dw_gate_up_E2FD, Tensor& dw_down_EDF);
double cross_entropy_fwd(const Tensor& logits_TV, const Tensor& labels_T, Tensor& lse_T, int64_t* n_valid);
void cross_entropy_bwd(const Tensor& logits_TV, const Tensor& labels_T, const Tensor& lse_T, float scale,
                       Tensor& dlogits_TV);
void adamw_step(Tensor& p, const Tensor& g, Tensor& m, Tensor& v, const AdamWHyper& h, float grad_scale);
double sum_squares(const Tensor& x);
void scale_(Tensor& x, float s);
void add_(Tensor& y, const Tensor& x, float alpha);
bool all_finite(const Tensor& x);

}  // namespace mt::cpu
