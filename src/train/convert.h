// `moetrain convert`: a training checkpoint (or any HF directory of a Qwen3-MoE / Qwen3 model we read)
// to a clean Hugging Face model directory that transformers' AutoModelForCausalLM.from_pretrained loads:
// config.json (dtype recorded), generation_config.json, model.safetensors or shards
// model-0000i-of-0000n.safetensors with model.safetensors.index.json, and the tokenizer files when the
// source (or --tokenizer) has them. No training state, no manifest, no router bias (a warning says the
// export routes without it). A model with score_before_experts (moetrain_score_before_experts in its
// config.json) is refused: transformers would run it with Qwen3-MoE's formula.
//
// Promises: the source is verified first (its manifest, when it has one: a corrupt checkpoint is refused
// with the file named); the tensors are the source's, in the model's parameter order, converted to the
// requested dtype (bf16 rounds to nearest even, as torch does); the output appears only complete (written
// into DIR.tmp, then renamed) and never over an existing non-empty directory.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "core/dtype.h"

namespace mt {

struct ConvertOptions {
  std::string from;                                         // a checkpoint-N directory or an HF model directory
  std::string to;                                           // the new directory (must not exist, or be empty)
  DType dtype = DType::BF16;                                // BF16 or F32
  size_t max_shard_bytes = size_t(5) * 1000 * 1000 * 1000;  // "5GB", as transformers' save_pretrained(max_shard_size)
  std::string tokenizer;  // a directory or tokenizer.json to copy the tokenizer files from ("" = the source's)
  // LoRA sources (docs/lora.md): `from` a LoRA run's checkpoint-N or a PEFT adapter directory.
  //   adapter: write `to` as the PEFT adapter directory (adapter_config.json + adapter_model.safetensors)
  //   merge:   write `to` as the HF model of the base with the adapters added into its weights
  // base: the base model (a directory, or a preset with the run's seed) when not the one the adapter names.
  bool adapter = false, merge = false;
  std::string base;
};

struct ConvertReport {
  size_t tensors = 0, bytes = 0, shards = 0;
  std::vector<std::string> copied;  // tokenizer / generation files copied
  double seconds = 0;
};

ConvertReport convert_checkpoint(const ConvertOptions& opt);
// The adapter or merged export of a LoRA source (ConvertOptions::adapter / merge).
ConvertReport convert_lora(const ConvertOptions& opt);
// A size in bytes, or with a unit: "5GB", "500MB", "2GiB" (> 0; an error names the flag and the value).
size_t parse_size(const std::string& flag, const std::string& v);

}  // namespace mt
