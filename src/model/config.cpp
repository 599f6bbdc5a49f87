// ModelConfig: parsing and writing Hugging Face config.json for Qwen3-MoE and dense Qwen3, the
// parameter counts used for MFU, and the built-in presets. Parsing follows what transformers
// itself reads from the same file (its class defaults for absent fields, its spellings across
// versions), and rejects features this engine does not implement instead of ignoring them.
#include "model/config.h"

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <mutex>
#include <optional>
#include <set>
#include <sstream>

#include "core/error.h"
#include "core/log.h"

namespace mt {

namespace {

using nlohmann::json;

constexpr const char* kMoeArch = "Qwen3MoeForCausalLM";
constexpr const char* kDenseArch = "Qwen3ForCausalLM";
constexpr const char* kSupported = "Qwen3MoeForCausalLM (model_type qwen3_moe), Qwen3ForCausalLM (model_type qwen3)";

// Typed access to config.json fields. A null value counts as absent (the Hub configs write
// `"rope_scaling": null`, `"sliding_window": null`). Every error names the origin, the field and the value.
class Fields {
 public:
  Fields(const json& j, const std::string& origin) : j_(j), origin_(origin) {}

  const json* find(const char* key) const {
    auto it = j_.find(key);
    if (it == j_.end() || it->is_null()) return nullptr;
    return &*it;
  }
  bool has(const char* key) const { return find(key) != nullptr; }

  int64_t require_int(const char* key) const {
    const json* v = find(key);
    if (!v) MT_THROW(origin_, ": missing required field '", key, "'");
    return to_int(key, *v);
  }
  int64_t get_int(const char* key, int64_t def) const {
    const json* v = find(key);
    return v ? to_int(key, *v) : def;
  }
  double get_double(const char* key, double def) const {
    const json* v = find(key);
    return v ? to_double(key, *v) : def;
  }
  bool get_bool(const char* key, bool def) const {
    const json* v = find(key);
    if (!v) return def;
    if (!v->is_boolean()) MT_THROW(origin_, ": field '", key, "' must be true or false, got ", v->dump());
    return v->get<bool>();
  }
  std::optional<std::string> get_string(const char* key) const {
    const json* v = find(key);
    if (!v) return std::nullopt;
    if (!v->is_string()) MT_THROW(origin_, ": field '", key, "' must be a string, got ", v->dump());
    return v->get<std::string>();
  }
  std::vector<int64_t> get_int_list(const char* key) const {
    const json* v = find(key);
    if (!v) return {};
    if (!v->is_array()) MT_THROW(origin_, ": field '", key, "' must be a list of integers, got ", v->dump());
    std::vector<int64_t> out;
    for (const json& e : *v) out.push_back(to_int(key, e));
    return out;
  }

  int64_t to_int(const std::string& key, const json& v) const {
    if (v.is_number_integer() && !v.is_number_unsigned()) return v.get<int64_t>();
    if (v.is_number_unsigned()) {
      uint64_t u = v.get<uint64_t>();
      if (u <= uint64_t(INT64_MAX)) return int64_t(u);
    }
    // Python's json writes 2048.0 for a float-typed int; accept it only when it is integral.
    if (v.is_number_float()) {
      double d = v.get<double>();
      if (std::isfinite(d) && d == std::floor(d) && std::fabs(d) < 9.0e15) return int64_t(d);
    }
    MT_THROW(origin_, ": field '", key, "' must be an integer, got ", v.dump());
  }
  double to_double(const std::string& key, const json& v) const {
    if (!v.is_number()) MT_THROW(origin_, ": field '", key, "' must be a number, got ", v.dump());
    return v.get<double>();
  }

 private:
  const json& j_;
  const std::string& origin_;
};

// rope_theta lives at the top level (Hub configs, transformers 4.x), inside rope_parameters
// (transformers 5.x) or inside rope_scaling (some 4.x exports). Only the default RoPE is implemented,
// so a scaled RoPE (yarn, linear, dynamic, ...) is an error rather than a silently different model.
double parse_rope_theta(const json& j, const Fields& f, const std::string& origin) {
  std::optional<double> theta;
  std::string theta_from;
  auto take = [&](double value, const std::string& from) {
    if (theta && *theta != value)
      MT_THROW(origin, ": rope_theta is ", *theta, " in ", theta_from, " but ", value, " in ", from,
               "; they must agree");
    theta = value;
    theta_from = from;
  };
  if (f.has("rope_theta")) take(f.to_double("rope_theta", j["rope_theta"]), "rope_theta");
  for (const char* section : {"rope_parameters", "rope_scaling"}) {
    const json* s = f.find(section);
    if (!s) continue;
    if (!s->is_object()) MT_THROW(origin, ": field '", section, "' must be an object or null, got ", s->dump());
    std::string type = "default";
    for (const char* type_key : {"rope_type", "type"}) {
      auto it = s->find(type_key);
      if (it == s->end() || it->is_null()) continue;
      if (!it->is_string())
        MT_THROW(origin, ": field '", section, ".", type_key, "' must be a string, got ", it->dump());
      type = it->get<std::string>();
    }
    if (type != "default")
      MT_THROW(origin, ": ", section, " asks for rope_type '", type,
               "', but only the default RoPE is supported (rope_type \"default\")");
    auto it = s->find("rope_theta");
    if (it != s->end() && !it->is_null()) take(f.to_double(std::string(section) + ".rope_theta", *it), section);
  }
  return theta.value_or(10000.0);  // transformers' default
}

// The fields read above, and those transformers writes that do not change what the model computes here
// (bookkeeping, inference-time settings, a disabled sliding window). Anything else may be a feature this engine
// does not know: a warning names it, once per field name in the process (configs are read several times).
void warn_unknown_fields(const json& j, const std::string& origin) {
  static const std::set<std::string> kKnown = {
      // read by parse_model_config
      "architectures", "model_type", "hidden_act", "attention_bias", "use_sliding_window", "vocab_size", "hidden_size",
      "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps", "rope_theta",
      "rope_parameters", "rope_scaling", "max_position_embeddings", "tie_word_embeddings", "initializer_range",
      "bos_token_id", "eos_token_id", "num_experts", "num_local_experts", "num_experts_per_tok",
      "moe_intermediate_size", "intermediate_size", "decoder_sparse_step", "mlp_only_layers", "norm_topk_prob",
      "output_router_logits", "router_aux_loss_coef", "moetrain_score_before_experts",
      // written by transformers, no effect on the computation here
      "attention_dropout", "sliding_window", "max_window_layers", "layer_types", "use_cache", "torch_dtype", "dtype",
      "transformers_version", "pad_token_id", "_name_or_path", "_attn_implementation_autoset"};
  static std::mutex mu;
  static std::set<std::string> warned;
  std::lock_guard<std::mutex> lock(mu);
  for (auto it = j.begin(); it != j.end(); ++it) {
    if (kKnown.count(it.key()) || !warned.insert(it.key()).second) continue;
    std::string v = it.value().dump();
    if (v.size() > 80) v = v.substr(0, 80) + "...";
    log_info("warning: ", origin, ": unknown field '", it.key(), "' (", v,
             ") is ignored; moetrain reads the Qwen3 and Qwen3-MoE fields of transformers' configs");
  }
}

std::string read_text_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) MT_THROW("cannot open model config '", path, "'");
  std::ostringstream s;
  s << in.rdbuf();
  if (in.bad()) MT_THROW("error reading model config '", path, "'");
  return s.str();
}

}  // namespace

bool ModelConfig::is_sparse_layer(int64_t layer) const {
  for (int64_t l : mlp_only_layers)
    if (l == layer) return false;
  return num_experts > 0 && decoder_sparse_step > 0 && (layer + 1) % decoder_sparse_step == 0;
}

int64_t ModelConfig::num_sparse_layers() const {
  int64_t n = 0;
  for (int64_t l = 0; l < num_hidden_layers; ++l) n += is_sparse_layer(l) ? 1 : 0;
  return n;
}

int64_t ModelConfig::num_parameters() const {
  const int64_t D = hidden_size, H = num_attention_heads, G = num_key_value_heads, Hd = head_dim;
  int64_t n = vocab_size * D;                     // embed_tokens
  if (!tie_word_embeddings) n += (value_head ? 1 : vocab_size) * D;  // lm_head (score.weight: [1, D])
  for (int64_t l = 0; l < num_hidden_layers; ++l) {
    n += 2 * H * Hd * D + 2 * G * Hd * D;  // q, o and k, v projections
    n += 2 * Hd + 2 * D;                   // q_norm, k_norm, input and post-attention layer norms
    if (is_sparse_layer(l))
      n += num_experts * D + num_experts * 3 * moe_intermediate_size * D;  // router + experts
    else
      n += 3 * intermediate_size * D;
  }
  return n + D;  // final norm
}

int64_t ModelConfig::active_matmul_parameters() const {
  const int64_t D = hidden_size, H = num_attention_heads, G = num_key_value_heads, Hd = head_dim;
  int64_t n = (value_head ? 1 : vocab_size) * D;  // lm_head (tied or not, it is a matmul); the embedding lookup is not
  for (int64_t l = 0; l < num_hidden_layers; ++l) {
    n += 2 * H * Hd * D + 2 * G * Hd * D;
    if (is_sparse_layer(l))
      n += num_experts * D + num_experts_per_tok * 3 * moe_intermediate_size * D;
    else
      n += 3 * intermediate_size * D;
  }
  return n;
}

void ModelConfig::validate() const {
  if (architecture != kMoeArch && architecture != kDenseArch)
    MT_THROW("unsupported architecture '", architecture, "'; supported: ", kSupported);
  auto positive = [](const char* name, int64_t v) {
    if (v <= 0) MT_THROW(name, " (", v, ") must be > 0");
  };
  positive("vocab_size", vocab_size);
  if (value_head && tie_word_embeddings)
    MT_THROW("value_head with tie_word_embeddings true: the scalar head score.weight [1, D] cannot share the "
             "embedding [V, D]; use an untied model");
  positive("hidden_size", hidden_size);
  positive("num_hidden_layers", num_hidden_layers);
  positive("num_attention_heads", num_attention_heads);
  positive("num_key_value_heads", num_key_value_heads);
  positive("head_dim", head_dim);
  positive("max_position_embeddings", max_position_embeddings);
  positive("decoder_sparse_step", decoder_sparse_step);
  if (num_attention_heads % num_key_value_heads != 0)
    MT_THROW("num_attention_heads (", num_attention_heads, ") must be divisible by num_key_value_heads (",
             num_key_value_heads, ")");
  if (head_dim % 2 != 0) MT_THROW("head_dim (", head_dim, ") must be even (RoPE rotates pairs)");
  if (num_experts < 0) MT_THROW("num_experts (", num_experts, ") must be >= 0");
  if (architecture == kDenseArch && num_experts != 0)
    MT_THROW(kDenseArch, " is dense: num_experts (", num_experts, ") must be 0");
  if (num_experts > 0) {
    positive("num_experts_per_tok", num_experts_per_tok);
    positive("moe_intermediate_size", moe_intermediate_size);
    if (num_experts_per_tok > num_experts)
      MT_THROW("num_experts_per_tok (", num_experts_per_tok, ") must be <= num_experts (", num_experts, ")");
  }
  for (int64_t l : mlp_only_layers)
    if (l < 0 || l >= num_hidden_layers)
      MT_THROW("mlp_only_layers entry (", l, ") must be in [0, num_hidden_layers (", num_hidden_layers, "))");
  for (int64_t l = 0; l < num_hidden_layers; ++l) {
    if (!is_sparse_layer(l) && intermediate_size <= 0)
      MT_THROW("intermediate_size (", intermediate_size, ") must be > 0: layer ", l, " uses a dense MLP");
  }
  if (!(rms_norm_eps > 0)) MT_THROW("rms_norm_eps (", rms_norm_eps, ") must be > 0");
  if (!(rope_theta > 0)) MT_THROW("rope_theta (", rope_theta, ") must be > 0");
  if (!(router_aux_loss_coef >= 0)) MT_THROW("router_aux_loss_coef (", router_aux_loss_coef, ") must be >= 0");
  if (!(initializer_range >= 0)) MT_THROW("initializer_range (", initializer_range, ") must be >= 0");
  if (score_before_experts) {
    bool sparse = false;
    for (int64_t l = 0; l < num_hidden_layers; ++l) sparse = sparse || is_sparse_layer(l);
    if (!sparse)
      MT_THROW("score_before_experts (moetrain_score_before_experts) true needs MoE layers, but this model has none "
               "(num_experts ", num_experts, ")");
  }
}

ModelConfig parse_model_config(const std::string& json_text, const std::string& origin) {
  json j;
  try {
    j = json::parse(json_text);
  } catch (const json::exception& e) {
    MT_THROW(origin, ": not valid JSON: ", e.what());
  }
  if (!j.is_object()) MT_THROW(origin, ": expected a JSON object at the top level, got ", j.type_name());
  Fields f(j, origin);

  // Which model: architectures[0], else model_type.
  ModelConfig c;
  std::optional<std::string> model_type = f.get_string("model_type");
  if (const json* archs = f.find("architectures")) {
    if (!archs->is_array() || archs->empty() || !(*archs)[0].is_string())
      MT_THROW(origin, ": field 'architectures' must be a non-empty list of strings, got ", archs->dump());
    c.architecture = (*archs)[0].get<std::string>();
    if (c.architecture != kMoeArch && c.architecture != kDenseArch)
      MT_THROW(origin, ": unsupported architecture '", c.architecture, "'; supported: ", kSupported);
    const char* want_type = c.architecture == kMoeArch ? "qwen3_moe" : "qwen3";
    if (model_type && *model_type != want_type)
      MT_THROW(origin, ": model_type '", *model_type, "' does not match architecture '", c.architecture,
               "' (expected model_type '", want_type, "')");
  } else if (model_type) {
    if (*model_type == "qwen3_moe")
      c.architecture = kMoeArch;
    else if (*model_type == "qwen3")
      c.architecture = kDenseArch;
    else
      MT_THROW(origin, ": unsupported model_type '", *model_type, "'; supported: ", kSupported);
  } else {
    MT_THROW(origin, ": names no architecture (neither 'architectures' nor 'model_type'); supported: ", kSupported);
  }
  const bool moe = c.architecture == kMoeArch;

  // Features of the Qwen3 family that this engine does not implement: refuse rather than ignore.
  if (auto act = f.get_string("hidden_act"); act && *act != "silu")
    MT_THROW(origin, ": hidden_act '", *act, "' is not supported (only \"silu\")");
  if (f.get_bool("attention_bias", false)) MT_THROW(origin, ": attention_bias true is not supported (no biases)");
  if (f.get_bool("use_sliding_window", false))
    MT_THROW(origin, ": use_sliding_window true is not supported (full causal attention only)");

  // Structural fields are required: their defaults differ between transformers versions.
  c.vocab_size = f.require_int("vocab_size");
  c.hidden_size = f.require_int("hidden_size");
  c.num_hidden_layers = f.require_int("num_hidden_layers");
  c.num_attention_heads = f.require_int("num_attention_heads");

  // transformers' class defaults otherwise (the same in 4.51 and 5.x). An explicit null
  // num_key_value_heads means "as many as the query heads" (Qwen3Config.__post_init__).
  const bool kv_null = j.contains("num_key_value_heads") && j["num_key_value_heads"].is_null();
  c.num_key_value_heads = kv_null ? c.num_attention_heads : f.get_int("num_key_value_heads", moe ? 4 : 32);
  // Qwen3Config has head_dim = 128 by default; Qwen3MoeConfig has no such field and the attention
  // falls back to hidden_size / num_attention_heads.
  if (f.has("head_dim"))
    c.head_dim = f.require_int("head_dim");
  else if (moe && c.num_attention_heads > 0)
    c.head_dim = c.hidden_size / c.num_attention_heads;
  else
    c.head_dim = moe ? 0 : 128;
  c.rms_norm_eps = f.get_double("rms_norm_eps", 1e-6);
  c.rope_theta = parse_rope_theta(j, f, origin);
  c.max_position_embeddings = f.get_int("max_position_embeddings", 32768);
  c.tie_word_embeddings = f.get_bool("tie_word_embeddings", false);
  c.initializer_range = f.get_double("initializer_range", 0.02);
  c.bos_token_id = f.get_int("bos_token_id", -1);
  // eos_token_id may be a list in transformers; the first is the primary one.
  if (const json* eos = f.find("eos_token_id"); eos && eos->is_array())
    c.eos_token_id = eos->empty() ? -1 : f.to_int("eos_token_id", (*eos)[0]);
  else
    c.eos_token_id = f.get_int("eos_token_id", -1);

  if (moe) {
    // transformers 5 serialises num_experts as num_local_experts (attribute_map); accept both.
    bool has_e = f.has("num_experts"), has_local = f.has("num_local_experts");
    if (!has_e && !has_local)
      MT_THROW(origin, ": missing required field 'num_experts' (or 'num_local_experts') for ", kMoeArch);
    c.num_experts = has_e ? f.require_int("num_experts") : f.require_int("num_local_experts");
    if (has_e && has_local && f.require_int("num_local_experts") != c.num_experts)
      MT_THROW(origin, ": num_experts (", c.num_experts, ") and num_local_experts (",
               f.require_int("num_local_experts"), ") disagree");
    c.num_experts_per_tok = f.require_int("num_experts_per_tok");
    c.moe_intermediate_size = f.require_int("moe_intermediate_size");
    c.intermediate_size = f.get_int("intermediate_size", 6144);
    c.decoder_sparse_step = f.get_int("decoder_sparse_step", 1);
    c.mlp_only_layers = f.get_int_list("mlp_only_layers");
    c.norm_topk_prob = f.get_bool("norm_topk_prob", false);
    c.output_router_logits = f.get_bool("output_router_logits", false);
    c.router_aux_loss_coef = f.get_double("router_aux_loss_coef", 0.001);
  } else {
    c.intermediate_size = f.require_int("intermediate_size");
    c.num_experts = c.num_experts_per_tok = c.moe_intermediate_size = 0;
    c.decoder_sparse_step = 1;
    c.mlp_only_layers.clear();
    c.norm_topk_prob = false;
    c.output_router_logits = false;  // the aux loss exists only where there are MoE layers
    c.router_aux_loss_coef = 0.0;
  }
  c.score_before_experts = f.get_bool("moetrain_score_before_experts", false);
  warn_unknown_fields(j, origin);

  try {
    c.validate();
  } catch (const Error& e) {
    MT_THROW(origin, ": ", e.what());
  }
  return c;
}

ModelConfig load_model_config(const std::string& path) {
  namespace fs = std::filesystem;
  std::string file = fs::is_directory(path) ? (fs::path(path) / "config.json").string() : path;
  return parse_model_config(read_text_file(file), file);
}

std::optional<bool> stated_score_before_experts(const std::string& dir) {
  namespace fs = std::filesystem;
  const std::string file = (fs::path(dir) / "config.json").string();
  if (!fs::is_regular_file(file)) return std::nullopt;
  json j;
  try {
    j = json::parse(read_text_file(file));
  } catch (const json::exception& e) {
    MT_THROW(file, ": not valid JSON: ", e.what());
  }
  if (!j.is_object()) MT_THROW(file, ": expected a JSON object at the top level, got ", j.type_name());
  return Fields(j, file).get_bool("moetrain_score_before_experts", false);
}

bool resolve_score_before_experts(int64_t asked, const std::string& setting, std::optional<bool> stated,
                                  const std::string& dir) {
  if (asked != -1 && asked != 0 && asked != 1) MT_THROW(setting, " ", asked, " must be -1 (not given), 0 or 1");
  if (!stated) return asked == 1;
  if (asked != -1 && (asked == 1) != *stated)
    MT_THROW(setting, " ", asked, " contradicts ", dir, "/config.json, whose model ",
             *stated ? "has \"moetrain_score_before_experts\": true (y = sum_k expert_k(w_k x))"
                     : "has no \"moetrain_score_before_experts\" (Qwen3-MoE's y = sum_k w_k expert_k(x))",
             ": the model directory defines what the model computes; drop the setting, or edit its config.json "
             "to change the model on purpose");
  return *stated;
}

std::string model_config_to_json(const ModelConfig& c) {
  c.validate();
  const bool moe = c.architecture == kMoeArch;
  json j;
  j["architectures"] = json::array({c.architecture});
  j["model_type"] = moe ? "qwen3_moe" : "qwen3";
  j["vocab_size"] = c.vocab_size;
  j["hidden_size"] = c.hidden_size;
  j["intermediate_size"] = c.intermediate_size;
  j["num_hidden_layers"] = c.num_hidden_layers;
  j["num_attention_heads"] = c.num_attention_heads;
  j["num_key_value_heads"] = c.num_key_value_heads;
  j["head_dim"] = c.head_dim;
  j["hidden_act"] = "silu";
  j["max_position_embeddings"] = c.max_position_embeddings;
  j["initializer_range"] = c.initializer_range;
  j["rms_norm_eps"] = c.rms_norm_eps;
  j["use_cache"] = true;
  j["tie_word_embeddings"] = c.tie_word_embeddings;
  // Both spellings, so that transformers 4.x (top level) and 5.x (rope_parameters) read the same theta.
  j["rope_theta"] = c.rope_theta;
  j["rope_parameters"] = {{"rope_type", "default"}, {"rope_theta", c.rope_theta}};
  j["attention_bias"] = false;
  j["attention_dropout"] = 0.0;
  j["use_sliding_window"] = false;
  j["sliding_window"] = nullptr;
  j["max_window_layers"] = c.num_hidden_layers;
  j["bos_token_id"] = c.bos_token_id >= 0 ? json(c.bos_token_id) : json(nullptr);
  j["eos_token_id"] = c.eos_token_id >= 0 ? json(c.eos_token_id) : json(nullptr);
  j["torch_dtype"] = "float32";
  j["dtype"] = "float32";
  if (moe) {
    j["num_experts"] = c.num_experts;
    j["num_experts_per_tok"] = c.num_experts_per_tok;
    j["moe_intermediate_size"] = c.moe_intermediate_size;
    j["decoder_sparse_step"] = c.decoder_sparse_step;
    j["mlp_only_layers"] = c.mlp_only_layers;
    j["norm_topk_prob"] = c.norm_topk_prob;
    j["output_router_logits"] = c.output_router_logits;
    j["router_aux_loss_coef"] = c.router_aux_loss_coef;
  }
  if (c.score_before_experts) j["moetrain_score_before_experts"] = true;  // absent: Qwen3-MoE's formula
  return j.dump(2) + "\n";
}

void save_model_config(const ModelConfig& c, const std::string& path) {
  namespace fs = std::filesystem;
  std::string file = fs::is_directory(path) ? (fs::path(path) / "config.json").string() : path;
  std::string text = model_config_to_json(c);
  std::string tmp = file + ".tmp";
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    if (!out) MT_THROW("cannot write model config '", tmp, "'");
    out << text;
    out.flush();
    if (!out) MT_THROW("error writing model config '", tmp, "'");
  }
  std::error_code ec;
  fs::rename(tmp, file, ec);
  if (ec) MT_THROW("cannot rename '", tmp, "' to '", file, "': ", ec.message());
}

ModelConfig preset_model_config(const std::string& name) {
  ModelConfig c;
  c.architecture = kMoeArch;
  c.decoder_sparse_step = 1;
  c.norm_topk_prob = true;
  c.rms_norm_eps = 1e-6;
  c.initializer_range = 0.02;
  c.tie_word_embeddings = false;
  c.output_router_logits = false;
  c.router_aux_loss_coef = 0.001;
  if (name == "tiny") {
    c.vocab_size = 512;
    c.hidden_size = 64;
    c.num_hidden_layers = 2;
    c.num_attention_heads = 4;
    c.num_key_value_heads = 2;
    c.head_dim = 16;
    c.num_experts = 8;
    c.num_experts_per_tok = 2;
    c.moe_intermediate_size = 32;
    c.intermediate_size = 128;
    c.rope_theta = 1e6;
    c.max_position_embeddings = 2048;
  } else if (name == "demo") {
    c.vocab_size = 32;
    c.hidden_size = 128;
    c.num_hidden_layers = 4;
    c.num_attention_heads = 4;
    c.num_key_value_heads = 2;
    c.head_dim = 32;
    c.num_experts = 8;
    c.num_experts_per_tok = 2;
    c.moe_intermediate_size = 128;
    c.intermediate_size = 256;
    c.rope_theta = 10000.0;
    c.max_position_embeddings = 256;
    c.output_router_logits = true;
    c.router_aux_loss_coef = 0.01;
    c.bos_token_id = 1;  // data/char_tokenizer.h's <bos> and <eos>: a checkpoint's generate stops at <eos>
    c.eos_token_id = 2;
  } else if (name == "bench-4L" || name == "qwen3-30b-a3b") {
    c.vocab_size = 151936;
    c.hidden_size = 2048;
    c.num_hidden_layers = name == "bench-4L" ? 4 : 48;
    c.num_attention_heads = 32;
    c.num_key_value_heads = 4;
    c.head_dim = 128;
    c.num_experts = 128;
    c.num_experts_per_tok = 8;
    c.moe_intermediate_size = 768;
    c.intermediate_size = 6144;
    c.rope_theta = 1e6;
    c.max_position_embeddings = 40960;
    c.bos_token_id = 151643;
    c.eos_token_id = 151645;
  } else {
    std::string names;
    for (const std::string& n : preset_names()) names += (names.empty() ? "" : ", ") + n;
    MT_THROW("unknown model preset '", name, "'; available: ", names);
  }
  c.validate();
  return c;
}

std::vector<std::string> preset_names() {
  return {"tiny", "demo", "bench-4L", "qwen3-30b-a3b"};
}

}  // namespace mt
