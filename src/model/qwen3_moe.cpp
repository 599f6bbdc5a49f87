#include "model/qwen3_moe.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <optional>

#include "core/cuda_graph.h"
#include "ops/ops.h"
#include "moe/ulysses.h"
#include "model/objective.h"

namespace mt {

namespace {

bool env_switch(const char* var) {
  const char* v = std::getenv(var);
  const std::string s = v ? v : "";
  if (s.empty() || s == "1") return true;
  if (s == "0") return false;
  MT_THROW(var, " (\"", s, "\") must be 0 or 1");
}

// A column-parallel layer's adapter under tensor parallelism (lora.h): A whole and B's rows of this rank's n
// output features. tp rank r holds the global rows [r out / tp, ...) (parallel/tensor_parallel.h), or, where a
// kv head is replicated over tp / G ranks, the n rows of kv head r G / tp: both are r out / tp rounded down to a
// multiple of n.
LoraPair tp_out_rows(const LoraPair& p, int64_t n, const comm::Communicator* tp) {
  if (!tp || !p.defined()) return p;
  const int64_t out = p.B.size(0), r = tp->rank(), ntp = tp->size();
  return p.out_rows(r * out / ntp / n * n, n);
}

}  // namespace

bool fuse_norm_add_default() {
  static const bool on = env_switch("MOETRAIN_FUSE_NORM_ADD");
  return on;
}

bool fuse_gemm_add_default() {
  static const bool on = env_switch("MOETRAIN_FUSE_GEMM_ADD");
  return on;
}

bool wgrad_stream_default() {
  static const bool on = [] {
    const char* v = std::getenv("MOETRAIN_WGRAD_STREAM");
    const std::string s = v ? v : "";
    if (s.empty() || s == "0") return false;
    if (s == "1") return true;
    MT_THROW("MOETRAIN_WGRAD_STREAM (\"", s, "\") must be 0 or 1");
  }();
  return on;
}

int parse_wgrad_sms(const std::string& s) {
  if (s.empty()) return 0;
  const bool digits = s.size() <= 6 && std::all_of(s.begin(), s.end(), [](char c) { return c >= '0' && c <= '9'; });
  const int n = digits ? std::stoi(s) : 0;
  if (n < 1)
    MT_THROW("MOETRAIN_WGRAD_SMS (\"", s,
             "\") must be a whole number of SMs >= 1 (at most the GPU's SM count), or "
             "unset for all SMs on the compute stream and half on the side stream");
  return n;
}

streams::Side wgrad_priority_default() {
  static const streams::Side side = [] {
    const char* v = std::getenv("MOETRAIN_WGRAD_PRIORITY");
    const std::string s = v ? v : "";
    if (s.empty() || s == "high") return streams::Side::high;
    if (s == "low") return streams::Side::low;
    MT_THROW("MOETRAIN_WGRAD_PRIORITY (\"", s, "\") must be high or low");
  }();
  return side;
}

int wgrad_sms_default() {
  static const int n = [] {
    const char* v = std::getenv("MOETRAIN_WGRAD_SMS");
    return parse_wgrad_sms(v ? v : "");
  }();
  return n;
}

Recompute parse_recompute(const std::string& s) {
  if (s == "none") return Recompute::None;
  if (s == "full") return Recompute::Full;
  if (s == "selective") return Recompute::Selective;
  if (s == "moe") return Recompute::Moe;
  MT_THROW("recompute '", s, "' is not supported; allowed: none, full, selective, moe");
}

const char* recompute_name(Recompute r) {
  switch (r) {
    case Recompute::None:
      return "none";
    case Recompute::Full:
      return "full";
    case Recompute::Selective:
      return "selective";
    case Recompute::Moe:
      return "moe";
  }
  return "?";
}

// What a block's backward needs. The first group is always kept for the whole micro-batch; the
// second is kept (recompute none) or rebuilt from the first just before the block's backward.
struct Qwen3MoeModel::LayerActs {
  Tensor x;                                       // (T, D) block input
  Tensor probs, idx, wts;                         // (T, E) f32, (T, K) i32, (T, K) f32: routing decision
  Tensor zlse;                                    // (T) f32: log-sum-exp of the router logits (z-loss)
  Tensor offsets, assign_of_row, row_of_assign;   // (E+1) i64, (R) i32, (T, K) i32: dispatch plan
  Tensor xn1, rstd1, q, k, v, qr, kr, rstd_q, rstd_k, att, lse, h1, xn2, rstd2;
  Tensor xp, gu, hh, yp;                          // experts (R rows) or dense MLP (T rows; no xp/yp)
  std::shared_ptr<moe::DispatchPlan> ep_plan;     // expert parallelism: the routing plan across ranks
  Tensor ys;                                      // expert parallelism: outputs back at the source
  Tensor xg1, xg2;                                // tensor parallelism: xn1, xn2 of all T rows (else xn1, xn2)
  Tensor idx_g, wts_g;                            // etp = tp: the routing of all T rows (i32, f32 [T, K])
  Tensor qf, kf, vf, attf;                        // sequence parallelism: whole sequences, this rank's heads
};

template <class F>
void Qwen3MoeModel::for_valid_rows(F&& f) const {
  if (all_valid_) {
    f(int64_t(0), Tl_);  // every local row (under tp this rank's T_ / tp rows)
    return;
  }
  // Valid rows of sequence b are [b S_, b S_ + row_valid_[b]) of the T_ rows; this rank holds rows
  // [lo, lo + Tl_) of them (all of them without tp), and f gets the overlap in local row numbers.
  const int64_t lo = par_.tp ? int64_t(par_.tp->rank()) * Tl_ : 0;
  for (int64_t b = 0; b < B_; ++b) {
    const int64_t r0 = std::max(b * S_, lo), r1 = std::min(b * S_ + row_valid_[size_t(b)], lo + Tl_);
    if (r1 > r0) f(r0 - lo, r1 - r0);
  }
}

// Whether the layer's exchanged rows (xp, ys) live outside the arenas and can be kept for the
// backward: a sparse layer whose plan spans ranks. With ep = 1 (a capacity in one process) the
// combined rows alias the expert outputs in an arena, and nothing travels anyway.
bool Qwen3MoeModel::keeps_exchanges(const LayerActs& a) const { return par_.dispatcher && a.ep_plan && a.ep_plan->ep > 1; }

Qwen3MoeModel::Qwen3MoeModel(const ModelConfig& config, Device device, ParamSource* source, Weights weights,
                             const ModelOptions& options)
    : cfg_(config),
      opt_(options),
      device_(device),
      act_(device == Device::CUDA ? DType::BF16 : DType::F32),
      table_(config),
      keep_(0, device),
      work_(0, device) {
  wgrad_done_.resize(1, device);
  MT_CHECK(!(source && weights == Weights::Frozen), "Weights::Frozen applies to a model that holds its own "
           "parameters; an external source decides for itself (FsdpOptions::weights)");
  if (source) {
    src_ = source;
  } else {
    local_ = std::make_unique<LocalParams>(cfg_, table_, device, weights,
                                           opt_.frozen_host_masters || device != Device::CUDA || weights != Weights::Frozen);
    src_ = local_.get();
  }
  plan_ = &src_->plan();
  acts_.resize(size_t(cfg_.num_hidden_layers));
  // Per unit, the parameters it holds that the compute path reads in fp32 (see acquire()).
  fp32_params_.resize(plan_->units.size());
  for (size_t u = 0; u < plan_->units.size(); ++u) {
    const ParamUnit& pu = plan_->units[u];
    if (pu.local_experts) continue;
    for (const ParamEntry& e : table_.entries())
      if (fp32_compute_param(e.name))
        for (const FlatRange& p : pu.pieces)
          if (e.offset >= p.begin && e.offset + e.numel <= p.end) fp32_params_[u].push_back(&e);
  }
}

Qwen3MoeModel::~Qwen3MoeModel() = default;

void Qwen3MoeModel::lora_fwd_if(const Tensor& x, const LoraPair& p, Tensor& y, int64_t col0) {
  if (p.defined()) lora_fwd(x, p, lora_->scale(), y, col0, work_);
}

bool Qwen3MoeModel::lora_on_experts() const {
  return lora_ && lora_->spec().targets_any({LoraTarget::ExpertsGateUp, LoraTarget::ExpertsDown}) &&
         cfg_.num_sparse_layers() > 0;
}

int64_t Qwen3MoeModel::local_expert_begin(int64_t l) const {
  const int u = plan_->experts.empty() ? -1 : plan_->experts[size_t(l)];
  return u >= 0 ? plan_->units[size_t(u)].expert_begin : 0;
}

void Qwen3MoeModel::run_experts_fwd(const LayerLora* lo, const LayerWeights& w, const Tensor& offsets, const Tensor& xp,
                                    Tensor& gu, Tensor& hh, Tensor& yp, int64_t e0) {
  if (!lo || !lo->experts()) {
    ops::experts_fwd(xp, offsets, w.experts_gate_up, w.experts_down, gu, hh, yp);
    return;
  }
  // The base's grouped GEMMs, each with its adapters' low-rank product added before the next step reads it.
  const float s = lora_->scale();
  ops::grouped_linear_fwd(xp, offsets, w.experts_gate_up, 1.0f, gu);
  lora_grouped_fwd(xp, offsets, (*lo)[LoraTarget::ExpertsGateUp], e0, s, gu, work_);
  ops::swiglu_fwd(gu, hh);
  ops::grouped_linear_fwd(hh, offsets, w.experts_down, 1.0f, yp);
  lora_grouped_fwd(hh, offsets, (*lo)[LoraTarget::ExpertsDown], e0, s, yp, work_);
}

void Qwen3MoeModel::lora_experts_bwd(const LayerLora& lo, const LayerLora& lg, const LayerWeights& w,
                                     const Tensor& offsets, const Tensor& xp, const Tensor& gu, const Tensor& hh,
                                     const Tensor& dyp, Tensor& dxp, int64_t e0) {
  const int64_t F = cfg_.moe_intermediate_size, R = xp.size(0);
  const float s = lora_->scale();
  Tensor dhh = work_.alloc({R, F}, act_), dgu = work_.alloc({R, 2 * F}, act_), frozen;  // no gradient of the base
  ops::grouped_linear_bwd(dyp, hh, offsets, w.experts_down, 1.0f, &dhh, false, frozen);
  lora_grouped_bwd(dyp, hh, offsets, lo[LoraTarget::ExpertsDown], lg[LoraTarget::ExpertsDown], e0, s, &dhh, work_);
  ops::swiglu_bwd(dhh, gu, dgu);
  ops::grouped_linear_bwd(dgu, xp, offsets, w.experts_gate_up, 1.0f, &dxp, false, frozen);
  lora_grouped_bwd(dgu, xp, offsets, lo[LoraTarget::ExpertsGateUp], lg[LoraTarget::ExpertsGateUp], e0, s, &dxp, work_);
}

void Qwen3MoeModel::attach_lora(LoraAdapters* lora) {
  if (lora && lora->params().device() != device_)
    MT_THROW("LoRA adapters on ", device_name(lora->params().device()), " for a model on ", device_name(device_));
  lora_ = lora;
}

void Qwen3MoeModel::attach(ModelWiring wiring) {
  if (attached_) MT_THROW("Qwen3MoeModel::attach: the model's parallel parts are already attached (once per model)");
  MT_CHECK(opt_.prefetch_depth >= 0, "prefetch_depth ", opt_.prefetch_depth, " must be >= 0");
  par_ = std::move(wiring);
  attached_ = true;
}

LocalParams& Qwen3MoeModel::local() {
  if (!local_)
    MT_THROW("this model's parameters live in an external ParamSource (sharded); the full flat buffers "
             "exist only for a model that holds its own parameters");
  return *local_;
}

// Binding a unit's views is cheap (no copies). A unit of local experts binds the experts tensors of
// its layer to this rank's experts only ([E / ep, 2F, D] and [E / ep, D, F]).
void Qwen3MoeModel::bind_unit(int u, const Tensor& buf, ModelWeights& w) {
  const ParamUnit& pu = plan_->units[size_t(u)];
  if (!pu.local_experts) {
    for (const FlatRange& p : pu.pieces) bind_range(cfg_, table_, buf.rows(p.dst_offset, p.end - p.begin), p.begin, w);
    return;
  }
  if (w.layers.size() != size_t(cfg_.num_hidden_layers)) {
    w.layers.resize(size_t(cfg_.num_hidden_layers));
    for (int64_t l = 0; l < cfg_.num_hidden_layers; ++l) w.layers[size_t(l)].sparse = cfg_.is_sparse_layer(l);
  }
  const int64_t n = pu.expert_end - pu.expert_begin, D = cfg_.hidden_size, F = cfg_.moe_intermediate_size;
  LayerWeights& lw = w.layers[size_t(pu.layer)];
  lw.experts_gate_up = buf.rows(pu.pieces[0].dst_offset, n * 2 * F * D).view({n, 2 * F, D});
  lw.experts_down = buf.rows(pu.pieces[1].dst_offset, n * D * F).view({n, D, F});
}

// The unit's compute views, then its RMSNorm gains and router over the source's f32 values where the
// compute copy is bf16 (params.h, fp32_compute_param).
void Qwen3MoeModel::acquire(int u) {
  bind_unit(u, src_->acquire_weights(u), w_);
  for (const ParamEntry* e : fp32_params_[size_t(u)]) {
    Tensor v = src_->fp32_param(*e);
    if (v.defined()) bind_range(cfg_, table_, v, e->offset, w_);
  }
}

void Qwen3MoeModel::release(int u) { src_->release_weights(u); }

void Qwen3MoeModel::grads_for(int u) {
  if (base_frozen()) {  // adapters on a frozen base: the base's gradients go nowhere (grad_sink_)
    if (!grad_sink_.defined()) {  // once: the size of the largest unit
      int64_t most = 0;
      for (const ParamUnit& pu : plan_->units) most = std::max(most, pu.numel);
      grad_sink_ = Tensor::empty({most}, DType::F32, device_);
    }
    bind_unit(u, grad_sink_.rows(0, plan_->units[size_t(u)].numel), g_);
    return;
  }
  bind_unit(u, src_->unit_grads(u), g_);
}

std::vector<int> Qwen3MoeModel::block_units(int64_t l) const {
  std::vector<int> u{plan_->block[size_t(l)]};
  for (const std::vector<int>* v : {&plan_->tp_split, &plan_->tp_kv, &plan_->experts})
    if (!v->empty() && (*v)[size_t(l)] >= 0) u.push_back((*v)[size_t(l)]);
  return u;
}

const Tensor& Qwen3MoeModel::ones_TK(int64_t rows) {
  const Shape want{rows, cfg_.num_experts_per_tok};
  if (!ones_TK_.defined() || ones_TK_.shape() != want) {
    Tensor h = Tensor::empty(want);
    h.fill_(1.0f);
    ones_TK_ = h.to(device_);
    if (device_ == Device::CUDA) cuda_graph::bump_epoch();  // a graph captured over the old tensor is stale
  }
  return ones_TK_;
}

Tensor Qwen3MoeModel::tp_gather(const Tensor& x, Arena& A) {
  if (!par_.tp) return x;
  Shape shape = x.shape();
  shape[0] *= par_.tp->size();
  Tensor all = A.alloc(shape, x.dtype());
  par_.tp->all_gather(x, all)->wait();
  return all;
}

void Qwen3MoeModel::tp_reduce_scatter(const Tensor& partial, Tensor& out) {
  par_.tp->reduce_scatter(partial, out, comm::ReduceOp::Sum)->wait();
}

bool Qwen3MoeModel::aux_enabled() const {
  if (!cfg_.output_router_logits) return false;
  for (int64_t l = 0; l < cfg_.num_hidden_layers; ++l)
    if (cfg_.is_sparse_layer(l)) return true;
  return false;
}

int64_t Qwen3MoeModel::sparse_index(int64_t l) const {
  int64_t i = 0;
  for (int64_t j = 0; j < l; ++j) i += cfg_.is_sparse_layer(j) ? 1 : 0;
  return i;
}

void Qwen3MoeModel::enable_router_bias() {
  int64_t n_sparse = sparse_index(cfg_.num_hidden_layers);
  if (n_sparse == 0)
    MT_THROW("router bias (aux-loss-free balancing) needs MoE layers; this model (num_experts ", cfg_.num_experts,
             ") has none");
  if (!router_bias_LE_.defined()) router_bias_LE_ = Tensor::zeros({n_sparse, cfg_.num_experts}, DType::F32, device_);
}

void Qwen3MoeModel::reset_expert_load() {
  if (load_LE_.defined()) load_LE_.zero_();
}

void Qwen3MoeModel::replay_routing(int64_t l, LayerActs& a) {
  const int64_t si = sparse_index(l);
  if (si >= int64_t(replay_.size()))
    MT_THROW("routing replay has ", replay_.size(), " layers of expert ids; sparse layer ", l, " needs more");
  const int64_t T = T_, K = cfg_.num_experts_per_tok, E = cfg_.num_experts;
  Tensor idx = replay_[size_t(si)].to(Device::CPU);
  if (idx.shape() != Shape{T, K} || idx.dtype() != DType::I32)
    MT_THROW("routing replay for sparse layer ", l, " is ", idx.desc(), "; expected i32[", T, ", ", K, "]");
  Tensor probs = a.probs.to(Device::CPU), wts = Tensor::empty({T, K});
  for (int64_t t = 0; t < T; ++t) {
    double sum = 0;
    for (int64_t k = 0; k < K; ++k) {
      int32_t e = idx.data<int32_t>()[t * K + k];
      if (e < 0 || e >= E) MT_THROW("routing replay: expert id ", e, " of token ", t, " is outside [0, ", E, ")");
      wts.data<float>()[t * K + k] = probs.data<float>()[t * E + e];
      sum += probs.data<float>()[t * E + e];
    }
    if (cfg_.norm_topk_prob)
      for (int64_t k = 0; k < K; ++k) wts.data<float>()[t * K + k] = float(wts.data<float>()[t * K + k] / sum);
  }
  a.idx.copy_from(idx.to(device_));
  a.wts.copy_from(wts.to(device_));
}

std::vector<Tensor> Qwen3MoeModel::last_routing() const {
  std::vector<Tensor> out;
  for (int64_t l = 0; l < cfg_.num_hidden_layers; ++l)
    if (cfg_.is_sparse_layer(l)) out.push_back(acts_[size_t(l)].idx.to(Device::CPU).clone());
  return out;
}

LossParts Qwen3MoeModel::forward_backward(const MicroBatch& mb, const PassOptions& opt) { return run(mb, opt, true); }

LossParts Qwen3MoeModel::forward_backward(const MicroBatch& mb, double ce_scale, double aux_scale, Tensor* logits_out) {
  PassOptions o;
  o.ce_scale = ce_scale;
  o.aux_scale = aux_scale;
  o.logits_out = logits_out;
  return run(mb, o, true);
}

LossParts Qwen3MoeModel::forward(const MicroBatch& mb, const PassOptions& opt) { return run(mb, opt, false); }

LossParts Qwen3MoeModel::forward(const MicroBatch& mb, Tensor* logits_out) {
  PassOptions o;
  o.logits_out = logits_out;
  return run(mb, o, false);
}

void Qwen3MoeModel::forward_layer(int64_t l, LayerActs& a, Tensor& out, bool routing_known, const Tensor& add_in,
                                  Tensor* add_out) {
  const LayerWeights& w = w_.layers[size_t(l)];
  const LayerLora* lo = pass_lora_ ? &pass_lora_->weights(l) : nullptr;  // adapters (lora.h) beside the GEMMs
  // T: the micro-batch's rows (attention, q/k/v, MLP); Tl: this rank's rows (norms, residual, router).
  // They differ only under tensor parallelism.
  const int64_t T = T_, Tl = Tl_, D = cfg_.hidden_size, H = cfg_.num_attention_heads, G = cfg_.num_key_value_heads,
                Hd = cfg_.head_dim, K = cfg_.num_experts_per_tok, E = cfg_.num_experts;
  const float eps = float(cfg_.rms_norm_eps), theta = float(cfg_.rope_theta);
  const Recompute rc = pass_.recompute;
  // A: the block's tensors the backward reads; Af: the FFN's hidden activations (for an MoE layer the
  // R = T K rows: xp, gu, hh, yp), which recompute moe rebuilds while keeping the rest as none does.
  Arena& A = rc == Recompute::None || rc == Recompute::Moe ? keep_ : work_;
  Arena& Af = rc == Recompute::None ? keep_ : work_;
  // Selective recompute keeps the attention output and its statistics: attention is the one part
  // whose cost grows with S^2, so the recompute pass skips it and rebuilds only the cheap rest.
  const bool keep_attention = rc != Recompute::Full;
  const bool attention_known = routing_known && rc == Recompute::Selective;
  // Recompute moe's pass (routing_known) starts at the FFN: everything before it was kept.
  const bool ffn_only = routing_known && rc == Recompute::Moe;
  // Under expert parallelism selective (and moe) also keeps what the two all-to-alls delivered (the
  // expert-side input rows and the outputs back at the source), so its recompute issues no all-to-all:
  // the exchanges, not the expert GEMMs, are the expensive part there (keeps_exchanges(a)).
  const bool exchanges_known = (attention_known || ffn_only) && keeps_exchanges(a);
  // The recompute pass (routing_known) needs the FFN's saved tensors, not the block output, so under
  // tp it skips the output's reduce-scatter.
  const bool need_out = !(par_.tp && routing_known);

  if (!ffn_only) {
    a.xn1 = A.alloc({Tl, D}, act_);
    a.rstd1 = A.alloc({Tl});
    if (add_in.defined())  // the previous block's output add, done here: a.x becomes the block input
      ops::add_rms_norm_fwd(a.x, add_in, w.in_norm, eps, a.xn1, a.rstd1);
    else
      ops::rms_norm_fwd(a.x, w.in_norm, eps, a.xn1, a.rstd1);
    a.xg1 = tp_gather(a.xn1, A);  // column-parallel q/k/v read every row of the tp group
    a.q = A.alloc({T, H * Hd}, act_);
    a.k = A.alloc({T, G * Hd}, act_);
    a.v = A.alloc({T, G * Hd}, act_);
    ops::linear_fwd(a.xg1, w.q, a.q);
    ops::linear_fwd(a.xg1, w.k, a.k);
    ops::linear_fwd(a.xg1, w.v, a.v);
    if (lo) {  // under tp this rank's heads' rows of B (tp_out_rows)
      lora_fwd_if(a.xg1, tp_out_rows((*lo)[LoraTarget::Q], H * Hd, par_.tp), a.q, 0);
      lora_fwd_if(a.xg1, tp_out_rows((*lo)[LoraTarget::K], G * Hd, par_.tp), a.k, 0);
      lora_fwd_if(a.xg1, tp_out_rows((*lo)[LoraTarget::V], G * Hd, par_.tp), a.v, 0);
    }
    a.qr = A.alloc({T, H, Hd}, act_);
    a.kr = A.alloc({T, G, Hd}, act_);
    a.rstd_q = A.alloc({T * H});
    a.rstd_k = A.alloc({T * G});
    Tensor qr_rows = a.qr.view({T * H, Hd}), kr_rows = a.kr.view({T * G, Hd});
    ops::rms_norm_fwd(a.q.view({T * H, Hd}), w.q_norm, eps, qr_rows, a.rstd_q);
    ops::rms_norm_fwd(a.k.view({T * G, Hd}), w.k_norm, eps, kr_rows, a.rstd_k);
    ops::rope_fwd(a.qr, pos_T_, theta);
    ops::rope_fwd(a.kr, pos_T_, theta);
    if (sp_) {
      // Ulysses: whole sequences for this rank's heads, attention, and back to this rank's tokens. The
      // recompute re-issues the same exchanges (selective: only the first; the backward needs q, k, v).
      const int64_t Tf = B_ * S_full_, Hl = par_.ulysses->local_heads(), Gl = par_.ulysses->local_kv_heads();
      a.qf = A.alloc({Tf, Hl, Hd}, act_);
      a.kf = A.alloc({Tf, Gl, Hd}, act_);
      a.vf = A.alloc({Tf, Gl, Hd}, act_);
      par_.ulysses->to_heads(a.qr, a.kr, a.v.view({T, G, Hd}), B_, a.qf, a.kf, a.vf);
      if (!attention_known) {
        Arena& Att = keep_attention ? keep_ : work_;
        a.att = Att.alloc({T, H, Hd}, act_);
        a.attf = Att.alloc({Tf, Hl, Hd}, act_);
        a.lse = Att.alloc({Tf, Hl});
        ops::attention_fwd(a.qf, a.kf, a.vf, B_, S_full_, a.attf, a.lse, doc_start_ptr());
        par_.ulysses->to_tokens(a.attf, B_, a.att);
      }
    } else if (!attention_known) {
      Arena& Att = keep_attention ? keep_ : work_;
      a.att = Att.alloc({T, H, Hd}, act_);
      a.lse = Att.alloc({T, H});
      ops::attention_fwd(a.qr, a.kr, a.v.view({T, G, Hd}), B_, S_, a.att, a.lse, doc_start_ptr());
    }
    a.h1 = A.alloc({Tl, D}, DType::F32);
    a.xn2 = A.alloc({Tl, D}, act_);
    a.rstd2 = A.alloc({Tl});
    // h1 = x + o_proj(att): the add in the GEMM's epilogue (fuse_gemm_add), fused with norm2
    // (fuse_norm_add), or an add_ of its own.
    if (par_.tp) {  // row-parallel o_proj: partial sums over this rank's heads, summed into the local rows
      Tensor part = work_.alloc({T, D}, DType::F32);
      ops::linear_fwd(a.att.view({T, H * Hd}), w.o, part);
      if (lo && (*lo)[LoraTarget::O].defined())  // A's columns of this rank's heads: a partial sum too
        lora_fwd_in_cols(a.att.view({T, H * Hd}), par_.tp->rank() * H * Hd, (*lo)[LoraTarget::O], lora_->scale(), part,
                         work_);
      tp_reduce_scatter(part, a.h1);
    } else if (opt_.fuse_gemm_add) {
      ops::linear_fwd_add(a.att.view({T, H * Hd}), w.o, a.x, a.h1);
    } else {
      ops::linear_fwd(a.att.view({T, H * Hd}), w.o, a.h1);
    }
    if (lo && !par_.tp) lora_fwd_if(a.att.view({T, H * Hd}), (*lo)[LoraTarget::O], a.h1, 0);
    if (opt_.fuse_gemm_add && !par_.tp) {
      ops::rms_norm_fwd(a.h1, w.post_norm, eps, a.xn2, a.rstd2);
    } else if (opt_.fuse_norm_add) {
      ops::add_rms_norm_fwd(a.h1, a.x, w.post_norm, eps, a.xn2, a.rstd2);
    } else {
      ops::add_(a.h1, a.x);
      ops::rms_norm_fwd(a.h1, w.post_norm, eps, a.xn2, a.rstd2);
    }
  }

  if (w.sparse) {
    // etp = tp: the experts are F slices and see every row of the tp group; etp = 1: the local rows.
    const bool etp = par_.tp && par_.expert_tp;
    const int64_t Tr = etp ? T : Tl, R = Tr * K, F = cfg_.moe_intermediate_size;
    if (!routing_known) {
      Tensor logits = work_.alloc({Tl, E});  // read by nothing after the routing decision
      ops::linear_fwd(a.xn2, w.router, logits);
      if (lo) lora_fwd_if(a.xn2, (*lo)[LoraTarget::Router], logits, 0);
      a.probs = keep_.alloc({Tl, E});
      a.idx = keep_.alloc({Tl, K}, DType::I32);
      a.wts = keep_.alloc({Tl, K});
      Tensor bias_E;
      if (router_bias_LE_.defined()) bias_E = router_bias_LE_.rows(sparse_index(l), 1).view({E});
      ops::router_fwd(logits, K, cfg_.norm_topk_prob, a.probs, a.idx, a.wts, bias_E.defined() ? &bias_E : nullptr);
      a.zlse = keep_.alloc({Tl});
      for_valid_rows([&](int64_t r0, int64_t n) {  // padding (sp chunks, tp remainder) adds nothing to the z-loss
        Tensor zlse = a.zlse.rows(r0, n);
        ops::router_z_loss_fwd(logits.rows(r0, n), zlse, zsum_);
      });
      if (!replay_.empty()) replay_routing(l, a);
      if (etp) {  // the routing of every row of the tp group, kept with the decision
        a.idx_g = tp_gather(a.idx, keep_);
        a.wts_g = tp_gather(a.wts, keep_);
      }
      const Tensor& idx_e = etp ? a.idx_g : a.idx;
      if (par_.dispatcher) {
        // Expert parallelism: the one routing decision across ranks (counts exchanged), kept for the
        // backward and any recompute.
        a.ep_plan = std::make_shared<moe::DispatchPlan>(par_.dispatcher->prepare(idx_e, etp ? a.wts_g : a.wts));
        dropped_ += a.ep_plan->n_dropped;
      } else {
        a.offsets = keep_.alloc({E + 1}, DType::I64);
        a.assign_of_row = keep_.alloc({R}, DType::I32);
        a.row_of_assign = keep_.alloc({Tr, K}, DType::I32);
        ops::make_dispatch_plan(idx_e, E, a.offsets, a.assign_of_row, a.row_of_assign);
      }
    }
    const Tensor& wts_e = etp ? a.wts_g : a.wts;
    Tensor xe = a.xn2;
    if (etp) xe = ffn_only ? a.xg2 : (a.xg2 = tp_gather(a.xn2, A));  // moe kept the gathered rows
    // Whether this pass forms the layer's output: not recompute moe's, unless its combine must run to
    // rebuild the rows the backward reads (a dispatcher whose exchanged rows were not kept).
    const bool combine = !ffn_only || (par_.dispatcher && !exchanges_known);
    // etp: the F slices' partial outputs of all T rows, summed over tp into the local rows.
    Tensor oute = etp && combine ? work_.alloc({T, D}, DType::F32) : out;
    if (par_.dispatcher) {
      // Tokens travel to the ranks that own their experts (one all_to_all_v), this rank's experts run
      // on what arrived, and the outputs come back weighted (one all_to_all_v).
      const moe::DispatchPlan& pl = *a.ep_plan;
      const int64_t Rr = pl.rows_received;
      if (!exchanges_known)
        a.xp = cfg_.score_before_experts ? par_.dispatcher->dispatch_weighted(pl, xe, wts_e) : par_.dispatcher->dispatch(pl, xe);
      a.gu = Af.alloc({Rr, 2 * F}, act_);
      a.hh = Af.alloc({Rr, F}, act_);
      // With ep > 1 the expert-side outputs are needed only until the combine has sent them (the
      // backward reads the combined rows ys): scratch, also under recompute none (the work arena is
      // reset per layer). With ep = 1 the combined rows are these rows themselves.
      Tensor yp = (pl.ep > 1 ? work_ : Af).alloc({Rr, D}, act_);
      run_experts_fwd(lo, w, pl.local_offsets, a.xp, a.gu, a.hh, yp, local_expert_begin(l));
      // The combine's phases, finishing straight into the f32 residual-stream output (a recompute
      // with the exchanges kept needs only gu and hh: the block output is not read).
      if (!exchanges_known) {
        a.ys = par_.dispatcher->combine_comm(pl, par_.dispatcher->combine_prepare(pl, yp));
        par_.dispatcher->combine_finish(pl, a.ys, cfg_.score_before_experts ? ones_TK(Tr) : wts_e, oute);
      }
    } else {
      a.xp = Af.alloc({R, D}, act_);
      if (cfg_.score_before_experts)
        ops::permute_weighted_fwd(xe, a.row_of_assign, wts_e, a.xp);
      else
        ops::permute_fwd(xe, a.assign_of_row, K, a.xp);
      a.gu = Af.alloc({R, 2 * F}, act_);
      a.hh = Af.alloc({R, F}, act_);
      a.yp = Af.alloc({R, D}, act_);  // the backward reads it (the routing weights' gradient)
      run_experts_fwd(lo, w, a.offsets, a.xp, a.gu, a.hh, a.yp, 0);
      if (combine) ops::unpermute_fwd(a.yp, a.row_of_assign, cfg_.score_before_experts ? ones_TK(Tr) : wts_e, oute);
    }
    if (etp && need_out) tp_reduce_scatter(oute, out);
  } else {
    const int64_t I = cfg_.intermediate_size;
    if (!ffn_only) a.xg2 = tp_gather(a.xn2, A);  // column-parallel gate/up, row-parallel down (moe: kept)
    a.gu = Af.alloc({T, 2 * I}, act_);
    a.hh = Af.alloc({T, I}, act_);
    ops::linear_fwd(a.xg2, w.mlp_gate_up, a.gu);
    if (lo) {  // under tp this rank's I rows of each (tp_out_rows)
      lora_fwd_if(a.xg2, tp_out_rows((*lo)[LoraTarget::Gate], I, par_.tp), a.gu, 0);
      lora_fwd_if(a.xg2, tp_out_rows((*lo)[LoraTarget::Up], I, par_.tp), a.gu, I);
    }
    ops::swiglu_fwd(a.gu, a.hh);
    if (ffn_only) return;  // the down projection's output is not read by the backward
    if (par_.tp) {
      Tensor part = work_.alloc({T, D}, DType::F32);
      ops::linear_fwd(a.hh, w.mlp_down, part);
      if (lo && need_out && (*lo)[LoraTarget::Down].defined())  // A's columns of this rank's I: a partial sum
        lora_fwd_in_cols(a.hh, par_.tp->rank() * I, (*lo)[LoraTarget::Down], lora_->scale(), part, work_);
      if (need_out) tp_reduce_scatter(part, out);
    } else if (opt_.fuse_gemm_add) {  // out = h1 + down(hh): the residual add in the GEMM's epilogue
      ops::linear_fwd_add(a.hh, w.mlp_down, a.h1, out);
      if (lo) lora_fwd_if(a.hh, (*lo)[LoraTarget::Down], out, 0);
      if (add_out) *add_out = Tensor();
      return;
    } else {
      ops::linear_fwd(a.hh, w.mlp_down, out);
      if (lo) lora_fwd_if(a.hh, (*lo)[LoraTarget::Down], out, 0);
    }
  }
  if (ffn_only) return;  // recompute moe rebuilt what the backward reads; the output is not read
  // out += h1: the caller's (with the next norm; a recompute drops it), or here.
  if (add_out)
    *add_out = a.h1;
  else
    ops::add_(out, a.h1);
}

void Qwen3MoeModel::backward_layer(int64_t l, LayerActs& a, const Tensor& dout, Tensor& dx, double aux_scale,
                                   moe::CombineBwdPending* early) {
  const LayerWeights& w = w_.layers[size_t(l)];
  LayerWeights& g = g_.layers[size_t(l)];
  const LayerLora* lo = pass_lora_ ? &pass_lora_->weights(l) : nullptr;
  const LayerLora* lg = pass_lora_ ? &pass_lora_->grads(l) : nullptr;
  auto lora_bwd_if = [&](const Tensor& dy, int64_t col0, const Tensor& x, LoraTarget t, Tensor* dxt) {
    if (lo && (*lo)[t].defined()) lora_bwd(dy, col0, x, (*lo)[t], (*lg)[t], lora_->scale(), dxt, work_);
  };
  // Tensor parallelism (lora.h): a column-parallel layer's n output features (B's rows, tp_out_rows), a
  // row-parallel layer's input features [tp rank × x.size(1), ...) (A's columns).
  auto lora_bwd_out_if = [&](const Tensor& dy, int64_t col0, const Tensor& x, LoraTarget t, int64_t n, Tensor* dxt) {
    if (lo && (*lo)[t].defined())
      lora_bwd(dy, col0, x, tp_out_rows((*lo)[t], n, par_.tp), tp_out_rows((*lg)[t], n, par_.tp), lora_->scale(), dxt,
               work_);
  };
  auto lora_bwd_in_if = [&](const Tensor& dy, const Tensor& x, LoraTarget t, Tensor* dxt) {
    if (!par_.tp) return lora_bwd_if(dy, 0, x, t, dxt);
    if (lo && (*lo)[t].defined())
      lora_bwd_in_cols(dy, x, par_.tp->rank() * x.size(1), (*lo)[t], (*lg)[t], lora_->scale(), dxt, work_);
  };
  const int64_t T = T_, Tl = Tl_, D = cfg_.hidden_size, H = cfg_.num_attention_heads, G = cfg_.num_key_value_heads,
                Hd = cfg_.head_dim, K = cfg_.num_experts_per_tok, E = cfg_.num_experts;
  const float theta = float(cfg_.rope_theta);
  Arena& W = work_;
  const bool acc = !pass_.overwrite_grads;  // parameter gradients: = on a step's first micro-batch

  // wgrad_stream: the experts' weight gradients run on the side stream from their call to the end of
  // this function, beside the rest of the layer's backward. They read dyp (this layer's work arena),
  // xp and hh (kept, or this layer's work arena under recompute), the offsets (kept) and the experts'
  // dgu scratch, and write this layer's expert gradients. Nothing here rewrites those (later
  // allocations of the arena are new memory); the compute stream waits for them below, before the
  // caller hands the gradients over (grads_done), resets the work arena for the next layer or returns.
  bool side_dw = false;

  // FFN: out = h1 + ffn(norm2(h1)). dxn2 sums the experts' (or the MLP's) input gradient and the
  // router's in f32: a bf16 sum would drop the router's share wherever it is below 2^-8 of the rest.
  Tensor dxn2 = W.zeros({Tl, D}, DType::F32);
  if (w.sparse) {
    // etp = tp: the experts' backward reads the output gradient of all T rows; their input and
    // routing-weight gradients are partial sums over the F slices, reduce-scattered to the local rows.
    const bool etp = par_.tp && par_.expert_tp;
    const int64_t Tr = etp ? T : Tl, R = Tr * K;
    const Tensor& wts_e = etp ? a.wts_g : a.wts;
    Tensor dout_e = etp ? tp_gather(dout, W) : dout;
    // The experts' input gradient goes straight into the f32 dxn2, except under etp (partial sums of
    // all T rows, reduce-scattered in the compute dtype first).
    Tensor dxe = etp ? W.zeros({T, D}, act_) : dxn2;
    Tensor dwts;
    if (par_.dispatcher) {
      const moe::DispatchPlan& pl = *a.ep_plan;
      moe::CombineGrads cg = early ? par_.dispatcher->combine_bwd_finish(pl, *early)
                                   : par_.dispatcher->combine_bwd(pl, dout_e, a.ys, cfg_.score_before_experts ? ones_TK(Tr) : wts_e);
      dwts = cg.dw_TK;
      Tensor dxp = W.alloc({pl.rows_received, D}, act_);
      const bool lora_experts =
          lo && lo->experts();
      if (lora_experts)  // the adapters' path: per local expert, no weight gradient of the base
        lora_experts_bwd(*lo, *lg, w, pl.local_offsets, a.xp, a.gu, a.hh, cg.dyr_RD, dxp, local_expert_begin(l));
      if (cfg_.score_before_experts) {  // the weights' gradient comes from the input side
        if (!lora_experts)
          ops::experts_bwd(cg.dyr_RD, a.xp, pl.local_offsets, w.experts_gate_up, w.experts_down, a.gu, a.hh, dxp,
                           g.experts_gate_up, g.experts_down, acc);
        dwts = par_.dispatcher->dispatch_weighted_bwd(pl, dxp, etp ? a.xg2 : a.xn2, wts_e, dxe);
      } else {  // dxp travels back while the experts' weight gradients run
        moe::DispatchBwdPending back;
        auto send_back = [&] { back = par_.dispatcher->dispatch_bwd_start(pl, dxp); };
        if (!lora_experts)
          ops::experts_bwd(cg.dyr_RD, a.xp, pl.local_offsets, w.experts_gate_up, w.experts_down, a.gu, a.hh, dxp,
                           g.experts_gate_up, g.experts_down, acc,
                           opt_.ep_backward_overlap ? send_back : std::function<void()>());
        if (lora_experts || !opt_.ep_backward_overlap) send_back();
        par_.dispatcher->dispatch_bwd_finish(pl, back, dxe);
      }
    } else {
      Tensor dyp = W.alloc({R, D}, act_), dxp = W.alloc({R, D}, act_);
      dwts = W.alloc({Tr, K});
      if (cfg_.score_before_experts)  // y = sum_k expert_k(w_k x): the output side is unweighted
        ops::permute_weighted_fwd(dout_e, a.row_of_assign, ones_TK(Tr), dyp);
      else
        ops::unpermute_bwd(dout_e, a.yp, a.row_of_assign, wts_e, dyp, dwts);
      const bool lora_experts =
          lo && lo->experts();
      side_dw = opt_.wgrad_stream && device_ == Device::CUDA && !lora_experts;
      if (side_dw) wgrad_done_.resize(1, device_, opt_.wgrad_priority);
      if (lora_experts) {
        lora_experts_bwd(*lo, *lg, w, a.offsets, a.xp, a.gu, a.hh, dyp, dxp, 0);
      } else {
        const streams::WgradScope place({side_dw, opt_.wgrad_sms, opt_.wgrad_priority});
        ops::experts_bwd(dyp, a.xp, a.offsets, w.experts_gate_up, w.experts_down, a.gu, a.hh, dxp,
                         g.experts_gate_up, g.experts_down, acc);
      }
      if (side_dw) wgrad_done_.record_side(0);
      if (cfg_.score_before_experts)
        ops::permute_weighted_bwd(dxp, etp ? a.xg2 : a.xn2, a.row_of_assign, wts_e, dxe, dwts);
      else
        ops::permute_bwd(dxp, a.assign_of_row, K, dxe);
    }
    if (etp) {
      Tensor part = W.alloc({Tl, D}, act_);
      tp_reduce_scatter(dxe, part);
      ops::add_(dxn2, part);
      Tensor dw_local = W.alloc({Tl, K});
      tp_reduce_scatter(dwts, dw_local);
      dwts = dw_local;
    }
    Tensor dprobs;
    if (aux_scale != 0) {
      dprobs = W.zeros({Tl, E});
      for_valid_rows([&](int64_t r0, int64_t n) {  // padding rows are not part of the aux loss
        Tensor d = dprobs.rows(r0, n);
        ops::aux_loss_bwd(counts_E_, aux_rows_, float(aux_scale), d);
      });
    }
    Tensor dlogits = W.alloc({Tl, E});
    ops::router_bwd(dwts, dprobs.defined() ? &dprobs : nullptr, a.probs, a.idx, cfg_.norm_topk_prob, dlogits);
    if (pass_.z_loss_scale != 0)
      for_valid_rows([&](int64_t r0, int64_t n) {
        Tensor d = dlogits.rows(r0, n);
        ops::router_z_loss_bwd(a.zlse.rows(r0, n), a.probs.rows(r0, n), float(pass_.z_loss_scale), d);
      });
    ops::linear_bwd(dlogits, a.xn2, w.router, &dxn2, true, g.router, acc);
    lora_bwd_if(dlogits, 0, a.xn2, LoraTarget::Router, &dxn2);
  } else {
    const int64_t I = cfg_.intermediate_size;
    Tensor dout_g = tp_gather(dout, W);
    Tensor dhh = W.alloc({T, I}, act_), dgu = W.alloc({T, 2 * I}, act_);
    ops::linear_bwd(dout_g, a.hh, w.mlp_down, &dhh, false, g.mlp_down, acc);
    lora_bwd_in_if(dout_g, a.hh, LoraTarget::Down, &dhh);
    ops::swiglu_bwd(dhh, a.gu, dgu);
    if (par_.tp) {  // partial input gradients of this rank's columns, summed into the local rows
      Tensor dxg = W.alloc({T, D}, act_), part = W.alloc({Tl, D}, act_);
      ops::linear_bwd(dgu, a.xg2, w.mlp_gate_up, &dxg, false, g.mlp_gate_up, acc);
      lora_bwd_out_if(dgu, 0, a.xg2, LoraTarget::Gate, I, &dxg);
      lora_bwd_out_if(dgu, I, a.xg2, LoraTarget::Up, I, &dxg);
      tp_reduce_scatter(dxg, part);
      ops::add_(dxn2, part);
    } else {
      ops::linear_bwd(dgu, a.xn2, w.mlp_gate_up, &dxn2, true, g.mlp_gate_up, acc);
      lora_bwd_if(dgu, 0, a.xn2, LoraTarget::Gate, &dxn2);
      lora_bwd_if(dgu, I, a.xn2, LoraTarget::Up, &dxn2);
    }
  }
  Tensor dh1 = W.alloc({Tl, D}, DType::F32);  // dout + norm2's input gradient
  if (opt_.fuse_norm_add) {
    ops::add_rms_norm_bwd(dxn2, a.h1, w.post_norm, a.rstd2, dout, dh1, g.post_norm, acc);
  } else {
    ops::rms_norm_bwd(dxn2, a.h1, w.post_norm, a.rstd2, dh1, g.post_norm, acc);
    ops::add_(dh1, dout);
  }

  // Attention: h1 = x + o_proj(attn(rope(qn), rope(kn), v))
  Tensor dh1_g = tp_gather(dh1, W);
  Tensor datt = W.alloc({T, H * Hd}, act_);
  ops::linear_bwd(dh1_g, a.att.view({T, H * Hd}), w.o, &datt, false, g.o, acc);
  lora_bwd_in_if(dh1_g, a.att.view({T, H * Hd}), LoraTarget::O, &datt);
  Tensor dqr = W.alloc({T, H, Hd}, act_), dkr = W.alloc({T, G, Hd}, act_), dv = W.alloc({T, G, Hd}, act_);
  if (sp_) {
    const int64_t Tf = B_ * S_full_, Hl = par_.ulysses->local_heads(), Gl = par_.ulysses->local_kv_heads();
    Tensor dattf = W.alloc({Tf, Hl, Hd}, act_), dqf = W.alloc({Tf, Hl, Hd}, act_), dkf = W.alloc({Tf, Gl, Hd}, act_),
           dvf = W.alloc({Tf, Gl, Hd}, act_);
    par_.ulysses->to_heads_q(datt.view({T, H, Hd}), B_, dattf);
    ops::attention_bwd(dattf, a.qf, a.kf, a.vf, a.attf, a.lse, B_, S_full_, dqf, dkf, dvf, doc_start_ptr());
    par_.ulysses->grads_to_tokens(dqf, dkf, dvf, B_, dqr, dkr, dv);
  } else {
    ops::attention_bwd(datt.view({T, H, Hd}), a.qr, a.kr, a.v.view({T, G, Hd}), a.att, a.lse, B_, S_, dqr, dkr, dv,
                       doc_start_ptr());
  }
  ops::rope_bwd(dqr, pos_T_, theta);
  ops::rope_bwd(dkr, pos_T_, theta);
  Tensor dq = W.alloc({T * H, Hd}, act_), dk = W.alloc({T * G, Hd}, act_);
  ops::rms_norm_bwd(dqr.view({T * H, Hd}), a.q.view({T * H, Hd}), w.q_norm, a.rstd_q, dq, g.q_norm, acc);
  ops::rms_norm_bwd(dkr.view({T * G, Hd}), a.k.view({T * G, Hd}), w.k_norm, a.rstd_k, dk, g.k_norm, acc);
  // q, k and v's input gradients sum in f32 (rounded once, where tp sends them in bf16).
  Tensor dxg1 = W.alloc({T, D}, DType::F32);
  ops::linear_bwd(dq.view({T, H * Hd}), a.xg1, w.q, &dxg1, false, g.q, acc);
  ops::linear_bwd(dk.view({T, G * Hd}), a.xg1, w.k, &dxg1, true, g.k, acc);
  ops::linear_bwd(dv.view({T, G * Hd}), a.xg1, w.v, &dxg1, true, g.v, acc);
  lora_bwd_out_if(dq.view({T, H * Hd}), 0, a.xg1, LoraTarget::Q, H * Hd, &dxg1);
  lora_bwd_out_if(dk.view({T, G * Hd}), 0, a.xg1, LoraTarget::K, G * Hd, &dxg1);
  lora_bwd_out_if(dv.view({T, G * Hd}), 0, a.xg1, LoraTarget::V, G * Hd, &dxg1);
  Tensor dxn1 = dxg1;
  if (par_.tp) {  // partial sums over this rank's heads (a replicated kv head's share included)
    Tensor part = W.alloc({T, D}, act_);
    ops::copy_cast(dxg1, part);
    dxn1 = W.alloc({Tl, D}, act_);
    tp_reduce_scatter(part, dxn1);
  }
  if (opt_.fuse_norm_add) {  // dx = dh1 + norm1's input gradient
    ops::add_rms_norm_bwd(dxn1, a.x, w.in_norm, a.rstd1, dh1, dx, g.in_norm, acc);
  } else {
    ops::rms_norm_bwd(dxn1, a.x, w.in_norm, a.rstd1, dx, g.in_norm, acc);
    ops::add_(dx, dh1);
  }
  if (side_dw) wgrad_done_.compute_waits(0);
}

LossParts Qwen3MoeModel::run(const MicroBatch& whole, const PassOptions& opt, bool backward) {
  const int64_t ntp = par_.tp ? par_.tp->size() : 1;
  // A micro-batch of whole sequences is planned here: positions, shifted targets and values, padding
  // for tp (every sequence padded at its end to the shortest S' with B × S' divisible by tp, exactly as
  // sequence parallelism pads its chunks: padded tokens (id 0, label -100) come after every real token
  // of their sequence, so under causal attention no real query sees them, their rows get a zero
  // gradient, and for_valid_rows keeps them out of every router statistic (aux loss, z-loss, load).
  const MicroBatch mb = whole.plan ? whole : plan_micro_batch(whole, 1, 0, int(ntp));
  const BatchPlan& plan = *mb.plan;
  const Tensor& ids = mb.input_ids;
  if (ids.dim() != 2 || ids.dtype() != DType::I64) MT_THROW("input_ids must be i64 [B, S], got ", ids.desc());
  MT_CHECK(ids.size(1) == plan.chunk && plan.positions.numel() == ids.numel(), "planned micro-batch of chunk ",
           plan.chunk, " for input_ids ", ids.desc());
  if (plan.sp > 1 && (!par_.ulysses || par_.ulysses->size() != plan.sp))
    MT_THROW("a micro-batch sharded over sp ", plan.sp, " needs the model's Ulysses exchange over as many ranks (",
             par_.ulysses ? par_.ulysses->size() : 0, ")");
  const bool has_labels = plan.shifted_labels.defined();
  if (backward && !has_labels) MT_THROW("forward_backward needs labels");
  if (backward && !src_->trainable() && !lora_)
    MT_THROW("forward_backward on frozen weights (Weights::Frozen, no gradients): a frozen model runs forward only");
  if (par_.tp && par_.expert_tp && lora_on_experts())
    MT_THROW("LoRA adapters on the routed experts under expert tensor parallelism (ModelWiring::expert_tp, etp = ",
             "tp = ", ntp, ") are not supported: the experts are F slices there; run the experts whole on each tp ",
             "rank (etp 1) or leave them unadapted");
  pass_lora_ = opt.adapters ? lora_ : nullptr;
  if (backward && lora_ && !opt.adapters)
    MT_THROW("forward_backward with PassOptions::adapters off: the base is frozen, nothing would train");
  if (backward && lora_ && opt.overwrite_grads) lora_->grads().zero_();  // the step's first micro-batch: =, as any
  if (opt.objective && opt.ce_scale != 0)
    MT_THROW("PassOptions: ce_scale ", opt.ce_scale, " and a per-token objective given; use one (the objective path "
             "takes CrossEntropyObjective for cross-entropy)");
  if ((opt.objective || opt.token_logprobs) && opt.logits_out)
    MT_THROW("PassOptions: logits_out materialises the logits; it does not combine with a per-token objective or "
             "token_logprobs (chunked head)");
  if (opt.token_entropy && !opt.token_logprobs) MT_THROW("PassOptions: token_entropy needs token_logprobs");
  if (!(opt.temperature > 0) || !std::isfinite(opt.temperature))
    MT_THROW("PassOptions: temperature ", opt.temperature, "; the head divides the logits by it: need a finite value > 0");
  if (opt.objective && !backward) MT_THROW("a per-token objective applies to forward_backward; forward takes token_logprobs");
  if (opt.objective && dynamic_cast<const ValueObjective*>(opt.objective) && !cfg_.value_head)
    MT_THROW("a value objective on a model with an LM head: it needs a value-head model (ModelConfig::value_head, "
             "score.weight [1, D])");
  if (cfg_.value_head) {
    if (backward && !dynamic_cast<const ValueObjective*>(opt.objective))
      MT_THROW("a value-head model (score.weight [1, D]) trains on a ValueObjective (dL/dv), not ",
               opt.objective ? "a token objective" : "cross-entropy (ce_scale)");
    if (opt.token_logprobs || opt.logits_out || opt.temperature != 1.0)
      MT_THROW("a value-head model has no token distribution: token_logprobs, logits_out and temperature ",
               opt.temperature, " (need 1) do not apply");
  }
  const double aux_scale = backward ? opt.aux_scale : 0.0;
  if (aux_scale != 0 && !aux_enabled())
    MT_THROW("aux_scale ", aux_scale, " given but the aux loss is disabled (output_router_logits false or no MoE layer)");
  const double z_scale = backward ? opt.z_loss_scale : 0.0;
  if (z_scale != 0 && sparse_index(cfg_.num_hidden_layers) == 0)
    MT_THROW("z_loss_scale ", z_scale, " given but the model has no MoE layer (the router z-loss needs one)");
  pass_ = opt;
  pass_.aux_scale = aux_scale;
  pass_.z_loss_scale = z_scale;
  if (!backward) pass_.recompute = Recompute::None;  // nothing is kept for a backward anyway
  dropped_ = 0;

  using Clock = std::chrono::steady_clock;
  auto t0 = Clock::now();
  // The last pass's activations hold their arena blocks: drop them first, so that a reset that merges
  // a chain into one block as large as the peak frees the chain instead of sitting beside it (on the
  // first micro-batch after a growth that was the whole kept set twice: arena_held_at_merge_bytes()).
  for (LayerActs& a : acts_) a = LayerActs{};
  counts_E_ = sums_E_ = zsum_ = Tensor();
  keep_.reset();
  work_.reset();
  B_ = ids.size(0);
  S_ = ids.size(1);
  T_ = B_ * S_;
  if (T_ % ntp != 0)  // a plan made elsewhere must have been made for this tp
    MT_THROW("sequence chunks of ", B_, " x ", S_, " = ", T_, " tokens cannot be split evenly over tp (", ntp,
             ") ranks; plan the micro-batch with plan_micro_batch(..., row_multiple = ", ntp, ")");
  replay_ = plan.routing;
  if (par_.tp && !replay_.empty()) MT_THROW("routing replay is not supported with tensor parallelism (tp ", ntp, ")");
  Tl_ = T_ / ntp;
  const int64_t row0 = par_.tp ? int64_t(par_.tp->rank()) * Tl_ : 0;
  const int64_t T = Tl_, D = cfg_.hidden_size, V = cfg_.vocab_size, E = cfg_.num_experts, L = cfg_.num_hidden_layers;
  const bool cpu = device_ == Device::CPU;
  sp_ = plan.sp > 1;
  S_full_ = plan.padded_len;
  // Real tokens per local row (packed rows may end in padding of their own) and, for packed rows,
  // where each token's document starts (whole rows: attention runs on them, also under sp).
  row_valid_ = plan.row_valid;
  if (row_valid_.empty()) row_valid_.assign(size_t(B_), plan.valid);  // a plan made before packing existed
  MT_CHECK(int64_t(row_valid_.size()) == B_, "plan row_valid has ", row_valid_.size(), " rows for ", B_);
  all_valid_ = std::all_of(row_valid_.begin(), row_valid_.end(), [&](int64_t v) { return v == S_; });
  doc_start_ = plan.doc_start.defined() ? (cpu ? plan.doc_start : plan.doc_start.to(device_)) : Tensor();
  // All T_ rows' positions (under tp RoPE runs on the gathered rows); this rank's rows of the rest.
  pos_T_ = cpu ? plan.positions : plan.positions.to(device_);
  Tensor lab_host = Tensor::empty({T}, DType::I64);
  if (has_labels) lab_host = plan.shifted_labels.rows(row0, T);
  else std::fill_n(lab_host.data<int64_t>(), T, int64_t(-100));
  Tensor labels_T = cpu ? lab_host : lab_host.to(device_);
  Tensor ids_T = ids.to(device_).view({T_}).rows(row0, T);

  const int64_t n_sparse = cfg_.num_sparse_layers();
  // The aux loss's N: router rows of the whole real sequences of this data-parallel rank (under sequence
  // and tensor parallelism the sp and tp ranks' real tokens together; reduce_aux_stats multiplies by
  // the data-parallel ranks only). Packed rows: their real tokens, padding excluded.
  aux_rows_ = (plan.row_valid.empty() ? B_ * plan.seq_len : plan.real_tokens) * n_sparse;
  if (n_sparse > 0) {
    counts_E_ = keep_.zeros({E}, DType::I64);
    sums_E_ = keep_.zeros({E});
    zsum_ = keep_.zeros({1});
    if (!load_LE_.defined()) load_LE_ = Tensor::zeros({n_sparse, E}, DType::I64, device_);
  }

  // Parameter units in the order this micro-batch uses them (see param_source.h): forward 0, 1..L,
  // head (+ 0 when tied); backward head (+ 0 when tied), L..1, then the embedding's gradient.
  const int head = plan_->head, embed = plan_->embed;
  const bool tied = cfg_.tie_word_embeddings;
  // Units are announced prefetch_depth ahead of their use: position l < L is block l, L the head.
  auto fwd_prefetch = [&](int64_t pos) {
    if (pos < L)
      for (int u : block_units(pos)) src_->prefetch(u);
    else if (pos == L)
      src_->prefetch(head);
  };
  src_->begin_pass(backward);
  acquire(embed);
  for (int64_t p = 0; p < opt_.prefetch_depth; ++p) fwd_prefetch(p);
  Tensor h = keep_.alloc({T, D}, DType::F32);
  ops::embedding_fwd(ids_T, w_.embed, h);
  release(embed);
  // fuse_norm_add under recompute none (and moe, which keeps h1 too): each block leaves its output's
  // add (h1, kept in keep_) to the next block's input norm, or the final norm (pending). Under full and
  // selective h1 lives in the work arena, which the next block resets first, so the blocks add their
  // outputs themselves.
  const Recompute rc = pass_.recompute;
  const bool defer_add = opt_.fuse_norm_add && (rc == Recompute::None || rc == Recompute::Moe);
  // Selective and moe keep the exchanged rows under expert parallelism (keeps_exchanges).
  auto kept_exchanges = [&](const LayerActs& a) {
    return (rc == Recompute::Selective || rc == Recompute::Moe) && keeps_exchanges(a);
  };
  Tensor pending;
  for (int64_t l = 0; l < L; ++l) {
    LayerActs& a = acts_[size_t(l)];
    a = LayerActs{};
    a.x = h;
    Tensor out = keep_.alloc({T, D}, DType::F32);
    work_.reset();  // a layer's scratch (under recompute none only what its backward does not read)
    for (int u : block_units(l)) acquire(u);
    fwd_prefetch(l + opt_.prefetch_depth);
    Tensor add_in = pending;
    forward_layer(l, a, out, false, add_in, defer_add ? &pending : nullptr);
    for (int u : block_units(l)) release(u);
    // Rebuilt by the recompute (EP keeps them off the arenas), except what selective and moe keep under EP.
    if (rc != Recompute::None && !kept_exchanges(a)) {
      a.xp = Tensor();
      a.ys = Tensor();
    }
    if (cfg_.is_sparse_layer(l)) {
      Tensor load_E = load_LE_.rows(sparse_index(l), 1).view({E});
      for_valid_rows([&](int64_t r0, int64_t n) {  // real tokens only: padding is not part of any statistic
        ops::expert_counts(a.idx.rows(r0, n), E, counts_E_);
        ops::prob_column_sums(a.probs.rows(r0, n), sums_E_);
        if (backward) ops::expert_counts(a.idx.rows(r0, n), E, load_E);
      });
    }
    h = out;
  }
  work_.reset();
  acquire(head);
  if (tied) acquire(embed);
  if (backward)
    for (int64_t l = L - 1; l >= std::max<int64_t>(0, L - opt_.prefetch_depth); --l)
      for (int u : block_units(l)) src_->prefetch(u);
  Tensor hn = keep_.alloc({T, D}, act_), rstd_f = keep_.alloc({T});
  if (pending.defined())  // the last block's output add
    ops::add_rms_norm_fwd(h, pending, w_.norm, float(cfg_.rms_norm_eps), hn, rstd_f);
  else
    ops::rms_norm_fwd(h, w_.norm, float(cfg_.rms_norm_eps), hn, rstd_f);
  const bool tempered = opt.temperature != 1.0;  // logits / T = (hn / T) W (PassOptions::temperature)
  if (tempered) ops::scale_(hn, float(1.0 / opt.temperature));

  LossParts out;
  for (int64_t t = 0; t < T; ++t) out.n_valid += lab_host.data<int64_t>()[t] != -100 ? 1 : 0;
  if (aux_enabled()) {
    if (par_.reduce_aux_stats) par_.reduce_aux_stats(counts_E_, sums_E_, aux_rows_);
    out.aux = ops::aux_loss_value(counts_E_, sums_E_, aux_rows_);
  }
  // The heads. (1) Training on cross-entropy with no logits requested: the fused, chunked LM head +
  // loss, one pass that never holds the f32 logits of the whole micro-batch. (2) A per-token objective,
  // or log-probabilities requested: the chunked head computes logp (and entropy) first, the objective
  // its coefficients from them, then the chunked backward takes those. (3) Otherwise (logits_out, or a
  // forward that reports ce_sum) the logits are materialised.
  const double ce_scale = opt.ce_scale;
  const TokenObjective* obj = backward ? opt.objective : nullptr;
  // (4) A value head (ModelConfig::value_head): v = hn w^T, one column, and its objective's dL/dv.
  const ValueObjective* vobj = obj ? dynamic_cast<const ValueObjective*>(obj) : nullptr;
  const bool want_entropy = opt.token_entropy || (obj && obj->needs_entropy());
  const bool chunked = obj || opt.token_logprobs;
  const bool fused_head = backward && !opt.logits_out && !chunked;
  Tensor logits, lse;
  if (cfg_.value_head) {
    Tensor v_T1 = keep_.alloc({T, 1});
    ops::linear_fwd(hn, w_.lm_head, v_T1);
    out.value = v_T1.view({T}).clone();  // outlives the pass
  } else if (chunked) {
    out.logp = Tensor::empty({T}, DType::F32, device_);  // outlives the pass: not in an arena
    if (want_entropy) out.entropy = Tensor::empty({T}, DType::F32, device_);
    ops::lm_head_logprobs(hn, w_.lm_head, labels_T, 0, out.logp, want_entropy ? &out.entropy : nullptr);
    if (has_labels) out.ce_sum = -host_sum(out.logp);
  } else if (!fused_head) {
    logits = keep_.alloc({T, V});
    lse = keep_.alloc({T});
    ops::linear_fwd(hn, w_.lm_head, logits);
    if (has_labels) out.ce_sum = ops::cross_entropy_fwd(logits, labels_T, lse, &out.n_valid);
    if (opt.logits_out) *opt.logits_out = logits.clone();
  }
  if (n_sparse > 0) out.z = double(zsum_.to(Device::CPU).data<float>()[0]);
  auto total = [&] { return (obj ? out.objective : out.ce_sum * ce_scale) + out.aux * aux_scale + out.z * z_scale; };
  out.loss = total();
  out.dropped_assignments = dropped_;
  device_mem::synchronize(device_);
  auto t1 = Clock::now();
  forward_s_ = std::chrono::duration<double>(t1 - t0).count();
  backward_s_ = 0;
  if (!backward) {
    release(head);
    if (tied) release(embed);
    return out;
  }

  grads_for(head);
  if (tied) grads_for(embed);
  Tensor dhn = keep_.alloc({T, D}, act_);
  const bool acc = !pass_.overwrite_grads;  // the embedding's second use (tied) then still adds
  if (vobj) {
    TokenRows rows;
    rows.rows = T;
    rows.labels = lab_host;
    rows.value = out.value;
    for (const Tensor& v : plan.shifted_values) rows.values.push_back(v.rows(row0, T));
    Tensor dv = Tensor::zeros({T}, DType::F32, device_);
    out.objective = vobj->value_coefficients(rows, dv);
    Tensor dv_host = dv.to(Device::CPU);  // ignored rows get no gradient, whatever the objective wrote
    for (int64_t t = 0; t < T; ++t)
      if (lab_host.data<int64_t>()[t] == -100) dv_host.data<float>()[t] = 0;
    Tensor dv_T1 = keep_.alloc({T, 1});
    dv_T1.copy_from(cpu ? dv_host.view({T, 1}) : dv_host.view({T, 1}).to(device_));
    ops::linear_bwd(dv_T1, hn, w_.lm_head, &dhn, false, g_.lm_head, acc);
    out.loss = total();
  } else if (obj) {
    TokenRows rows;
    rows.rows = T;
    rows.labels = lab_host;
    rows.logp = out.logp;
    rows.entropy = out.entropy;
    for (const Tensor& v : plan.shifted_values) rows.values.push_back(v.rows(row0, T));
    Tensor dlogp = Tensor::zeros({T}, DType::F32, device_), dent;
    if (obj->needs_entropy()) dent = Tensor::zeros({T}, DType::F32, device_);
    out.objective = obj->coefficients(rows, dlogp, dent.defined() ? &dent : nullptr);
    ops::lm_head_objective_bwd(hn, w_.lm_head, labels_T, dlogp, dent.defined() ? &dent : nullptr, 0, dhn, g_.lm_head,
                               acc);
    out.loss = total();
  } else if (fused_head) {
    Tensor loss_sum = keep_.zeros({1});
    ops::lm_head_cross_entropy(hn, w_.lm_head, labels_T, float(ce_scale), 0, loss_sum, dhn, g_.lm_head, acc);
    out.ce_sum = double(loss_sum.to(Device::CPU).data<float>()[0]);
    out.loss = total();
  } else {
    Tensor dlogits = keep_.alloc({T, V});
    ops::cross_entropy_bwd(logits, labels_T, lse, float(ce_scale), dlogits);
    ops::linear_bwd(dlogits, hn, w_.lm_head, &dhn, false, g_.lm_head, acc);
  }
  if (tempered) ops::scale_(dhn, float(1.0 / opt.temperature));  // d(hn / T) / d hn
  Tensor dA = keep_.alloc({T, D}, DType::F32), dB = keep_.alloc({T, D}, DType::F32);
  ops::rms_norm_bwd(dhn, h, w_.norm, rstd_f, dA, g_.norm, acc);
  release(head);
  if (tied) release(embed);
  if (!base_frozen()) src_->grads_done(head);
  for (int64_t l = L - 1; l >= 0; --l) {
    LayerActs& a = acts_[size_t(l)];
    work_.reset();
    const std::vector<int> us = block_units(l);
    for (int u : us) acquire(u);
    if (l - opt_.prefetch_depth >= 0)
      for (int u : block_units(l - opt_.prefetch_depth)) src_->prefetch(u);
    for (int u : us) grads_for(u);
    // Selective and moe recompute under expert parallelism kept the combined rows, so the combine's
    // backward (one all-to-all) needs nothing the recompute makes: it starts first and travels meanwhile.
    std::optional<moe::CombineBwdPending> early;
    if (kept_exchanges(a) && !(par_.tp && par_.expert_tp))
      early = par_.dispatcher->combine_bwd_start(*a.ep_plan, dA, a.ys, cfg_.score_before_experts ? ones_TK(T) : a.wts);
    if (rc != Recompute::None) {
      // Moe's recompute forms no block output, except through a combine that must rebuild its rows
      // (a dispatcher whose exchanged rows were not kept).
      const bool want_out = rc != Recompute::Moe || (par_.dispatcher && cfg_.is_sparse_layer(l) && !kept_exchanges(a));
      Tensor scratch_out = want_out ? work_.alloc({T, D}, DType::F32) : Tensor(), dropped;
      // a.x is the block input already (any deferred add was done in the forward); the output's add is
      // dropped with fuse_norm_add (nothing reads scratch_out's sum).
      forward_layer(l, a, scratch_out, true, Tensor(), opt_.fuse_norm_add ? &dropped : nullptr);
    }
    backward_layer(l, a, dA, dB, aux_scale, early ? &*early : nullptr);
    // The layer's activations are spent: free them now (under expert parallelism the exchanged rows live
    // outside the arenas; the recomputed ones hold a work-arena block the next layer's reset may merge
    // away). The routing ids stay for last_routing().
    Tensor idx = a.idx;
    a = LayerActs{};
    a.idx = idx;
    for (int u : us) release(u);
    if (!base_frozen())
      for (int u : us) src_->grads_done(u);
    std::swap(dA, dB);
  }
  if (!base_frozen()) {  // adapters leave the embedding as it is
    grads_for(embed);
    ops::embedding_bwd(ids_T, dA, g_.embed, acc || cfg_.tie_word_embeddings);
    src_->grads_done(embed);
  }
  device_mem::synchronize(device_);
  backward_s_ = std::chrono::duration<double>(Clock::now() - t1).count();
  return out;
}

}  // namespace mt
