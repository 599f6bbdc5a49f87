#include "train/trainer.h"

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "comm/communicator.h"
#include "comm/dist_env.h"
#include "core/clock.h"
#include "core/determinism.h"
#include "core/device_select.h"
#include "core/interrupt.h"
#include "core/log.h"
#include "data/batch.h"
#include "model/hf_checkpoint.h"
#include "ops/ops.h"
#include "ops/threads.h"
#include "parallel/dist.h"
#include "parallel/fsdp.h"
#include "parallel/parallel_model.h"
#include "parallel/sharded_load.h"
#include "train/checkpoint.h"
#include "train/load_balance.h"
#include "train/lr_schedule.h"
#include "train/metrics.h"
#include "train/optimizer.h"
#include "train/run_dir.h"
#include "train/session.h"

namespace mt {

namespace fs = std::filesystem;
static std::string fmt_duration(double s) {
  if (!std::isfinite(s) || s < 0) return "?";
  int64_t t = int64_t(s + 0.5);
  if (t < 60) return str(t, "s");
  if (t < 3600) return str(t / 60, "m", (t % 60 < 10 ? "0" : ""), t % 60, "s");
  return str(t / 3600, "h", (t % 3600) / 60 / 10, (t % 3600) / 60 % 10, "m");
}

ModelConfig resolve_model_config(const std::string& model) {
  if (fs::is_directory(model) || fs::is_regular_file(model)) return load_model_config(model);
  for (const std::string& p : preset_names())
    if (p == model) return preset_model_config(model);
  std::string names;
  for (const std::string& p : preset_names()) names += (names.empty() ? "" : ", ") + p;
  MT_THROW("model '", model, "' is neither a preset (", names, ") nor a Hugging Face model directory");
}

// How to continue a run that a signal stopped: the same command on the settings this run wrote to
// out_dir/train_config.json (all of them, so nothing of the original command line is lost), under the
// same launch when there was more than one rank.
static std::string resume_command(const std::string& command, const std::string& out_dir, int world_size) {
  const std::string cmd =
      str(command, " --config ", (fs::path(out_dir) / "train_config.json").string(), " --resume latest");
  if (world_size <= 1) return "moetrain " + cmd;
  const int local = comm::detect_dist_env().local_world_size;
  if (local == world_size) return str("moetrain launch --nproc-per-node ", local, " -- ", cmd);
  return "moetrain launch <this job's launch options> -- " + cmd;
}

TrainSummary run_training(const TrainConfig& cfg, const RunOptions& run) {
  validate_train_config(cfg);
  ops::set_cpu_threads(int(cfg.threads));
  Device device = resolve_device(cfg.device);
  // Before the first op: attention plans are decided per shape under the switch (core/determinism.h).
  // MOETRAIN_DETERMINISTIC=1 turns it on as well; the config only ever adds to it.
  if (cfg.deterministic) set_deterministic(true);
  if (deterministic() && device == Device::CUDA)
    log_info(
        "deterministic: CUDA kernels without float atomics, fixed reduction orders, deterministic attention "
        "backward (slower; docs/cuda.md)");
  ModelConfig mc = resolve_model_config(cfg.model);
  // What the model computes travels with the checkpoint its weights come from (docs/model.md "What a
  // checkpoint carries"): --init-from's config.json states score_before_experts; a key that contradicts it is
  // an error. From random weights the key (or the model directory's config.json) decides.
  if (!cfg.init_from.empty())
    mc.score_before_experts = resolve_score_before_experts(cfg.score_before_experts, "score_before_experts",
                                                           stated_score_before_experts(cfg.init_from), cfg.init_from);
  else if (cfg.score_before_experts != -1)
    mc.score_before_experts = cfg.score_before_experts == 1;

  // Load balancing beside the aux loss (docs/model.md), capacity and the routing weights' side: all need MoE
  // layers (checked before the session, which would otherwise fail on the capacity without naming it).
  const int64_t n_sparse = mc.num_sparse_layers();
  for (auto [key, v] : {std::pair<const char*, double>{"router_z_loss_coef", cfg.router_z_loss_coef},
                        {"router_bias_update_rate", cfg.router_bias_update_rate},
                        {"moe_capacity_factor", cfg.moe_capacity_factor},
                        {"score_before_experts", double(mc.score_before_experts)}})
    if (v != 0 && n_sparse == 0)
      MT_THROW(key, " = ", v, " needs MoE layers, but model '", cfg.model, "' has none (num_experts ", mc.num_experts,
               "); use 0");
  // Parallel layout: with more than one rank the parameters are FSDP-sharded over dp_shard (and
  // replicated over dp_replicate); every rank draws the same global micro-batches and trains on its
  // rows of each, so the loss and gradients are those of the global batch.
  DistOptions dopt;
  dopt.mesh.dp_shard = int(cfg.dp_shard);
  dopt.mesh.dp_replicate = int(cfg.dp_replicate);
  dopt.mesh.ep = int(cfg.ep);
  dopt.mesh.tp = int(cfg.tp);
  dopt.mesh.etp = int(cfg.etp);
  dopt.mesh.sp = int(cfg.sp);
  dopt.comm.timeout = std::chrono::seconds(cfg.comm_timeout_s);
  dopt.comm.schedule_check = cfg.schedule_check == "off"      ? comm::ScheduleCheck::Off
                             : cfg.schedule_check == "per_op" ? comm::ScheduleCheck::PerOp
                                                              : comm::ScheduleCheck::Periodic;
  SessionOptions sess;
  sess.device = device;
  sess.dist = dopt;
  sess.fsdp.grad_sync = cfg.grad_sync == "last" ? GradSync::LastMicroBatch : GradSync::EveryMicroBatch;
  sess.fsdp.reduce_dtype = cfg.grad_reduce_dtype == "bf16" ? DType::BF16 : DType::F32;
  sess.fsdp.reshard_after_forward = cfg.reshard_after_forward != 0;
  sess.moe_capacity_factor = cfg.moe_capacity_factor;
  sess.recompute = parse_recompute(cfg.recompute);
  if (cfg.lora_rank > 0) {  // adapters on the frozen base (docs/lora.md)
    sess.lora.rank = cfg.lora_rank;
    sess.lora.alpha = cfg.lora_alpha;
    sess.lora.targets = parse_lora_targets(cfg.lora_targets);
    sess.lora_seed = uint64_t(cfg.seed) ^ 0x4c6f5241ull;
  }
  TrainSession session(mc, sess);
  LoraAdapters* lora = session.lora();
  DistContext* dist = &session.dist();
  const bool lead = dist->rank() == 0;
  const int dp_size = dist->dp_size();
  if (cfg.micro_batch_size % dp_size != 0)
    MT_THROW("micro_batch_size ", cfg.micro_batch_size, " cannot be split evenly over ", dp_size,
             " data-parallel ranks (dp_replicate × dp_shard); use a multiple of ", dp_size);
  const ParamTable& table = session.table();
  ParallelModel& pm = session.parallel();
  FsdpParams* fsdp = session.fsdp();
  Qwen3MoeModel& model = session.model();
  if (cfg.router_bias_update_rate > 0) model.enable_router_bias();
  Tensor& master = session.master();
  // A rank that cannot see init_from (load_mode broadcast) read no score_before_experts from it: every rank
  // must build the same model, so a rank that differs from rank 0 stops them all.
  if (dist->distributed()) {
    const std::vector<double> sbe = comm::all_gather_doubles(*dist->world(), {double(mc.score_before_experts)});
    for (int r = 1; r < dist->world_size(); ++r)
      if (sbe[size_t(r)] != sbe[0])
        MT_THROW("score_before_experts is ", int(sbe[0]), " on rank 0 but ", int(sbe[size_t(r)]), " on rank ", r,
                 " (it cannot read ", cfg.init_from.empty() ? cfg.model : cfg.init_from,
                 "/config.json?); every rank must see the model's config.json");
  }
  // Resume (train/run_dir.h): rank 0 picks the newest checkpoint whose manifest verifies and every rank takes
  // its choice; every rank then reads its own pieces of the saved state, whatever layout saved it.
  const std::string resume_dir = cfg.resume.empty() ? std::string() : resume_checkpoint(cfg.out_dir, cfg.resume, dist);
  const bool resuming = !resume_dir.empty();
  if (resuming) {
    // The run's checkpoints state the model they hold; a resume must run the same one.
    const std::optional<bool> saved = stated_score_before_experts(resume_dir);
    if (saved && *saved != mc.score_before_experts)
      MT_THROW("resume: ", resume_dir, "/config.json was trained with score_before_experts ", int(*saved),
               ", but this run's model has ", int(mc.score_before_experts),
               " (from the score_before_experts key, init_from or the model directory); give score_before_experts ",
               int(*saved), " to resume it");
  }
  auto t_init = Clock::now();
  bool fsdp_broadcast_load = false;
  if (resuming && !lora) {
    // The weights come with the training state below (a LoRA run's base is read again: the state is its adapters').
  } else if (cfg.init_from.empty()) {
    session.init_weights(uint64_t(cfg.seed));
    if (dist->distributed())
      log_info("rank ", dist->rank(), ": initialised ", master.numel(), " parameters (its shard) in ",
               seconds_since(t_init), " s");
  } else {
    // Each rank maps the files and reads its own slices; when some rank cannot see the files (or
    // load_mode says so), rank 0 reads and broadcasts the parameters in large buckets instead.
    const bool broadcast = fsdp && (cfg.load_mode == "broadcast" ||
                                    (cfg.load_mode == "auto" && !all_ranks_see(cfg.init_from, *dist->world())));
    fsdp_broadcast_load = broadcast;
    if (broadcast) {
      const char* bb = std::getenv("MOETRAIN_BROADCAST_BUCKET_BYTES");  // tests: small buckets
      BroadcastLoadReport rep =
          load_hf_weights_broadcast(cfg.init_from, mc, table, pm.pieces(table), master, *dist->world(), 0,
                                    bb ? size_t(std::stoull(bb)) : size_t(1) << 30);
      log_info("rank ", dist->rank(), ": loaded its shards from rank 0's broadcast of ", cfg.init_from, ": ",
               rep.buckets, " buckets, ", rep.bytes_broadcast / 1e6, " MB broadcast, ", rep.bytes_read / 1e6,
               " MB read here, in ", rep.seconds, " s");
      session.refresh_compute_weights();
    } else {
      LoadReport rep = session.load(cfg.init_from);
      log_info(dist->distributed() ? str("rank ", dist->rank(), ": ") : std::string(), "loaded ", rep.tensors,
               " tensors, read ", rep.bytes_read / 1e6, " MB from ", cfg.init_from, " in ", rep.seconds, " s",
               rep.router_bias ? str(" and its ", kRouterBiasFile,
                                     cfg.router_bias_update_rate > 0 ? "" : " (frozen: router_bias_update_rate 0)")
                               : std::string());
    }
  }
  // The balancing bias is part of the model's routing: it comes with the weights (init_from, or the resumed
  // checkpoint), whatever the rate; with rate 0 it stays as read. (session.load above read it already; the
  // broadcast load and a resume read it here.)
  const std::string bias_from = resuming && !lora ? resume_dir : cfg.init_from;
  if (!bias_from.empty() && ((resuming && !lora) || fsdp_broadcast_load) && session.load_router_bias(bias_from) &&
      lead)
    log_info("router bias: read ", kRouterBiasFile, " from ", bias_from,
             dist->distributed() ? " (rank 0, broadcast to every rank)" : "",
             cfg.router_bias_update_rate > 0 ? "" : "; frozen (router_bias_update_rate 0)");
  // JSONL data needs a tokenizer: the configured one, else the model directory's tokenizer.json (copied into
  // the checkpoints: the model's own vocabulary, whatever the data).
  const bool synthetic = cfg.data.rfind("synthetic:", 0) == 0;
  DataOptions data_opt;
  data_opt.tokenizer = cfg.tokenizer;
  if (data_opt.tokenizer.empty() && fs::is_regular_file(fs::path(cfg.model) / "tokenizer.json"))
    data_opt.tokenizer = (fs::path(cfg.model) / "tokenizer.json").string();
  data_opt.data_format = cfg.data_format;
  data_opt.bad_lines = cfg.bad_lines;
  data_opt.eos_id = mc.eos_token_id;
  std::unique_ptr<BatchSource> data = make_batch_source(cfg.data, cfg.micro_batch_size, cfg.seq_len, mc.vocab_size,
                                                        int(cfg.max_digits), uint64_t(cfg.seed), data_opt);
  std::vector<Problem> eval_set;
  // Greedy evaluation grows sequences one token at a time, which the tp split of the rows does not
  // follow yet.
  if (synthetic && cfg.eval_problems > 0 && cfg.tp > 1)
    MT_THROW("evaluation (eval_problems ", cfg.eval_problems, ") is not supported with tp ", cfg.tp,
             " yet; use eval_problems 0");
  if (synthetic && cfg.eval_problems > 0)
    eval_set = make_eval_problems(cfg.eval_problems, uint64_t(cfg.seed) + 1, int(cfg.max_digits));

  AdamWConfig oc;
  oc.beta1 = cfg.beta1;
  oc.beta2 = cfg.beta2;
  oc.eps = cfg.eps;
  oc.weight_decay = cfg.weight_decay;
  oc.max_grad_norm = cfg.grad_clip;
  // One device: each unit's update runs beside the next forward, which waits per unit (train/optimizer.h).
  session.make_optimizer(oc, cfg.optimizer_overlap != 0);
  AdamW& opt = session.optimizer();
  LrParams lrp = lr_params(cfg);
  // A warm-up longer than the run spans the run (the note is logged with the run's other settings below).
  lrp.warmup_steps = effective_warmup_steps(cfg);
  const int64_t stop = cfg.max_steps > 0 ? cfg.max_steps : cfg.steps;  // this run ends here
  int64_t start_step = 0;
  if (resuming) {
    auto t = Clock::now();
    const nlohmann::json st = read_train_state(resume_dir);
    const ReshardReport rr = restore_checkpoint_state(session, resume_dir, st);
    start_step = st.at("step").get<int64_t>();
    opt.set_state(st.at("optimizer_steps").get<int64_t>(), st.at("skipped_steps").get<int64_t>());
    session.set_steps_done(start_step);
    data->set_position(st.at("data_position").get<int64_t>());
    if (lead) {
      log_info("resume: step ", start_step, " from ", resume_dir, " (saved under ", rr.saved_layout, ", ", rr.shards,
               " shard(s)); weights, AdamW moments, ", opt.steps_skipped(), " skipped step(s), data position ",
               data->position(), " restored in ", seconds_since(t), " s");
      if (st.contains("config")) {
        const std::string diff = train_config_changes(st["config"], cfg);
        if (!diff.empty()) log_info("resume: warning: settings differ from the saved run's (", diff, ")");
      }
      // A longer or shorter run (steps) is allowed; its LR schedule then differs from the saved one's.
      const double saved_lr = st.contains("lr_schedule") ? st["lr_schedule"].value("next_lr", -1.0) : -1.0;
      if (saved_lr >= 0 && saved_lr != lr_at(lrp, start_step))
        log_info("resume: the LR schedule differs from the saved run's (steps ", st["lr_schedule"].value("steps", 0),
                 " -> ", cfg.steps, "): the next step runs at lr ", lr_at(lrp, start_step), " instead of ", saved_lr);
    }
    if (start_step >= stop)
      MT_THROW("resume: checkpoint ", resume_dir, " is at step ", start_step,
               ", which is not before the end of this run (", cfg.max_steps > 0 ? "max_steps " : "steps ", stop,
               "); raise --steps or --max-steps");
  }

  // Rank 0 writes the run's files and logs the steps; the other ranks only log their own start-up.
  if (lead) {
    fs::create_directories(cfg.out_dir);
    std::ofstream f(cfg.out_dir + "/train_config.json");
    f << to_json(cfg) << "\n";
  }
  MetricsWriter metrics(metrics_path(cfg), lead, cfg.tensorboard != 0, resuming ? start_step : -1);
  const std::string& mpath = metrics.path();
  auto log0 = [&](const auto&... a) {
    if (lead) log_info(a...);
  };

  log0("model ", mc.architecture, ": ", mc.num_parameters() / 1e6, " M parameters (", model.table().total(),
       " in the flat buffer), ", mc.num_hidden_layers, " layers, ", mc.num_experts, " experts top-",
       mc.num_experts_per_tok, ", device ", device_name(device), ", recompute ", cfg.recompute);
  if (lora)
    log0("LoRA: rank ", lora->spec().rank, ", alpha ", lora->spec().effective_alpha(), " (scale ", lora->scale(),
         ") on ", lora_targets_text(lora->spec()), ": ", lora->table().total(), " adapter parameters train (",
         100.0 * double(lora->table().total()) / double(mc.num_parameters()), "% of the model's), the base is frozen");
  if (const std::string note = warmup_clamp_note(cfg); !note.empty()) log0(run.command, ": ", note);
  log0("data: ", data->describe());
  log0("training ", resuming ? str("steps ", start_step + 1, "..", stop, " of ") : std::string(), cfg.steps,
       " steps x ", cfg.grad_accum, " micro-batches of ", cfg.micro_batch_size, " x ", cfg.seq_len,
       " tokens; metrics -> ", mpath,
       metrics.tensorboard_path().empty() ? "" : ", TensorBoard -> " + metrics.tensorboard_path());

  TrainSummary sum;
  auto run_start = Clock::now();
  double last10 = 0;
  int64_t n_last = 0;
  auto evaluate = [&](int64_t step) {
    opt.join();  // evaluation reads the weights (its forward also waits per unit; this covers the rest)
    if (eval_set.empty()) return;
    auto t = Clock::now();
    AgreeFn agree;
    if (dist->distributed())
      agree = [&](bool done) {  // the minimum over ranks: stop only when every rank is done
        Tensor f = Tensor::empty({1}, DType::I32);
        f.data<int32_t>()[0] = done ? 1 : 0;
        Tensor d = f.to(device);
        dist->world()->all_reduce(d, comm::ReduceOp::Min)->wait();
        device_mem::synchronize(device);
        return d.to(Device::CPU).data<int32_t>()[0] != 0;
      };
    sum.eval = evaluate_addition(model, eval_set, int(cfg.max_digits), agree);
    sum.evaluated = true;
    if (!lead) return;
    log_info("eval @ step ", step, ": exact-match ", sum.eval.exact_match(), "% (", sum.eval.correct, "/",
             sum.eval.problems, ") in ", seconds_since(t), " s; e.g. ",
             sum.eval.samples.empty() ? "" : sum.eval.samples[0]);
    nlohmann::json j{
        {"event", "eval"}, {"step", step}, {"exact_match", sum.eval.exact_match()}, {"problems", sum.eval.problems}};
    metrics.write(j);
  };
  // A checkpoint (train/run_dir.h): the HF weights with the tokenizer, every rank's shard of the training state
  // and train_state.json, committed by manifest and rename, then keep_last.
  auto save = [&](int64_t step) {
    opt.join();  // the checkpoint reads the weights the last overlapped update writes
    nlohmann::ordered_json st;
    st["format"] = "moetrain-train-state-1";
    st["step"] = step;
    st["optimizer_steps"] = opt.steps_taken();
    st["skipped_steps"] = opt.steps_skipped();
    st["data_position"] = data->position();
    st["lr_schedule"] = {{"kind", cfg.lr_schedule},          {"lr", cfg.lr},       {"min_lr", cfg.min_lr},
                         {"warmup_steps", lrp.warmup_steps}, {"steps", cfg.steps}, {"next_lr", lr_at(lrp, step)}};
    st["rng"] = "none: initialisation and data are functions of (seed, index); the data index is data_position";
    st["flat_numel"] = lora ? lora->table().total() : table.total();
    if (lora) {
      st["lora"] = lora_state_json(lora->spec());
      st["lora"]["base"] = cfg.init_from.empty() ? cfg.model : cfg.init_from;
      st["lora"]["base_seed"] = cfg.init_from.empty() ? nlohmann::json(cfg.seed) : nlohmann::json(nullptr);
    }
    const DeviceMesh& mesh = dist->mesh();
    st["layout"] = {{"world_size", dist->world_size()},
                    {"dp_replicate", mesh.size(Axis::DpReplicate)},
                    {"dp_shard", mesh.size(Axis::DpShard)},
                    {"ep", mesh.size(Axis::Ep)},
                    {"tp", mesh.size(Axis::Tp)},
                    {"etp", mesh.size(Axis::Etp)},
                    {"sp", mesh.size(Axis::Sp)}};
    st["config"] = nlohmann::ordered_json::parse(to_json(cfg));
    CheckpointWeights weights = checkpoint_weights(session);
    weights.tokenizer_json = data_opt.tokenizer;
    weights.lora_base = cfg.init_from.empty() ? cfg.model : cfg.init_from;
    sum.checkpoint_dir = save_checkpoint(cfg.out_dir, step, weights, {checkpoint_state(session, "", std::move(st))},
                                         cfg.keep_last, *dist);
    // On the CPU the weights are already host memory; on a GPU the digest would cost a second copy.
    if (!fsdp && device == Device::CPU) sum.checkpoint_digest = shard_digest(lora ? lora->params() : model.params());
  };

  // A stop signal (core/interrupt.h) ends the run after the step in progress. Every rank must leave the
  // loop at the same step (the others would wait in the next step's collectives), so with more than one
  // rank the flag is combined every step: the largest signal number any rank saw, one all-reduce of one int.
  auto stop_agreed = [&] { return dist->agreed_stop_signal(device); };

  bool replicas_logged = false;  // the HSDP replica check logs its first pass only
  StepOptions so;
  so.aux_loss_coef = mc.router_aux_loss_coef;
  so.router_z_loss_coef = cfg.router_z_loss_coef;
  so.router_bias_update_rate = cfg.router_bias_update_rate;
  so.schedule_check_every = cfg.schedule_check_every;
  so.check_replicas = cfg.schedule_check != "off";
  int64_t end = stop;  // stop_at_exact_match may end the run earlier
  for (int64_t step = start_step; step < stop; ++step) {
    auto step_start = Clock::now();
    auto td = Clock::now();
    std::vector<MicroBatch> batches;  // global micro-batches: the session takes this rank's part
    for (int64_t m = 0; m < cfg.grad_accum; ++m) {
      Batch b = data->next();
      batches.emplace_back(b.input_ids, b.labels);
      batches.back().segments = b.segments;  // packed rows: their document boundaries
    }
    const double t_data = seconds_since(td);
    so.lr = lr_at(lrp, step);
    so.on_micro_batch = [&](int64_t m, int64_t n, const LossParts&) {
      if (n == 1 || !lead) return;
      double done = double(m + 1) / double(n);
      log_info("  step ", step + 1, " micro ", m + 1, "/", n, ": fwd ", model.last_forward_seconds(), " s, bwd ",
               model.last_backward_seconds(), " s, elapsed ", fmt_duration(seconds_since(run_start)), ", step ETA ",
               fmt_duration(seconds_since(step_start) / done * (1 - done)));
    };
    const StepResult r = session.train_step(batches, so);
    const OptimStepResult& os = r.opt;
    if (r.replicas_checked && !replicas_logged) {
      log0("replicas: master weights identical on ", r.replicas.replicas, " replicas (", r.replicas.units,
           " units, bitwise) at step ", step + 1, "; checked every ", cfg.schedule_check_every, " steps");
      replicas_logged = true;
    }
    const double lr = so.lr, loss = r.loss, ce = r.ce, aux = r.aux, z = r.z;
    const int64_t tokens = r.tokens;
    const double t_fwd = r.forward_s, t_bwd = r.backward_s, t_opt = r.optimizer_s;
    const ExpertLoadStats& ls = r.load;
    if (os.skipped)
      log0("step ", step + 1, ": grad norm ", os.grad_norm, " is not finite; step skipped (", opt.steps_skipped(),
           " skipped so far)");
    double dt = seconds_since(step_start), elapsed = seconds_since(run_start);
    double eta = elapsed / double(step + 1 - start_step) * double(stop - step - 1);
    if (step == start_step) sum.first_loss = loss;
    sum.last_loss = loss;
    if (step >= stop - 10) {
      last10 += loss;
      ++n_last;
    }
    nlohmann::json j = step_json(r, *dist);
    j["step"] = step + 1;
    j["skipped_total"] = opt.steps_skipped();
    j["lr"] = lr;
    j["tokens_per_s"] = double(tokens) / dt;
    j["time_s"]["step"] = dt;
    j["time_s"]["data"] = t_data;
    j["activation_peak_bytes"] = model.activation_peak_bytes();
    j["peak_rss_bytes"] = peak_rss_bytes();
    j["gpu_peak_bytes"] = device_mem::cuda_peak_bytes();
    j["gpu_bytes_in_use"] = device_mem::cuda_bytes_in_use();
    j["elapsed_s"] = elapsed;
    if (n_sparse > 0 && cfg.router_bias_update_rate > 0) {
      Tensor b = model.router_bias().to(Device::CPU);
      float bmin = 0, bmax = 0;
      for (int64_t i = 0; i < b.numel(); ++i) {
        bmin = i ? std::min(bmin, b.data<float>()[i]) : b.data<float>()[i];
        bmax = i ? std::max(bmax, b.data<float>()[i]) : b.data<float>()[i];
      }
      j["router_bias"] = {{"min", bmin}, {"max", bmax}};
    }
    metrics.write(j);
    if (lead && cfg.log_every > 0 && ((step + 1) % cfg.log_every == 0 || step == start_step || step + 1 == stop)) {
      char line[640], moe[96] = "";
      if (n_sparse > 0)
        std::snprintf(moe, sizeof moe, " z %.4f) | experts max/mean %.2f unused %lld", z, ls.imbalance,
                      (long long)ls.unused);
      std::snprintf(line, sizeof line,
                    "step %lld/%lld | loss %.4f (ce %.4f aux %.4f%s | gnorm %.3f%s | lr %.2e | %.0f tok/s | "
                    "fwd %.3fs bwd %.3fs opt %.3fs data %.3fs | %s %.0f MB | elapsed %s ETA %s",
                    (long long)(step + 1), (long long)cfg.steps, loss, ce, aux, n_sparse > 0 ? moe : ")", os.grad_norm,
                    os.skipped ? " SKIPPED" : "", lr, double(tokens) / dt, t_fwd, t_bwd, t_opt, t_data,
                    device == Device::CUDA ? "gpu peak" : "peak rss",
                    double(device == Device::CUDA ? device_mem::cuda_peak_bytes() : peak_rss_bytes()) / 1e6,
                    fmt_duration(elapsed).c_str(), fmt_duration(eta).c_str());
      log_line(line);
    }
    if (run.after_step) run.after_step(step + 1);
    if (const int sig = stop_agreed(); sig != 0) {  // saved below, like the run's end
      sum.stop_signal = sig;
      end = step + 1;
      break;
    }
    // The checkpoint first: whatever the evaluation meets, the weights are on disk.
    if (cfg.save_every > 0 && (step + 1) % cfg.save_every == 0 && step + 1 < stop) save(step + 1);
    if (cfg.eval_every > 0 && (step + 1) % cfg.eval_every == 0 && step + 1 < stop) {
      evaluate(step + 1);
      // Every rank evaluated the same weights on the same problems: the same decision everywhere.
      if (cfg.stop_at_exact_match > 0 && sum.evaluated && sum.eval.exact_match() >= cfg.stop_at_exact_match) {
        if (lead)
          log_info("stop_at_exact_match: held-out exact match ", sum.eval.exact_match(),
                   "% >= ", cfg.stop_at_exact_match, "% at step ", step + 1, "; stopping here");
        end = step + 1;
        break;
      }
    }
  }
  sum.steps = end;
  sum.skipped = opt.steps_skipped();
  save(end);
  if (sum.stop_signal == 0) sum.stop_signal = stop_agreed();  // one that came during the save skips the evaluation
  if (sum.stop_signal != 0) {
    if (lead && end < stop)
      log_info(run.command, ": stopped by ", stop_signal_name(sum.stop_signal), " after step ", end, "; saved ",
               sum.checkpoint_dir, "; resume with: ", resume_command(run.command, cfg.out_dir, dist->world_size()));
    else if (lead)
      log_info(run.command, ": stopped by ", stop_signal_name(sum.stop_signal), " after the last step (", end,
               "); saved ", sum.checkpoint_dir, eval_set.empty() ? "" : "; the final evaluation was skipped");
  } else if (end == stop) {
    evaluate(stop);  // an early stop has just evaluated these weights
  }
  dist->finish();
  if (!lead) return sum;  // rank 0 prints the summary
  std::string name = cfg.model.find('/') == std::string::npos ? cfg.model : "train";
  double last = n_last ? last10 / double(n_last) : sum.last_loss;
  if (sum.evaluated)
    sum.summary_line = str(name, ": loss ", std::round(sum.first_loss * 1e4) / 1e4, " -> ",
                           std::round(last * 1e4) / 1e4, ", exact-match ", std::round(sum.eval.exact_match() * 10) / 10,
                           "% on ", sum.eval.problems, " held-out problems");
  else
    sum.summary_line =
        str(name, ": loss ", std::round(sum.first_loss * 1e4) / 1e4, " -> ", std::round(last * 1e4) / 1e4);
  return sum;
}

int exit_status(const TrainSummary& s) {
  return s.stop_signal != 0 ? 128 + s.stop_signal : 0;
}

}  // namespace mt
