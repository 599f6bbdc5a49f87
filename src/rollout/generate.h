// `moetrain generate`: the rollout engine from the command line (docs/rollout.md).
#pragma once
#include <string>
#include <vector>

namespace mt {

int generate_main(const std::vector<std::string>& args);

}  // namespace mt
