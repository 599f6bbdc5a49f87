// `moetrain grpo` end to end on a small model (the real binary, CPU): it evaluates, runs its steps with
// one metrics line each, saves a checkpoint and ends with the summary line; bad options are errors
// before any work.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>

#include "parallel/launch_test_util.h"

using namespace mt::test;

TEST(GrpoCli, RunsStepsWritesMetricsAndTheSummaryLine) {
  const std::string out = tmp_path("grpocli", "run");
  ShellRun r = sh(kMoetrainBin + " grpo --device cpu --model " + kGoldens +
                  "/tiny --steps 3 --prompts-per-step 2 --n 2 --max-digits 2 --eval-problems 8 --out-dir " + out);
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("grpo: exact-match "), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("% on 8 held-out problems"), std::string::npos) << r.out;
  std::ifstream f(out + "/metrics.jsonl");
  std::string line;
  int lines = 0;
  while (std::getline(f, line)) lines += line.find("\"reward_mean\"") != std::string::npos;
  EXPECT_EQ(lines, 3);
  EXPECT_TRUE(std::filesystem::exists(out + "/checkpoint-3/config.json"));
}

TEST(GrpoCli, BadOptionsAreErrorsBeforeAnyWork) {
  ShellRun r = sh(kMoetrainBin + " grpo --device cpu --model " + kGoldens + "/tiny --n 1");
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.out.find("--n 1 samples per prompt; group advantages need at least 2"), std::string::npos) << r.out;
  r = sh(kMoetrainBin + " grpo --algorithm sac");
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.out.find("unknown argument '--algorithm'"), std::string::npos) << r.out;
  r = sh(kMoetrainBin + " grpo --model /nonexistent/dir");
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.out.find("/nonexistent/dir has no config.json"), std::string::npos) << r.out;
}
