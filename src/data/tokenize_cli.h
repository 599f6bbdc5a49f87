// `moetrain tokenize`: encode stdin lines to ids, decode id lines to text, render chat messages, or time the
// tokenizer (docs/tokenizer.md).
#pragma once
#include <string>
#include <vector>

namespace mt {

int tokenize_main(const std::vector<std::string>& args);

}  // namespace mt
