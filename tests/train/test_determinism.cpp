// The deterministic switch (core/determinism.h) and its config key: `--deterministic` bare or with 0/1,
// the environment variable's allowed values, and the scope that tests use. The CUDA kernels it selects
// are tested in tests/cuda/test_cuda_deterministic.cpp.
#include <gtest/gtest.h>

#include <cstdlib>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "core/determinism.h"
#include "test_util.h"
#include "train/train_config.h"

using namespace mt;
using mt::testutil::error_of;

TEST(Deterministic, BareFlagValueAndRefusal) {
  EXPECT_FALSE(TrainConfig{}.deterministic);
  EXPECT_TRUE(train_config_from_args({"--deterministic"}).deterministic);
  // A bare flag followed by another key takes no value from it.
  TrainConfig c = train_config_from_args({"--deterministic", "--steps", "700"});
  EXPECT_TRUE(c.deterministic);
  EXPECT_EQ(c.steps, 700);
  EXPECT_FALSE(train_config_from_args({"--deterministic", "0"}).deterministic);
  EXPECT_TRUE(train_config_from_args({"--deterministic=1"}).deterministic);
  const std::string msg = error_of([] { train_config_from_args({"--deterministic=2"}); });
  EXPECT_NE(msg.find("--deterministic '2' is not on or off"), std::string::npos) << msg;
  EXPECT_NE(train_config_help().find("--deterministic"), std::string::npos);
  // It changes bits, not the arithmetic: a resume may turn it on or off without a warning.
  TrainConfig on;
  on.deterministic = true;
  EXPECT_EQ(train_config_changes(nlohmann::json::parse(to_json(TrainConfig{})), on), "");
}

TEST(Deterministic, ScopeSetsAndRestores) {
  const bool before = deterministic();
  {
    DeterministicScope on(true);
    EXPECT_TRUE(deterministic());
    {
      DeterministicScope off(false);
      EXPECT_FALSE(deterministic());
    }
    EXPECT_TRUE(deterministic());
  }
  EXPECT_EQ(deterministic(), before);
}
