// Qwen3MoeModel::forward_cached and KvCache (qwen3_moe.h): inference over a paged KV cache for the
// rollout engine. The layer maths are those of forward_layer (docs/design.md), with attention reading
// the cache: norm → q/k/v → q/k norms → RoPE at the tokens' positions → write k, v into their slots →
// paged attention over each sequence's positions 0..own → o_proj + residual → norm → MoE (router, plan,
// permute, grouped experts, weighted unpermute) or the dense MLP → residual. One device, no parallel
// wiring but expert parallelism, whose dispatcher moves the tokens to their experts' ranks.
#include <chrono>
#include <utility>

#include "model/qwen3_moe.h"
#include "moe/dispatcher.h"
#include "ops/ops.h"

namespace mt {

KvCache KvCache::allocate(const ModelConfig& c, Device device, int64_t num_blocks, int64_t block_size) {
  MT_CHECK(num_blocks >= 1 && block_size >= 1, "KvCache: ", num_blocks, " blocks of ", block_size, " tokens");
  KvCache kc;
  kc.block_size = block_size;
  const DType dt = device == Device::CUDA ? DType::BF16 : DType::F32;
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
    // Not zeroed: a slot is written before any attention reads it (copy-on-write may copy unwritten
    // slots of a block, which nothing reads either).
    kc.k.push_back(Tensor::empty({num_blocks * block_size, c.num_key_value_heads, c.head_dim}, dt, device));
    kc.v.push_back(Tensor::empty({num_blocks * block_size, c.num_key_value_heads, c.head_dim}, dt, device));
  }
  return kc;
}

void KvCache::copy_block(int64_t src, int64_t dst) {
  for (std::vector<Tensor>* kv : {&k, &v})
    for (Tensor& t : *kv) {
      Tensor d = t.rows(dst * block_size, block_size);
      d.copy_from(t.rows(src * block_size, block_size));
    }
}

double Qwen3MoeModel::begin_inference() {
  MT_CHECK(!inference_, "begin_inference: already in inference (end_inference first)");
  const auto t = std::chrono::steady_clock::now();
  src_->begin_pass(false);  // the fp32 gains from the current masters (a collective under FSDP)
  for (size_t u = 0; u < plan_->units.size(); ++u) src_->prefetch(int(u));
  for (size_t u = 0; u < plan_->units.size(); ++u) src_->acquire_weights(int(u));
  device_mem::synchronize(device_);
  inference_ = true;
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
}

void Qwen3MoeModel::end_inference() {
  if (!inference_) return;
  for (size_t u = 0; u < plan_->units.size(); ++u) src_->release_weights(int(u));
  inference_ = false;
}

Tensor Qwen3MoeModel::forward_cached(const CachedBatch& b, KvCache& cache, std::vector<Tensor>* routing_out) {
  auto dev = [&](const Tensor& t) { return device_ == Device::CPU ? t : t.to(device_); };
  CachedBatch d{dev(b.tokens), dev(b.positions), dev(b.seq), dev(b.slots), dev(b.block_table), dev(b.logit_rows)};
  Tensor logits = Tensor::empty({b.logit_rows.numel(), cfg_.vocab_size}, DType::F32, device_);
  if (routing_out) routing_out->clear();
  cached_pass(d, cache, logits, routing_out, false);
  return logits;
}

void Qwen3MoeModel::forward_cached_into(const CachedBatch& b, KvCache& cache, Tensor& logits_RV,
                                        std::vector<Tensor>* routing_into) {
  for (const Tensor* t : {&b.tokens, &b.positions, &b.seq, &b.slots, &b.block_table, &b.logit_rows})
    MT_CHECK(t->device() == device_, "forward_cached_into: the batch's tensors must be on the model's device, got ",
             t->desc());
  MT_CHECK(logits_RV.device() == device_ && logits_RV.dtype() == DType::F32 && logits_RV.dim() == 2 &&
               logits_RV.size(0) == b.logit_rows.numel() && logits_RV.size(1) == cfg_.vocab_size,
           "forward_cached_into: logits_RV must be f32 [", b.logit_rows.numel(), ", ", cfg_.vocab_size,
           "] on the model's device, got ", logits_RV.desc());
  cached_pass(b, cache, logits_RV, routing_into, true);
}

void Qwen3MoeModel::cached_pass(const CachedBatch& b, KvCache& cache, Tensor& logits_out,
                                std::vector<Tensor>* routing_out, bool routing_into) {
  if (par_.tp || par_.ulysses)
    MT_THROW("forward_cached: tensor and sequence parallelism are not supported for inference (attach neither)");
  pass_lora_ = lora_;
  if (!inference_) MT_THROW("forward_cached outside begin_inference() / end_inference()");
  if (cfg_.value_head)
    MT_THROW("forward_cached: a value-head model (score.weight [1, D], the RL critic) has no next-token logits to "
             "sample from");
  const int64_t N = b.tokens.numel(), R = b.logit_rows.numel();
  MT_CHECK(b.tokens.dtype() == DType::I64 && b.tokens.dim() == 1, "CachedBatch tokens must be i64 [N], got ",
           b.tokens.desc());
  MT_CHECK(b.logit_rows.dtype() == DType::I64 && b.logit_rows.dim() == 1, "CachedBatch logit_rows must be i64 [R], got ",
           b.logit_rows.desc());
  if (int64_t(cache.k.size()) != cfg_.num_hidden_layers)
    MT_THROW("forward_cached: the cache has ", cache.k.size(), " layers, the model ", cfg_.num_hidden_layers);
  const int64_t D = cfg_.hidden_size, H = cfg_.num_attention_heads, G = cfg_.num_key_value_heads,
                Hd = cfg_.head_dim, K = cfg_.num_experts_per_tok, E = cfg_.num_experts, L = cfg_.num_hidden_layers;
  const float eps = float(cfg_.rms_norm_eps), theta = float(cfg_.rope_theta);
  const Tensor &tokens = b.tokens, &pos = b.positions, &seq = b.seq, &slots = b.slots, &table = b.block_table,
               &rows = b.logit_rows;
  keep_.reset();
  work_.reset();
  acquire(plan_->embed);
  // The f32 residual stream in three buffers reused by every layer: x in, h1 after attention, y out.
  Tensor x = keep_.alloc({N, D}, DType::F32), h1 = keep_.alloc({N, D}, DType::F32), y = keep_.alloc({N, D}, DType::F32);
  ops::embedding_fwd(tokens, w_.embed, x);
  release(plan_->embed);
  for (int64_t l = 0; l < L; ++l) {
    work_.reset();
    for (int u : block_units(l)) acquire(u);
    const LayerWeights& w = w_.layers[size_t(l)];
    const LayerLora* lo = lora_ ? &lora_->weights(l) : nullptr;  // adapters beside the GEMMs (lora.h)
    Tensor xn = work_.alloc({N, D}, act_), rstd = work_.alloc({N});
    ops::rms_norm_fwd(x, w.in_norm, eps, xn, rstd);
    Tensor q = work_.alloc({N, H * Hd}, act_), k = work_.alloc({N, G * Hd}, act_), v = work_.alloc({N, G * Hd}, act_);
    ops::linear_fwd(xn, w.q, q);
    ops::linear_fwd(xn, w.k, k);
    ops::linear_fwd(xn, w.v, v);
    if (lo) {
      lora_fwd_if(xn, (*lo)[LoraTarget::Q], q, 0);
      lora_fwd_if(xn, (*lo)[LoraTarget::K], k, 0);
      lora_fwd_if(xn, (*lo)[LoraTarget::V], v, 0);
    }
    Tensor qr = work_.alloc({N, H, Hd}, act_), kr = work_.alloc({N, G, Hd}, act_);
    Tensor qr_rows = qr.view({N * H, Hd}), kr_rows = kr.view({N * G, Hd});
    Tensor rq = work_.alloc({N * H}), rk = work_.alloc({N * G});
    ops::rms_norm_fwd(q.view({N * H, Hd}), w.q_norm, eps, qr_rows, rq);
    ops::rms_norm_fwd(k.view({N * G, Hd}), w.k_norm, eps, kr_rows, rk);
    ops::rope_fwd(qr, pos, theta);
    ops::rope_fwd(kr, pos, theta);
    ops::kv_cache_write(kr, v.view({N, G, Hd}), slots, cache.k[size_t(l)], cache.v[size_t(l)]);
    Tensor att = work_.alloc({N, H, Hd}, act_);
    ops::paged_attention_fwd(qr, cache.k[size_t(l)], cache.v[size_t(l)], table, cache.block_size, seq, pos, att);
    ops::linear_fwd(att.view({N, H * Hd}), w.o, h1);
    if (lo) lora_fwd_if(att.view({N, H * Hd}), (*lo)[LoraTarget::O], h1, 0);
    ops::add_(h1, x);
    Tensor xn2 = work_.alloc({N, D}, act_), rstd2 = work_.alloc({N});
    ops::rms_norm_fwd(h1, w.post_norm, eps, xn2, rstd2);
    Tensor& out = y;
    if (w.sparse) {
      const int64_t Rr = N * K, F = cfg_.moe_intermediate_size;
      Tensor logits = work_.alloc({N, E}), probs = work_.alloc({N, E});
      Tensor idx = work_.alloc({N, K}, DType::I32), wts = work_.alloc({N, K});
      ops::linear_fwd(xn2, w.router, logits);
      if (lo) lora_fwd_if(xn2, (*lo)[LoraTarget::Router], logits, 0);
      Tensor bias_E;
      if (router_bias_LE_.defined()) bias_E = router_bias_LE_.rows(sparse_index(l), 1).view({E});
      ops::router_fwd(logits, K, cfg_.norm_topk_prob, probs, idx, wts, bias_E.defined() ? &bias_E : nullptr);
      if (routing_out && routing_into) {  // into the caller's buffers (a graph's static memory)
        const int64_t si = sparse_index(l);
        MT_CHECK(si < int64_t(routing_out->size()) && (*routing_out)[size_t(si)].size(0) >= N,
                 "forward_cached_into: routing_into needs an i32 [>= ", N, ", ", K, "] tensor per sparse layer");
        Tensor dst = (*routing_out)[size_t(si)].rows(0, N);
        ops::copy_cast(idx, dst);
      } else if (routing_out) {
        routing_out->push_back(idx.clone());  // the arena is reused by the next layer
      }
      if (par_.dispatcher) {  // expert parallelism: the tokens travel to their experts' ranks and back
        const moe::DispatchPlan pl = par_.dispatcher->prepare(idx, wts);
        const Tensor xp = cfg_.score_before_experts ? par_.dispatcher->dispatch_weighted(pl, xn2, wts)
                                                    : par_.dispatcher->dispatch(pl, xn2);
        const int64_t Rx = pl.rows_received;
        Tensor gu = work_.alloc({Rx, 2 * F}, act_), hh = work_.alloc({Rx, F}, act_), yp = work_.alloc({Rx, D}, act_);
        run_experts_fwd(lo, w, pl.local_offsets, xp, gu, hh, yp, local_expert_begin(l));
        const Tensor ys = par_.dispatcher->combine_comm(pl, par_.dispatcher->combine_prepare(pl, yp));
        par_.dispatcher->combine_finish(pl, ys, cfg_.score_before_experts ? ones_TK(N) : wts, out);
      } else {
        Tensor offsets = work_.alloc({E + 1}, DType::I64), assign = work_.alloc({Rr}, DType::I32),
               row_of = work_.alloc({N, K}, DType::I32);
        ops::make_dispatch_plan(idx, E, offsets, assign, row_of);
        Tensor xp = work_.alloc({Rr, D}, act_), gu = work_.alloc({Rr, 2 * F}, act_), hh = work_.alloc({Rr, F}, act_),
               yp = work_.alloc({Rr, D}, act_);
        if (cfg_.score_before_experts) ops::permute_weighted_fwd(xn2, row_of, wts, xp);
        else ops::permute_fwd(xn2, assign, K, xp);
        run_experts_fwd(lo, w, offsets, xp, gu, hh, yp, 0);
        ops::unpermute_fwd(yp, row_of, cfg_.score_before_experts ? ones_TK(N) : wts, out);
      }
    } else {
      const int64_t I = cfg_.intermediate_size;
      Tensor gu = work_.alloc({N, 2 * I}, act_), hh = work_.alloc({N, I}, act_);
      ops::linear_fwd(xn2, w.mlp_gate_up, gu);
      if (lo) {
        lora_fwd_if(xn2, (*lo)[LoraTarget::Gate], gu, 0);
        lora_fwd_if(xn2, (*lo)[LoraTarget::Up], gu, I);
      }
      ops::swiglu_fwd(gu, hh);
      ops::linear_fwd(hh, w.mlp_down, out);
      if (lo) lora_fwd_if(hh, (*lo)[LoraTarget::Down], out, 0);
    }
    ops::add_(out, h1);
    for (int u : block_units(l)) release(u);
    std::swap(x, y);
  }
  work_.reset();
  acquire(plan_->head);
  if (cfg_.tie_word_embeddings) acquire(plan_->embed);
  Tensor hn = work_.alloc({N, D}, act_), rstd = work_.alloc({N});
  ops::rms_norm_fwd(x, w_.norm, eps, hn, rstd);
  Tensor hr = work_.alloc({R, D}, act_);
  ops::embedding_fwd(rows, hn, hr);  // the rows whose logits are wanted (a gather)
  ops::linear_fwd(hr, w_.lm_head, logits_out);
  release(plan_->head);
  if (cfg_.tie_word_embeddings) release(plan_->embed);
}

}  // namespace mt
