// moetrain convert (convert.h).
#include "train/convert.h"

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>

#include "core/cli_args.h"
#include "core/error.h"
#include "core/log.h"
#include "io/manifest.h"
#include "io/safetensors.h"
#include "model/config.h"
#include "model/hf_checkpoint.h"
#include "model/lora_peft.h"
#include "model/params.h"
#include "train/checkpoint.h"
#include "train/load_balance.h"

namespace mt {

namespace fs = std::filesystem;

namespace {

// The files of a Hugging Face tokenizer (and chat template) that travel with the weights.
const char* const kTokenizerFiles[] = {
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json",
    "merges.txt",     "added_tokens.json",     "chat_template.jinja",     "tokenizer.model"};

// config.json with the dtype the weights are stored in.
std::string config_text(const ModelConfig& c, DType dt) {
  nlohmann::ordered_json j = nlohmann::ordered_json::parse(model_config_to_json(c));
  const char* name = dt == DType::BF16 ? "bfloat16" : "float32";
  j["torch_dtype"] = name;
  j["dtype"] = name;
  return j.dump(2) + "\n";
}

std::string generation_config_text(const ModelConfig& c) {
  nlohmann::ordered_json j;
  j["_from_model_config"] = true;
  if (c.bos_token_id >= 0) j["bos_token_id"] = c.bos_token_id;
  if (c.eos_token_id >= 0) j["eos_token_id"] = c.eos_token_id;
  return j.dump(2) + "\n";
}

}  // namespace

size_t parse_size(const std::string& flag, const std::string& v) {
  struct Unit {
    const char* suffix;
    double mult;
  };
  static const Unit kUnits[] = {{"GiB", 1073741824.0}, {"MiB", 1048576.0}, {"KiB", 1024.0}, {"GB", 1e9},
                                {"MB", 1e6},           {"KB", 1e3},        {"B", 1.0}};
  for (const Unit& u : kUnits) {
    const std::string s = u.suffix;
    if (v.size() > s.size() && v.ends_with(s)) {
      const double x = parse_flag_number<double>(flag, v.substr(0, v.size() - s.size()));
      if (!(x > 0)) MT_THROW(flag, " '", v, "' must be > 0");
      return size_t(x * u.mult);
    }
  }
  const double x = parse_flag_number<double>(flag, v);
  if (!(x >= 1)) MT_THROW(flag, " '", v, "' must be at least 1 byte (or use KB, MB, GB)");
  return size_t(x);
}

namespace {
// The target is new or empty, and a source with a manifest verifies against it.
void check_source_and_target(const ConvertOptions& opt) {
  std::error_code ec;
  if (fs::exists(opt.to, ec) && !(fs::is_directory(opt.to, ec) && fs::is_empty(opt.to, ec)))
    MT_THROW("convert: --to '", opt.to, "' exists and is not an empty directory; choose a new directory");
  if (fs::exists(fs::path(opt.from) / kManifestFile)) {
    const std::string why = verify_manifest(opt.from);
    if (!why.empty()) MT_THROW("convert: checkpoint '", opt.from, "' does not verify against its manifest: ", why);
  }
}
}  // namespace

ConvertReport convert_checkpoint(const ConvertOptions& opt) {
  const auto t0 = std::chrono::steady_clock::now();
  if (opt.from.empty() || opt.to.empty()) MT_THROW("convert: --from and --to are required");
  if (opt.dtype != DType::BF16 && opt.dtype != DType::F32)
    MT_THROW("convert: dtype ", dtype_name(opt.dtype), " is not supported; allowed: bf16, f32");
  if (!fs::is_directory(opt.from)) MT_THROW("convert: --from '", opt.from, "' is not a directory");
  if (!fs::exists(fs::path(opt.from) / "config.json") &&
      (fs::exists(fs::path(opt.from) / "adapter" / "adapter_config.json") ||
       fs::exists(fs::path(opt.from) / "adapter_config.json")))
    MT_THROW("convert: '", opt.from, "' holds LoRA adapters, not a model; give --adapter (the PEFT adapter) or "
             "--merge (the base with the adapters added)");
  check_source_and_target(opt);
  std::error_code ec;
  const ModelConfig c = load_model_config(opt.from);
  // transformers keeps the unknown key but runs Qwen3-MoE's formula: the export would load without a word
  // and compute another model at every token. Refused rather than warned (a warning scrolls by; a wrong
  // model in a serving stack does not); the checkpoint itself stays a moetrain model directory.
  if (c.score_before_experts)
    MT_THROW(
        "convert: ", opt.from, "/config.json has \"moetrain_score_before_experts\": true (the model computes ",
        "y = sum_k expert_k(w_k x)); transformers' Qwen3-MoE computes y = sum_k w_k expert_k(x) and would load the "
        "export as another model, so it is not exported. moetrain generate, grpo, sft and grads run the "
        "checkpoint as it is");
  const ParamTable table(c);
  const CheckpointReader reader(opt.from);
  const ExpertLayout layout = detect_expert_layout(reader);
  // The model's tensors in parameter order (the names and shapes its own saver writes); every one must
  // be in the source, and the source must hold nothing else (the loader's rules).
  std::vector<PendingTensor> pending =
      pending_hf_tensors(c, table, layout, [](const ParamEntry&) -> Tensor { MT_THROW("unused"); });
  std::set<std::string> names;
  for (PendingTensor& p : pending) {
    if (!reader.has(p.name))
      MT_THROW("convert: '", opt.from, "' lacks tensor '", p.name, "' of this ", c.architecture, " config");
    const SafetensorsEntry& e = reader.info(p.name);
    if (e.shape != p.shape)
      MT_THROW("convert: tensor '", p.name, "' in '", opt.from, "' has shape ", shape_str(e.shape),
               ", the config says ", shape_str(p.shape));
    names.insert(p.name);
    p.dtype = opt.dtype;
    const std::string name = p.name;
    const DType dt = opt.dtype;
    p.produce = [&reader, name, dt] {
      const Tensor v = reader.view(name);
      if (v.dtype() == dt) return v;
      return (v.dtype() == DType::F32 ? v : v.to(DType::F32)).to(dt);
    };
  }
  for (const std::string& n : reader.names())
    if (!names.count(n) && !(n == "lm_head.weight" && c.tie_word_embeddings))
      MT_THROW("convert: '", opt.from, "' has tensor '", n, "', which this ", c.architecture, " config does not");

  const std::string tmp = opt.to + ".tmp";
  fs::remove_all(tmp, ec);
  fs::create_directories(tmp, ec);
  if (ec) MT_THROW("convert: cannot create '", tmp, "': ", ec.message());
  ConvertReport rep;
  write_safetensors_sharded_lazy(tmp, pending, opt.max_shard_bytes);
  write_file_atomic(tmp + "/config.json", config_text(c, opt.dtype));
  // Tokenizer files: from --tokenizer (a directory or one tokenizer.json), else from the source.
  fs::path tok_dir = opt.from;
  if (!opt.tokenizer.empty()) {
    if (fs::is_regular_file(opt.tokenizer)) {
      fs::copy_file(opt.tokenizer, fs::path(tmp) / "tokenizer.json", fs::copy_options::overwrite_existing);
      rep.copied.push_back("tokenizer.json");
      tok_dir.clear();
    } else if (fs::is_directory(opt.tokenizer)) {
      tok_dir = opt.tokenizer;
    } else {
      MT_THROW("convert: --tokenizer '", opt.tokenizer, "' is neither a directory nor a file");
    }
  }
  // A single tokenizer.json given: none of the source's tokenizer files (its tokenizer.json would replace the
  // one given, and its tokenizer_config.json would describe another tokenizer).
  std::vector<const char*> files;
  if (!tok_dir.empty()) files.assign(std::begin(kTokenizerFiles), std::end(kTokenizerFiles));
  files.push_back("generation_config.json");
  for (const char* f : files) {
    const fs::path src = std::string(f) == "generation_config.json" ? fs::path(opt.from) / f : tok_dir / f;
    if (!fs::is_regular_file(src)) continue;
    fs::copy_file(src, fs::path(tmp) / f, fs::copy_options::overwrite_existing, ec);
    if (ec) MT_THROW("convert: cannot copy '", src.string(), "' to '", tmp, "': ", ec.message());
    rep.copied.push_back(f);
  }
  if (!fs::exists(fs::path(tmp) / "generation_config.json"))
    write_file_atomic(tmp + "/generation_config.json", generation_config_text(c));
  for (const auto& de : fs::directory_iterator(tmp)) {
    const std::string n = de.path().filename().string();
    if (n.ends_with(".safetensors")) {
      ++rep.shards;
      rep.bytes += size_t(de.file_size());
    }
  }
  fs::remove(opt.to, ec);  // an empty directory (checked above)
  rename_durable(tmp, opt.to);
  rep.tensors = pending.size();
  rep.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (fs::exists(fs::path(opt.from) / kRouterBiasFile))
    log_info("convert: warning: ", opt.from, " has ", kRouterBiasFile,
             " (aux-loss-free balancing); transformers' Qwen3-MoE routes without a bias, so the exported model "
             "routes as the checkpoint's weights alone say");
  return rep;
}

ConvertReport convert_lora(const ConvertOptions& opt) {
  const auto t0 = std::chrono::steady_clock::now();
  if (opt.adapter == opt.merge) MT_THROW("convert: give one of --adapter (the PEFT adapter) and --merge (merged weights)");
  check_source_and_target(opt);
  std::error_code ec;
  const std::string adir = find_adapter_dir(opt.from);
  // The base: --base, else what the run's train_state.json or the adapter's config names.
  std::string base = opt.base;
  int64_t base_seed = -1;
  const fs::path state = fs::path(opt.from) / "train_state.json";
  nlohmann::json lora_state;
  if (fs::exists(state)) {
    std::ifstream f(state);
    const nlohmann::json st = nlohmann::json::parse(f);
    if (st.contains("lora")) lora_state = st["lora"];
  }
  if (base.empty() && lora_state.is_object()) base = lora_state.value("base", std::string());
  if (base.empty() && lora_state.is_null() && fs::exists(state)) {
    std::ifstream f(state);
    base = nlohmann::json::parse(f).value("model_dir", std::string());  // a grpo run's initial model
  }
  if (base.empty()) {
    std::ifstream f(fs::path(adir) / "adapter_config.json");
    base = nlohmann::json::parse(f).value("base_model_name_or_path", std::string());
  }
  if (lora_state.is_object() && lora_state.contains("base_seed") && lora_state["base_seed"].is_number_integer())
    base_seed = lora_state["base_seed"].get<int64_t>();
  if (base.empty())
    MT_THROW("convert: ", opt.from, " does not say which model its adapters belong to; give --base DIR");
  const bool preset = !fs::is_directory(base);
  if (preset && opt.merge && base_seed < 0)
    MT_THROW("convert --merge: the base '", base, "' is not a directory and the run records no seed to make it "
             "from; give --base DIR");
  const ModelConfig c = preset ? preset_model_config(base) : load_model_config(base);
  const LoraSpec spec = read_peft_config(adir);
  const Tensor values = read_peft_adapter(adir, c, spec);  // checks every tensor against the base's shapes
  ConvertReport r;
  if (opt.adapter) {
    const std::string tmp = opt.to + ".tmp";
    fs::remove_all(tmp);
    write_peft_adapter(tmp, c, spec, values, base);
    fs::remove_all(opt.to, ec);
    fs::rename(tmp, opt.to);
    r.tensors = LoraTable(c, spec).entries().size();
    r.bytes = size_t(values.numel()) * 4;
    r.shards = 1;
  } else {
    // The merged model as a plain f32 HF directory beside the target, then the ordinary conversion from it
    // (dtype, shards, tokenizer files, the atomic rename), then the intermediate goes.
    const ParamTable table(c);
    Tensor flat = Tensor::empty({table.total()});
    if (preset) {
      init_weights(c, table, flat, uint64_t(base_seed));
    } else {
      load_hf_weights(base, c, table, flat);
    }
    merge_lora(c, spec, values, table, flat);
    const std::string merged = opt.to + ".merged-f32";
    fs::remove_all(merged);
    fs::create_directories(merged);
    save_hf_checkpoint(merged, c, table, flat);
    ConvertOptions plain = opt;
    plain.from = merged;
    plain.adapter = plain.merge = false;
    if (plain.tokenizer.empty() && !preset && fs::exists(fs::path(base) / "tokenizer.json")) plain.tokenizer = base;
    r = convert_checkpoint(plain);
    fs::remove_all(merged);
  }
  r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return r;
}

}  // namespace mt
