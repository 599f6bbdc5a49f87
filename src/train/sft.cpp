// `moetrain sft` (see sft.h).
#include "train/sft.h"

#include <unistd.h>

#include <cstdio>
#include <filesystem>

#include "core/error.h"
#include "core/interrupt.h"
#include "core/log.h"
#include "data/tokenizer.h"
#include "model/config.h"
#include "train/trainer.h"

namespace mt {

namespace fs = std::filesystem;

TrainConfig sft_defaults() {
  TrainConfig c;
  c.model = "";
  c.data = "";
  c.out_dir = "runs/sft";
  c.steps = 100;
  c.micro_batch_size = 4;
  c.seq_len = 1024;
  c.lr = 2e-5;
  c.min_lr = 2e-6;
  c.warmup_steps = 10;
  c.eval_problems = 0;
  c.eval_every = 0;
  c.data_format = "messages";
  return c;
}

namespace {

bool ends_with(const std::string& s, const std::string& tail) {
  return s.size() >= tail.size() && s.compare(s.size() - tail.size(), tail.size(), tail) == 0;
}

}  // namespace

cli::Options sft_options(TrainConfig& c) {
  cli::Options o("sft", "--model DIR --data FILE.jsonl [--tokenizer FILE] [--config FILE.json] [--key value ...]",
                 "Fine-tunes a Hugging Face model directory on chat data: {\"messages\": [...]} per line, rendered "
                 "with the\nQwen3 chat template, loss on the assistant turns only, documents packed with boundaries "
                 "(docs/data.md).\n--model may also be a preset with --tokenizer (random init, for demonstrations). "
                 "The options are\nmoetrain train's, with sft's defaults.");
  declare_train_command(o, c);
  o.at("model").required();
  o.at("data").required();
  o.rule([&c] {
    if (!ends_with(c.data, ".jsonl"))
      MT_THROW("sft: --data '", c.data,
               "' is not a .jsonl file; sft reads JSONL lines of {\"messages\": [...]} (or "
               "{\"text\": ...} with --data-format auto|text)");
  });
  return o;
}

TrainConfig sft_config_from_args(const std::vector<std::string>& args) {
  TrainConfig c = sft_defaults();
  cli::Options o = sft_options(c);
  if (!parse_train_args(o, c, args)) MT_THROW("sft: -h/--help asks for the help, which the command prints");
  return c;
}

TrainConfig prepare_sft(const TrainConfig& in) {
  TrainConfig c = in;
  const bool dir = fs::is_directory(c.model);
  if (dir) {
    if (c.tokenizer.empty()) {
      const fs::path t = fs::path(c.model) / "tokenizer.json";
      if (!fs::is_regular_file(t))
        MT_THROW("sft: model directory '", c.model, "' has no tokenizer.json; pass --tokenizer FILE");
      c.tokenizer = t.string();
    }
    if (c.init_from.empty()) c.init_from = c.model;
    return c;
  }
  bool preset = false;
  for (const std::string& p : preset_names()) preset = preset || p == c.model;
  if (!preset) {
    std::string names;
    for (const std::string& p : preset_names()) names += (names.empty() ? "" : ", ") + p;
    MT_THROW("sft: --model '", c.model, "' is neither a directory nor a preset (", names, ")");
  }
  if (c.tokenizer.empty())
    MT_THROW("sft: --model ", c.model, " is a preset (random weights): give its tokenizer with --tokenizer FILE");
  if (!c.init_from.empty()) MT_THROW("sft: --init-from applies to a model directory, not to the preset ", c.model);
  // A fresh model for this tokenizer: the vocabulary widened to hold every id (a multiple of 64), the
  // end of an assistant turn as its EOS (what generation stops at after a chat turn).
  const Tokenizer tok = Tokenizer::from_file(c.tokenizer);
  ModelConfig mc = preset_model_config(c.model);
  const int64_t need = (int64_t(tok.vocab_size()) + 63) / 64 * 64;
  if (mc.vocab_size < need) mc.vocab_size = need;
  const int64_t im_end = tok.token_to_id("<|im_end|>"), eot = tok.token_to_id("<|endoftext|>");
  mc.eos_token_id = im_end >= 0 ? im_end : eot;
  const fs::path init = fs::path(c.out_dir) / "init-model";
  fs::create_directories(init);
  // Every rank of a launch writes the same two files: each to a name of its own, renamed into place
  // (atomic), so no rank reads a half-written file.
  const std::string mine = str(".tmp.", ::getpid());
  save_model_config(mc, (init / ("config.json" + mine)).string());
  fs::rename(init / ("config.json" + mine), init / "config.json");
  fs::copy_file(c.tokenizer, init / ("tokenizer.json" + mine), fs::copy_options::overwrite_existing);
  fs::rename(init / ("tokenizer.json" + mine), init / "tokenizer.json");
  log_info("sft: preset ", c.model, " with vocab_size ", mc.vocab_size, " for the tokenizer's ", tok.vocab_size(),
           " ids, eos ", mc.eos_token_id, ", random init: ", init.string());
  c.model = init.string();
  c.tokenizer = (init / "tokenizer.json").string();
  return c;
}

}  // namespace mt
