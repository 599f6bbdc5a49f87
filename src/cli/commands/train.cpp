// moetrain train and moetrain sft: a TrainConfig from the command line (train/train_config.h: every
// setting declared once with the options module, --config FILE, then --key value / --key=value; sft's own
// defaults and required options in train/sft.h), the stop signals (core/interrupt.h), the run
// (train/trainer.h), the summary line; the exit code 0, or 128 + the signal that stopped the run.
#include <cstdio>
#include <string>
#include <vector>

#include "cli/commands.h"
#include "core/interrupt.h"
#include "core/options.h"
#include "train/sft.h"
#include "train/train_config.h"
#include "train/trainer.h"

namespace mt {

int train_main(const std::vector<std::string>& args, const RunOptions& run) {
  TrainConfig cfg;
  cli::Options opt = train_options(cfg);
  if (!parse_train_args(opt, cfg, args)) {
    std::printf("%s", opt.help().c_str());
    return 0;
  }
  install_stop_signals();
  TrainSummary s = run_training(cfg, run);
  if (!s.summary_line.empty()) std::printf("%s\n", s.summary_line.c_str());
  return exit_status(s);
}

int sft_main(const std::vector<std::string>& args, const RunOptions& run) {
  TrainConfig cfg = sft_defaults();
  cli::Options opt = sft_options(cfg);
  if (!parse_train_args(opt, cfg, args)) {
    std::printf("%s", opt.help().c_str());
    return 0;
  }
  cfg = prepare_sft(cfg);
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
