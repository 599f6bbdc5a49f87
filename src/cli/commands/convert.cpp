// moetrain convert --from RUN_DIR/checkpoint-N --to DIR: a checkpoint as a clean Hugging Face model
// directory (train/convert.h says what it writes and promises); prints one summary line.
#include "train/convert.h"

#include <cstdio>
#include <string>
#include <vector>

#include "cli/commands.h"
#include "core/error.h"
#include "core/options.h"

namespace mt {

int convert_main(const std::vector<std::string>& args) {
  ConvertOptions c;
  std::string dtype = "bf16", shard = "5GB";
  cli::Options opt("convert", "--from RUN_DIR/checkpoint-N --to DIR [--adapter | --merge] [options]",
                   "Writes a Hugging Face model directory (config.json, generation_config.json, safetensors shards "
                   "+ index,\ntokenizer files) that transformers loads.");
  opt.add("from", &c.from, "a checkpoint-N directory or an HF model directory").var("DIR").required();
  opt.add("to", &c.to, "the new directory (absent or empty)").var("DIR").required();
  opt.add("dtype", &dtype, "the stored weights' type (bfloat16, float32 and fp32 are the same)")
      .one_of({"bf16", "f32", "bfloat16", "float32", "fp32"});
  opt.add("max-shard-size", &shard, "the largest safetensors file: bytes, or with KB/MB/GB/KiB/MiB/GiB").var("SIZE");
  opt.group("LoRA");
  opt.add("adapter", &c.adapter,
          "--from is a LoRA run's checkpoint-N (or a PEFT adapter): write its adapters as a PEFT adapter directory");
  opt.add("merge", &c.merge,
          "--from is a LoRA run's checkpoint-N (or a PEFT adapter): write the base with the adapters added into "
          "its weights");
  opt.add("base", &c.base, "the adapters' base model when not the one the run names").var("DIR");
  opt.group("output");
  opt.add("tokenizer", &c.tokenizer,
          "copy the tokenizer files from this directory or tokenizer.json (default: the "
          "source's)")
      .var("PATH");
  if (!opt.parse(args)) {
    std::printf("%s", opt.help().c_str());
    return 0;
  }
  opt.check();
  c.dtype = dtype == "bf16" || dtype == "bfloat16" ? DType::BF16 : DType::F32;
  c.max_shard_bytes = parse_size("--max-shard-size", shard);
  const bool lora = c.adapter || c.merge;
  const ConvertReport r = lora ? convert_lora(c) : convert_checkpoint(c);
  if (c.adapter) {
    std::printf("convert: %zu adapter tensors, %.1f MB -> %s (a PEFT adapter directory) in %.2f s\n", r.tensors,
                double(r.bytes) / 1e6, c.to.c_str(), r.seconds);
    return 0;
  }
  std::string copied;
  for (const std::string& f : r.copied) copied += (copied.empty() ? "" : ", ") + f;
  std::printf("convert: %zu tensors, %.1f MB in %zu safetensors file(s) (%s) -> %s in %.2f s%s%s\n", r.tensors,
              double(r.bytes) / 1e6, r.shards, c.dtype == DType::BF16 ? "bf16" : "f32", c.to.c_str(), r.seconds,
              copied.empty() ? "" : "; copied ", copied.c_str());
  return 0;
}

}  // namespace mt
