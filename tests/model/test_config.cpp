// Tests for ModelConfig: parsing the published Hub configs and their transformers-5 re-saves,
// defaults, errors that name the field and value, validation, parameter counts, presets and the
// config.json round trip.
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "model/config.h"

using namespace mt;

namespace {

std::string asset(const std::string& name) {
  return std::string(MT_SOURCE_DIR) + "/tests/assets/configs/" + name;
}

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "<no error>";
}

#define EXPECT_CONTAINS(haystack, needle) EXPECT_NE(std::string(haystack).find(needle), std::string::npos) << haystack

void expect_same(const ModelConfig& a, const ModelConfig& b) {
  EXPECT_EQ(a.architecture, b.architecture);
  EXPECT_EQ(a.vocab_size, b.vocab_size);
  EXPECT_EQ(a.hidden_size, b.hidden_size);
  EXPECT_EQ(a.num_hidden_layers, b.num_hidden_layers);
  EXPECT_EQ(a.num_attention_heads, b.num_attention_heads);
  EXPECT_EQ(a.num_key_value_heads, b.num_key_value_heads);
  EXPECT_EQ(a.head_dim, b.head_dim);
  EXPECT_EQ(a.intermediate_size, b.intermediate_size);
  EXPECT_EQ(a.moe_intermediate_size, b.moe_intermediate_size);
  EXPECT_EQ(a.num_experts, b.num_experts);
  EXPECT_EQ(a.num_experts_per_tok, b.num_experts_per_tok);
  EXPECT_EQ(a.decoder_sparse_step, b.decoder_sparse_step);
  EXPECT_EQ(a.mlp_only_layers, b.mlp_only_layers);
  EXPECT_EQ(a.norm_topk_prob, b.norm_topk_prob);
  EXPECT_EQ(a.output_router_logits, b.output_router_logits);
  EXPECT_EQ(a.router_aux_loss_coef, b.router_aux_loss_coef);
  EXPECT_EQ(a.rms_norm_eps, b.rms_norm_eps);
  EXPECT_EQ(a.rope_theta, b.rope_theta);
  EXPECT_EQ(a.max_position_embeddings, b.max_position_embeddings);
  EXPECT_EQ(a.tie_word_embeddings, b.tie_word_embeddings);
  EXPECT_EQ(a.initializer_range, b.initializer_range);
  EXPECT_EQ(a.bos_token_id, b.bos_token_id);
  EXPECT_EQ(a.eos_token_id, b.eos_token_id);
}

// A minimal MoE config.json with the required fields; `extra` is merged over it.
std::string moe_json(const nlohmann::json& extra = nlohmann::json::object()) {
  nlohmann::json j = {{"architectures", {"Qwen3MoeForCausalLM"}},
                      {"vocab_size", 100},
                      {"hidden_size", 64},
                      {"num_hidden_layers", 4},
                      {"num_attention_heads", 4},
                      {"num_experts", 8},
                      {"num_experts_per_tok", 2},
                      {"moe_intermediate_size", 32}};
  j.update(extra);
  return j.dump();
}

}  // namespace

TEST(ModelConfig, ParsesHubQwen3MoE) {
  ModelConfig c = load_model_config(asset("qwen3-30b-a3b.json"));
  EXPECT_EQ(c.architecture, "Qwen3MoeForCausalLM");
  EXPECT_EQ(c.num_hidden_layers, 48);
  EXPECT_EQ(c.head_dim, 128);  // not hidden/heads (= 64): the explicit field wins
  EXPECT_EQ(c.num_experts, 128);
  EXPECT_EQ(c.num_experts_per_tok, 8);
  EXPECT_TRUE(c.norm_topk_prob);
  EXPECT_EQ(c.rope_theta, 1e6);
  EXPECT_EQ(c.max_position_embeddings, 40960);
  EXPECT_EQ(c.eos_token_id, 151645);
  expect_same(c, preset_model_config("qwen3-30b-a3b"));
  // The published sizes: 30.5B parameters, 3.3B activated (3.04B matmul + 0.31B embedding).
  EXPECT_EQ(c.num_parameters(), 30532122624);
  EXPECT_EQ(c.active_matmul_parameters(), 3041656832);
}

TEST(ModelConfig, ParsesHubQwen3Dense) {
  ModelConfig c = load_model_config(asset("qwen3-0.6b.json"));
  EXPECT_EQ(c.architecture, "Qwen3ForCausalLM");
  EXPECT_EQ(c.hidden_size, 1024);
  EXPECT_EQ(c.intermediate_size, 3072);
  EXPECT_EQ(c.num_hidden_layers, 28);
  EXPECT_EQ(c.num_attention_heads, 16);
  EXPECT_EQ(c.num_key_value_heads, 8);
  EXPECT_EQ(c.head_dim, 128);
  EXPECT_EQ(c.vocab_size, 151936);
  EXPECT_TRUE(c.tie_word_embeddings);
  EXPECT_EQ(c.rope_theta, 1e6);
  EXPECT_EQ(c.num_experts, 0);
  EXPECT_FALSE(c.output_router_logits);
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) EXPECT_FALSE(c.is_sparse_layer(l));
  // Qwen3-0.6B: 0.6B parameters, 0.44B without the (tied) embedding.
  EXPECT_EQ(c.num_parameters(), 596049920);
  EXPECT_EQ(c.num_parameters() - c.vocab_size * c.hidden_size, 440467456);
}

TEST(ModelConfig, ParsesTransformers5Spellings) {
  // Re-saved by transformers 5: dtype, rope_parameters, num_local_experts, layer_types.
  expect_same(load_model_config(asset("qwen3-30b-a3b-transformers5.json")),
              load_model_config(asset("qwen3-30b-a3b.json")));
  expect_same(load_model_config(asset("qwen3-0.6b-transformers5.json")), load_model_config(asset("qwen3-0.6b.json")));
  // rope_theta inside rope_scaling (some 4.x exports) and model_type alone.
  ModelConfig c = parse_model_config(moe_json({{"rope_scaling", {{"rope_type", "default"}, {"rope_theta", 5e5}}}}));
  EXPECT_EQ(c.rope_theta, 5e5);
  nlohmann::json j = nlohmann::json::parse(moe_json());
  j.erase("architectures");
  j["model_type"] = "qwen3_moe";
  EXPECT_EQ(parse_model_config(j.dump()).architecture, "Qwen3MoeForCausalLM");
}

TEST(ModelConfig, LoadsFromADirectory) {
  auto dir = std::filesystem::temp_directory_path() / ("mt_config_dir_" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  std::filesystem::copy_file(asset("qwen3-0.6b.json"), dir / "config.json",
                             std::filesystem::copy_options::overwrite_existing);
  EXPECT_EQ(load_model_config(dir.string()).hidden_size, 1024);
  std::filesystem::remove_all(dir);
  EXPECT_CONTAINS(error_of([&] { load_model_config(dir.string()); }), "cannot open model config");
}

TEST(ModelConfig, AbsentFieldsTakeTransformersDefaults) {
  ModelConfig c = parse_model_config(moe_json());
  EXPECT_EQ(c.head_dim, 16);  // hidden / heads for Qwen3MoeConfig
  EXPECT_EQ(c.num_key_value_heads, 4);
  EXPECT_EQ(c.intermediate_size, 6144);
  EXPECT_FALSE(c.norm_topk_prob);
  EXPECT_EQ(c.rope_theta, 10000.0);
  EXPECT_EQ(c.rms_norm_eps, 1e-6);
  EXPECT_EQ(c.decoder_sparse_step, 1);
  EXPECT_TRUE(c.mlp_only_layers.empty());
  EXPECT_EQ(c.router_aux_loss_coef, 0.001);
  EXPECT_FALSE(c.output_router_logits);
  EXPECT_FALSE(c.tie_word_embeddings);
  EXPECT_EQ(c.max_position_embeddings, 32768);
  EXPECT_EQ(c.bos_token_id, -1);
  // An explicit null num_key_value_heads means one kv head per query head.
  EXPECT_EQ(parse_model_config(moe_json({{"num_key_value_heads", nullptr}})).num_key_value_heads, 4);
  EXPECT_EQ(
      parse_model_config(moe_json({{"num_attention_heads", 8}, {"num_key_value_heads", nullptr}})).num_key_value_heads,
      8);
  // eos_token_id may be a list: the first is the primary one.
  EXPECT_EQ(parse_model_config(moe_json({{"eos_token_id", {7, 9}}})).eos_token_id, 7);
}

TEST(ModelConfig, RejectsUnknownArchitectures) {
  std::string msg = error_of([] { parse_model_config(moe_json({{"architectures", {"LlamaForCausalLM"}}})); });
  EXPECT_CONTAINS(msg, "'LlamaForCausalLM'");
  EXPECT_CONTAINS(msg, "Qwen3MoeForCausalLM");
  EXPECT_CONTAINS(msg, "Qwen3ForCausalLM");
  nlohmann::json j = nlohmann::json::parse(moe_json());
  j.erase("architectures");
  j["model_type"] = "qwen2_moe";
  EXPECT_CONTAINS(error_of([&] { parse_model_config(j.dump()); }), "model_type 'qwen2_moe'");
  j.erase("model_type");
  EXPECT_CONTAINS(error_of([&] { parse_model_config(j.dump()); }), "names no architecture");
  EXPECT_CONTAINS(error_of([] {
                    parse_model_config(moe_json({{"model_type", "qwen3"}}));
                  }),
                  "model_type 'qwen3' does not match");
}

TEST(ModelConfig, MissingAndMistypedFieldsAreNamed) {
  nlohmann::json j = nlohmann::json::parse(moe_json());
  j.erase("hidden_size");
  std::string msg = error_of([&] { parse_model_config(j.dump(), "my/config.json"); });
  EXPECT_CONTAINS(msg, "my/config.json");
  EXPECT_CONTAINS(msg, "missing required field 'hidden_size'");

  msg = error_of([] { parse_model_config(moe_json({{"hidden_size", "2048"}})); });
  EXPECT_CONTAINS(msg, "field 'hidden_size' must be an integer, got \"2048\"");
  msg = error_of([] { parse_model_config(moe_json({{"rope_theta", "1e6"}})); });
  EXPECT_CONTAINS(msg, "field 'rope_theta' must be a number, got \"1e6\"");
  msg = error_of([] { parse_model_config(moe_json({{"norm_topk_prob", 1}})); });
  EXPECT_CONTAINS(msg, "field 'norm_topk_prob' must be true or false, got 1");
  msg = error_of([] { parse_model_config(moe_json({{"num_experts", 2.5}})); });
  EXPECT_CONTAINS(msg, "field 'num_experts' must be an integer, got 2.5");
  EXPECT_EQ(parse_model_config(moe_json({{"hidden_size", 64.0}})).hidden_size, 64);  // integral float is fine

  j = nlohmann::json::parse(moe_json());
  j.erase("num_experts");
  EXPECT_CONTAINS(error_of([&] { parse_model_config(j.dump()); }), "missing required field 'num_experts'");
  nlohmann::json dense = {{"architectures", {"Qwen3ForCausalLM"}},
                          {"vocab_size", 10},
                          {"hidden_size", 8},
                          {"num_hidden_layers", 1},
                          {"num_attention_heads", 2}};
  EXPECT_CONTAINS(error_of([&] { parse_model_config(dense.dump()); }), "missing required field 'intermediate_size'");
  EXPECT_CONTAINS(error_of([] { parse_model_config("{not json"); }), "not valid JSON");
}

TEST(ModelConfig, RejectsFeaturesNotImplemented) {
  EXPECT_CONTAINS(error_of([] {
                    parse_model_config(moe_json({{"rope_scaling", {{"rope_type", "yarn"}, {"factor", 4}}}}));
                  }),
                  "rope_type 'yarn'");
  EXPECT_CONTAINS(error_of([] { parse_model_config(moe_json({{"use_sliding_window", true}})); }), "use_sliding_window");
  EXPECT_CONTAINS(error_of([] { parse_model_config(moe_json({{"attention_bias", true}})); }), "attention_bias");
  EXPECT_CONTAINS(error_of([] { parse_model_config(moe_json({{"hidden_act", "gelu"}})); }), "hidden_act 'gelu'");
  EXPECT_CONTAINS(error_of([] {
                    parse_model_config(moe_json({{"rope_theta", 1e6}, {"rope_parameters", {{"rope_theta", 1e4}}}}));
                  }),
                  "must agree");
  EXPECT_CONTAINS(error_of([] { parse_model_config(moe_json({{"num_local_experts", 16}})); }), "disagree");
}

TEST(ModelConfig, UnknownFieldsAreWarnedOnceEach) {
  // The Hub configs (and their transformers-5 re-saves) hold no unknown field: no warning.
  testing::internal::CaptureStderr();
  for (const char* f :
       {"qwen3-30b-a3b.json", "qwen3-0.6b.json", "qwen3-30b-a3b-transformers5.json", "qwen3-0.6b-transformers5.json"})
    load_model_config(asset(f));
  EXPECT_EQ(testing::internal::GetCapturedStderr(), "");
  // An unknown field: one warning naming it and its value, the model still parses; a second read says nothing.
  testing::internal::CaptureStderr();
  const ModelConfig c = parse_model_config(moe_json({{"unknown_test_field_a", 3}, {"unknown_test_field_b", "x"}}));
  parse_model_config(moe_json({{"unknown_test_field_a", 4}}), "other.json");
  const std::string log = testing::internal::GetCapturedStderr();
  EXPECT_EQ(c.num_experts, 8);
  EXPECT_CONTAINS(log, "warning: config.json: unknown field 'unknown_test_field_a' (3) is ignored");
  EXPECT_CONTAINS(log, "warning: config.json: unknown field 'unknown_test_field_b' (\"x\") is ignored");
  EXPECT_EQ(log.find("unknown_test_field_a"), log.rfind("unknown_test_field_a")) << log;
  EXPECT_EQ(log.find("other.json"), std::string::npos) << log;
  // A known field with an unsupported value is still an error, not a warning.
  EXPECT_CONTAINS(error_of([] { parse_model_config(moe_json({{"attention_bias", true}})); }), "attention_bias");
}

TEST(ModelConfig, ValidateNamesFieldValueAndRule) {
  ModelConfig c = preset_model_config("tiny");
  c.num_experts_per_tok = 9;
  EXPECT_CONTAINS(error_of([&] { c.validate(); }), "num_experts_per_tok (9) must be <= num_experts (8)");
  c = preset_model_config("tiny");
  c.num_key_value_heads = 3;
  EXPECT_CONTAINS(error_of([&] { c.validate(); }),
                  "num_attention_heads (4) must be divisible by num_key_value_heads (3)");
  c = preset_model_config("tiny");
  c.head_dim = 15;
  EXPECT_CONTAINS(error_of([&] { c.validate(); }), "head_dim (15) must be even");
  c = preset_model_config("tiny");
  c.mlp_only_layers = {2};
  EXPECT_CONTAINS(error_of([&] { c.validate(); }), "mlp_only_layers entry (2) must be in [0, num_hidden_layers (2))");
  c = preset_model_config("tiny");
  c.rms_norm_eps = 0;
  EXPECT_CONTAINS(error_of([&] { c.validate(); }), "rms_norm_eps (0) must be > 0");
  c = preset_model_config("tiny");
  c.hidden_size = -1;
  EXPECT_CONTAINS(error_of([&] { c.validate(); }), "hidden_size (-1) must be > 0");
  c = preset_model_config("tiny");
  c.architecture = "Qwen3ForCausalLM";
  EXPECT_CONTAINS(error_of([&] { c.validate(); }), "num_experts (8) must be 0");
  c = preset_model_config("tiny");
  c.mlp_only_layers = {1};
  c.intermediate_size = 0;
  EXPECT_CONTAINS(error_of([&] { c.validate(); }), "intermediate_size (0) must be > 0: layer 1 uses a dense MLP");
  // Parsing validates too, and says where the config came from.
  std::string msg = error_of([] { parse_model_config(moe_json({{"num_experts_per_tok", 9}}), "x/config.json"); });
  EXPECT_CONTAINS(msg, "x/config.json: num_experts_per_tok (9) must be <= num_experts (8)");
}

TEST(ModelConfig, SparseLayerRuleMatchesTransformers) {
  ModelConfig c = preset_model_config("tiny");
  c.num_hidden_layers = 6;
  c.decoder_sparse_step = 2;
  c.mlp_only_layers = {3};
  std::vector<bool> sparse;
  for (int64_t l = 0; l < 6; ++l) sparse.push_back(c.is_sparse_layer(l));
  // (l + 1) % 2 == 0 -> layers 1, 3, 5; layer 3 is forced dense.
  EXPECT_EQ(sparse, (std::vector<bool>{false, true, false, false, false, true}));
  c.num_experts = 0;
  for (int64_t l = 0; l < 6; ++l) EXPECT_FALSE(c.is_sparse_layer(l));
}

TEST(ModelConfig, ParameterCounts) {
  ModelConfig b = preset_model_config("bench-4L");
  // docs/design.md: 3.11 B parameters, 0.537 B active matmul parameters per token.
  EXPECT_NEAR(double(b.num_parameters()) / 3.11e9, 1.0, 0.005);
  EXPECT_NEAR(double(b.active_matmul_parameters()) / 0.537e9, 1.0, 0.005);
  EXPECT_EQ(b.num_parameters(), 3114814464);
  EXPECT_EQ(b.active_matmul_parameters(), 538705920);

  // tiny by hand: embed + lm_head 2*512*64; per layer attention 2*(4*16*64) + 2*(2*16*64) = 12288,
  // norms 2*16 + 2*64 = 160, router 8*64 = 512, experts 8*3*32*64 = 49152; final norm 64.
  ModelConfig t = preset_model_config("tiny");
  EXPECT_EQ(t.num_parameters(), 2 * 512 * 64 + 2 * (12288 + 160 + 512 + 49152) + 64);
  EXPECT_EQ(t.active_matmul_parameters(), 512 * 64 + 2 * (12288 + 512 + 2 * 3 * 32 * 64));
  t.tie_word_embeddings = true;  // counted once in the total, still a matmul per token
  EXPECT_EQ(t.num_parameters(), 512 * 64 + 2 * (12288 + 160 + 512 + 49152) + 64);
  EXPECT_EQ(t.active_matmul_parameters(), 512 * 64 + 2 * (12288 + 512 + 2 * 3 * 32 * 64));
  t.mlp_only_layers = {0};  // layer 0 becomes a dense MLP of intermediate_size 128
  EXPECT_EQ(t.num_parameters(), 512 * 64 + (12288 + 160 + 3 * 128 * 64) + (12288 + 160 + 512 + 49152) + 64);
}

TEST(ModelConfig, Presets) {
  for (const std::string& name : preset_names()) {
    SCOPED_TRACE(name);
    ModelConfig c = preset_model_config(name);
    EXPECT_NO_THROW(c.validate());
    EXPECT_EQ(c.architecture, "Qwen3MoeForCausalLM");
    EXPECT_TRUE(c.norm_topk_prob);
    EXPECT_FALSE(c.tie_word_embeddings);
  }
  ModelConfig d = preset_model_config("demo");
  EXPECT_EQ(d.vocab_size, 32);
  EXPECT_EQ(d.num_hidden_layers, 4);
  EXPECT_TRUE(d.output_router_logits);
  EXPECT_EQ(d.router_aux_loss_coef, 0.01);
  EXPECT_EQ(d.max_position_embeddings, 256);
  EXPECT_EQ(preset_model_config("tiny").hidden_size, 64);
  EXPECT_EQ(preset_model_config("bench-4L").num_hidden_layers, 4);
  std::string msg = error_of([] { preset_model_config("huge"); });
  EXPECT_CONTAINS(msg, "unknown model preset 'huge'");
  EXPECT_CONTAINS(msg, "tiny, demo, bench-4L, qwen3-30b-a3b");
}

TEST(ModelConfig, JsonRoundTrip) {
  std::vector<ModelConfig> configs;
  for (const std::string& name : preset_names()) configs.push_back(preset_model_config(name));
  ModelConfig odd = preset_model_config("tiny");
  odd.decoder_sparse_step = 2;
  odd.mlp_only_layers = {1};
  odd.norm_topk_prob = false;
  odd.output_router_logits = true;
  odd.tie_word_embeddings = true;
  configs.push_back(odd);
  configs.push_back(load_model_config(asset("qwen3-0.6b.json")));
  for (const ModelConfig& c : configs) {
    SCOPED_TRACE(c.architecture + " L=" + std::to_string(c.num_hidden_layers));
    std::string text = model_config_to_json(c);
    expect_same(parse_model_config(text), c);
    nlohmann::json j = nlohmann::json::parse(text);
    // Both rope spellings, so transformers 4.x and 5.x read the same theta.
    EXPECT_EQ(j["rope_theta"].get<double>(), c.rope_theta);
    EXPECT_EQ(j["rope_parameters"]["rope_type"], "default");
    EXPECT_EQ(j["rope_parameters"]["rope_theta"].get<double>(), c.rope_theta);
    EXPECT_EQ(j["torch_dtype"], "float32");
    EXPECT_EQ(j.contains("num_experts"), c.num_experts > 0);  // dense: Qwen3 fields only
  }
  auto path = std::filesystem::temp_directory_path() / ("mt_config_" + std::to_string(::getpid()) + ".json");
  save_model_config(configs[1], path.string());
  expect_same(load_model_config(path.string()), configs[1]);
  std::filesystem::remove(path);
}
