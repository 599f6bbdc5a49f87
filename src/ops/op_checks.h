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

}  // namespace mt::ops
