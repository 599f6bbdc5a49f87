#include "train/grads.h"

#include "core/log.h"
#include "data/batch.h"
#include "model/hf_checkpoint.h"

namespace mt {

static Tensor read_batch_tensor(const SafetensorsFile& f, const char* name) {
  if (!f.has(name)) MT_THROW("batch file ", f.path(), " has no tensor '", name, "' (need input_ids and labels)");
  const SafetensorsEntry& e = f.info(name);
  if (e.dtype != DType::I64 || e.shape.size() != 2)
    MT_THROW("batch tensor '", name, "' in ", f.path(), " is ", dtype_name(e.dtype), shape_str(e.shape),
             "; expected i64 [B, T]");
  return f.view(name).clone();
}

GradsResult run_grads(const GradsOptions& opt) {
  ModelConfig cfg = load_model_config(opt.model_dir);
  Qwen3MoeModel model(cfg);
  model.recompute = opt.recompute;
  LoadReport rep = load_hf_weights(opt.model_dir, cfg, model.table(), model.params());
  model.refresh_compute_weights();
  log_info("grads: loaded ", rep.tensors, " tensors (", rep.bytes_read, " bytes, ", expert_layout_name(rep.layout),
           " experts) from ", opt.model_dir, " in ", rep.seconds, " s");

  SafetensorsFile bf(opt.batch_path);
  MicroBatch mb{read_batch_tensor(bf, "input_ids"), read_batch_tensor(bf, "labels")};
  if (mb.labels.shape() != mb.input_ids.shape())
    MT_THROW("labels ", shape_str(mb.labels.shape()), " and input_ids ", shape_str(mb.input_ids.shape()),
             " in ", opt.batch_path, " differ in shape");
  int64_t n_valid = count_target_tokens(mb.labels);
  if (n_valid == 0) MT_THROW("batch ", opt.batch_path, " has no label other than -100 after the shift: the loss is undefined");
  double aux_scale = model.aux_enabled() ? cfg.router_aux_loss_coef : 0.0;

  model.zero_grads();
  Tensor logits;
  LossParts lp = model.forward_backward(mb, 1.0 / double(n_valid), aux_scale, &logits);

  GradsResult res{lp.loss, lp.aux, lp.n_valid};
  NamedTensors out;
  Tensor loss = Tensor::empty({1}), aux = Tensor::empty({1});
  loss.data<float>()[0] = float(lp.loss);
  aux.data<float>()[0] = float(lp.aux);
  out.emplace_back("loss", loss);
  out.emplace_back("aux_loss", aux);
  out.emplace_back("logits", logits.to(Device::CPU).view({mb.input_ids.size(0), mb.input_ids.size(1), cfg.vocab_size}));
  CheckpointReader r(opt.model_dir);
  bool file_has_lm_head = r.has("lm_head.weight");
  for (auto& [name, t] : export_hf_tensors(cfg, model.table(), model.grads(), rep.layout)) {
    out.emplace_back("grad." + name, t);
    if (cfg.tie_word_embeddings && file_has_lm_head && name == "model.embed_tokens.weight")
      out.emplace_back("grad.lm_head.weight", t);  // the file names the tied matrix twice
  }
  write_safetensors(opt.out_path, out);
  return res;
}

int grads_main(const std::vector<std::string>& args) {
  GradsOptions opt;
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& a = args[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= args.size()) MT_THROW("grads: ", a, " needs a value");
      return args[++i];
    };
    if (a == "--model") opt.model_dir = value();
    else if (a == "--batch") opt.batch_path = value();
    else if (a == "--out") opt.out_path = value();
    else if (a == "--recompute") opt.recompute = parse_recompute(value());
    else MT_THROW("grads: unknown argument '", a, "'; usage: moetrain grads --model DIR --batch FILE.safetensors --out FILE.safetensors [--recompute none|full|selective]");
  }
  if (opt.model_dir.empty() || opt.batch_path.empty() || opt.out_path.empty())
    MT_THROW("grads: --model, --batch and --out are required; usage: moetrain grads --model DIR --batch FILE.safetensors --out FILE.safetensors [--recompute none|full|selective]");
  GradsResult r = run_grads(opt);
  std::printf("grads: loss %.8f aux_loss %.8f over %lld target tokens -> %s\n", r.loss, r.aux_loss,
              (long long)r.n_valid, opt.out_path.c_str());
  return 0;
}

}  // namespace mt
