// `moetrain grpo`: GRPO on the built-in addition task (docs/rl.md "moetrain grpo").
#pragma once
#include <string>
#include <vector>

namespace mt {
int grpo_main(const std::vector<std::string>& args);
}
