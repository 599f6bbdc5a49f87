// Argument checks that every backend would otherwise repeat: what an op's contract in ops.h says about
// shapes and scalar arguments, whatever the device. The dispatch (ops.cpp) calls check_<op> with all of
// the op's arguments, after the device check and before the backend: tools/gen_op_dispatch.py emits
// that call for every check_<op> declared here. Dtype and device checks stay in the backends (they
// differ: CUDA takes bf16 where the CPU takes f32); so do checks that read tensor data. A backend
// called directly (tests) skips these checks. The attention shapes are shared differently: both
// backends call ops/attention_shapes.h, because the CUDA backend needs the dims it returns.
#pragma once
#include "ops/ops.h"

namespace mt::ops {

// g, m, v and p_compute (when given) have p's shape; the hyper-parameters are in their ranges.
void check_adamw_step(const Tensor& p, const Tensor& g, const Tensor& m, const Tensor& v, const AdamWHyper& h,
                      float grad_scale, const Tensor* p_compute);

// ---- router, load balancing ----
// logits_TE is 2-D [T, E]; K in [1, E]; probs_TE is [T, E], topk_idx_TK and topk_w_TK [T, K], bias_E (when given) [E].
void check_router_fwd(const Tensor& logits_TE, int64_t K, bool norm_topk, const Tensor& probs_TE,
                      const Tensor& topk_idx_TK, const Tensor& topk_w_TK, const Tensor* bias_E);
// probs_TE is 2-D [T, E], dtopk_w_TK 2-D [T, K], topk_idx_TK [T, K]; dprobs_TE (when given) and dlogits_TE [T, E].
void check_router_bwd(const Tensor& dtopk_w_TK, const Tensor* dprobs_TE, const Tensor& probs_TE,
                      const Tensor& topk_idx_TK, bool norm_topk, const Tensor& dlogits_TE);
// topk_idx_TK is 2-D; E >= 1; counts_E is [E].
void check_expert_counts(const Tensor& topk_idx_TK, int64_t E, const Tensor& counts_E);
// probs_TE is 2-D [T, E]; sums_E is [E].
void check_prob_column_sums(const Tensor& probs_TE, const Tensor& sums_E);
// counts_E is 1-D [E], sums_E [E]; N >= 1.
void check_aux_loss_value(const Tensor& counts_E, const Tensor& sums_E, int64_t N);
// counts_E is 1-D [E]; N >= 1; dprobs_TE is 2-D [T, E].
void check_aux_loss_bwd(const Tensor& counts_E, int64_t N, float dloss, const Tensor& dprobs_TE);
// logits_TE is 2-D [T, E]; lse_T is [T], zsum [1].
void check_router_z_loss_fwd(const Tensor& logits_TE, const Tensor& lse_T, const Tensor& zsum);
// probs_TE is 2-D [T, E]; lse_T is [T], dlogits_TE [T, E].
void check_router_z_loss_bwd(const Tensor& lse_T, const Tensor& probs_TE, float scale, const Tensor& dlogits_TE);
// counts_LE is 2-D [L, E], bias_LE [L, E]; rate is finite.
void check_router_bias_update(const Tensor& counts_LE, float rate, const Tensor& bias_LE);

// ---- token permutation by expert ----
// topk_idx_TK is 2-D [T, K]; E >= 1; R = T*K fits i32; offsets_E1 [E+1], assign_of_row_R [R], row_of_assign_TK [T, K].
void check_make_dispatch_plan(const Tensor& topk_idx_TK, int64_t E, const Tensor& offsets_E1,
                              const Tensor& assign_of_row_R, const Tensor& row_of_assign_TK);
// x_TD is 2-D [T, D], assign_of_row_R 1-D [R]; K >= 1; xp_RD is [R, D].
void check_permute_fwd(const Tensor& x_TD, const Tensor& assign_of_row_R, int64_t K, const Tensor& xp_RD);
// dxp_RD and dx_TD are 2-D [R, D] and [T, D]; K >= 1; assign_of_row_R is [R].
void check_permute_bwd(const Tensor& dxp_RD, const Tensor& assign_of_row_R, int64_t K, const Tensor& dx_TD);
// yp_RD and row_of_assign_TK are 2-D [R, D] and [T, K]; w_TK is [T, K], y_TD [T, D].
void check_unpermute_fwd(const Tensor& yp_RD, const Tensor& row_of_assign_TK, const Tensor& w_TK, const Tensor& y_TD);
// yp_RD or dyp_RD given, each [R, D]; dy_TD 2-D [T, D]; row_of_assign_TK, w_TK and dw_TK (with yp_RD) [T, K].
void check_unpermute_bwd(const Tensor& dy_TD, const Tensor& yp_RD, const Tensor& row_of_assign_TK, const Tensor& w_TK,
                         const Tensor& dyp_RD, const Tensor& dw_TK);
// x_TD, row_of_assign_TK and xp_RD are 2-D [T, D], [T, K], [R, D]; w_TK is [T, K].
void check_permute_weighted_fwd(const Tensor& x_TD, const Tensor& row_of_assign_TK, const Tensor& w_TK,
                                const Tensor& xp_RD);
// dxp_RD, x_TD and row_of_assign_TK are 2-D [R, D], [T, D], [T, K]; w_TK and dw_TK are [T, K], dx_TD [T, D].
void check_permute_weighted_bwd(const Tensor& dxp_RD, const Tensor& x_TD, const Tensor& row_of_assign_TK,
                                const Tensor& w_TK, const Tensor& dx_TD, const Tensor& dw_TK);

// ---- experts ----
// Weights [E, 2F, D] and [E, D, F]; xp_RD 2-D [R, D]; gu_R2F [R, 2F], h_RF [R, F], yp_RD [R, D]; offsets_E1 [E+1].
void check_experts_fwd(const Tensor& xp_RD, const Tensor& offsets_E1, const Tensor& w_gate_up_E2FD,
                       const Tensor& w_down_EDF, const Tensor& gu_R2F, const Tensor& h_RF, const Tensor& yp_RD);
// As experts_fwd, and dyp_RD and dxp_RD are [R, D], dw_gate_up_E2FD and dw_down_EDF have their weight's shape.
void check_experts_bwd(const Tensor& dyp_RD, const Tensor& xp_RD, const Tensor& offsets_E1,
                       const Tensor& w_gate_up_E2FD, const Tensor& w_down_EDF, const Tensor& gu_R2F, const Tensor& h_RF,
                       const Tensor& dxp_RD, const Tensor& dw_gate_up_E2FD, const Tensor& dw_down_EDF,
                       bool accumulate_dw, const std::function<void()>& after_dx);
// x_RK 2-D [R, K], w_ENK 3-D [E, N, K], offsets_E1 [E+1], y_RN and dy_RN [R, N], dx_RK [R, K], dw_ENK w's shape.
void check_grouped_linear_fwd(const Tensor& x_RK, const Tensor& offsets_E1, const Tensor& w_ENK, float alpha,
                              const Tensor& y_RN, bool accumulate);
void check_grouped_linear_bwd(const Tensor& dy_RN, const Tensor& x_RK, const Tensor& offsets_E1, const Tensor& w_ENK,
                              float alpha, const Tensor* dx_RK, bool accumulate_dx, const Tensor& dw_ENK);
// The weights as experts_fwd; x_TD is 2-D [T, D], topk_idx_TK 2-D [T, K], topk_w_TK [T, K], y_TD [T, D].
void check_experts_ref_fwd(const Tensor& x_TD, const Tensor& topk_idx_TK, const Tensor& topk_w_TK,
                           const Tensor& w_gate_up_E2FD, const Tensor& w_down_EDF, const Tensor& y_TD);
// As experts_ref_fwd, and dy_TD and dx_TD are [T, D], dtopk_w_TK [T, K], the weight gradients their weight's shape.
void check_experts_ref_bwd(const Tensor& dy_TD, const Tensor& x_TD, const Tensor& topk_idx_TK, const Tensor& topk_w_TK,
                           const Tensor& w_gate_up_E2FD, const Tensor& w_down_EDF, const Tensor& dx_TD,
                           const Tensor& dtopk_w_TK, const Tensor& dw_gate_up_E2FD, const Tensor& dw_down_EDF,
                           bool accumulate_dw);

// ---- cross-entropy and the LM head ----
// logits_TV is 2-D [T, V]; labels_T and lse_T are [T]; V > 0 when T > 0.
void check_cross_entropy_fwd(const Tensor& logits_TV, const Tensor& labels_T, const Tensor& lse_T, int64_t* n_valid);
// As the forward, and dlogits_TV is [T, V] (V == 0 allowed: then every label must be -100).
void check_cross_entropy_bwd(const Tensor& logits_TV, const Tensor& labels_T, const Tensor& lse_T, float scale,
                             const Tensor& dlogits_TV);
// hn_TD is 2-D [T, D], w_VD [V, D] with V > 0 when T > 0, labels_T [T], loss_sum [1], dhn_TD [T, D], dw_VD [V, D].
void check_lm_head_cross_entropy(const Tensor& hn_TD, const Tensor& w_VD, const Tensor& labels_T, float scale,
                                 int64_t chunk_rows, const Tensor& loss_sum, const Tensor& dhn_TD, const Tensor& dw_VD,
                                 bool accumulate_dw);
// hn_TD and w_VD as above; labels_T, logp_T and entropy_T (when given) are [T].
void check_lm_head_logprobs(const Tensor& hn_TD, const Tensor& w_VD, const Tensor& labels_T, int64_t chunk_rows,
                            const Tensor& logp_T, const Tensor* entropy_T);
// hn_TD and w_VD as above; labels_T, dlogp_T and dentropy_T (when given) are [T], dhn_TD [T, D], dw_VD [V, D].
void check_lm_head_objective_bwd(const Tensor& hn_TD, const Tensor& w_VD, const Tensor& labels_T, const Tensor& dlogp_T,
                                 const Tensor* dentropy_T, int64_t chunk_rows, const Tensor& dhn_TD,
                                 const Tensor& dw_VD, bool accumulate_dw);

// k, v [N, G, Hd] alike; slot [N]; the caches [S, G, Hd] with k's G and Hd.
void check_kv_cache_write(const Tensor& k_NGD, const Tensor& v_NGD, const Tensor& slot_N, const Tensor& k_cache_SGD,
                          const Tensor& v_cache_SGD);
// q [N, H, Hd], out like q, caches [S, G, Hd] with H % G == 0, block_table [B, M] with M × block_size
// slots reachable, seq and pos [N], block_size >= 1.
void check_paged_attention_fwd(const Tensor& q_NHD, const Tensor& k_cache_SGD, const Tensor& v_cache_SGD,
                               const Tensor& block_table_BM, int64_t block_size, const Tensor& seq_N,
                               const Tensor& pos_N, const Tensor& out_NHD);

// logits_RV 2-D [R, V] with V > 0 when R > 0; rows_R5 [R, 5]; tokens_R and logprobs_R [R].
void check_sample_tokens(const Tensor& logits_RV, const Tensor& rows_R5, const Tensor& tokens_R,
                         const Tensor& logprobs_R);

// ---- column blocks ----
// y_TO and x_TC 2-D with the same rows; 0 <= col0 and col0 + C <= O.
void check_add_cols_(const Tensor& y_TO, const Tensor& x_TC, int64_t col0, float alpha);
void check_copy_cols(const Tensor& x_TO, int64_t col0, const Tensor& y_TC);

}  // namespace mt::ops
