// `moetrain generate` values that once ran without a word (the real binary, the tiny golden model): a stop
// token outside the vocabulary (it can never be sampled, so it never stops anything), a negative --threads
// (ignored) and a negative --seed (read as 2^64 - 1). Each is an error now, before the weights are read.
#include <gtest/gtest.h>

#include <fstream>
#include <string>

#include "parallel/launch_test_util.h"

using namespace mt::test;

TEST(GenerateCliOptions, BadValuesAreErrors) {
  const std::string prompts = tmp_path("genclioptions", "p.jsonl"), out = tmp_path("genclioptions", "o.jsonl");
  std::ofstream(prompts) << "{\"prompt_ids\": [1, 2, 3]}\n";
  const std::string base =
      kMoetrainBin + " generate --device cpu --model " + kGoldens + "/tiny --prompts " + prompts + " --out " + out;
  const std::pair<std::string, std::string> cases[] = {
      {"--stop-token-ids 3,99999", "--stop-token-ids: 99999 is not a token id of the model (vocabulary [0, "},
      {"--stop-token-ids -1", "--stop-token-ids: -1 is not a token id of the model (vocabulary [0, "},
      {"--threads -2", "--threads -2; need >= 0; 0: all cores"},
      {"--seed -1", "--seed -1; need >= 0"},
  };
  for (const auto& [opts, want] : cases) {
    const ShellRun r = sh(base + " " + opts);
    EXPECT_NE(r.code, 0) << opts << ": " << r.out;
    EXPECT_NE(r.out.find(want), std::string::npos) << opts << ": " << r.out;
  }
  const ShellRun ok = sh(base + " --stop-token-ids 3,4 --threads 1 --seed 7 --max-new-tokens 2");
  EXPECT_EQ(ok.code, 0) << ok.out;
}

// The help said a prompt line's "other keys are kept"; generate reads them and writes none of them to --out
// (the prompt reader keeps them as metadata for grpo's rewards). It says so now, and how to join.
TEST(GenerateCliOptions, HelpSaysOtherKeysAreNotCopied) {
  const ShellRun r = sh(kMoetrainBin + " generate --help");
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_EQ(r.out.find("other keys are kept"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("not copied to --out"), std::string::npos) << r.out;
}
