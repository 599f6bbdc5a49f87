// ModelConfig: the Qwen3-MoE / Qwen3 architecture hyper-parameters, read from and written to a
// Hugging Face config.json (plus moetrain's own keys, prefixed "moetrain_", for what a checkpoint must carry
// that transformers has no field for), plus the built-in presets of docs/design.md (tiny, demo, bench-4L,
// qwen3-30b-a3b). Dense Qwen3 is the same model with num_experts = 0.
#pragma once
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace mt {

struct ModelConfig {
  std::string architecture = "Qwen3MoeForCausalLM";  // or "Qwen3ForCausalLM" (dense)
  int64_t vocab_size = 0;
  int64_t hidden_size = 0;            // D
  int64_t num_hidden_layers = 0;      // L
  int64_t num_attention_heads = 0;    // H
  int64_t num_key_value_heads = 0;    // G
  int64_t head_dim = 0;               // Hd (config.json may omit it: hidden_size / heads)
  int64_t intermediate_size = 0;      // dense MLP hidden dim (dense layers)
  int64_t moe_intermediate_size = 0;  // F
  int64_t num_experts = 0;            // E (0 = dense model)
  int64_t num_experts_per_tok = 0;    // K
  int64_t decoder_sparse_step = 1;
  std::vector<int64_t> mlp_only_layers;
  bool norm_topk_prob = true;
  bool output_router_logits = false;  // adds router_aux_loss_coef * aux to the loss
  double router_aux_loss_coef = 0.001;
  double rms_norm_eps = 1e-6;
  double rope_theta = 1e6;
  int64_t max_position_embeddings = 32768;
  bool tie_word_embeddings = false;
  double initializer_range = 0.02;
  int64_t bos_token_id = -1, eos_token_id = -1;  // -1 = absent
  // A value model (the RL critic): the LM head is a scalar head score.weight [1, D] (transformers'
  // *ForTokenClassification with num_labels 1) and the model outputs v_t = norm(h_t) . w per token
  // (Qwen3MoeModel: LossParts::value, ValueObjective). Not read from config.json; needs untied embeddings.
  bool value_head = false;
  // Where the routing weights multiply (a moetrain extension, config.json key
  // "moetrain_score_before_experts", written only when true): false (Qwen3-MoE, transformers)
  // y = sum_k w_k expert_k(x); true: y = sum_k expert_k(w_k x). Part of what the model computes, so it
  // travels in the checkpoint's config.json; transformers ignores the key and would run the other formula.
  bool score_before_experts = false;

  bool is_sparse_layer(int64_t layer) const;  // transformers' rule (decoder_sparse_step, mlp_only_layers)
  int64_t num_sparse_layers() const;          // how many layers is_sparse_layer takes (0 for dense Qwen3)
  int64_t num_parameters() const;             // all parameters (tied embedding counted once)
  int64_t active_matmul_parameters() const;   // per token: attention + active experts/dense MLP + lm_head
  void validate() const;                      // throws mt::Error naming the field, value and rule
};

// Parses config.json text / file. Accepts the field spellings of the Hub configs and of current
// transformers (e.g. rope_theta at top level or inside rope_parameters / rope_scaling).
// Unknown architectures are an error naming the architecture and the supported ones.
ModelConfig parse_model_config(const std::string& json_text, const std::string& origin = "config.json");
ModelConfig load_model_config(const std::string& path);  // path to config.json or a model directory
std::string model_config_to_json(const ModelConfig& c);   // transformers-loadable config.json text
void save_model_config(const ModelConfig& c, const std::string& path);

// What a model directory's config.json says of score_before_experts (its "moetrain_score_before_experts";
// false when the key is absent, as in every transformers checkpoint), or nullopt when it has no config.json.
std::optional<bool> stated_score_before_experts(const std::string& dir);
// A command's own setting of score_before_experts (`asked`: -1 not given, else 0 or 1; `setting` names it as
// the user wrote it, e.g. "--score-before-experts") against what the directory `dir` states (`stated`, nullopt:
// nothing): the value to run with, the directory's unless it states nothing. A setting that contradicts the
// directory is an error naming both (a model trained one way must run the same way everywhere).
bool resolve_score_before_experts(int64_t asked, const std::string& setting, std::optional<bool> stated,
                                  const std::string& dir);

// Built-in presets: "tiny", "demo", "bench-4L", "qwen3-30b-a3b". Unknown name: error listing them.
ModelConfig preset_model_config(const std::string& name);
std::vector<std::string> preset_names();

}  // namespace mt
