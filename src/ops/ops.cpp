// Op dispatch: every op checks that its tensors share one device and runs that backend's version.
// The CUDA backend lands with P2; until then a CUDA tensor reaching an op is a clear error.
#include "ops/ops.h"

#include "backend/cpu/cpu_ops.h"

namespace mt::ops {

static void route(const char* op, std::initializer_list<const Tensor*> ts) {
  check_same_device(ts, op);
  for (const Tensor* t : ts)
    if (t && t->numel() > 0 && t->device() != Device::CPU)
      MT_THROW("op ", op, " has no implementation for device ", device_name(t->device()), " yet (tensor ", t->desc(),
               ")");
}

void linear_fwd(const Tensor& x_TI, const Tensor& w_OI, Tensor& y_TO) {
  route("linear_fwd", {&x_TI, &w_OI, &y_TO});
  return cpu::linear_fwd(x_TI, w_OI, y_TO);
}

void linear_bwd(const Tensor& dy_TO, const Tensor& x_TI, const Tensor& w_OI, Tensor* dx_TI, bool accumulate_dx,
                Tensor& dw_OI) {
  route("linear_bwd", {&dy_TO, &x_TI, &w_OI, dx_TI, &dw_OI});
  return cpu::linear_bwd(dy_TO, x_TI, w_OI, dx_TI, accumulate_dx, dw_OI);
}

void embedding_fwd(const Tensor& ids_T, const Tensor& table_VD, Tensor& out_TD) {
  route("embedding_fwd", {&ids_T, &table_VD, &out_TD});
  return cpu::embedding_fwd(ids_T, table_VD, out_TD);
}

void embedding_bwd(const Tensor& ids_T, const Tensor& dout_TD, Tensor& dtable_VD) {
  route("embedding_bwd", {&ids_T, &dout_TD, &dtable_VD});
  return cpu::embedding_bwd(ids_T, dout_TD, dtable_VD);
}

void rms_norm_fwd(const Tensor& x_ND, const Tensor& w_D, float eps, Tensor& y_ND, Tensor& rstd_N) {
  route("rms_norm_fwd", {&x_ND, &w_D, &y_ND, &rstd_N});
  return cpu::rms_norm_fwd(x_ND, w_D, eps, y_ND, rstd_N);
}

void rms_norm_bwd(const Tensor& dy_ND, const Tensor& x_ND, const Tensor& w_D, const Tensor& rstd_N, Tensor& dx_ND,
                  Tensor& dw_D) {
  route("rms_norm_bwd", {&dy_ND, &x_ND, &w_D, &rstd_N, &dx_ND, &dw_D});
  return cpu::rms_norm_bwd(dy_ND, x_ND, w_D, rstd_N, dx_ND, dw_D);
}

void rope_fwd(Tensor& x_TNHd, const Tensor& pos_T, float theta) {
  route("rope_fwd", {&x_TNHd, &pos_T});
  return cpu::rope_fwd(x_TNHd, pos_T, theta);
}

void rope_bwd(Tensor& dx_TNHd, const Tensor& pos_T, float theta) {
  route("rope_bwd", {&dx_TNHd, &pos_T});
  return cpu::rope_bwd(dx_TNHd, pos_T, theta);
}

void attention_fwd(const Tensor& q_THHd, const Tensor& k_TGHd, const Tensor& v_TGHd, int64_t B, int64_t S,
                   Tensor& out_THHd, Tensor& lse_TH) {
  route("attention_fwd", {&q_THHd, &k_TGHd, &v_TGHd, &out_THHd, &lse_TH});
  return cpu::attention_fwd(q_THHd, k_TGHd, v_TGHd, B, S, out_THHd, lse_TH);
}

void attention_bwd(const Tensor& dout_THHd, const Tensor& q_THHd, const Tensor& k_TGHd, const Tensor& v_TGHd,
                   const Tensor& out_THHd, const Tensor& lse_TH, int64_t B, int64_t S, Tensor& dq_THHd, Tensor& dk_TGHd,
                   Tensor& dv_TGHd) {
  route("attention_bwd", {&dout_THHd, &q_THHd, &k_TGHd, &v_TGHd, &out_THHd, &lse_TH, &dq_THHd, &dk_TGHd, &dv_TGHd});
  return cpu::attention_bwd(dout_THHd, q_THHd, k_TGHd, v_TGHd, out_THHd, lse_TH, B, S, dq_THHd, dk_TGHd, dv_TGHd);
}

void router_fwd(const Tensor& logits_TE, int64_t K, bool norm_topk, Tensor& probs_TE, Tensor& topk_idx_TK,
                Tensor& topk_w_TK) {
  route("router_fwd", {&logits_TE, &probs_TE, &topk_idx_TK, &topk_w_TK});
  return cpu::router_fwd(logits_TE, K, norm_topk, probs_TE, topk_idx_TK, topk_w_TK);
}

void router_bwd(const Tensor& dtopk_w_TK, const Tensor* dprobs_TE, const Tensor& probs_TE, const Tensor& topk_idx_TK,
                bool norm_topk, Tensor& dlogits_TE) {
  route("router_bwd", {&dtopk_w_TK, dprobs_TE, &probs_TE, &topk_idx_TK, &dlogits_TE});
  return cpu::router_bwd(dtopk_w_TK, dprobs_TE, probs_TE, topk_idx_TK, norm_topk, dlogits_TE);
}

void expert_counts(const Tensor& topk_idx_TK, int64_t E, Tensor& counts_E) {
  route("expert_counts", {&topk_idx_TK, &counts_E});
  return cpu::expert_counts(topk_idx_TK, E, counts_E);
}

void prob_column_sums(const Tensor& probs_TE, Tensor& sums_E) {
  route("prob_column_sums", {&probs_TE, &sums_E});
  return cpu::prob_column_sums(probs_TE, sums_E);
}

double aux_loss_value(const Tensor& counts_E, const Tensor& sums_E, int64_t N) {
  route("aux_loss_value", {&counts_E, &sums_E});
  return cpu::aux_loss_value(counts_E, sums_E, N);
}

void aux_loss_bwd(const Tensor& counts_E, int64_t N, float dloss, Tensor& dprobs_TE) {
  route("aux_loss_bwd", {&counts_E, &dprobs_TE});
  return cpu::aux_loss_bwd(counts_E, N, dloss, dprobs_TE);
}

void make_dispatch_plan(const Tensor& topk_idx_TK, int64_t E, Tensor& offsets_E1, Tensor& assign_of_row_R,
                        Tensor& row_of_assign_TK) {
  route("make_dispatch_plan", {&topk_idx_TK, &offsets_E1, &assign_of_row_R, &row_of_assign_TK});
  return cpu::make_dispatch_plan(topk_idx_TK, E, offsets_E1, assign_of_row_R, row_of_assign_TK);
}

void permute_fwd(const Tensor& x_TD, const Tensor& assign_of_row_R, int64_t K, Tensor& xp_RD) {
  route("permute_fwd", {&x_TD, &assign_of_row_R, &xp_RD});
  return cpu::permute_fwd(x_TD, assign_of_row_R, K, xp_RD);
}

void permute_bwd(const Tensor& dxp_RD, const Tensor& assign_of_row_R, int64_t K, Tensor& dx_TD) {
  route("permute_bwd", {&dxp_RD, &assign_of_row_R, &dx_TD});
  return cpu::permute_bwd(dxp_RD, assign_of_row_R, K, dx_TD);
}

void unpermute_fwd(const Tensor& yp_RD, const Tensor& row_of_assign_TK, const Tensor& w_TK, Tensor& y_TD) {
  route("unpermute_fwd", {&yp_RD, &row_of_assign_TK, &w_TK, &y_TD});
  return cpu::unpermute_fwd(yp_RD, row_of_assign_TK, w_TK, y_TD);
}

void unpermute_bwd(const Tensor& dy_TD, const Tensor& yp_RD, const Tensor& row_of_assign_TK, const Tensor& w_TK,
                   Tensor& dyp_RD, Tensor& dw_TK) {
  route("unpermute_bwd", {&dy_TD, &yp_RD, &row_of_assign_TK, &w_TK, &dyp_RD, &dw_TK});
  return cpu::unpermute_bwd(dy_TD, yp_RD, row_of_assign_TK, w_TK, dyp_RD, dw_TK);
}

void swiglu_fwd(const Tensor& gu_N2F, Tensor& h_NF) {
  route("swiglu_fwd", {&gu_N2F, &h_NF});
  return cpu::swiglu_fwd(gu_N2F, h_NF);
}

void swiglu_bwd(const Tensor& dh_NF, const Tensor& gu_N2F, Tensor& dgu_N2F) {
  route("swiglu_bwd", {&dh_NF, &gu_N2F, &dgu_N2F});
  return cpu::swiglu_bwd(dh_NF, gu_N2F, dgu_N2F);
}

void experts_fwd(const Tensor& xp_RD, const Tensor& offsets_E1, const Tensor& w_gate_up_E2FD, const Tensor& w_down_EDF,
                 Tensor& gu_R2F, Tensor& h_RF, Tensor& yp_RD) {
  route("experts_fwd", {&xp_RD, &offsets_E1, &w_gate_up_E2FD, &w_down_EDF, &gu_R2F, &h_RF, &yp_RD});
  return cpu::experts_fwd(xp_RD, offsets_E1, w_gate_up_E2FD, w_down_EDF, gu_R2F, h_RF, yp_RD);
}

void experts_bwd(const Tensor& dyp_RD, const Tensor& xp_RD, const Tensor& offsets_E1, const Tensor& w_gate_up_E2FD,
                 const Tensor& w_down_EDF, const Tensor& gu_R2F, const Tensor& h_RF, Tensor& dxp_RD,
                 Tensor& dw_gate_up_E2FD, Tensor& dw_down_EDF) {
  route("experts_bwd", {&dyp_RD, &xp_RD, &offsets_E1, &w_gate_up_E2FD, &w_down_EDF, &gu_R2F, &h_RF, &dxp_RD,
                        &dw_gate_up_E2FD, &dw_down_EDF});
  return cpu::experts_bwd(dyp_RD, xp_RD, offsets_E1, w_gate_up_E2FD, w_down_EDF, gu_R2F, h_RF, dxp_RD, dw_gate_up_E2FD,
                          dw_down_EDF);
}

void experts_ref_fwd(const Tensor& x_TD, const Tensor& topk_idx_TK, const Tensor& topk_w_TK,
                     const Tensor& w_gate_up_E2FD, const Tensor& w_down_EDF, Tensor& y_TD) {
  route("experts_ref_fwd", {&x_TD, &topk_idx_TK, &topk_w_TK, &w_gate_up_E2FD, &w_down_EDF, &y_TD});
  return cpu::experts_ref_fwd(x_TD, topk_idx_TK, topk_w_TK, w_gate_up_E2FD, w_down_EDF, y_TD);
}

void experts_ref_bwd(const Tensor& dy_TD, const Tensor& x_TD, const Tensor& topk_idx_TK, const Tensor& topk_w_TK,
                     const Tensor& w_gate_up_E2FD, const Tensor& w_down_EDF, Tensor& dx_TD, Tensor& dtopk_w_TK,
                     Tensor& dw_gate_up_E2FD, Tensor& dw_down_EDF) {
  route("experts_ref_bwd", {&dy_TD, &x_TD, &topk_idx_TK, &topk_w_TK, &w_gate_up_E2FD, &w_down_EDF, &dx_TD, &dtopk_w_TK,
                            &dw_gate_up_E2FD, &dw_down_EDF});
  return cpu::experts_ref_bwd(dy_TD, x_TD, topk_idx_TK, topk_w_TK, w_gate_up_E2FD, w_down_EDF, dx_TD, dtopk_w_TK,
                              dw_gate_up_E2FD, dw_down_EDF);
}

double cross_entropy_fwd(const Tensor& logits_TV, const Tensor& labels_T, Tensor& lse_T, int64_t* n_valid) {
  route("cross_entropy_fwd", {&logits_TV, &labels_T, &lse_T});
  return cpu::cross_entropy_fwd(logits_TV, labels_T, lse_T, n_valid);
}

void cross_entropy_bwd(const Tensor& logits_TV, const Tensor& labels_T, const Tensor& lse_T, float scale,
                       Tensor& dlogits_TV) {
  route("cross_entropy_bwd", {&logits_TV, &labels_T, &lse_T, &dlogits_TV});
  return cpu::cross_entropy_bwd(logits_TV, labels_T, lse_T, scale, dlogits_TV);
}

void adamw_step(Tensor& p, const Tensor& g, Tensor& m, Tensor& v, const AdamWHyper& h, float grad_scale) {
  route("adamw_step", {&p, &g, &m, &v});
  return cpu::adamw_step(p, g, m, v, h, grad_scale);
}

double sum_squares(const Tensor& x) {
  route("sum_squares", {&x});
  return cpu::sum_squares(x);
}

void scale_(Tensor& x, float s) {
  route("scale_", {&x});
  return cpu::scale_(x, s);
}

void add_(Tensor& y, const Tensor& x, float alpha) {
  route("add_", {&y, &x});
  return cpu::add_(y, x, alpha);
}

bool all_finite(const Tensor& x) {
  route("all_finite", {&x});
  return cpu::all_finite(x);
}

}  // namespace mt::ops
