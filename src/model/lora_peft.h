// PEFT adapter directories (adapter_config.json + adapter_model.safetensors), read and written, so that an
// adapter trained here loads in PEFT (PeftModel.from_pretrained on the transformers model) and one written
// by PEFT loads here.
//
// Keys: PEFT's "base_model.model." + our names (model/lora.h), except the routed experts', whose two
// parameters sit on one module (mlp.experts) and are adapted through `target_parameters`: with both
// adapted, PEFT nests its wrappers and gate_up_proj's keys are mlp.experts.base_layer.lora_{A,B}.weight and
// down_proj's mlp.experts.lora_{A,B}.weight; with one, that one's are mlp.experts.lora_{A,B}.weight.
// Their shapes: lora_A [r E, in] (expert e's A is rows e r .. e r + r: our [E, r, in] as it is) and lora_B
// [out, r E] with expert e's column j at j E + e (ours is [E, out, r]: reordered on the way).
// The dense MLP's gate/up/down are written as target_parameters (mlp.gate_proj.weight, ...): PEFT maps
// target_modules named *_proj onto the fused experts of transformers 5's Qwen3-MoE and would leave the
// dense MLP unadapted. Attention goes in target_modules (q_proj, k_proj, v_proj, o_proj).
#pragma once
#include <string>

#include "core/tensor.h"
#include "model/config.h"
#include "model/lora.h"

namespace mt {

// The adapter directory `path` names: itself when it holds adapter_config.json, else its adapter/ (a LoRA
// run's checkpoint-N); an error that says what was looked for otherwise.
std::string find_adapter_dir(const std::string& path);

// The spec of an adapter directory's adapter_config.json: r, lora_alpha, use_rslora, the targets. Settings
// we do not implement (dropout > 0 is fine to read: it only matters in training; DoRA, bias, per-module
// ranks, fan_in_fan_out, modules_to_save) are errors that name the setting.
LoraSpec read_peft_config(const std::string& dir);
// The adapter's values in the layout of LoraTable(c, spec) (host f32): every tensor the table needs must be
// there with its shape, and a tensor the table does not know is an error naming it.
Tensor read_peft_adapter(const std::string& dir, const ModelConfig& c, const LoraSpec& spec);
// Writes dir/adapter_config.json and dir/adapter_model.safetensors (f32) for the adapters' values `flat`
// (any device). base_model: what adapter_config.json names as the base (a path or a hub id; may be "").
void write_peft_adapter(const std::string& dir, const ModelConfig& c, const LoraSpec& spec, const Tensor& flat,
                        const std::string& base_model);

// Adds s B A to each adapted weight of the base's flat f32 buffer (ParamTable layout, host): the merged
// model, which computes what base + adapters computes (convert --merge, the engine's merged mode).
void merge_lora(const ModelConfig& c, const LoraSpec& spec, const Tensor& lora_flat, const class ParamTable& table,
                Tensor& base_flat);

}  // namespace mt
