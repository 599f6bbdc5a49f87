// Qwen3-MoE (and dense Qwen3) with explicit per-layer forward and backward, written for one
// device; parallelism is applied from outside. Parameters, gradients and optimizer states are
// flat buffers laid out by ParamTable. Activations live in arenas reset per micro-batch.
//
// Precision on CUDA: fp32 master weights, gradients and optimizer state; bf16 compute weights and
// activations; the residual stream (each block's input and output, and the gradient along it) stays
// f32, as under PyTorch's fp32-master + bf16-autocast policy, so that additions over many layers
// do not round to bf16 at every step. The RMSNorm gains and the MoE router are read from the f32
// masters, not from bf16 copies (ParamSource::fp32_param); the router runs in fp32 end to end
// (logits, softmax, its GEMMs and gradients). Input gradients that several GEMMs sum (q/k/v into
// the attention norm, experts and router into the FFN norm) are summed in f32.
//
// Contracts: forward_backward accumulates (+=) parameter gradients, so micro-batches add up; with
// first_micro_batch set it writes them (=) instead, so the caller need not zero them first.
// Everything that needs data about the whole micro-batch (positions, shifted labels) is computed
// before the first layer and passed in. Full recompute keeps each block's input and routing
// decision (probabilities, top-k ids and weights, dispatch plan) and recomputes the rest from
// them, never re-deciding routing, so its results are bit-identical to no recompute.
#pragma once
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "core/arena.h"
#include "core/streams.h"
#include "model/config.h"
#include "model/lora.h"
#include "model/param_source.h"
#include "model/params.h"
#include "model/micro_batch.h"
#include "moe/dispatcher.h"

namespace mt {

class UlyssesExchange;  // moe/ulysses.h

// none: keep every activation. full: keep each block's input and routing decision, recompute the
// rest before the block's backward. selective: as full, but also keep the attention output and its
// log-sum-exp, so the recompute skips attention (the S^2 part) and rebuilds only the cheap rest;
// under expert parallelism it also keeps the rows both all-to-alls delivered (no exchange in the recompute).
// moe: keep everything none keeps except the FFN's hidden activations, which are K times the tokens
// for an MoE layer (the dispatched rows xp [R, D], the experts' gate_up gu [R, 2F] and SwiGLU hh
// [R, F], their outputs yp [R, D]; a dense MLP's gu and hh): the recompute re-runs only the
// dispatch gather and the experts (or the MLP's gate_up and SwiGLU) from the kept normed input and
// routing. Under expert parallelism it keeps the exchanged rows as selective does (no all-to-all in
// the recompute) and rebuilds gu and hh. docs/model.md has the bytes each policy keeps.
enum class Recompute { None, Full, Selective, Moe };
Recompute parse_recompute(const std::string& s);  // "none" | "full" | "selective" | "moe"
const char* recompute_name(Recompute r);

struct LossParts {
  double ce_sum = 0;    // sum of token cross-entropies over valid labels (-sum of logp on the objective path)
  int64_t n_valid = 0;  // labels != -100 after the shift
  double aux = 0;       // unscaled load-balancing loss of this micro-batch (0 when disabled)
  double z = 0;         // router z-loss sum: logsumexp(router logits)^2 summed over every sparse layer's rows
  double objective = 0;  // the per-token objective's value (PassOptions::objective), 0 without one
  // ce_sum * ce_scale (or objective) + aux * aux_scale (+ z * z_loss_scale in forward_backward)
  double loss = 0;
  int64_t dropped_assignments = 0;  // this rank's assignments dropped at the experts' capacity
  // PassOptions::token_logprobs: log p(target) and, with token_entropy, the entropy of every local
  // target row (f32 [rows] on the model's device, 0 on ignored rows; under tp this rank's rows).
  Tensor logp, entropy;
  // Value-head models (ModelConfig::value_head): v_t of every local row, f32 [rows] on the model's
  // device, in every forward and forward_backward (ce_sum then stays 0).
  Tensor value;
};

class TokenObjective;  // model/objective.h

// The paged KV cache forward_cached reads and writes (the model's side of the rollout engine's memory):
// per layer, keys and values in slots [slots, G, Hd] of the activation dtype, slot = block × block_size
// + offset. Which sequence owns which block is the block manager's business (rollout/kv_blocks.h); the
// model sees only tensors and block tables.
struct KvCache {
  int64_t block_size = 0;
  std::vector<Tensor> k, v;  // per layer [num_blocks × block_size, G, Hd]
  int64_t num_blocks() const { return k.empty() ? 0 : k[0].size(0) / block_size; }
  // Uninitialised (every slot is written before it is read); the model's config, device and activation
  // dtype decide the shapes.
  static KvCache allocate(const ModelConfig& c, Device device, int64_t num_blocks, int64_t block_size);
  // Copies block src into block dst in every layer, K and V (copy-on-write of a shared block).
  void copy_block(int64_t src, int64_t dst);
};

// One inference step over the cache: N new tokens of B sequences, prefill chunks and single decode
// tokens in one batch. All i32 but tokens; host tensors (the model moves them).
struct CachedBatch {
  Tensor tokens;       // i64 [N]
  Tensor positions;    // i32 [N]: each token's position in its sequence
  Tensor seq;          // i32 [N]: the row of block_table of its sequence
  Tensor slots;        // i32 [N]: the slot its key and value go to
  Tensor block_table;  // i32 [B, M]: each sequence's blocks in position order (unused entries any valid id)
  Tensor logit_rows;   // i64 [R]: the tokens whose next-token logits are wanted (e.g. each sequence's last)
};

// The defaults of ModelOptions::fuse_norm_add and fuse_gemm_add: the environment variables
// MOETRAIN_FUSE_NORM_ADD and MOETRAIN_FUSE_GEMM_ADD, "1" (or unset/empty) on, "0" off, read once per
// process (anything else is an error naming the variable and its value).
bool fuse_norm_add_default();
bool fuse_gemm_add_default();
// The defaults of ModelOptions::wgrad_stream, wgrad_sms and wgrad_priority, read once per process:
// MOETRAIN_WGRAD_STREAM "0" (or unset/empty) off, "1" on; MOETRAIN_WGRAD_SMS unset/empty 0 (automatic),
// else a whole number >= 1 (parse_wgrad_sms); MOETRAIN_WGRAD_PRIORITY "high" (or unset/empty) or "low".
// Anything else is an error naming the variable and value.
bool wgrad_stream_default();
int wgrad_sms_default();
int parse_wgrad_sms(const std::string& value);
streams::Side wgrad_priority_default();

// How the model runs, fixed for its life. (What it computes is the ModelConfig's, including
// ModelConfig::score_before_experts, which travels in the checkpoint's config.json; these options change
// only how, never the result beyond rounding.)
struct ModelOptions {
  // How many units ahead of their use the model announces them to the ParamSource (prefetch). Under
  // FSDP each is an all-gather started that early, on the communicator's stream, and one more
  // gathered unit held in memory. Measured on 2 H200s (bench-4L, batch 4 per GPU): 2 gave no gain
  // over 1 (98.6k vs 99.4k tokens/s per GPU, within noise), so 1 is the default.
  int64_t prefetch_depth = 1;
  // Expert parallelism: the experts' input gradient travels back to its sources while their weight
  // gradients run (ops::experts_bwd's after_dx). Off: after them (the A/B of train_step --no-ep-overlap).
  bool ep_backward_overlap = true;
  // Residual-stream fusions (each gives the same loss and gradients, bit for bit on the CPU; A/B
  // switches for the benchmark). fuse_norm_add: a residual add followed by the RMSNorm of its result is
  // one op (ops::add_rms_norm_fwd): the post-attention h1 = x + o_proj(..) then norm2, and, under
  // recompute none, the block output's add out = h1 + ffn(..), deferred to the next block's input norm
  // (or the final norm); the backward's two "rms_norm_bwd then add_ into the residual gradient" pairs
  // likewise (ops::add_rms_norm_bwd). fuse_gemm_add: where a GEMM's f32 output goes straight into the
  // residual (o_proj, the dense MLP's down projection, without tp), the add is in the GEMM's epilogue
  // (ops::linear_fwd_add) and no separate add remains; the experts' output (unpermute) and tp's
  // reduce-scattered outputs keep the add (fused with the next norm when fuse_norm_add is on).
  bool fuse_norm_add = fuse_norm_add_default();
  bool fuse_gemm_add = fuse_gemm_add_default();
  // The experts' two weight-gradient GEMMs (f32 += traffic, memory bound) on the side stream,
  // beside the rest of their layer's backward (router, norms, attention, q/k/v/o: compute bound), on
  // CUDA with the local dispatch (no expert parallelism) and the grouped experts path; elsewhere a
  // no-op (the CPU has one stream). The same GEMMs in the same order into each gradient: the same
  // bits. The compute stream waits for them at the end of the layer's backward (core/streams.h,
  // WgradScope). wgrad_sms: the weight-gradient GEMMs' CTAs (persistent grid), on either stream; 0:
  // all SMs on the compute stream, half on the side stream. wgrad_priority: which side stream, high
  // (the urgent one: the GEMMs' CTAs take SMs as soon as they free up, the compute stream keeps the
  // rest) or low (the optimizer's: they get SMs only where the compute stream leaves some idle).
  bool wgrad_stream = wgrad_stream_default();
  // A frozen model on CUDA that holds its own parameters keeps f32 masters in host memory (true), or none
  // (false: LocalParams::fill_from_host writes its device copies; the base of a LoRA run).
  bool frozen_host_masters = true;
  int wgrad_sms = wgrad_sms_default();
  streams::Side wgrad_priority = wgrad_priority_default();
};

// The parallel parts the model calls (parallel/parallel_model.cpp attaches them once, before the first
// pass). All must outlive the model's calls; null / unset: that parallelism is absent.
struct ModelWiring {
  // Expert parallelism: moves tokens to the ranks that own their experts (the ParamSource then holds
  // only this rank's experts). Null: every expert is local.
  moe::ExpertDispatcher* dispatcher = nullptr;
  // Tensor parallelism (parallel/tensor_parallel.h): the tp group, in tp order; the model's config is
  // then the tp-local one (H / tp heads, ...). tp rank r holds rows [r T / tp, (r + 1) T / tp) of the
  // flattened micro-batch (T = B S) between the blocks' column- and row-parallel parts: embedding,
  // norms, residual, router, head and loss run on those rows; attention and the dense MLPs gather all
  // T rows over tp and reduce-scatter their partial outputs back. expert_tp (etp = tp): the experts are
  // F slices too, run on all T rows (inputs and routing gathered), outputs reduce-scattered; otherwise
  // (etp = 1) they run on the local rows. LossParts and logits then cover the local rows.
  comm::Communicator* tp = nullptr;
  bool expert_tp = false;
  // Sequence parallelism (Ulysses): attention's all-to-alls over the sp group, used for micro-batches
  // planned with sp > 1 (others, e.g. evaluation, run whole sequences on every rank).
  UlyssesExchange* ulysses = nullptr;
  // Data parallelism: sums the load-balancing statistics (per-expert counts i64 [E], probability
  // column sums f32 [E], and the row count) over the ranks that hold other samples of the batch, so
  // the aux loss is the one of the global batch. Under sequence parallelism the counts and sums are
  // this rank's real tokens only, and the row count is already that of the whole sequences of its
  // micro-batch (B × S × sparse layers, real tokens only; the same under tensor parallelism), so the
  // hook sums counts over dp × sp (× tp) and multiplies rows by dp.
  // Called once per micro-batch between the forward and the loss, only when the aux loss is enabled
  // (the same on every rank).
  std::function<void(Tensor& counts_E, Tensor& sums_E, int64_t& rows)> reduce_aux_stats;
};

// One pass's inputs besides the micro-batch.
struct PassOptions {
  // The objective of forward_backward: cross-entropy times ce_scale through the fused LM head + loss
  // (objective null), or a per-token objective (model/objective.h), whose coefficients the head's
  // backward takes. The trainer passes ce_scale = 1 / (target tokens of the whole step on all ranks),
  // so micro-batches and data-parallel ranks add up to the step's mean.
  double ce_scale = 0;
  const TokenObjective* objective = nullptr;
  double aux_scale = 0;  // the load-balancing loss's weight (only when aux_enabled())
  // Router z-loss (ST-MoE): forward_backward also differentiates z_loss_scale * LossParts::z; the
  // trainer passes coef / (router rows of the whole step on all ranks: tokens x sparse layers). 0 = off
  // (z is still computed and reported; the gradients are exactly those without z-loss).
  double z_loss_scale = 0;
  Recompute recompute = Recompute::None;  // forward_backward only
  // Write grads (=, none read) instead of adding to them: the first micro-batch of a step, in place of
  // zero_grads().
  bool overwrite_grads = false;
  // When given, receives the logits (rows, V) (materialised: not the fused path); under tensor
  // parallelism this rank's rows of the B × padded_seq_len() rows.
  Tensor* logits_out = nullptr;
  bool token_logprobs = false;  // LossParts::logp (and entropy with token_entropy), chunked head
  bool token_entropy = false;
  // Every head (log-probs, entropy, objective, cross-entropy, logits_out) sees logits / temperature: the
  // sampler's distribution softmax(logits / T), so an RL update's ratios compare like with like. The
  // logits are linear in the final normed hidden state, so the head reads hn / T (one scale of [T, D],
  // and of its gradient in the backward); 1 leaves the pass unchanged. Must be > 0 and finite.
  double temperature = 1.0;
  // With adapters attached (attach_lora): false runs this forward on the base alone (the RL reference of a
  // LoRA policy is its frozen base: no second copy of the model). A backward needs them.
  bool adapters = true;
};

class Qwen3MoeModel {
 public:
  // With no source the model holds its own parameters (LocalParams), trainable or frozen (`weights`:
  // a frozen model has no gradient memory and only runs forward()); with a source (FSDP), which must
  // outlive the model, the source decides.
  explicit Qwen3MoeModel(const ModelConfig& config, Device device = Device::CPU, ParamSource* source = nullptr,
                         Weights weights = Weights::Trainable, const ModelOptions& options = {});
  ~Qwen3MoeModel();

  const ModelConfig& config() const { return cfg_; }
  const ParamTable& table() const { return table_; }
  const ModelOptions& options() const { return opt_; }
  // Once, before the first pass (ParallelModel::attach).
  void attach(ModelWiring wiring);
  // Low-rank adapters (model/lora.h) on the model's GEMMs, from then on. The base weights are frozen: a
  // backward computes the adapters' gradients (into lora->grads(), written on a step's first micro-batch as
  // any gradient) and none of the base's, so the model's source may be frozen (Weights::Frozen). One
  // process, FSDP, expert or sequence parallelism; tensor parallelism is refused (the pass says so). The
  // adapters must outlive the model's calls; null detaches them.
  void attach_lora(LoraAdapters* lora);
  LoraAdapters* lora() const { return lora_; }
  const ModelWiring& wiring() const { return par_; }
  // The full buffers of a model that holds its own parameters (no external ParamSource).
  LocalParams& local();
  Tensor& params() { return local().params(); }  // f32 (P): the master weights
  Tensor& grads() { return local().grads(); }    // f32 (P)
  // The weights the forward reads: bf16 (P) on CUDA, the master weights themselves on the CPU. After
  // changing params() other than through AdamW::step(..., compute_params()), call
  // refresh_compute_weights().
  Tensor* compute_params() { return local().has_compute_copy() ? &local().compute() : nullptr; }
  void refresh_compute_weights() { local().refresh_compute_weights(); }
  Device device() const { return device_; }
  DType activation_dtype() const { return act_; }
  void zero_grads() { local().grads().zero_(); }
  ParamSource& param_source() { return *src_; }
  bool aux_enabled() const;  // output_router_logits and at least one sparse layer

  // Forward and backward of one micro-batch: the gradients of the objective (+ aux_scale * aux +
  // z_loss_scale * z) are accumulated into grads() (written with overwrite_grads). A micro-batch
  // without a plan is planned here (whole sequences, padded for tp).
  LossParts forward_backward(const MicroBatch& mb, const PassOptions& opt);
  // The cross-entropy case: forward_backward(mb, {.ce_scale, .aux_scale, .logits_out}).
  LossParts forward_backward(const MicroBatch& mb, double ce_scale, double aux_scale, Tensor* logits_out = nullptr);
  // Forward only; labels optional (ce_sum then 0). Without logits_out or token_logprobs and with labels
  // the logits are materialised for ce_sum.
  LossParts forward(const MicroBatch& mb, const PassOptions& opt);
  LossParts forward(const MicroBatch& mb, Tensor* logits_out);
  // The last micro-batch's local sequence length as the model ran it: S, or under tensor parallelism
  // the shortest S' >= S with B × S' divisible by tp (each sequence padded at its end).
  int64_t padded_seq_len() const { return S_; }

  // Inference over a paged KV cache, between begin_inference() and end_inference(): each new token's key
  // and value are written to its slot, its attention reads its sequence's cached positions 0..its own,
  // and the logits of the logit_rows come back, f32 [R, V] on the model's device. The same maths as
  // forward(): a sequence decoded token by token gives the logits of its full forward (tests/rollout).
  // With routing_out, the expert ids every sparse layer chose for each new token (i32 [N, K] per sparse
  // layer, on the model's device: no layer waits for the host). The aux-loss-free router bias applies
  // as in training.
  // Layouts: one device, plain FSDP (every rank decodes its own sequences on the gathered weights, no
  // collective per call) and expert parallelism (attention data parallel; each sparse layer exchanges
  // the tokens with the ranks owning their experts: every rank of the ep group must call forward_cached
  // the same number of times, with N = 0 tokens when it has none). Tensor and sequence parallelism are
  // refused.
  Tensor forward_cached(const CachedBatch& batch, KvCache& cache, std::vector<Tensor>* routing_out = nullptr);
  // forward_cached on inputs already on the model's device, writing the logits into logits_RV (f32 [R, V]) and,
  // with routing_into (one i32 [>= N, K] tensor per sparse layer, on the device), each sparse layer's expert ids
  // into its rows 0..N. It allocates nothing but from the model's arenas and launches no host synchronisation:
  // what a CUDA graph of a decode step captures (rollout/engine.cpp), when capturable_cached() says so.
  void forward_cached_into(const CachedBatch& device_batch, KvCache& cache, Tensor& logits_RV,
                           std::vector<Tensor>* routing_into);
  // Resets the activation arenas now, merging their blocks (a capture must find them settled: a merge
  // inside it would allocate).
  void settle_arenas() {
    keep_.reset();
    work_.reset();
  }
  // CUDA, one process's weights (no expert parallelism, whose exchange plans live on the host).
  bool capturable_cached() const {
    return device_ == Device::CUDA && !par_.dispatcher && !par_.tp && !par_.ulysses;
  }
  // The inference layout: every unit's compute weights acquired (under FSDP: all-gathered once, the
  // experts over their expert-shard group; with ep > 1 each rank keeps its own experts) and the fp32
  // gains refreshed, held until end_inference(). A rollout phase's weight sync: call it after each
  // optimizer step, before generating. Returns its seconds. Collective under FSDP.
  double begin_inference();
  void end_inference();
  bool in_inference() const { return inference_; }

  // The top-k expert ids (i32 [T, K], host copies) each sparse layer used in the last forward: the
  // form MicroBatch::routing takes for a replay.
  std::vector<Tensor> last_routing() const;

  // Aux-loss-free balancing (DeepSeek-V3): a bias per sparse layer and expert (f32 [sparse layers, E],
  // on the model's device) added to the router probabilities for the top-k choice only; the routing
  // weights stay the unbiased probabilities. Not a trained parameter (no gradient, not in the HF
  // weights): optimizer-like state that the trainer updates after each optimizer step. It changes only
  // between forward_backward calls, and recompute reuses the stored routing, so forward and recompute
  // always agree. Routing replay ignores it. enable_router_bias() allocates it (zeros).
  void enable_router_bias();
  Tensor& router_bias() { return router_bias_LE_; }  // undefined unless enabled
  // Tokens routed to each expert (i64 [sparse layers, E], on the model's device), added up over every
  // forward_backward since the last reset_expert_load(): a training step's load, before any reduction
  // over data-parallel ranks. Undefined when the model has no sparse layer.
  Tensor& expert_load() { return load_LE_; }
  void reset_expert_load();
  size_t activation_peak_bytes() const { return keep_.peak() + work_.peak(); }
  // Arena blocks a merging reset found still held by the model's tensors (Arena::held_at_merge; the
  // keep arena's, then the work arena's): memory that stood twice for a moment.
  size_t arena_held_at_merge_bytes(bool work) const { return work ? work_.held_at_merge() : keep_.held_at_merge(); }
  // Wall time of the last call's forward (through the loss) and backward (including recompute).
  double last_forward_seconds() const { return forward_s_; }
  double last_backward_seconds() const { return backward_s_; }

 private:
  // forward_cached's body (routing_into: copy into the caller's tensors instead of appending clones).
  void cached_pass(const CachedBatch& device_batch, KvCache& cache, Tensor& logits_out,
                   std::vector<Tensor>* routing_out, bool routing_into);
  struct LayerActs;
  LossParts run(const MicroBatch& mb, const PassOptions& opt, bool backward);
  // add_in (defined only when the previous block deferred its output's add): a.x += add_in, fused with
  // the input norm. add_out (non-null: fuse_norm_add): when the block output still lacks h1, *add_out =
  // h1 for the caller to add (fused with the next norm; a recompute drops it, as out is not read), else
  // an undefined tensor; null: out is complete on return.
  void forward_layer(int64_t l, LayerActs& a, Tensor& out, bool routing_known, const Tensor& add_in = Tensor(),
                     Tensor* add_out = nullptr);
  bool keeps_exchanges(const LayerActs& a) const;
  // The adapters' forward beside one GEMM (p undefined: that weight is not adapted).
  void lora_fwd_if(const Tensor& x, const LoraPair& p, Tensor& y, int64_t col0);
  // The routed experts' forward on the local dispatch (ops::experts_fwd); with adapters on them (lo), the base's
  // grouped GEMMs each followed by its adapters' grouped low-rank product (lora.h), no host synchronisation.
  // offsets: the local experts' rows; e0: the global id of local expert 0 (expert parallelism), whose adapters
  // are the e0 + e-th of the layer's.
  void run_experts_fwd(const LayerLora* lo, const LayerWeights& w, const Tensor& offsets, const Tensor& xp, Tensor& gu,
                       Tensor& hh, Tensor& yp, int64_t e0);
  bool lora_on_experts() const;  // adapters on some routed expert weights
  // Their backward with adapters: input and adapter gradients, none of the base's weights.
  void lora_experts_bwd(const LayerLora& lo, const LayerLora& lg, const LayerWeights& w, const Tensor& offsets,
                        const Tensor& xp, const Tensor& gu, const Tensor& hh, const Tensor& dyp, Tensor& dxp, int64_t e0);
  int64_t local_expert_begin(int64_t l) const;  // the global id of this rank's first expert of layer l
  // early: the combine's backward already started (its all-to-all travelling during the recompute).
  void backward_layer(int64_t l, LayerActs& a, const Tensor& dout, Tensor& dx, double aux_scale,
                      moe::CombineBwdPending* early = nullptr);
  void replay_routing(int64_t l, LayerActs& a);
  const Tensor& ones_TK(int64_t rows);  // f32 [rows, K] of ones on the device: unit weights (output side)
  int64_t sparse_index(int64_t l) const;  // position of sparse layer l among the sparse layers
  // Tensor parallelism: rows [Tl, ...] of every tp rank -> [T, ...] (x itself without tp), and the
  // sum over tp of partial [T, D] into this rank's rows [Tl, D] (=).
  Tensor tp_gather(const Tensor& x, Arena& A);
  void tp_reduce_scatter(const Tensor& partial, Tensor& out);

  ModelConfig cfg_;
  ModelOptions opt_;
  ModelWiring par_;
  bool attached_ = false;
  PassOptions pass_;     // the current pass's options (aux and z scales 0 in a forward)
  int64_t dropped_ = 0;  // assignments the current pass dropped at the experts' capacity
  Device device_;
  DType act_;  // activations: f32 on the CPU, bf16 on CUDA (the residual stream is f32 on both)
  ParamTable table_;
  LoraAdapters* lora_ = nullptr;
  LoraAdapters* pass_lora_ = nullptr;  // the current pass's: lora_, or null when PassOptions::adapters is off
  // With adapters on a frozen base: where the base's weight gradients would go (the fused ops that compute
  // them beside an input gradient write here and nothing reads it), f32 of the largest unit.
  Tensor grad_sink_;
  bool base_frozen() const { return lora_ != nullptr; }
  std::unique_ptr<LocalParams> local_;  // when the model holds its own parameters
  ParamSource* src_ = nullptr;           // local_ or the external source
  const UnitPlan* plan_ = nullptr;  // src_->plan()
  std::vector<std::vector<const ParamEntry*>> fp32_params_;  // per unit: its fp32_compute_param entries
  // Views of the units currently acquired (weights) and of their gradient buffers.
  ModelWeights w_, g_;
  void bind_unit(int u, const Tensor& buf, ModelWeights& w);
  void acquire(int u);
  void release(int u);
  void grads_for(int u);
  // The units block l reads: the block's, and its experts' under expert parallelism.
  std::vector<int> block_units(int64_t l) const;
  Arena keep_, work_;
  // Event 0: the side stream's experts weight gradients of the layer being run (wgrad_stream).
  streams::EventSet wgrad_done_;
  // Per micro-batch state planned before the layers run.
  // S_: the local sequence length, padded at the end of each sequence when B × S does not divide by tp
  // (the real tokens are then the first valid_ of each sequence).
  int64_t B_ = 0, S_ = 0, T_ = 0;
  int64_t Tl_ = 0;               // this rank's rows: T_ / tp (T_ without tensor parallelism)
  Tensor pos_T_;                 // i32 positions of the T_ rows (the plan's)
  // The plan's padded whole-sequence length S' (= S_ with sp 1), the real tokens at the start of each
  // local row (with sp 1 and no packing: the unpadded S, = S_ unless the tp remainder was padded), and
  // whether every local row is real.
  int64_t S_full_ = 0;
  std::vector<int64_t> row_valid_;
  bool all_valid_ = true;
  // Packed rows: each token's document start over the whole rows (BatchPlan::doc_start) on the model's
  // device; undefined otherwise (plain causal attention, the unpacked path unchanged).
  Tensor doc_start_;
  const Tensor* doc_start_ptr() const { return doc_start_.defined() ? &doc_start_ : nullptr; }
  bool sp_ = false;  // this micro-batch is a sequence chunk (attention through ulysses)
  // Calls f(first_row, rows) for each run of real (not padding) local token rows.
  template <class F>
  void for_valid_rows(F&& f) const;
  Tensor counts_E_, sums_E_;     // aux-loss statistics pooled over sparse layers
  int64_t aux_rows_ = 0;         // N = real tokens of the whole sequences (B × S) * sparse layers
  std::vector<LayerActs> acts_;
  double forward_s_ = 0, backward_s_ = 0;
  std::vector<Tensor> replay_;  // the current micro-batch's planned routing (host), empty: the router decides
  Tensor zsum_;                      // f32 [1]: this micro-batch's z-loss sum, on the device
  Tensor router_bias_LE_, load_LE_;  // balancing bias and step load, [sparse layers, E]
  Tensor ones_TK_;
  bool inference_ = false;  // begin_inference() holds every unit
};

}  // namespace mt
