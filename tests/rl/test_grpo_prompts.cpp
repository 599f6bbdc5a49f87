// `moetrain grpo --prompts FILE.jsonl` on the real binary (CPU, tiny models): text, chat and token-id
// prompts with exact-match, math and external-program rewards run their steps and end with the
// held-out line; every kind of bad input is an error that names what is wrong before any work starts.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <regex>

#include "parallel/launch_test_util.h"

using namespace mt::test;
namespace fs = std::filesystem;

namespace {

void write_text(const std::string& path, const std::string& text) {
  std::ofstream f(path);
  f << text;
}

// A tiny model directory with the test tokenizer (vocab 3008): one SFT step from the `tiny` preset.
const std::string& text_model() {
  static const std::string dir = [] {
    const std::string run = tmp_path("grpoprompts", "sft");
    const ShellRun r = sh(kMoetrainBin + " sft --device cpu --model tiny --tokenizer " + std::string(MT_SOURCE_DIR) +
                          "/tests/assets/tokenizer/trained/tokenizer.json --data " + std::string(MT_SOURCE_DIR) +
                          "/examples/chat_small.jsonl --steps 1 --warmup-steps 0 --seq-len 64 --out-dir " + run);
    EXPECT_EQ(r.code, 0) << r.out;
    return run + "/checkpoint-1";
  }();
  return dir;
}

std::string grpo(const std::string& model, const std::string& rest) {
  return kMoetrainBin + " grpo --device cpu --model " + model +
         " --steps 2 --prompts-per-step 2 --n 2 --max-new-tokens 6 --temperature 1.0 " + rest;
}

}  // namespace

TEST(GrpoPrompts, TextAndChatPromptsWithExactMatchRunAndEvaluate) {
  const std::string dir = tmp_path("grpoprompts", "exact");
  write_text(dir + ".train.jsonl",
             "{\"prompt\": \"What is 2+2?\", \"answer\": \"4\", \"source\": \"toy\"}\n"
             "\n"
             "{\"messages\": [{\"role\": \"user\", \"content\": \"Say hi\"}], \"answer\": \"hi\"}\n"
             "{\"prompt\": \"Capital of France?\", \"answer\": \"Paris\"}\n");
  write_text(dir + ".eval.jsonl",
             "{\"prompt\": \"1+1=\", \"answer\": 2}\n{\"prompt\": \"3+3=\", \"answer\": \"6\"}\n"
             "{\"messages\": [{\"role\": \"user\", \"content\": \"ok?\"}], \"answer\": \"ok\"}\n");
  const ShellRun r = sh(grpo(text_model(), "--prompts " + dir + ".train.jsonl --eval-prompts " + dir +
                                               ".eval.jsonl --reward exact --run-dir " + dir));
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("3 prompts from"), std::string::npos) << r.out;
  EXPECT_TRUE(std::regex_search(r.out, std::regex(R"(grpo: exact-match \d+\.\d% -> \d+\.\d% on 3 held-out prompts)")))
      << r.out;
  const auto steps = read_step_metrics(dir + "/metrics.jsonl");
  ASSERT_EQ(steps.size(), 2u);
  for (const auto& j : steps) EXPECT_TRUE(j.contains("reward_mean") && j.contains("response_len_max")) << j.dump();
  // The final checkpoint is a model directory again: weights, config and the tokenizer.
  EXPECT_TRUE(fs::exists(dir + "/checkpoint-2/model.safetensors"));
  EXPECT_TRUE(fs::exists(dir + "/checkpoint-2/tokenizer.json"));
}

TEST(GrpoPrompts, MathRewardWithoutEvalPromptsSaysTheEvaluationIsSkipped) {
  const std::string dir = tmp_path("grpoprompts", "math");
  write_text(dir + ".jsonl", "{\"prompt\": \"Compute 6*7. Put the answer in \\\\boxed{}.\", \"answer\": 42}\n");
  const ShellRun r = sh(grpo(text_model(), "--prompts " + dir + ".jsonl --reward math --run-dir " + dir));
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("grpo: 2 steps done; evaluation skipped (no --eval-prompts)"), std::string::npos) << r.out;
  EXPECT_EQ(read_step_metrics(dir + "/metrics.jsonl").size(), 2u);
}

// Token-id prompts and an external program that gets the prompt, the response and the line's metadata
// (here it rewards the "bonus" field, so every sample scores 3 and the held-out mean is 3).
TEST(GrpoPrompts, RewardProgramGetsTheMetadata) {
  const std::string dir = tmp_path("grpoprompts", "program");
  write_text(dir + ".jsonl", "{\"prompt_ids\": [1, 2, 3], \"bonus\": 3}\n{\"prompt_ids\": [7, 8], \"bonus\": 3}\n");
  write_text(dir + ".sh",
             "#!/bin/sh\nwhile IFS= read -r line; do\n"
             "  case \"$line\" in *'\"metadata\":{\"bonus\":3}'*'\"response\":\"['*) echo 3;; *) echo 0;; esac\n"
             "done\n");
  fs::permissions(dir + ".sh", fs::perms::owner_all);
  const ShellRun r = sh(grpo(kGoldens + "/tiny", "--prompts " + dir + ".jsonl --eval-prompts " + dir +
                                                     ".jsonl --reward program:" + dir + ".sh --run-dir " + dir));
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("grpo: program-reward 3.0000 -> 3.0000 on 2 held-out prompts"), std::string::npos) << r.out;
}

TEST(GrpoPrompts, BadInputIsAnErrorBeforeAnyWork) {
  const std::string dir = tmp_path("grpoprompts", "bad");
  const std::string tiny = kGoldens + "/tiny";
  auto expect_error = [](const ShellRun& r, const std::string& text) {
    EXPECT_NE(r.code, 0) << r.out;
    EXPECT_NE(r.out.find(text), std::string::npos) << "want: " << text << "\ngot: " << r.out;
    EXPECT_EQ(r.out.find("step 1/"), std::string::npos) << "no step may run: " << r.out;
  };
  write_text(dir + ".empty.jsonl", "\n\n");
  expect_error(sh(grpo(tiny, "--prompts " + dir + ".empty.jsonl")), "no prompts (the file is empty");
  write_text(dir + ".noprompt.jsonl", "{\"prompt_ids\": [1], \"answer\": [2]}\n{\"answer\": \"5\"}\n");
  expect_error(sh(grpo(tiny, "--prompts " + dir + ".noprompt.jsonl")),
               ".noprompt.jsonl:2: no \"prompt_ids\", \"prompt\" or \"messages\"");
  write_text(dir + ".noanswer.jsonl", "{\"prompt\": \"a\", \"answer\": \"b\"}\n{\"prompt\": \"c\"}\n");
  expect_error(sh(grpo(text_model(), "--prompts " + dir + ".noanswer.jsonl --reward math")),
               ".noanswer.jsonl:2: no \"answer\"; the math reward compares the response with it");
  write_text(dir + ".text.jsonl", "{\"prompt\": \"hello\", \"answer\": \"x\"}\n");
  expect_error(sh(grpo(tiny, "--prompts " + dir + ".text.jsonl")), "\"prompt\" needs a tokenizer");
  write_text(dir + ".ids.jsonl", "{\"prompt_ids\": [1, 2], \"answer\": \"12\"}\n");
  expect_error(sh(grpo(tiny, "--prompts " + dir + ".ids.jsonl")),
               "exact match then compares token ids (give \"answer\" as a list of ids)");
  expect_error(sh(grpo(tiny, "--prompts " + dir + ".ids.jsonl --reward math")),
               "--reward math reads the response's text");
  expect_error(sh(grpo(tiny, "--prompts " + dir + ".ids.jsonl --reward program:/no/such/scorer --max-new-tokens 4")),
               "/no/such/scorer");
  write_text(dir + ".noexec.sh", "#!/bin/sh\necho 1\n");
  fs::permissions(dir + ".noexec.sh", fs::perms::owner_read | fs::perms::owner_write);
  const ShellRun noexec = sh(grpo(tiny, "--prompts " + dir + ".ids.jsonl --reward program:" + dir + ".noexec.sh"));
  expect_error(noexec, ".noexec.sh");
  EXPECT_NE(noexec.out.find("executable"), std::string::npos) << noexec.out;
  expect_error(sh(grpo(tiny, "--prompts " + dir + ".ids.jsonl --reward digits")),
               "--reward 'digits' is unknown with --prompts; use exact, math or program:CMD");
  expect_error(sh(grpo(tiny, "--prompts " + dir + ".ids.jsonl --n 1")),
               "--n 1; need >= 2");
  expect_error(sh(grpo(tiny, "--prompts " + dir + ".ids.jsonl --advantage position")),
               "--advantage position needs per-token rewards");
  expect_error(sh(grpo(tiny, "--prompts " + dir + ".ids.jsonl --max-digits 3")),
               "--max-digits sets the built-in addition task");
  expect_error(sh(grpo(tiny, "--eval-prompts " + dir + ".ids.jsonl")), "--eval-prompts needs --prompts");
  expect_error(sh(kMoetrainBin + " grpo --device cpu --model " + tiny + " --reward math"),
               "--reward math scores the responses to a prompt file");
  expect_error(sh(grpo(tiny, "--prompts " + dir + ".missing.jsonl")), "cannot open the prompt file");
  expect_error(sh(grpo(tiny, "--prompts " + dir + ".ids.jsonl --max-new-tokens 256")),
               "--max-new-tokens 256 leaves no room for a prompt in the model's 256 positions");
}
