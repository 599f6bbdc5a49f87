// parse_grpo_args for tests: the parsed arguments, or the error it throws.
#pragma once
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "cli/commands/grpo_args.h"
#include "test_util.h"

namespace mt::testutil {

// The arguments parse_grpo_args makes of `args` (a test failure when it asks for help instead).
inline GrpoArgs parsed_grpo_args(const std::vector<std::string>& args) {
  GrpoArgs a;
  std::string help;
  EXPECT_TRUE(parse_grpo_args(args, a, &help));
  return a;
}

// The error parse_grpo_args throws for `args` (a test failure when it throws none).
inline std::string grpo_args_error(const std::vector<std::string>& args) {
  GrpoArgs a;
  std::string help;
  return error_of([&] { parse_grpo_args(args, a, &help); });
}

}  // namespace mt::testutil
