// The commands of the `moetrain` binary (apps/moetrain.cpp dispatches to them), one file each under
// src/cli/commands/: each parses its options (core/options.h), composes the library's pieces and
// returns the process's exit code.
#pragma once
#include <string>
#include <vector>

#include "train/trainer.h"

namespace mt {

int convert_main(const std::vector<std::string>& args);
int generate_main(const std::vector<std::string>& args);
int grads_main(const std::vector<std::string>& args);
int grpo_main(const std::vector<std::string>& args);
struct GrpoHooks;  // cli/commands/grpo_args.h: the Python API's in-process reward function and environment
int grpo_main(const std::vector<std::string>& args, const GrpoHooks& hooks);
int launch_main(const std::vector<std::string>& args);
int plot_main(const std::vector<std::string>& args);
int selftest_main(const std::vector<std::string>& args);  // hidden: _selftest comm|dist|rl
// train and sft (commands/train.cpp): `run` lets a test stop the run after a step (trainer.h).
int sft_main(const std::vector<std::string>& args, const RunOptions& run = {});
int train_main(const std::vector<std::string>& args, const RunOptions& run = {});
int tokenize_main(const std::vector<std::string>& args);

namespace comm {
struct LaunchOptions;
// `launch`'s options and the command after "--", checked (launch_main without the run; -h/--help is an error).
LaunchOptions parse_launch_args(const std::vector<std::string>& args);
}  // namespace comm

}  // namespace mt
