// moetrain train and moetrain sft: a TrainConfig from the command line (train/train_config.h: --config
// FILE, then --key value / --key=value; sft's own defaults), the stop signals (core/interrupt.h), the run
// (train/trainer.h), the summary line; the exit code 0, or 128 + the signal that stopped the run.
#include <cstdio>
#include <string>
#include <vector>

#include "cli/commands.h"
#include "core/interrupt.h"
#include "train/sft.h"
#include "train/train_config.h"
#include "train/trainer.h"

namespace mt {

int train_main(const std::vector<std::string>& args, const RunOptions& run) {
  for (const std::string& a : args)
    if (a == "--help" || a == "-h") {
      std::printf("usage: moetrain train [--config FILE.json] [--key value ...]\noptions:\n%s",
                  train_config_help().c_str());
      return 0;
    }
  TrainConfig cfg = train_config_from_args(args);
  install_stop_signals();
  TrainSummary s = run_training(cfg, run);
  if (!s.summary_line.empty()) std::printf("%s\n", s.summary_line.c_str());
  return exit_status(s);
}

int sft_main(const std::vector<std::string>& args, const RunOptions& run) {
  for (const std::string& a : args)
    if (a == "--help" || a == "-h") {
      const TrainConfig d = sft_defaults();
      std::printf(
          "usage: moetrain sft --model DIR --data FILE.jsonl [--tokenizer FILE] [--config FILE.json] [--key value "
          "...]\n"
          "  fine-tunes a Hugging Face model directory on chat data: {\"messages\": [...]} per line, rendered with "
          "the\n"
          "  Qwen3 chat template, loss on the assistant turns only, documents packed with boundaries (docs/data.md).\n"
          "  --model may also be a preset with --tokenizer (random init, for demonstrations).\n"
          "  SFT defaults: out_dir %s, steps %lld, micro_batch_size %lld, seq_len %lld, lr %g, min_lr %g, warmup_steps "
          "%lld, data_format %s\noptions (as moetrain train, with sft's defaults):\n%s",
          d.out_dir.c_str(), (long long)d.steps, (long long)d.micro_batch_size, (long long)d.seq_len, d.lr, d.min_lr,
          (long long)d.warmup_steps, d.data_format.c_str(), train_config_help(d).c_str());
      return 0;
    }
  const TrainConfig cfg = prepare_sft(sft_config_from_args(args));
  install_stop_signals();
  RunOptions ro = run;
  ro.command = "sft";
  TrainSummary s = run_training(cfg, ro);
  if (!s.summary_line.empty()) {
    const size_t colon = s.summary_line.find(':');
    std::printf("sft%s\n",
                colon == std::string::npos ? (": " + s.summary_line).c_str() : s.summary_line.substr(colon).c_str());
  }
  return exit_status(s);
}

}  // namespace mt
