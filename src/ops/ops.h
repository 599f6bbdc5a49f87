// The op interface: one signature per op, implemented by every backend (backend/cpu and
// backend/cuda; ops.cpp runs the CUDA version when the op's tensors are on CUDA). The model calls
// only these. tools/gen_op_dispatch.py generates the dispatch and the backends' declarations from
// this file; ops in its COMPOSITE table (permute_weighted_*) are built from other backend ops there.
//
// Contracts (as in llm.c):
//   - tensors are contiguous row-major; all tensors of one call live on one device;
//   - dtypes: on the CPU every float tensor is f32. On CUDA, activations and compute weights are
//     bf16 and everything marked "f32" below stays f32 (norm statistics, log-sum-exp, router logits,
//     probabilities and routing weights, parameter gradients, optimizer state); reductions and GEMMs
//     accumulate in f32. Where an op says "bf16|f32" the CUDA version takes either;
//   - parameter gradients use += (they accumulate over micro-batches and branches), unless the
//     op's trailing `accumulate_dw` argument is false: then they are written with = (the first
//     micro-batch of a step writes its gradients, which saves zeroing and re-reading every dW). A
//     parameter whose gradient comes from two ops in one micro-batch (tied embeddings) is written
//     with = by the first of them only;
//   - activation gradients use = unless the argument says "+=";
//   - outputs are preallocated by the caller with the documented shape; ops check shapes and
//     dtypes and fail with the tensor's role, its shape and the expected shape.
//
// Shape letters: T tokens (B*S flattened, batch-major), B batch, S sequence length, D hidden,
// V vocab, H query heads, G key/value heads, Hd head dim, N rows of any kind, E experts, K top-k,
// F expert hidden dim, R = T*K dispatched rows, I linear input dim, O linear output dim.
#pragma once
#include <cstdint>
#include <functional>
#include <span>

#include "core/tensor.h"

namespace mt::ops {

// ---- GEMM and linear layers (HF weight layout: w_OI is [out, in]) ----
// y_TO = x_TI @ w_OI^T. CUDA: a bf16 w takes bf16 x and gives y bf16|f32; an f32 w (the router, kept
// fp32 end to end) computes in fp32 from x bf16|f32 (widened exactly) and gives f32 y.
void linear_fwd(const Tensor& x_TI, const Tensor& w_OI, Tensor& y_TO);
// y_TO = x_TI @ w_OI^T + r_TO: a GEMM whose output goes into the residual stream, the add in the GEMM's
// epilogue (one write of y, one read of r, instead of the GEMM's write and add_'s read, read and write).
// r may be y itself (y +=); otherwise r and y must not overlap. CPU: the GEMM, then the add in f32 (the
// same bits as linear_fwd then add_). CUDA: w bf16, x bf16, r and y both f32 or both bf16 (cuBLASLt,
// beta = 1 with C = r and D = y: the f32 accumulator plus r, rounded once).
void linear_fwd_add(const Tensor& x_TI, const Tensor& w_OI, const Tensor& r_TO, Tensor& y_TO);
// dx_TI = (or += when accumulate_dx) dy_TO @ w_OI; dw_OI += (or = unless accumulate_dw) dy_TO^T @ x_TI.
// dx may be null; an undefined dw (a frozen weight's, Tensor()) skips the weight gradient. CUDA: dw f32; a bf16 w: x bf16, dy bf16|f32 (an f32 dy is rounded to bf16 for the
// GEMM), dx bf16|f32 (f32 when several GEMMs sum into it); an f32 w: fp32 GEMMs, dy and x bf16|f32,
// dx f32.
void linear_bwd(const Tensor& dy_TO, const Tensor& x_TI, const Tensor& w_OI, Tensor* dx_TI, bool accumulate_dx,
                Tensor& dw_OI, bool accumulate_dw = true);

// ---- embedding: ids_T is i64, each in [0, V) (checked) ----
// CUDA: table bf16; out and dout bf16|f32 (f32 for an f32 residual stream); dtable f32.
void embedding_fwd(const Tensor& ids_T, const Tensor& table_VD, Tensor& out_TD);
// dtable += (f32); with accumulate_dw false, dtable = (rows of ids not present become 0)
void embedding_bwd(const Tensor& ids_T, const Tensor& dout_TD, Tensor& dtable_VD, bool accumulate_dw = true);

// ---- RMSNorm over the last dim: y = w * x / sqrt(mean(x^2) + eps), fp64 accumulation ----
// Per-head norms (q_norm/k_norm) call this with x viewed as [T*H, Hd]. rstd_N (f32) is saved for
// backward; dw_D is f32. CUDA: w f32 (gains are read from the fp32 masters), y bf16; x, dx and dy
// each bf16|f32, independently (an f32 residual stream has x and dx f32; the per-head norms bf16).
void rms_norm_fwd(const Tensor& x_ND, const Tensor& w_D, float eps, Tensor& y_ND, Tensor& rstd_N);
void rms_norm_bwd(const Tensor& dy_ND, const Tensor& x_ND, const Tensor& w_D, const Tensor& rstd_N, Tensor& dx_ND,
                  Tensor& dw_D, bool accumulate_dw = true);  // dx =, dw += (= unless accumulate_dw)
// The residual add fused with the RMSNorm of its result, one pass over the rows:
// h_ND += x_ND (in place: h stays the residual stream, the backward's x), then y_ND, rstd_N as
// rms_norm_fwd of the new h. Equal (bit for bit) to add_(h, x) then rms_norm_fwd(h, ...). CPU: all f32.
// CUDA: h f32 (the residual stream), x bf16|f32, w f32, y bf16.
void add_rms_norm_fwd(Tensor& h_ND, const Tensor& x_ND, const Tensor& w_D, float eps, Tensor& y_ND, Tensor& rstd_N);
// Its backward: dx_ND = rms_norm_bwd's dx + dres_ND (the gradient reaching the residual h from its other
// uses), dw as rms_norm_bwd. Equal (bit for bit) to rms_norm_bwd then add_(dx, dres). x_ND is the norm's
// input (the h after the add). CUDA: dy and x bf16|f32, dres and dx f32.
void add_rms_norm_bwd(const Tensor& dy_ND, const Tensor& x_ND, const Tensor& w_D, const Tensor& rstd_N,
                      const Tensor& dres_ND, Tensor& dx_ND, Tensor& dw_D, bool accumulate_dw = true);

// ---- RoPE, rotate-half form, in place on x_TNHd ([T, heads, Hd]); pos_T is i32 ----
// inv_freq[i] = theta^(-2i/Hd) for i < Hd/2; angle = pos * inv_freq[i];
// out[..., i] = x[i] cos - x[i + Hd/2] sin; out[..., i + Hd/2] = x[i + Hd/2] cos + x[i] sin.
void rope_fwd(Tensor& x_TNHd, const Tensor& pos_T, float theta);
void rope_bwd(Tensor& dx_TNHd, const Tensor& pos_T, float theta);  // applies the inverse rotation

// ---- causal grouped-query attention over B sequences of length S (T = B*S) ----
// q_THHd [T, H, Hd], k_TGHd/v_TGHd [T, G, Hd], H % G == 0, query head h uses kv head h / (H/G).
// scale = 1/sqrt(Hd). out_THHd [T, H, Hd]; lse_TH [T, H] (f32) = log-sum-exp of the scaled scores
// (saved; its values are backend-specific: the CUDA backend may keep its own statistics layout).
// Packed rows (model/micro_batch.h): with doc_start_T (i32 [T], on the tensors' device), the query at
// row position s sees only the keys doc_start_T[b S + s] .. s (its own document); each token's start
// must lie in [0, s] of its row and be the same for every token of a document (the plan makes them so;
// the CPU checks). Null: plain causal attention. CUDA: packed calls run the reference kernels.
void attention_fwd(const Tensor& q_THHd, const Tensor& k_TGHd, const Tensor& v_TGHd, int64_t B, int64_t S,
                   Tensor& out_THHd, Tensor& lse_TH, const Tensor* doc_start_T = nullptr);
// dq =, dk =, dv =
void attention_bwd(const Tensor& dout_THHd, const Tensor& q_THHd, const Tensor& k_TGHd, const Tensor& v_TGHd,
                   const Tensor& out_THHd, const Tensor& lse_TH, int64_t B, int64_t S, Tensor& dq_THHd,
                   Tensor& dk_TGHd, Tensor& dv_TGHd, const Tensor* doc_start_T = nullptr);

// ---- paged KV cache (the rollout engine's decode) ----
// A cache holds the keys and values of many sequences in slots [S, G, Hd] (slot = block × block_size +
// offset; the block manager in rollout/ owns the block tables). kv_cache_write stores row n's k and v at
// slot_N[n] (i32). paged_attention_fwd is causal attention of N new query tokens over their sequences'
// cached keys and values: token n, of sequence seq_N[n] at position pos_N[n], attends to positions
// 0..pos_N[n] of that sequence, position p being at slot block_table_BM[seq][p / block_size] × block_size
// + p % block_size (its own key and value must already be written). q_NHD, out_NHD [N, H, Hd]; query head
// h reads kv head h / (H / G); scale 1/sqrt(Hd). seq, pos, block_table i32 (host-readable on the CPU,
// device on CUDA). CPU: f32; CUDA: q, caches, out bf16 (softmax in f32).
void kv_cache_write(const Tensor& k_NGD, const Tensor& v_NGD, const Tensor& slot_N, Tensor& k_cache_SGD,
                    Tensor& v_cache_SGD);
void paged_attention_fwd(const Tensor& q_NHD, const Tensor& k_cache_SGD, const Tensor& v_cache_SGD,
                         const Tensor& block_table_BM, int64_t block_size, const Tensor& seq_N, const Tensor& pos_N,
                         Tensor& out_NHD);

// ---- token sampling (the rollout engine): ops/sampling.h defines the draw and its CPU reference ----
// One token per row of logits_RV (f32 [R, V]) with row r's sampling parameters and draw counter packed in
// rows_R5 (i64 [R, 5], pack_sample_rows in ops/sampling.h); tokens_R i32 and logprobs_R f32 [R] out:
// log_softmax(logits / T)[token] before truncation. The CPU checks the parameters and logits (errors name
// the row); the CUDA kernel trusts them (the engine validates requests up front).
void sample_tokens(const Tensor& logits_RV, const Tensor& rows_R5, Tensor& tokens_R, Tensor& logprobs_R);

// ---- router: probs = softmax(logits) in fp32 (fp64 accumulation); top-k by probability ----
// Ties are broken by the lower expert index (as torch.topk on CPU does for equal values in practice).
// All f32 on every backend; topk_idx i32.
// topk_idx_TK is i32, sorted by descending probability; topk_w_TK are the probabilities, divided by
// their sum when norm_topk. With bias_E (f32 [E], aux-loss-free balancing as in DeepSeek-V3) the
// experts are chosen (and ordered) by the f32 sum probs[t, e] + bias_E[e] instead; the weights stay
// the unbiased probabilities of the chosen experts (renormalised as above).
void router_fwd(const Tensor& logits_TE, int64_t K, bool norm_topk, Tensor& probs_TE, Tensor& topk_idx_TK,
                Tensor& topk_w_TK, const Tensor* bias_E = nullptr);
// dlogits_TE = softmax-backward of dP, where dP = (d of the top-k weights through the optional
// renormalisation, scattered to their experts) + dprobs_TE (extra gradient on all probabilities,
// e.g. from the aux loss; may be null). dlogits =.
void router_bwd(const Tensor& dtopk_w_TK, const Tensor* dprobs_TE, const Tensor& probs_TE, const Tensor& topk_idx_TK,
                bool norm_topk, Tensor& dlogits_TE);

// ---- load-balancing aux loss (transformers' load_balancing_loss_func) ----
// Router rows of all sparse layers are pooled as one set of N rows. counts_E (i64) += number of
// top-k assignments to each expert in topk_idx_TK.
void expert_counts(const Tensor& topk_idx_TK, int64_t E, Tensor& counts_E);
// sums_E (f32 [E]) += column sums of probs_TE, accumulated in fp64 within the call.
void prob_column_sums(const Tensor& probs_TE, Tensor& sums_E);
// aux = E * sum_e (counts_e / N) * (sums_e / N)
double aux_loss_value(const Tensor& counts_E, const Tensor& sums_E, int64_t N);
// dprobs_TE += dloss * E * counts_e / N^2 for every row (gradient flows through P only)
void aux_loss_bwd(const Tensor& counts_E, int64_t N, float dloss, Tensor& dprobs_TE);

// ---- router z-loss (ST-MoE): z = sum over router rows of logsumexp(logits_t)^2 ----
// lse_T (f32 [T]) = log-sum-exp of each row (fp64 inside), saved for the backward; zsum (f32 [1], on
// the op's device, no host synchronisation) += sum_t lse_t^2 (fp64 within the call on the CPU).
void router_z_loss_fwd(const Tensor& logits_TE, Tensor& lse_T, Tensor& zsum);
// dlogits_TE += scale * 2 * lse_T[t] * probs_TE[t, e]  (d lse / d logits = softmax = probs), in f32.
void router_z_loss_bwd(const Tensor& lse_T, const Tensor& probs_TE, float scale, Tensor& dlogits_TE);

// ---- aux-loss-free balancing (DeepSeek-V3): the per-expert routing bias update ----
// counts_LE (i64 [L, E]): tokens routed to each expert of L layers. For each row l, with
// mean_l = sum_e counts[l, e] / E: bias_LE[l, e] += rate * sign(mean_l - counts[l, e]) (f32; sign(0) = 0),
// so under-loaded experts become more likely to be chosen and over-loaded ones less.
void router_bias_update(const Tensor& counts_LE, float rate, Tensor& bias_LE);

// ---- token permutation by expert (dropless) ----
// Assignment a = t*K + k (token t's k-th choice). The dispatch order sorts assignments by expert,
// stably (so within an expert, by a). Outputs (all i32 except offsets):
//   offsets_E1 [E+1] i64: rows of expert e are [offsets[e], offsets[e+1]);
//   assign_of_row_R [R]: the assignment in dispatched row r;
//   row_of_assign_TK [T, K]: the dispatched row of assignment (t, k).
void make_dispatch_plan(const Tensor& topk_idx_TK, int64_t E, Tensor& offsets_E1, Tensor& assign_of_row_R,
                        Tensor& row_of_assign_TK);
// xp_RD[r] = x_TD[assign_of_row[r] / K]
void permute_fwd(const Tensor& x_TD, const Tensor& assign_of_row_R, int64_t K, Tensor& xp_RD);
// dx_TD += scatter of dxp_RD back to tokens. CUDA: dxp bf16; dx bf16|f32.
void permute_bwd(const Tensor& dxp_RD, const Tensor& assign_of_row_R, int64_t K, Tensor& dx_TD);
// y_TD[t] = sum_k w_TK[t,k] * yp_RD[row_of_assign[t,k]]   (y =). CUDA: yp bf16; y bf16|f32.
void unpermute_fwd(const Tensor& yp_RD, const Tensor& row_of_assign_TK, const Tensor& w_TK, Tensor& y_TD);
// dyp_RD[row(t,k)] = w[t,k] * dy[t]  (=);  dw_TK[t,k] = <dy[t], yp[row(t,k)]>  (=)
// CUDA: dy bf16|f32; yp, dyp bf16. w_TK and dw_TK are f32.
void unpermute_bwd(const Tensor& dy_TD, const Tensor& yp_RD, const Tensor& row_of_assign_TK, const Tensor& w_TK,
                   Tensor& dyp_RD, Tensor& dw_TK);
// Routing scores applied before the experts (score_before_experts): the transposes of the unpermute
// pair. xp_RD[row(t,k)] = w[t,k] * x[t] (=; rows no assignment points at are zero);
// dx[t] = sum_k w[t,k] * dxp[row(t,k)] (=), dw[t,k] = <x[t], dxp[row(t,k)]> (=). Dtypes as unpermute.
void permute_weighted_fwd(const Tensor& x_TD, const Tensor& row_of_assign_TK, const Tensor& w_TK, Tensor& xp_RD);
void permute_weighted_bwd(const Tensor& dxp_RD, const Tensor& x_TD, const Tensor& row_of_assign_TK, const Tensor& w_TK,
                          Tensor& dx_TD, Tensor& dw_TK);

// ---- SwiGLU: gu_N2F holds [gate | up] along the last dim; h = silu(gate) * up ----
// CUDA: bf16 in and out, f32 arithmetic.
void swiglu_fwd(const Tensor& gu_N2F, Tensor& h_NF);
void swiglu_bwd(const Tensor& dh_NF, const Tensor& gu_N2F, Tensor& dgu_N2F);  // dgu =

// ---- experts, grouped form: one GEMM chain per expert over its contiguous dispatched rows ----
// CUDA: xp, w, gu, h, yp, dxp bf16; dw f32. unpermute weights w_TK and dw_TK are f32.
// w_gate_up_E2FD [E, 2F, D] (rows [0,F) gate, [F,2F) up), w_down_EDF [E, D, F].
// gu_R2F = xp @ w_gate_up[e]^T; h_RF = swiglu(gu); yp_RD = h @ w_down[e]^T. gu and h are saved.
void experts_fwd(const Tensor& xp_RD, const Tensor& offsets_E1, const Tensor& w_gate_up_E2FD,
                 const Tensor& w_down_EDF, Tensor& gu_R2F, Tensor& h_RF, Tensor& yp_RD);
// dxp =, dw_gate_up +=, dw_down += (both = unless accumulate_dw; experts without rows then get 0).
// after_dx, when given, is called once dxp is final in stream order (queued on CUDA) and, on the
// grouped CUDA path, before the two weight-gradient GEMMs are queued: what the caller queues or
// starts from it (the expert-parallel return of dxp) runs beside those GEMMs. Other paths call it last.
void experts_bwd(const Tensor& dyp_RD, const Tensor& xp_RD, const Tensor& offsets_E1, const Tensor& w_gate_up_E2FD,
                 const Tensor& w_down_EDF, const Tensor& gu_R2F, const Tensor& h_RF, Tensor& dxp_RD,
                 Tensor& dw_gate_up_E2FD, Tensor& dw_down_EDF, bool accumulate_dw = true,
                 const std::function<void()>& after_dx = {});

// ---- grouped linear layers: one weight per expert over the experts' contiguous dispatched rows ----
// Rows [off[e], off[e+1]) of x and y belong to expert e (offsets_E1 i64 [E+1], non-decreasing from 0 to R);
// w_ENK is [E, N, K], expert e's weight in HF's [out, in] layout. The experts' LoRA path is built from these
// (the base's grouped GEMMs and the adapters' low-rank products beside them), with no host synchronisation.
// y_RN = alpha * x_RK @ w[e]^T, or y += that when accumulate.
// CUDA: w bf16 (the base's experts: x bf16, y bf16) or f32 (adapters: fp32 arithmetic from x bf16|f32, y
// bf16|f32, one rounding of the sum).
void grouped_linear_fwd(const Tensor& x_RK, const Tensor& offsets_E1, const Tensor& w_ENK, float alpha, Tensor& y_RN,
                        bool accumulate = false);
// dx_RK = (or += when accumulate_dx) alpha * dy_RN @ w[e]; dw_ENK += alpha * dy^T @ x over expert e's rows (f32;
// experts without rows keep theirs). dx null or dw undefined (a frozen base) skips that product.
// CUDA: dtypes as grouped_linear_fwd (dy for x), dx bf16|f32, dw f32.
void grouped_linear_bwd(const Tensor& dy_RN, const Tensor& x_RK, const Tensor& offsets_E1, const Tensor& w_ENK,
                        float alpha, Tensor* dx_RK, bool accumulate_dx, Tensor& dw_ENK);

// ---- experts, reference form: a plain loop over experts and the tokens routed to each ----
// y_TD = sum_k w_TK[t,k] * expert_{idx[t,k]}(x_TD[t]); no permutation, no saved state.
void experts_ref_fwd(const Tensor& x_TD, const Tensor& topk_idx_TK, const Tensor& topk_w_TK,
                     const Tensor& w_gate_up_E2FD, const Tensor& w_down_EDF, Tensor& y_TD);
// dx =, dw_TK =, dw_gate_up +=, dw_down += (= unless accumulate_dw) (recomputes what it needs)
void experts_ref_bwd(const Tensor& dy_TD, const Tensor& x_TD, const Tensor& topk_idx_TK, const Tensor& topk_w_TK,
                     const Tensor& w_gate_up_E2FD, const Tensor& w_down_EDF, Tensor& dx_TD, Tensor& dtopk_w_TK,
                     Tensor& dw_gate_up_E2FD, Tensor& dw_down_EDF, bool accumulate_dw = true);

// ---- cross-entropy with ignore index -100 (labels_T i64, already aligned with logits rows) ----
// Returns the sum over valid rows of (lse - logit[label]) in fp64; lse_T is saved; *n_valid = rows
// whose label != -100. Labels outside [0, V) other than -100 are an error naming the row and value.
double cross_entropy_fwd(const Tensor& logits_TV, const Tensor& labels_T, Tensor& lse_T, int64_t* n_valid);
// dlogits_TV = scale * (softmax - onehot(label)) for valid rows, 0 for ignored rows (=)
void cross_entropy_bwd(const Tensor& logits_TV, const Tensor& labels_T, const Tensor& lse_T, float scale,
                       Tensor& dlogits_TV);

// ---- LM head fused with cross-entropy, chunked over tokens ----
// For each chunk of rows: logits = hn @ w^T (f32, never for the whole batch at once), loss_sum += the
// chunk's sum of (lse - logit[label]) over labels != -100, dlogits = scale * (softmax - onehot) (0 on
// ignored rows), dhn = dlogits @ w (=), dw += dlogits^T @ hn (= unless accumulate_dw). loss_sum is
// f32 [1] on the op's device (no host synchronisation). chunk_rows <= 0 lets the backend choose.
// CUDA: hn, w, dhn bf16; dw f32.
void lm_head_cross_entropy(const Tensor& hn_TD, const Tensor& w_VD, const Tensor& labels_T, float scale,
                           int64_t chunk_rows, Tensor& loss_sum, Tensor& dhn_TD, Tensor& dw_VD,
                           bool accumulate_dw = true);
// ---- LM head: per-token log-probabilities and entropies, forward only, chunked over tokens ----
// logits = hn @ w^T per chunk (f32, never for the whole batch at once), p = softmax(logits) per row.
// logp_T[t] = log p[labels_T[t]] (f32) and, when entropy_T is given, entropy_T[t] = -sum_v p_v log p_v,
// on rows whose label != -100; both are 0 on ignored rows. Labels outside [0, V) other than -100 are an
// error naming the row and value. chunk_rows <= 0 lets the backend choose. CUDA: hn, w bf16.
void lm_head_logprobs(const Tensor& hn_TD, const Tensor& w_VD, const Tensor& labels_T, int64_t chunk_rows,
                      Tensor& logp_T, Tensor* entropy_T);
// ---- LM head backward under a per-token objective L(logp, H), chunked over tokens ----
// With g_T = dL/dlogp (f32 [T]) and h_T = dL/dH (f32 [T], optional; no entropy term when null):
// dlogits[t, v] = g_t (onehot(label_t)_v - p_v) - h_t p_v (log p_v + H_t) on rows whose label != -100,
// 0 on ignored rows; dhn = dlogits @ w (=), dw += dlogits^T @ hn (= unless accumulate_dw). With
// g_t = -scale and no h this is lm_head_cross_entropy's gradient. CUDA: hn, w, dhn bf16; dw f32.
void lm_head_objective_bwd(const Tensor& hn_TD, const Tensor& w_VD, const Tensor& labels_T, const Tensor& dlogp_T,
                           const Tensor* dentropy_T, int64_t chunk_rows, Tensor& dhn_TD, Tensor& dw_VD,
                           bool accumulate_dw = true);

// ---- optimizer and gradient utilities ----
struct AdamWHyper {
  float lr = 1e-3f, beta1 = 0.9f, beta2 = 0.999f, eps = 1e-8f, weight_decay = 0.01f;
  int64_t step = 1;  // 1-based step count after this update (for bias correction)
};
// torch.optim.AdamW semantics (decoupled decay p *= 1 - lr*wd first), with g read as grad_scale*g.
// p, g, m, v are f32. When p_compute is given (bf16, same shape), it receives the updated p rounded
// to bf16 in the same pass (the compute copy of the weights on CUDA).
void adamw_step(Tensor& p, const Tensor& g, Tensor& m, Tensor& v, const AdamWHyper& h, float grad_scale,
                Tensor* p_compute);
double sum_squares(const Tensor& x);  // f32 (any backend) or bf16 (CUDA); fp64 accumulation on CPU
void scale_(Tensor& x, float s);
// CUDA: y and x both f32 or both bf16, or y f32 with x bf16 (a bf16 branch added into an f32 residual).
void add_(Tensor& y, const Tensor& x, float alpha = 1.0f);  // y += alpha * x
bool all_finite(const Tensor& x);
// dst = src converted (f32 <-> bf16, or a plain copy when the dtypes match); same shape and device.
void copy_cast(const Tensor& src, Tensor& dst);
// Column blocks of row-major matrices (the low-rank adapters' outputs that land in part of a fused GEMM's
// columns, e.g. the gate half of a dense MLP's gate_up): y_TO[:, col0 : col0 + C] += alpha * x_TC, and
// y_TC = x_TO[:, col0 : col0 + C]. 0 <= col0 and col0 + C <= O. CPU: f32; CUDA: each of x and y bf16|f32,
// the sum in f32 and rounded once.
void add_cols_(Tensor& y_TO, const Tensor& x_TC, int64_t col0, float alpha);
void copy_cols(const Tensor& x_TO, int64_t col0, Tensor& y_TC);

}  // namespace mt::ops
