// The dispatch's shared argument checks (op_checks.h).
#include "ops/op_checks.h"

#include <array>

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

}  // namespace mt::ops
