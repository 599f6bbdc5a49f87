// PEFT adapter directories (lora_peft.h).
#include "model/lora_peft.h"

#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <set>

#include "core/error.h"
#include "io/safetensors.h"
#include "model/params.h"

namespace mt {

namespace fs = std::filesystem;

namespace {

constexpr const char* kPrefix = "base_model.model.";

bool experts_target(LoraTarget t) { return t == LoraTarget::ExpertsGateUp || t == LoraTarget::ExpertsDown; }

// The base parameter a target adapts (its ParamTable name under model.layers.L.).
const char* base_param(LoraTarget t) {
  switch (t) {
    case LoraTarget::Q: return "self_attn.q_proj.weight";
    case LoraTarget::K: return "self_attn.k_proj.weight";
    case LoraTarget::V: return "self_attn.v_proj.weight";
    case LoraTarget::O: return "self_attn.o_proj.weight";
    case LoraTarget::Gate: return "mlp.gate_proj.weight";
    case LoraTarget::Up: return "mlp.up_proj.weight";
    case LoraTarget::Down: return "mlp.down_proj.weight";
    case LoraTarget::ExpertsGateUp: return "mlp.experts.gate_up_proj";
    case LoraTarget::ExpertsDown: return "mlp.experts.down_proj";
    case LoraTarget::Router: return "mlp.gate.weight";
  }
  return "";
}

// PEFT's key of a table entry (without the prefix).
std::string peft_key(const LoraEntry& e, const LoraSpec& s) {
  if (!experts_target(e.target)) return e.name;
  const std::string layer = "model.layers." + std::to_string(e.layer) + ".mlp.experts.";
  const bool both = s[LoraTarget::ExpertsGateUp] && s[LoraTarget::ExpertsDown];
  const std::string ab = e.b ? "lora_B.weight" : "lora_A.weight";
  return layer + (both && e.target == LoraTarget::ExpertsGateUp ? "base_layer." : "") + ab;
}

std::vector<std::string> strings_of(const nlohmann::json& j, const std::string& key, const std::string& path) {
  std::vector<std::string> out;
  if (!j.contains(key) || j[key].is_null()) return out;
  if (j[key].is_string()) return {j[key].get<std::string>()};
  if (!j[key].is_array()) MT_THROW(path, ": ", key, " must be a list of names, got ", j[key].dump());
  for (const auto& v : j[key]) {
    if (!v.is_string()) MT_THROW(path, ": ", key, " must be a list of names, got ", j[key].dump());
    out.push_back(v.get<std::string>());
  }
  return out;
}

}  // namespace

std::string find_adapter_dir(const std::string& path) {
  if (fs::exists(fs::path(path) / "adapter_config.json")) return path;
  if (fs::exists(fs::path(path) / "adapter" / "adapter_config.json")) return (fs::path(path) / "adapter").string();
  MT_THROW("LoRA adapter: ", path, " holds no adapter_config.json, nor adapter/adapter_config.json (a PEFT adapter "
           "directory, or a checkpoint-N of a run with --lora-rank)");
}

LoraSpec read_peft_config(const std::string& dir) {
  const std::string path = dir + "/adapter_config.json";
  std::ifstream f(path);
  if (!f) MT_THROW("LoRA adapter: cannot open ", path, " (an adapter directory holds adapter_config.json and "
                   "adapter_model.safetensors)");
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(f);
  } catch (const std::exception& e) {
    MT_THROW(path, " is not JSON: ", e.what());
  }
  if (j.value("peft_type", std::string("LORA")) != "LORA")
    MT_THROW(path, ": peft_type ", j["peft_type"].dump(), " is not LORA");
  auto refuse_if = [&](const char* key, bool bad, const char* what) {
    if (bad) MT_THROW(path, ": ", key, " = ", j[key].dump(), " is not supported (", what, ")");
  };
  refuse_if("use_dora", j.value("use_dora", false), "DoRA");
  refuse_if("fan_in_fan_out", j.value("fan_in_fan_out", false), "Conv1D-style weights");
  refuse_if("bias", j.contains("bias") && j["bias"].is_string() && j["bias"] != "none", "adapter biases");
  refuse_if("lora_bias", j.value("lora_bias", false), "adapter biases");
  refuse_if("rank_pattern", j.contains("rank_pattern") && j["rank_pattern"].is_object() && !j["rank_pattern"].empty(),
            "one rank for every adapter");
  refuse_if("alpha_pattern",
            j.contains("alpha_pattern") && j["alpha_pattern"].is_object() && !j["alpha_pattern"].empty(),
            "one alpha for every adapter");
  refuse_if("modules_to_save", j.contains("modules_to_save") && !j["modules_to_save"].is_null() &&
                                   !j["modules_to_save"].empty(),
            "fully trained modules beside the adapters");
  LoraSpec s;
  if (!j.contains("r") || !j["r"].is_number_integer() || j["r"].get<int64_t>() < 1)
    MT_THROW(path, ": r must be an integer >= 1, got ", j.contains("r") ? j["r"].dump() : "nothing");
  s.rank = j["r"].get<int64_t>();
  if (!j.contains("lora_alpha") || !j["lora_alpha"].is_number() || !(j["lora_alpha"].get<double>() > 0))
    MT_THROW(path, ": lora_alpha must be a number > 0, got ", j.contains("lora_alpha") ? j["lora_alpha"].dump() : "nothing");
  s.alpha = j["lora_alpha"].get<double>();
  s.rslora = j.value("use_rslora", false);
  std::string list;
  for (const std::string& m : strings_of(j, "target_modules", path)) {
    // A module name, or a regex / dotted path that ends in one (PEFT matches suffixes).
    const std::string last = m.substr(m.find_last_of('.') == std::string::npos ? 0 : m.find_last_of('.') + 1);
    if (last == "q_proj" || last == "k_proj" || last == "v_proj" || last == "o_proj")
      list += "," + last;
    else
      MT_THROW(path, ": target_modules entry '", m, "' is not one this engine adapts as a module (q_proj, k_proj, "
               "v_proj, o_proj; the MLPs and experts go in target_parameters)");
  }
  for (std::string p : strings_of(j, "target_parameters", path)) {
    if (p.size() > 7 && p.compare(p.size() - 7, 7, ".weight") == 0) p.resize(p.size() - 7);
    const std::map<std::string, std::string> known = {
        {"mlp.experts.gate_up_proj", "experts.gate_up_proj"}, {"mlp.experts.down_proj", "experts.down_proj"},
        {"mlp.gate_proj", "gate_proj"}, {"mlp.up_proj", "up_proj"}, {"mlp.down_proj", "down_proj"},
        {"mlp.gate", "router"},
    };
    auto it = known.end();
    for (auto k = known.begin(); k != known.end(); ++k)
      if (p == k->first || (p.size() > k->first.size() && p.compare(p.size() - k->first.size() - 1, std::string::npos,
                                                                      "." + k->first) == 0))
        it = k;
    if (it == known.end())
      MT_THROW(path, ": target_parameters entry '", p, "' is not one this engine adapts (mlp.experts.gate_up_proj, "
               "mlp.experts.down_proj, mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight, mlp.gate.weight)");
    list += "," + it->second;
  }
  if (list.empty()) MT_THROW(path, ": no target_modules or target_parameters");
  s.targets = parse_lora_targets(list.substr(1));
  return s;
}

Tensor read_peft_adapter(const std::string& dir, const ModelConfig& c, const LoraSpec& spec) {
  const std::string path = dir + "/adapter_model.safetensors";
  if (!fs::exists(path))
    MT_THROW("LoRA adapter: ", path, " does not exist", fs::exists(dir + "/adapter_model.bin")
                                                             ? " (adapter_model.bin, PyTorch's pickle, is not read: "
                                                               "save the adapter with safe_serialization=True)"
                                                             : "");
  SafetensorsFile f(path);
  const LoraTable table(c, spec);
  Tensor flat = Tensor::empty({table.total()});
  std::set<std::string> unused;
  for (const std::string& n : f.names()) unused.insert(n);
  const int64_t E = c.num_experts, r = spec.rank;
  for (const LoraEntry& e : table.entries()) {
    const std::string key = kPrefix + peft_key(e, spec);
    if (!f.has(key))
      MT_THROW(path, " has no ", key, " (", e.name, " of the adapter that adapter_config.json describes)");
    unused.erase(key);
    Tensor v = f.read_f32(key);
    float* dst = flat.data<float>() + e.offset;
    if (!experts_target(e.target)) {
      if (v.shape() != e.shape) MT_THROW(path, ": ", key, " is ", v.desc(), "; this model needs ", shape_str(e.shape));
      std::copy(v.data<float>(), v.data<float>() + e.numel, dst);
      continue;
    }
    const int64_t out_or_r = e.shape[1], in_or_r = e.shape[2];
    const Shape want = e.b ? Shape{out_or_r, r * E} : Shape{r * E, in_or_r};
    if (v.shape() != want) MT_THROW(path, ": ", key, " is ", v.desc(), "; this model needs ", shape_str(want));
    if (!e.b) {  // [r E, in] = our [E, r, in]
      std::copy(v.data<float>(), v.data<float>() + e.numel, dst);
    } else {  // PEFT [out, r E], column j E + e -> ours [E, out, r]
      const int64_t out = out_or_r;
      const float* src = v.data<float>();
      for (int64_t x = 0; x < E; ++x)
        for (int64_t o = 0; o < out; ++o)
          for (int64_t j = 0; j < r; ++j) dst[(x * out + o) * r + j] = src[o * r * E + j * E + x];
    }
  }
  if (!unused.empty())
    MT_THROW(path, " holds ", unused.size(), " tensor(s) that adapter_config.json's targets do not account for, e.g. ",
             *unused.begin());
  return flat;
}

void write_peft_adapter(const std::string& dir, const ModelConfig& c, const LoraSpec& spec, const Tensor& flat,
                        const std::string& base_model) {
  const LoraTable table(c, spec);
  MT_CHECK(flat.numel() == table.total(), "write_peft_adapter: ", flat.numel(), " values for a table of ",
           table.total());
  const Tensor host = flat.to(Device::CPU).to(DType::F32);
  const int64_t E = c.num_experts, r = spec.rank;
  NamedTensors out;
  for (const LoraEntry& e : table.entries()) {
    const float* src = host.data<float>() + e.offset;
    Tensor v;
    if (!experts_target(e.target)) {
      v = Tensor::empty(e.shape);
      std::copy(src, src + e.numel, v.data<float>());
    } else if (!e.b) {
      v = Tensor::empty({r * E, e.shape[2]});
      std::copy(src, src + e.numel, v.data<float>());
    } else {
      const int64_t out_dim = e.shape[1];
      v = Tensor::empty({out_dim, r * E});
      float* d = v.data<float>();
      for (int64_t x = 0; x < E; ++x)
        for (int64_t o = 0; o < out_dim; ++o)
          for (int64_t j = 0; j < r; ++j) d[o * r * E + j * E + x] = src[(x * out_dim + o) * r + j];
    }
    out.emplace_back(kPrefix + peft_key(e, spec), v);
  }
  nlohmann::json modules = nlohmann::json::array(), params = nlohmann::json::array();
  for (LoraTarget t : {LoraTarget::Q, LoraTarget::K, LoraTarget::V, LoraTarget::O})
    if (spec[t]) modules.push_back(lora_target_name(t));
  std::set<std::string> have;
  for (const LoraEntry& e : table.entries()) have.insert(base_param(e.target));
  for (LoraTarget t : {LoraTarget::ExpertsGateUp, LoraTarget::ExpertsDown, LoraTarget::Gate, LoraTarget::Up,
                       LoraTarget::Down, LoraTarget::Router})
    if (spec[t] && have.count(base_param(t))) params.push_back(base_param(t));
  nlohmann::json cfg = {
      {"peft_type", "LORA"},
      {"task_type", "CAUSAL_LM"},
      {"base_model_name_or_path", base_model},
      {"r", r},
      {"lora_alpha", spec.effective_alpha()},
      {"use_rslora", spec.rslora},
      {"lora_dropout", 0.0},
      {"bias", "none"},
      {"fan_in_fan_out", false},
      {"use_dora", false},
      {"init_lora_weights", true},
      {"inference_mode", true},
      {"target_modules", modules},
      {"target_parameters", params},
      {"rank_pattern", nlohmann::json::object()},
      {"alpha_pattern", nlohmann::json::object()},
      {"modules_to_save", nullptr},
  };
  if (modules.empty()) cfg["target_modules"] = nullptr;
  fs::create_directories(dir);
  write_safetensors(dir + "/adapter_model.safetensors", out);
  std::ofstream f(dir + "/adapter_config.json");
  f << cfg.dump(2) << "\n";
  if (!f) MT_THROW("cannot write ", dir, "/adapter_config.json");
}

void merge_lora(const ModelConfig& c, const LoraSpec& spec, const Tensor& lora_flat, const ParamTable& table,
                Tensor& base_flat) {
  MT_CHECK(base_flat.is_cpu() && base_flat.dtype() == DType::F32 && base_flat.numel() == table.total(),
           "merge_lora needs the host f32 base of ", table.total(), " values, got ", base_flat.desc());
  const LoraTable lt(c, spec);
  const Tensor host = lora_flat.to(Device::CPU);
  const double s = spec.scale();
  const std::vector<LayerLora> pairs = bind_lora(c, lt, host);
  for (int64_t l = 0; l < c.num_hidden_layers; ++l)
    for (int t = 0; t < kLoraTargets; ++t) {
      const LoraPair& p = pairs[size_t(l)].t[size_t(t)];
      if (!p.defined()) continue;
      const ParamEntry& w = table.at("model.layers." + std::to_string(l) + "." + base_param(LoraTarget(t)));
      const bool ex = p.A.dim() == 3;
      const int64_t n = ex ? p.A.size(0) : 1, r = spec.rank, in = p.A.size(ex ? 2 : 1), out = p.B.size(ex ? 1 : 0);
      for (int64_t x = 0; x < n; ++x) {
        const float* A = p.A.data<float>() + x * r * in;
        const float* B = p.B.data<float>() + x * out * r;
        float* W = base_flat.data<float>() + w.offset + x * out * in;
        for (int64_t o = 0; o < out; ++o)
          for (int64_t i = 0; i < in; ++i) {
            double d = 0;
            for (int64_t j = 0; j < r; ++j) d += double(B[o * r + j]) * double(A[j * in + i]);
            W[o * in + i] += float(s * d);
          }
      }
    }
}

}  // namespace mt
