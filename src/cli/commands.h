// The commands of the `moetrain` binary (apps/moetrain.cpp dispatches to them), one file each under
// src/cli/commands/: each parses its options (cli/options.h), composes the library's pieces and
// returns the process's exit code.
#pragma once
#include <string>
#include <vector>

namespace mt {

int convert_main(const std::vector<std::string>& args);
int generate_main(const std::vector<std::string>& args);
int grpo_main(const std::vector<std::string>& args);

}  // namespace mt
