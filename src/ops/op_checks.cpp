// The dispatch's shared argument checks (op_checks.h).
#include "ops/op_checks.h"

#include <array>
#include <cmath>
#include <limits>

namespace mt::ops {

void check_adamw_step(const Tensor& p, const Tensor& g, const Tensor& m, const Tensor& v, const AdamWHyper& h,
                      float /*grad_scale: any value*/, const Tensor* p_compute) {
  check_shape(g, p.shape(), "adamw_step g");
  check_shape(m, p.shape(), "adamw_step m");
  check_shape(v, p.shape(), "adamw_step v");
  if (p_compute) check_shape(*p_compute, p.shape(), "adamw_step p_compute");
  if (h.step < 1) MT_THROW("adamw_step: step (", h.step, ") must be >= 1 (1-based count after this update)");
  if (!(h.lr >= 0.0f)) MT_THROW("adamw_step: lr (", h.lr, ") must be >= 0");
  if (!(h.beta1 >= 0.0f && h.beta1 < 1.0f)) MT_THROW("adamw_step: beta1 (", h.beta1, ") must be in [0, 1)");
  if (!(h.beta2 >= 0.0f && h.beta2 < 1.0f)) MT_THROW("adamw_step: beta2 (", h.beta2, ") must be in [0, 1)");
  if (!(h.eps >= 0.0f)) MT_THROW("adamw_step: eps (", h.eps, ") must be >= 0");
  if (!(h.weight_decay >= 0.0f)) MT_THROW("adamw_step: weight_decay (", h.weight_decay, ") must be >= 0");
}

namespace {

// "<what> must be 2-D, got f32[6] cpu"
void check_2d(const Tensor& t, const char* what) {
  MT_CHECK(t.dim() == 2, what, " must be 2-D, got ", t.desc());
}

void check_1d(const Tensor& t, const char* what) {
  MT_CHECK(t.dim() == 1, what, " must be 1-D, got ", t.desc());
}

void check_n_rows(int64_t N, const char* op) {
  if (N < 1) MT_THROW(op, ": pooled router row count N (", N, ") must be at least 1");
}

}  // namespace

// ---- router, load balancing ----

void check_router_fwd(const Tensor& logits_TE, int64_t K, bool /*norm_topk*/, const Tensor& probs_TE,
                      const Tensor& topk_idx_TK, const Tensor& topk_w_TK, const Tensor* bias_E) {
  check_2d(logits_TE, "router_fwd logits_TE");
  const int64_t T = logits_TE.size(0), E = logits_TE.size(1);
  if (K < 1 || K > E) MT_THROW("router_fwd: top-k K (", K, ") must be in [1, E] where E (", E, ") is the expert count");
  check_shape(probs_TE, {T, E}, "router_fwd probs_TE");
  check_shape(topk_idx_TK, {T, K}, "router_fwd topk_idx_TK");
  check_shape(topk_w_TK, {T, K}, "router_fwd topk_w_TK");
  if (bias_E) check_shape(*bias_E, {E}, "router_fwd bias_E");
}

void check_router_bwd(const Tensor& dtopk_w_TK, const Tensor* dprobs_TE, const Tensor& probs_TE,
                      const Tensor& topk_idx_TK, bool /*norm_topk*/, const Tensor& dlogits_TE) {
  check_2d(probs_TE, "router_bwd probs_TE");
  check_2d(dtopk_w_TK, "router_bwd dtopk_w_TK");
  const int64_t T = probs_TE.size(0), E = probs_TE.size(1), K = dtopk_w_TK.size(1);
  check_shape(dtopk_w_TK, {T, K}, "router_bwd dtopk_w_TK");
  check_shape(topk_idx_TK, {T, K}, "router_bwd topk_idx_TK");
  if (dprobs_TE) check_shape(*dprobs_TE, {T, E}, "router_bwd dprobs_TE");
  check_shape(dlogits_TE, {T, E}, "router_bwd dlogits_TE");
}

void check_expert_counts(const Tensor& topk_idx_TK, int64_t E, const Tensor& counts_E) {
  check_2d(topk_idx_TK, "expert_counts topk_idx_TK");
  if (E < 1) MT_THROW("expert_counts: expert count E (", E, ") must be at least 1");
  check_shape(counts_E, {E}, "expert_counts counts_E");
}

void check_prob_column_sums(const Tensor& probs_TE, const Tensor& sums_E) {
  check_2d(probs_TE, "prob_column_sums probs_TE");
  check_shape(sums_E, {probs_TE.size(1)}, "prob_column_sums sums_E");
}

void check_aux_loss_value(const Tensor& counts_E, const Tensor& sums_E, int64_t N) {
  check_1d(counts_E, "aux_loss_value counts_E");
  check_shape(sums_E, {counts_E.size(0)}, "aux_loss_value sums_E");
  check_n_rows(N, "aux_loss_value");
}

void check_aux_loss_bwd(const Tensor& counts_E, int64_t N, float /*dloss: any value*/, const Tensor& dprobs_TE) {
  check_1d(counts_E, "aux_loss_bwd counts_E");
  check_2d(dprobs_TE, "aux_loss_bwd dprobs_TE");
  check_shape(dprobs_TE, {dprobs_TE.size(0), counts_E.size(0)}, "aux_loss_bwd dprobs_TE");
  check_n_rows(N, "aux_loss_bwd");
}

void check_router_z_loss_fwd(const Tensor& logits_TE, const Tensor& lse_T, const Tensor& zsum) {
  check_2d(logits_TE, "router_z_loss_fwd logits_TE");
  check_shape(lse_T, {logits_TE.size(0)}, "router_z_loss_fwd lse_T");
  check_shape(zsum, {1}, "router_z_loss_fwd zsum");
}

void check_router_z_loss_bwd(const Tensor& lse_T, const Tensor& probs_TE, float /*scale: any value*/,
                             const Tensor& dlogits_TE) {
  check_2d(probs_TE, "router_z_loss_bwd probs_TE");
  const int64_t T = probs_TE.size(0), E = probs_TE.size(1);
  check_shape(lse_T, {T}, "router_z_loss_bwd lse_T");
  check_shape(dlogits_TE, {T, E}, "router_z_loss_bwd dlogits_TE");
}

void check_router_bias_update(const Tensor& counts_LE, float rate, const Tensor& bias_LE) {
  check_2d(counts_LE, "router_bias_update counts_LE");
  check_shape(bias_LE, counts_LE.shape(), "router_bias_update bias_LE");
  if (!std::isfinite(rate)) MT_THROW("router_bias_update: rate (", rate, ") must be finite");
}

// ---- token permutation by expert ----

void check_make_dispatch_plan(const Tensor& topk_idx_TK, int64_t E, const Tensor& offsets_E1,
                              const Tensor& assign_of_row_R, const Tensor& row_of_assign_TK) {
  check_2d(topk_idx_TK, "make_dispatch_plan topk_idx_TK");
  if (E < 1) MT_THROW("make_dispatch_plan: expert count E (", E, ") must be at least 1");
  const int64_t T = topk_idx_TK.size(0), K = topk_idx_TK.size(1), R = T * K;
  if (R > std::numeric_limits<int32_t>::max())
    MT_THROW("make_dispatch_plan: T*K (", T, "*", K, " = ", R, ") dispatched rows exceed the i32 row index range");
  check_shape(offsets_E1, {E + 1}, "make_dispatch_plan offsets_E1");
  check_shape(assign_of_row_R, {R}, "make_dispatch_plan assign_of_row_R");
  check_shape(row_of_assign_TK, {T, K}, "make_dispatch_plan row_of_assign_TK");
}

void check_permute_fwd(const Tensor& x_TD, const Tensor& assign_of_row_R, int64_t K, const Tensor& xp_RD) {
  check_2d(x_TD, "permute_fwd x_TD");
  check_1d(assign_of_row_R, "permute_fwd assign_of_row_R");
  if (K < 1) MT_THROW("permute_fwd: K (", K, ") must be at least 1");
  check_shape(xp_RD, {assign_of_row_R.size(0), x_TD.size(1)}, "permute_fwd xp_RD");
}

void check_permute_bwd(const Tensor& dxp_RD, const Tensor& assign_of_row_R, int64_t K, const Tensor& dx_TD) {
  check_2d(dxp_RD, "permute_bwd dxp_RD");
  if (K < 1) MT_THROW("permute_bwd: K (", K, ") must be at least 1");
  check_2d(dx_TD, "permute_bwd dx_TD");
  const int64_t R = dxp_RD.size(0), D = dxp_RD.size(1), T = dx_TD.size(0);
  check_shape(assign_of_row_R, {R}, "permute_bwd assign_of_row_R");
  check_shape(dx_TD, {T, D}, "permute_bwd dx_TD");
}

void check_unpermute_fwd(const Tensor& yp_RD, const Tensor& row_of_assign_TK, const Tensor& w_TK, const Tensor& y_TD) {
  check_2d(yp_RD, "unpermute_fwd yp_RD");
  check_2d(row_of_assign_TK, "unpermute_fwd row_of_assign_TK");
  const int64_t D = yp_RD.size(1), T = row_of_assign_TK.size(0), K = row_of_assign_TK.size(1);
  check_shape(w_TK, {T, K}, "unpermute_fwd w_TK");
  check_shape(y_TD, {T, D}, "unpermute_fwd y_TD");
}

void check_unpermute_bwd(const Tensor& dy_TD, const Tensor& yp_RD, const Tensor& row_of_assign_TK, const Tensor& w_TK,
                         const Tensor& dyp_RD, const Tensor& dw_TK) {
  // Either half may be skipped: yp_RD undefined = no dot products, dyp_RD undefined = no rows written.
  const bool rows = dyp_RD.defined(), dots = yp_RD.defined();
  MT_CHECK(rows || dots, "unpermute_bwd: neither dyp_RD nor yp_RD given");
  check_2d(dy_TD, "unpermute_bwd dy_TD");
  check_2d(row_of_assign_TK, "unpermute_bwd row_of_assign_TK");
  const Tensor& rd = dots ? yp_RD : dyp_RD;
  const char* rd_name = dots ? "unpermute_bwd yp_RD" : "unpermute_bwd dyp_RD";
  check_2d(rd, rd_name);
  const int64_t T = dy_TD.size(0), D = dy_TD.size(1), R = rd.size(0), K = row_of_assign_TK.size(1);
  check_shape(rd, {R, D}, rd_name);
  check_shape(row_of_assign_TK, {T, K}, "unpermute_bwd row_of_assign_TK");
  check_shape(w_TK, {T, K}, "unpermute_bwd w_TK");
  if (rows) check_shape(dyp_RD, {R, D}, "unpermute_bwd dyp_RD");
  if (dots) check_shape(dw_TK, {T, K}, "unpermute_bwd dw_TK");
}

void check_permute_weighted_fwd(const Tensor& x_TD, const Tensor& row_of_assign_TK, const Tensor& w_TK,
                                const Tensor& xp_RD) {
  check_2d(x_TD, "permute_weighted_fwd x_TD");
  check_2d(row_of_assign_TK, "permute_weighted_fwd row_of_assign_TK");
  check_2d(xp_RD, "permute_weighted_fwd xp_RD");
  const int64_t T = x_TD.size(0), D = x_TD.size(1), K = row_of_assign_TK.size(1);
  check_shape(xp_RD, {xp_RD.size(0), D}, "permute_weighted_fwd xp_RD");
  check_shape(row_of_assign_TK, {T, K}, "permute_weighted_fwd row_of_assign_TK");
  check_shape(w_TK, {T, K}, "permute_weighted_fwd w_TK");
}

void check_permute_weighted_bwd(const Tensor& dxp_RD, const Tensor& x_TD, const Tensor& row_of_assign_TK,
                                const Tensor& w_TK, const Tensor& dx_TD, const Tensor& dw_TK) {
  check_2d(dxp_RD, "permute_weighted_bwd dxp_RD");
  check_2d(x_TD, "permute_weighted_bwd x_TD");
  check_2d(row_of_assign_TK, "permute_weighted_bwd row_of_assign_TK");
  const int64_t T = x_TD.size(0), D = x_TD.size(1), K = row_of_assign_TK.size(1);
  check_shape(dxp_RD, {dxp_RD.size(0), D}, "permute_weighted_bwd dxp_RD");
  check_shape(row_of_assign_TK, {T, K}, "permute_weighted_bwd row_of_assign_TK");
  check_shape(w_TK, {T, K}, "permute_weighted_bwd w_TK");
  check_shape(dx_TD, {T, D}, "permute_weighted_bwd dx_TD");
  check_shape(dw_TK, {T, K}, "permute_weighted_bwd dw_TK");
}

// ---- experts ----

namespace {

struct ExpertDims {
  int64_t E, F, D;
};

// w_gate_up_E2FD [E, 2F, D] and w_down_EDF [E, D, F]; returns {E, F, D}.
ExpertDims check_expert_weights(const Tensor& w_gate_up_E2FD, const Tensor& w_down_EDF, const char* op) {
  MT_CHECK(w_gate_up_E2FD.dim() == 3 && w_gate_up_E2FD.size(1) % 2 == 0, op,
           ": w_gate_up_E2FD must be [E, 2F, D], got ", w_gate_up_E2FD.desc());
  const ExpertDims d{w_gate_up_E2FD.size(0), w_gate_up_E2FD.size(1) / 2, w_gate_up_E2FD.size(2)};
  check_shape(w_down_EDF, {d.E, d.D, d.F}, str(op, " w_down_EDF").c_str());
  return d;
}

// The grouped form's per-row tensors: xp_RD 2-D [R, D], gu_R2F [R, 2F], h_RF [R, F] and offsets_E1 [E+1];
// returns R.
int64_t check_expert_rows(const Tensor& xp_RD, const Tensor& offsets_E1, const ExpertDims& d, const Tensor& gu_R2F,
                          const Tensor& h_RF, const char* op) {
  check_2d(xp_RD, str(op, " xp_RD").c_str());
  const int64_t R = xp_RD.size(0);
  check_shape(xp_RD, {R, d.D}, str(op, " xp_RD").c_str());
  check_shape(gu_R2F, {R, 2 * d.F}, str(op, " gu_R2F").c_str());
  check_shape(h_RF, {R, d.F}, str(op, " h_RF").c_str());
  check_shape(offsets_E1, {d.E + 1}, str(op, " offsets_E1").c_str());
  return R;
}

// The reference form's token tensors: x_TD 2-D [T, D], topk_idx_TK 2-D [T, K], topk_w_TK [T, K]; returns {T, K}.
std::array<int64_t, 2> check_expert_tokens(const Tensor& x_TD, const Tensor& topk_idx_TK, const Tensor& topk_w_TK,
                                           const ExpertDims& d, const char* op) {
  check_2d(x_TD, str(op, " x_TD").c_str());
  const int64_t T = x_TD.size(0);
  check_shape(x_TD, {T, d.D}, str(op, " x_TD").c_str());
  MT_CHECK(topk_idx_TK.dim() == 2 && topk_idx_TK.size(0) == T, op, ": topk_idx_TK must be [T, K] with T = ", T,
           ", got ", topk_idx_TK.desc());
  const int64_t K = topk_idx_TK.size(1);
  check_shape(topk_w_TK, {T, K}, str(op, " topk_w_TK").c_str());
  return {T, K};
}

}  // namespace

void check_experts_fwd(const Tensor& xp_RD, const Tensor& offsets_E1, const Tensor& w_gate_up_E2FD,
                       const Tensor& w_down_EDF, const Tensor& gu_R2F, const Tensor& h_RF, const Tensor& yp_RD) {
  const char* op = "experts_fwd";
  const ExpertDims d = check_expert_weights(w_gate_up_E2FD, w_down_EDF, op);
  const int64_t R = check_expert_rows(xp_RD, offsets_E1, d, gu_R2F, h_RF, op);
  check_shape(yp_RD, {R, d.D}, "experts_fwd yp_RD");
}

void check_experts_bwd(const Tensor& dyp_RD, const Tensor& xp_RD, const Tensor& offsets_E1,
                       const Tensor& w_gate_up_E2FD, const Tensor& w_down_EDF, const Tensor& gu_R2F, const Tensor& h_RF,
                       const Tensor& dxp_RD, const Tensor& dw_gate_up_E2FD, const Tensor& dw_down_EDF,
                       bool /*accumulate_dw*/, const std::function<void()>& /*after_dx: may be empty*/) {
  const char* op = "experts_bwd";
  const ExpertDims d = check_expert_weights(w_gate_up_E2FD, w_down_EDF, op);
  const int64_t R = check_expert_rows(xp_RD, offsets_E1, d, gu_R2F, h_RF, op);
  check_shape(dyp_RD, {R, d.D}, "experts_bwd dyp_RD");
  check_shape(dxp_RD, {R, d.D}, "experts_bwd dxp_RD");
  check_shape(dw_gate_up_E2FD, w_gate_up_E2FD.shape(), "experts_bwd dw_gate_up_E2FD");
  check_shape(dw_down_EDF, w_down_EDF.shape(), "experts_bwd dw_down_EDF");
}

namespace {

// The grouped linear layers' shapes: x_RK 2-D, w_ENK [E, N, K], offsets_E1 [E + 1]; returns {R, N, K}.
std::array<int64_t, 3> check_grouped_linear(const Tensor& x_RK, const Tensor& offsets_E1, const Tensor& w_ENK,
                                            const char* op) {
  check_2d(x_RK, str(op, " x_RK").c_str());
  MT_CHECK(w_ENK.dim() == 3, op, " w_ENK must be 3-D [E, N, K], got shape ", shape_str(w_ENK.shape()));
  const int64_t E = w_ENK.size(0), N = w_ENK.size(1), K = w_ENK.size(2), R = x_RK.size(0);
  check_shape(x_RK, {R, K}, str(op, " x_RK").c_str());
  check_shape(offsets_E1, {E + 1}, str(op, " offsets_E1").c_str());
  return {R, N, K};
}

}  // namespace

void check_grouped_linear_fwd(const Tensor& x_RK, const Tensor& offsets_E1, const Tensor& w_ENK, float /*alpha*/,
                              const Tensor& y_RN, bool /*accumulate*/) {
  const auto [R, N, K] = check_grouped_linear(x_RK, offsets_E1, w_ENK, "grouped_linear_fwd");
  check_shape(y_RN, {R, N}, "grouped_linear_fwd y_RN");
}

void check_grouped_linear_bwd(const Tensor& dy_RN, const Tensor& x_RK, const Tensor& offsets_E1, const Tensor& w_ENK,
                              float /*alpha*/, const Tensor* dx_RK, bool /*accumulate_dx*/, const Tensor& dw_ENK) {
  const auto [R, N, K] = check_grouped_linear(x_RK, offsets_E1, w_ENK, "grouped_linear_bwd");
  check_shape(dy_RN, {R, N}, "grouped_linear_bwd dy_RN");
  if (dx_RK) check_shape(*dx_RK, {R, K}, "grouped_linear_bwd dx_RK");
  if (dw_ENK.defined()) check_shape(dw_ENK, w_ENK.shape(), "grouped_linear_bwd dw_ENK");
}

void check_experts_ref_fwd(const Tensor& x_TD, const Tensor& topk_idx_TK, const Tensor& topk_w_TK,
                           const Tensor& w_gate_up_E2FD, const Tensor& w_down_EDF, const Tensor& y_TD) {
  const char* op = "experts_ref_fwd";
  const ExpertDims d = check_expert_weights(w_gate_up_E2FD, w_down_EDF, op);
  const int64_t T = check_expert_tokens(x_TD, topk_idx_TK, topk_w_TK, d, op)[0];
  check_shape(y_TD, {T, d.D}, "experts_ref_fwd y_TD");
}

void check_experts_ref_bwd(const Tensor& dy_TD, const Tensor& x_TD, const Tensor& topk_idx_TK, const Tensor& topk_w_TK,
                           const Tensor& w_gate_up_E2FD, const Tensor& w_down_EDF, const Tensor& dx_TD,
                           const Tensor& dtopk_w_TK, const Tensor& dw_gate_up_E2FD, const Tensor& dw_down_EDF,
                           bool /*accumulate_dw*/) {
  const char* op = "experts_ref_bwd";
  const ExpertDims d = check_expert_weights(w_gate_up_E2FD, w_down_EDF, op);
  const auto [T, K] = check_expert_tokens(x_TD, topk_idx_TK, topk_w_TK, d, op);
  check_shape(dy_TD, {T, d.D}, "experts_ref_bwd dy_TD");
  check_shape(dx_TD, {T, d.D}, "experts_ref_bwd dx_TD");
  check_shape(dtopk_w_TK, {T, K}, "experts_ref_bwd dtopk_w_TK");
  check_shape(dw_gate_up_E2FD, w_gate_up_E2FD.shape(), "experts_ref_bwd dw_gate_up_E2FD");
  check_shape(dw_down_EDF, w_down_EDF.shape(), "experts_ref_bwd dw_down_EDF");
}

// ---- cross-entropy and the LM head ----

namespace {

// logits_TV 2-D, labels_T and lse_T [T].
void check_ce_shapes(const Tensor& logits_TV, const Tensor& labels_T, const Tensor& lse_T, const char* op) {
  if (logits_TV.dim() != 2) MT_THROW(op, " logits_TV must be 2-D [T, V], got shape ", shape_str(logits_TV.shape()));
  const int64_t T = logits_TV.size(0);
  check_shape(labels_T, {T}, str(op, " labels_T").c_str());
  check_shape(lse_T, {T}, str(op, " lse_T").c_str());
}

// hn_TD 2-D [T, D], w_VD [V, D] with V > 0 unless T == 0, labels_T [T]; returns {T, D, V}.
std::array<int64_t, 3> check_lm_head_shapes(const Tensor& hn_TD, const Tensor& w_VD, const Tensor& labels_T,
                                            const char* op) {
  if (hn_TD.dim() != 2) MT_THROW(op, " hn_TD must be 2-D [T, D], got shape ", shape_str(hn_TD.shape()));
  if (w_VD.dim() != 2) MT_THROW(op, " w_VD must be 2-D [V, D], got shape ", shape_str(w_VD.shape()));
  const int64_t T = hn_TD.size(0), D = hn_TD.size(1), V = w_VD.size(0);
  check_shape(w_VD, {V, D}, str(op, " w_VD").c_str());
  check_shape(labels_T, {T}, str(op, " labels_T").c_str());
  if (V == 0 && T > 0) MT_THROW(op, ": vocabulary size V is 0 (w_VD has shape ", shape_str(w_VD.shape()), ")");
  return {T, D, V};
}

}  // namespace

void check_cross_entropy_fwd(const Tensor& logits_TV, const Tensor& labels_T, const Tensor& lse_T,
                             int64_t* /*n_valid: may be null*/) {
  check_ce_shapes(logits_TV, labels_T, lse_T, "cross_entropy_fwd");
  if (logits_TV.size(1) == 0 && logits_TV.size(0) > 0) MT_THROW("cross_entropy_fwd: vocabulary size V is 0");
}

void check_cross_entropy_bwd(const Tensor& logits_TV, const Tensor& labels_T, const Tensor& lse_T,
                             float /*scale: any value*/, const Tensor& dlogits_TV) {
  check_ce_shapes(logits_TV, labels_T, lse_T, "cross_entropy_bwd");
  check_shape(dlogits_TV, logits_TV.shape(), "cross_entropy_bwd dlogits_TV");
}

void check_lm_head_cross_entropy(const Tensor& hn_TD, const Tensor& w_VD, const Tensor& labels_T,
                                 float /*scale: any value*/, int64_t /*chunk_rows: <= 0 = backend's choice*/,
                                 const Tensor& loss_sum, const Tensor& dhn_TD, const Tensor& dw_VD,
                                 bool /*accumulate_dw*/) {
  const char* op = "lm_head_cross_entropy";
  const auto [T, D, V] = check_lm_head_shapes(hn_TD, w_VD, labels_T, op);
  check_shape(loss_sum, {1}, "lm_head_cross_entropy loss_sum");
  check_shape(dhn_TD, {T, D}, "lm_head_cross_entropy dhn_TD");
  check_shape(dw_VD, {V, D}, "lm_head_cross_entropy dw_VD");
}

void check_lm_head_logprobs(const Tensor& hn_TD, const Tensor& w_VD, const Tensor& labels_T,
                            int64_t /*chunk_rows: <= 0 = backend's choice*/, const Tensor& logp_T,
                            const Tensor* entropy_T) {
  const char* op = "lm_head_logprobs";
  const int64_t T = check_lm_head_shapes(hn_TD, w_VD, labels_T, op)[0];
  check_shape(logp_T, {T}, "lm_head_logprobs logp_T");
  if (entropy_T) check_shape(*entropy_T, {T}, "lm_head_logprobs entropy_T");
}

void check_lm_head_objective_bwd(const Tensor& hn_TD, const Tensor& w_VD, const Tensor& labels_T, const Tensor& dlogp_T,
                                 const Tensor* dentropy_T, int64_t /*chunk_rows: <= 0 = backend's choice*/,
                                 const Tensor& dhn_TD, const Tensor& dw_VD, bool /*accumulate_dw*/) {
  const char* op = "lm_head_objective_bwd";
  const auto [T, D, V] = check_lm_head_shapes(hn_TD, w_VD, labels_T, op);
  check_shape(dlogp_T, {T}, "lm_head_objective_bwd dlogp_T");
  if (dentropy_T) check_shape(*dentropy_T, {T}, "lm_head_objective_bwd dentropy_T");
  check_shape(dhn_TD, {T, D}, "lm_head_objective_bwd dhn_TD");
  check_shape(dw_VD, {V, D}, "lm_head_objective_bwd dw_VD");
}

void check_kv_cache_write(const Tensor& k_NGD, const Tensor& v_NGD, const Tensor& slot_N, const Tensor& k_cache_SGD,
                          const Tensor& v_cache_SGD) {
  MT_CHECK(k_NGD.dim() == 3, "kv_cache_write k_NGD must be [N, G, Hd], got ", k_NGD.desc());
  const int64_t N = k_NGD.size(0), G = k_NGD.size(1), Hd = k_NGD.size(2);
  check_shape(v_NGD, {N, G, Hd}, "kv_cache_write v_NGD");
  check_shape(slot_N, {N}, "kv_cache_write slot_N");
  MT_CHECK(k_cache_SGD.dim() == 3 && k_cache_SGD.size(1) == G && k_cache_SGD.size(2) == Hd, "kv_cache_write k_cache_SGD ",
           k_cache_SGD.desc(), " must be [slots, ", G, ", ", Hd, "]");
  check_shape(v_cache_SGD, k_cache_SGD.shape(), "kv_cache_write v_cache_SGD");
}

void check_paged_attention_fwd(const Tensor& q_NHD, const Tensor& k_cache_SGD, const Tensor& v_cache_SGD,
                               const Tensor& block_table_BM, int64_t block_size, const Tensor& seq_N,
                               const Tensor& pos_N, const Tensor& out_NHD) {
  MT_CHECK(q_NHD.dim() == 3, "paged_attention_fwd q_NHD must be [N, H, Hd], got ", q_NHD.desc());
  const int64_t N = q_NHD.size(0), H = q_NHD.size(1), Hd = q_NHD.size(2);
  MT_CHECK(k_cache_SGD.dim() == 3 && k_cache_SGD.size(2) == Hd, "paged_attention_fwd k_cache_SGD ", k_cache_SGD.desc(),
           " must be [slots, G, ", Hd, "]");
  const int64_t G = k_cache_SGD.size(1);
  MT_CHECK(G > 0 && H % G == 0, "paged_attention_fwd: ", H, " query heads do not divide into ", G, " kv heads");
  check_shape(v_cache_SGD, k_cache_SGD.shape(), "paged_attention_fwd v_cache_SGD");
  MT_CHECK(block_table_BM.dim() == 2, "paged_attention_fwd block_table_BM must be [sequences, blocks], got ",
           block_table_BM.desc());
  MT_CHECK(block_size >= 1, "paged_attention_fwd block_size ", block_size, " must be >= 1");
  check_shape(seq_N, {N}, "paged_attention_fwd seq_N");
  check_shape(pos_N, {N}, "paged_attention_fwd pos_N");
  check_shape(out_NHD, {N, H, Hd}, "paged_attention_fwd out_NHD");
}

void check_sample_tokens(const Tensor& logits_RV, const Tensor& rows_R5, const Tensor& tokens_R,
                         const Tensor& logprobs_R) {
  MT_CHECK(logits_RV.dim() == 2, "sample_tokens logits_RV must be [R, V], got ", logits_RV.desc());
  const int64_t R = logits_RV.size(0);
  MT_CHECK(R == 0 || logits_RV.size(1) > 0, "sample_tokens: ", R, " rows of 0 logits; the vocabulary must hold a token");
  check_shape(rows_R5, {R, 5}, "sample_tokens rows_R5");
  check_shape(tokens_R, {R}, "sample_tokens tokens_R");
  check_shape(logprobs_R, {R}, "sample_tokens logprobs_R");
}

namespace {
void check_cols(const char* op, const Tensor& wide, const Tensor& narrow, int64_t col0) {
  if (wide.dim() != 2 || narrow.dim() != 2)
    MT_THROW(op, ": both tensors must be 2-D, got ", wide.desc(), " and ", narrow.desc());
  if (wide.size(0) != narrow.size(0))
    MT_THROW(op, ": the tensors have ", wide.size(0), " and ", narrow.size(0), " rows (", wide.desc(), ", ",
             narrow.desc(), ")");
  if (col0 < 0 || col0 + narrow.size(1) > wide.size(1))
    MT_THROW(op, ": columns [", col0, ", ", col0 + narrow.size(1), ") do not lie in the ", wide.size(1),
             " columns of ", wide.desc());
}
}  // namespace

void check_add_cols_(const Tensor& y_TO, const Tensor& x_TC, int64_t col0, float /*alpha: any value*/) {
  check_cols("add_cols_", y_TO, x_TC, col0);
}

void check_copy_cols(const Tensor& x_TO, int64_t col0, const Tensor& y_TC) { check_cols("copy_cols", x_TO, y_TC, col0); }

}  // namespace mt::ops
