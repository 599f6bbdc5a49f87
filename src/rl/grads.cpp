// run_grads (grads.h): one forward and backward on a batch, under any layout, written as one process would.
#include "rl/grads.h"

#include <cmath>
#include <cstdlib>
#include <exception>
#include <memory>

#include "core/log.h"
#include "data/batch.h"
#include "model/hf_checkpoint.h"
#include "parallel/dist.h"
#include "parallel/fsdp.h"
#include "parallel/parallel_model.h"
#include "train/session.h"

namespace mt {

static Tensor read_batch_tensor(const SafetensorsFile& f, const char* name) {
  if (!f.has(name)) MT_THROW("batch file ", f.path(), " has no tensor '", name, "' (need input_ids and labels)");
  const SafetensorsEntry& e = f.info(name);
  if (e.dtype != DType::I64 || e.shape.size() != 2)
    MT_THROW("batch tensor '", name, "' in ", f.path(), " is ", dtype_name(e.dtype), shape_str(e.shape),
             "; expected i64 [B, T]");
  return f.view(name).clone();
}

// Fault injection for the replica check's tests: MOETRAIN_DEBUG_PERTURB_GRAD=RANK makes that rank add
// one ulp to the first element it holds of the last block's gradient before the check.
static void debug_perturb_grad(FsdpParams& fsdp, int rank) {
  const char* v = std::getenv("MOETRAIN_DEBUG_PERTURB_GRAD");
  if (!v) return;
  char* end = nullptr;
  const long r = std::strtol(v, &end, 10);
  if (end == v || *end != '\0' || r < 0)
    MT_THROW("MOETRAIN_DEBUG_PERTURB_GRAD='", v, "' must be a rank (an integer >= 0)");
  if (r != rank) return;
  const int u = fsdp.plan().block.back();
  Tensor shard = fsdp.local_shard(u, /*grads=*/true);
  if (shard.numel() == 0)
    MT_THROW("MOETRAIN_DEBUG_PERTURB_GRAD: rank ", rank, " holds no element of ", fsdp.unit_name(u));
  Tensor x = shard.rows(0, 1).to(Device::CPU);
  x.data<float>()[0] = std::nextafter(x.data<float>()[0], INFINITY);
  shard.rows(0, 1).copy_from(x.to(shard.device()));
  log_info("grads: MOETRAIN_DEBUG_PERTURB_GRAD: added one ulp to the first element of this rank's ", fsdp.unit_name(u),
           " gradient shard");
}

GradsResult run_grads(const GradsOptions& opt) {
  ModelConfig cfg = load_model_config(opt.model_dir);  // with its score_before_experts
  // --score-before-experts only confirms the directory's model: it may not change it.
  resolve_score_before_experts(opt.score_before_experts ? 1 : -1, "--score-before-experts", cfg.score_before_experts,
                               opt.model_dir);
  DistOptions dopt;
  dopt.mesh = opt.mesh;
  SessionOptions so;
  so.dist = dopt;
  so.recompute = opt.recompute;
  TrainSession session(cfg, so);
  DistContext* dist = &session.dist();
  const int sp = dist->mesh().size(Axis::Sp);
  const ParamTable& table = session.table();
  ParallelModel& pm = session.parallel();
  FsdpParams* fsdp = session.fsdp();
  Qwen3MoeModel& model = session.model();
  LoadReport rep = session.load(opt.model_dir);
  log_info("grads: loaded ", rep.tensors, " tensors (", rep.bytes_read, " bytes read, ", expert_layout_name(rep.layout),
           " experts) from ", opt.model_dir, " in ", rep.seconds, " s",
           rep.router_bias ? str("; routing with its ", kRouterBiasFile) : std::string(),
           cfg.score_before_experts ? "; score_before_experts (its config.json)" : "");

  SafetensorsFile bf(opt.batch_path);
  MicroBatch mb{read_batch_tensor(bf, "input_ids"), read_batch_tensor(bf, "labels")};
  const bool policy = !opt.objective.empty();
  std::unique_ptr<rl::PolicyObjective> objective;
  if (policy) {
    if (opt.policy.kind == rl::PolicyLoss::Gspo && (dopt.mesh.sp > 1 || dopt.mesh.tp > 1))
      MT_THROW("grads: --objective gspo needs each sample's tokens on one rank; not with --",
               dopt.mesh.sp > 1 ? "sp " : "tp ", dopt.mesh.sp > 1 ? dopt.mesh.sp : dopt.mesh.tp,
               " (a rank holds a slice of a sample's tokens)");
    objective = std::make_unique<rl::PolicyObjective>(opt.policy);
    auto values = [&](const char* name, bool required) {
      if (!bf.has(name)) {
        if (required)
          MT_THROW("batch file ", opt.batch_path, " has no tensor '", name, "' (--objective ", opt.objective,
                   " needs advantages, old_logprobs, token_weights and, with --kl-coef, ref_logprobs)");
        return Tensor::zeros(mb.labels.shape());
      }
      Tensor t = bf.read_f32(name);
      if (t.shape() != mb.labels.shape())
        MT_THROW("batch tensor '", name, "' is ", shape_str(t.shape()), "; expected ", shape_str(mb.labels.shape()),
                 " like labels");
      return t;
    };
    Tensor sample = Tensor::empty(mb.labels.shape());
    for (int64_t i = 0; i < sample.numel(); ++i) sample.data<float>()[i] = float(i / mb.labels.size(1));
    mb.token_values = {values("advantages", true), values("old_logprobs", true), values("token_weights", true),
                       values("ref_logprobs", opt.policy.kl_coef > 0), sample};
  }
  if (mb.labels.shape() != mb.input_ids.shape())
    MT_THROW("labels ", shape_str(mb.labels.shape()), " and input_ids ", shape_str(mb.input_ids.shape()), " in ",
             opt.batch_path, " differ in shape");
  const int64_t B = mb.input_ids.size(0), S = mb.input_ids.size(1);
  // Planned before the model runs: the loss is normalised by the target tokens of the whole batch.
  int64_t n_valid = count_target_tokens(mb.labels);
  if (n_valid == 0)
    MT_THROW("batch ", opt.batch_path, " has no label other than -100 after the shift: the loss is undefined");
  double aux_scale = model.aux_enabled() ? cfg.router_aux_loss_coef : 0.0;
  const int64_t rows = B / dist->dp_size();
  MicroBatch local = session.local_micro_batch(mb);  // this rank's rows (and sp chunk), with their token values

  if (fsdp)
    fsdp->zero_grads();
  else
    model.zero_grads();
  Tensor logits;
  PassOptions po;
  po.ce_scale = policy ? 0.0 : 1.0 / double(n_valid);
  po.objective = objective.get();
  po.aux_scale = aux_scale;
  po.recompute = session.recompute();
  po.logits_out = policy ? nullptr : &logits;
  po.temperature = opt.temperature;
  LossParts lp = model.forward_backward(local, po);
  // HSDP: the replicas of every gradient shard must hold the same bits (the all-reduce over
  // dp_replicate gives them one sum); checked here, before anything is gathered or written.
  if (fsdp && dist->mesh().size(Axis::DpReplicate) > 1) {
    debug_perturb_grad(*fsdp, dist->rank());
    const FsdpParams::ReplicaReport rr = fsdp->check_replicas(/*grads=*/true, dist->rank(), dist->world());
    if (dist->rank() == 0)
      log_info("grads: replicated gradients identical on ", rr.replicas, " replicas (", rr.units, " units, bitwise)");
  }
  Tensor all_logits = logits;
  double ce_sum = lp.ce_sum;
  double objective_sum = lp.objective;
  if (policy && dist->world() && dist->world()->size() > 1) {  // every rank's rows are its own
    objective_sum = 0;
    for (double v : comm::all_gather_doubles(*dist->world(), {lp.objective})) objective_sum += v;
  }
  // The ranks with rows of their own: dp, and under tp every rank (tp rank order is row order within
  // a dp rank's rows, and the world's rank order is dp-major).
  comm::Communicator* rows_comm = pm.tp ? dist->world() : dist->dp();
  const bool rows_split = rows_comm && rows_comm->size() > 1 && sp == 1;
  // Every rank's rows of a per-row tensor (the logits [rows, V], the log-probs [rows, 1]) laid out as one
  // process's [B * S, V]; collective where the rows are split.
  auto gather_rows = [&](const Tensor& mine, int64_t V) -> Tensor {
    if (rows_split) {
      // Under tp the model may have padded each sequence to S' (B × S' divisible by tp): the gathered
      // rows are [B, S'], and the padding is dropped.
      const int64_t Sp = model.padded_seq_len();
      Tensor gathered = Tensor::empty({int64_t(rows_comm->size()) * mine.size(0), V});
      rows_comm->all_gather(mine, gathered)->wait();
      if (Sp == S) return gathered;
      Tensor all = Tensor::empty({B * S, V});
      for (int64_t b = 0; b < B; ++b) all.rows(b * S, S).copy_from(gathered.rows(b * Sp, S));
      return all;
    }
    if (sp > 1) {
      // Every rank's [rows, C] chunk rows (padding included); dp_sp rank k holds rows of dp rank
      // k / sp, chunk k % sp. Under tp each rank holds 1 / tp of its chunk's rows and tp varies fastest
      // in the world's rank order, so the world gather lays the chunks out the same way. Reassembled
      // into [B, S] without the padding.
      const int64_t C = local.plan->chunk;
      comm::Communicator& g = *dist->dp_sp();
      comm::Communicator& src = pm.tp ? *dist->world() : g;
      Tensor gathered = Tensor::empty({int64_t(src.size()) * mine.numel()});
      src.all_gather(mine, gathered)->wait();
      Tensor all = Tensor::empty({B * S, V});
      for (int k = 0; k < g.size(); ++k)
        for (int64_t b = 0; b < rows; ++b)
          for (int64_t c = 0; c < C; ++c) {
            const int64_t s = int64_t(k % sp) * C + c;
            if (s >= S) continue;
            all.rows((int64_t(k / sp) * rows + b) * S + s, 1)
                .copy_from(gathered.rows((int64_t(k) * rows * C + b * C + c) * V, V).view({1, V}));
          }
      return all;
    }
    return mine.view({B * S, V});
  };
  // The objective path never materialises the logits; it has the log-probs of the targets.
  Tensor all_logprobs;
  if (policy)
    all_logprobs = gather_rows(lp.logp.view({lp.logp.numel(), 1}), 1);
  else
    all_logits = gather_rows(logits, cfg.vocab_size);
  if (!policy && (rows_split || sp > 1)) {
    comm::Communicator& src = rows_split ? *rows_comm : pm.tp ? *dist->world() : *dist->dp_sp();
    ce_sum = 0;
    for (double v : comm::all_gather_doubles(src, {lp.ce_sum})) ce_sum += v;
  }
  // Full gradients: gathered one parameter at a time (every rank takes part), written by rank 0.
  Tensor grads = fsdp ? Tensor::empty({table.total()}) : model.grads();
  if (fsdp)
    for (const ParamEntry& e : table.entries())
      view_at(grads, e.offset, e.shape).copy_from(pm.gather_param_host(e, /*grads=*/true));

  GradsResult res{(policy ? objective_sum : ce_sum / double(n_valid)) + lp.aux * aux_scale, lp.aux, n_valid};
  struct Finish {  // every rank waits until rank 0 has written the file
    DistContext& d;
    ~Finish() noexcept(false) {
      if (!std::uncaught_exceptions()) d.finish();
    }
  } finish{*dist};
  if (dist->rank() != 0) return res;
  NamedTensors out;
  Tensor loss = Tensor::empty({1}), aux = Tensor::empty({1});
  loss.data<float>()[0] = float(res.loss);
  aux.data<float>()[0] = float(lp.aux);
  out.emplace_back("loss", loss);
  out.emplace_back("aux_loss", aux);
  if (!policy) out.emplace_back("logits", all_logits.to(Device::CPU).view({B, S, cfg.vocab_size}));
  if (policy) {
    // Row b * S + s holds log p(labels[b, s + 1]) (the shift): written aligned with the labels.
    const Tensor rows_h = all_logprobs.to(Device::CPU);
    Tensor logprobs = Tensor::zeros({B, S});
    for (int64_t b = 0; b < B; ++b)
      for (int64_t s = 0; s + 1 < S; ++s) logprobs.data<float>()[b * S + s + 1] = rows_h.data<float>()[b * S + s];
    out.emplace_back("logprobs", logprobs);
  }
  CheckpointReader r(opt.model_dir);
  bool file_has_lm_head = r.has("lm_head.weight");
  for (auto& [name, t] : export_hf_tensors(cfg, table, grads, rep.layout)) {
    out.emplace_back("grad." + name, t);
    if (cfg.tie_word_embeddings && file_has_lm_head && name == "model.embed_tokens.weight")
      out.emplace_back("grad.lm_head.weight", t);  // the file names the tied matrix twice
  }
  write_safetensors(opt.out_path, out);
  return res;
}

}  // namespace mt
