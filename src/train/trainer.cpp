#include "train/trainer.h"

#include <sys/resource.h>

#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "backend/cpu/gemm.h"
#include "core/log.h"
#include "data/batch.h"
#include "model/hf_checkpoint.h"
#include "train/lr_schedule.h"
#include "train/optimizer.h"

namespace mt {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

static double seconds_since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

static std::string fmt_duration(double s) {
  if (!std::isfinite(s) || s < 0) return "?";
  int64_t t = int64_t(s + 0.5);
  if (t < 60) return str(t, "s");
  if (t < 3600) return str(t / 60, "m", (t % 60 < 10 ? "0" : ""), t % 60, "s");
  return str(t / 3600, "h", (t % 3600) / 60 / 10, (t % 3600) / 60 % 10, "m");
}

static size_t peak_rss_bytes() {
  struct rusage ru {};
  getrusage(RUSAGE_SELF, &ru);
  return size_t(ru.ru_maxrss) * 1024;
}

Device resolve_device(const std::string& name) {
  if (name == "cpu") return Device::CPU;
  if (name == "cuda") {
    if (!device_mem::cuda_available())
      MT_THROW("device 'cuda': no GPU is visible or this moetrain was built without CUDA; use --device cpu");
    return Device::CUDA;
  }
  if (name == "auto") return device_mem::cuda_available() ? Device::CUDA : Device::CPU;
  MT_THROW("device '", name, "' is not supported; allowed: cpu, cuda, auto");
}

ModelConfig resolve_model_config(const std::string& model) {
  if (fs::is_directory(model) || fs::is_regular_file(model)) return load_model_config(model);
  for (const std::string& p : preset_names())
    if (p == model) return preset_model_config(model);
  std::string names;
  for (const std::string& p : preset_names()) names += (names.empty() ? "" : ", ") + p;
  MT_THROW("model '", model, "' is neither a preset (", names, ") nor a Hugging Face model directory");
}

TrainSummary run_training(const TrainConfig& cfg) {
  validate_train_config(cfg);
  cpu::set_blas_threads(int(cfg.threads));
  Device device = resolve_device(cfg.device);
  ModelConfig mc = resolve_model_config(cfg.model);

  Qwen3MoeModel model(mc, device);
  model.recompute = parse_recompute(cfg.recompute);
  if (cfg.init_from.empty()) {
    Tensor host = Tensor::zeros({model.table().total()});
    init_weights(mc, model.table(), host, uint64_t(cfg.seed));
    model.params().copy_from(host.to(device));
  } else {
    LoadReport rep = load_hf_weights(cfg.init_from, mc, model.table(), model.params());
    log_info("loaded ", rep.tensors, " tensors, ", rep.bytes_read / 1e6, " MB from ", cfg.init_from, " in ",
             rep.seconds, " s");
  }
  model.refresh_compute_weights();
  std::unique_ptr<BatchSource> data = make_batch_source(cfg.data, cfg.micro_batch_size, cfg.seq_len, mc.vocab_size,
                                                        int(cfg.max_digits), uint64_t(cfg.seed));
  const bool synthetic = cfg.data.rfind("synthetic:", 0) == 0;
  std::vector<Problem> eval_set;
  if (synthetic && cfg.eval_problems > 0)
    eval_set = make_eval_problems(cfg.eval_problems, uint64_t(cfg.seed) + 1, int(cfg.max_digits));

  AdamWConfig oc;
  oc.beta1 = cfg.beta1;
  oc.beta2 = cfg.beta2;
  oc.eps = cfg.eps;
  oc.weight_decay = cfg.weight_decay;
  oc.max_grad_norm = cfg.grad_clip;
  AdamW opt(model.table().total(), device, oc);
  LrParams lrp = lr_params(cfg);

  fs::create_directories(cfg.out_dir);
  {
    std::ofstream f(cfg.out_dir + "/train_config.json");
    f << to_json(cfg) << "\n";
  }
  std::string mpath = metrics_path(cfg);
  if (fs::path(mpath).has_parent_path()) fs::create_directories(fs::path(mpath).parent_path());
  std::ofstream metrics(mpath, std::ios::trunc);
  if (!metrics) MT_THROW("cannot open metrics file ", mpath);

  log_info("model ", mc.architecture, ": ", mc.num_parameters() / 1e6, " M parameters (", model.table().total(),
           " in the flat buffer), ", mc.num_hidden_layers, " layers, ", mc.num_experts, " experts top-",
           mc.num_experts_per_tok, ", device ", device_name(device), ", recompute ", cfg.recompute);
  log_info("data: ", data->describe());
  log_info("training ", cfg.steps, " steps x ", cfg.grad_accum, " micro-batches of ", cfg.micro_batch_size, " x ",
           cfg.seq_len, " tokens; metrics -> ", mpath);

  const double aux_scale = model.aux_enabled() ? mc.router_aux_loss_coef / double(cfg.grad_accum) : 0.0;
  TrainSummary sum;
  auto run_start = Clock::now();
  double last10 = 0;
  int64_t n_last = 0;
  auto evaluate = [&](int64_t step) {
    if (eval_set.empty()) return;
    auto t = Clock::now();
    sum.eval = evaluate_addition(model, eval_set, int(cfg.max_digits));
    sum.evaluated = true;
    log_info("eval @ step ", step, ": exact-match ", sum.eval.exact_match(), "% (", sum.eval.correct, "/",
             sum.eval.problems, ") in ", seconds_since(t), " s; e.g. ", sum.eval.samples.empty() ? "" : sum.eval.samples[0]);
    nlohmann::json j{{"event", "eval"}, {"step", step}, {"exact_match", sum.eval.exact_match()},
                     {"problems", sum.eval.problems}};
    metrics << j.dump() << "\n" << std::flush;
  };
  auto save = [&](int64_t step) {
    std::string dir = str(cfg.out_dir, "/checkpoint-", step);
    auto t = Clock::now();
    save_hf_checkpoint(dir, mc, model.table(), model.params());
    sum.checkpoint_dir = dir;
    log_info("saved checkpoint ", dir, " (HF format) in ", seconds_since(t), " s");
  };

  for (int64_t step = 0; step < cfg.steps; ++step) {
    auto step_start = Clock::now();
    double t_data = 0, t_fwd = 0, t_bwd = 0;
    // The loss is normalised by the target tokens of the whole step, counted before any forward.
    std::vector<Batch> batches;
    int64_t targets = 0, tokens = 0;
    auto td = Clock::now();
    for (int64_t m = 0; m < cfg.grad_accum; ++m) {
      batches.push_back(data->next());
      targets += count_target_tokens(batches.back().labels);
      tokens += batches.back().input_ids.numel();
    }
    t_data += seconds_since(td);
    if (targets == 0) MT_THROW("step ", step, ": no target tokens in any micro-batch (every label is -100)");
    double ce_sum = 0, aux_sum = 0;
    for (int64_t m = 0; m < cfg.grad_accum; ++m) {
      auto tm = Clock::now();
      model.first_micro_batch = m == 0;  // the first writes the gradients (=): no zeroing pass
      LossParts lp = model.forward_backward(MicroBatch{batches[size_t(m)].input_ids, batches[size_t(m)].labels},
                                            1.0 / double(targets), aux_scale);
      ce_sum += lp.ce_sum;
      aux_sum += lp.aux;
      t_fwd += model.last_forward_seconds();
      t_bwd += model.last_backward_seconds();
      if (cfg.grad_accum > 1) {
        double lat = seconds_since(tm), done = double(m + 1) / double(cfg.grad_accum);
        log_info("  step ", step + 1, " micro ", m + 1, "/", cfg.grad_accum, ": ", lat, " s (fwd ",
                 model.last_forward_seconds(), ", bwd ", model.last_backward_seconds(), "), elapsed ",
                 fmt_duration(seconds_since(run_start)), ", step ETA ",
                 fmt_duration(seconds_since(step_start) / done * (1 - done)));
      }
    }
    model.first_micro_batch = false;
    double lr = lr_at(lrp, step);
    auto to = Clock::now();
    OptimStepResult os = opt.step(model.params(), model.grads(), lr, model.compute_params());
    double t_opt = seconds_since(to);
    double ce = ce_sum / double(targets), aux = aux_sum / double(cfg.grad_accum);
    double loss = ce + (model.aux_enabled() ? mc.router_aux_loss_coef * aux : 0.0);
    if (os.skipped) log_info("step ", step + 1, ": grad norm ", os.grad_norm, " is not finite; step skipped (",
                             opt.steps_skipped(), " skipped so far)");
    double dt = seconds_since(step_start), elapsed = seconds_since(run_start);
    double eta = elapsed / double(step + 1) * double(cfg.steps - step - 1);
    if (step == 0) sum.first_loss = loss;
    sum.last_loss = loss;
    if (step >= cfg.steps - 10) {
      last10 += loss;
      ++n_last;
    }
    nlohmann::json j{{"step", step + 1},
                     {"loss", loss},
                     {"ce", ce},
                     {"aux", aux},
                     {"grad_norm", os.grad_norm},
                     {"clip_scale", os.clip_scale},
                     {"skipped", os.skipped},
                     {"skipped_total", opt.steps_skipped()},
                     {"lr", lr},
                     {"tokens", tokens},
                     {"target_tokens", targets},
                     {"tokens_per_s", double(tokens) / dt},
                     {"time_s", {{"step", dt}, {"data", t_data}, {"forward", t_fwd}, {"backward", t_bwd},
                                 {"optimizer", t_opt}}},
                     {"activation_peak_bytes", model.activation_peak_bytes()},
                     {"peak_rss_bytes", peak_rss_bytes()},
                     {"gpu_peak_bytes", device_mem::cuda_peak_bytes()},
                     {"elapsed_s", elapsed}};
    metrics << j.dump() << "\n" << std::flush;
    if (cfg.log_every > 0 && ((step + 1) % cfg.log_every == 0 || step == 0 || step + 1 == cfg.steps)) {
      char line[512];
      std::snprintf(line, sizeof line,
                    "step %lld/%lld | loss %.4f (ce %.4f aux %.4f) | gnorm %.3f%s | lr %.2e | %.0f tok/s | "
                    "fwd %.3fs bwd %.3fs opt %.3fs data %.3fs | %s %.0f MB | elapsed %s ETA %s",
                    (long long)(step + 1), (long long)cfg.steps, loss, ce, aux, os.grad_norm,
                    os.skipped ? " SKIPPED" : "", lr, double(tokens) / dt, t_fwd, t_bwd, t_opt, t_data,
                    device == Device::CUDA ? "gpu peak" : "peak rss",
                    double(device == Device::CUDA ? device_mem::cuda_peak_bytes() : peak_rss_bytes()) / 1e6,
                    fmt_duration(elapsed).c_str(), fmt_duration(eta).c_str());
      log_line(line);
    }
    if (cfg.eval_every > 0 && (step + 1) % cfg.eval_every == 0 && step + 1 < cfg.steps) evaluate(step + 1);
    if (cfg.save_every > 0 && (step + 1) % cfg.save_every == 0 && step + 1 < cfg.steps) save(step + 1);
  }
  sum.steps = cfg.steps;
  sum.skipped = opt.steps_skipped();
  evaluate(cfg.steps);
  save(cfg.steps);
  std::string name = cfg.model.find('/') == std::string::npos ? cfg.model : "train";
  double last = n_last ? last10 / double(n_last) : sum.last_loss;
  if (sum.evaluated)
    sum.summary_line = str(name, ": loss ", std::round(sum.first_loss * 1e4) / 1e4, " -> ", std::round(last * 1e4) / 1e4,
                           ", exact-match ", std::round(sum.eval.exact_match() * 10) / 10, "% on ", sum.eval.problems,
                           " held-out problems");
  else
    sum.summary_line = str(name, ": loss ", std::round(sum.first_loss * 1e4) / 1e4, " -> ", std::round(last * 1e4) / 1e4);
  return sum;
}

int train_main(const std::vector<std::string>& args) {
  TrainConfig cfg = train_config_from_args(args);
  TrainSummary s = run_training(cfg);
  std::printf("%s\n", s.summary_line.c_str());
  return 0;
}

}  // namespace mt
