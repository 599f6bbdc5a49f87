// `moetrain grpo`'s whole option surface without starting a run (cli/commands/grpo_args.h): the task
// presets as defaults, options over them, PPO's own lr default, prompt-file defaults, and the rules over
// several options, each an error naming what is wrong.
#include <gtest/gtest.h>

#include <functional>
#include <string>
#include <vector>

#include "cli/commands/grpo_args.h"
#include "cli/grpo_args_test_util.h"
#include "core/error.h"
#include "test_util.h"

using namespace mt;

TEST(GrpoArgs, TaskPresetsAreTheDefaultsAndOptionsOverrideThem) {
  GrpoArgs s = testutil::parsed_grpo_args({});
  EXPECT_EQ(s.preset.name, "sharpen");
  EXPECT_EQ(s.steps, 1500);
  EXPECT_FLOAT_EQ(s.o.sampling.temperature, 1.0f);
  EXPECT_EQ(s.reward_kind, rl::addition::Reward::Exact);
  EXPECT_FALSE(s.process);
  EXPECT_EQ(s.o.n, 8);
  EXPECT_DOUBLE_EQ(s.o.lr, 2e-4);
  EXPECT_TRUE(s.o.dynamic_sampling);
  EXPECT_EQ(s.seed, 1234);
  EXPECT_EQ(s.keep_last, 2);
  EXPECT_EQ(s.o.max_new_tokens, 5) << "the 1..3-digit task's answers";
  GrpoArgs e = testutil::parsed_grpo_args({"--task=extend"});
  EXPECT_EQ(e.steps, 500);
  EXPECT_FLOAT_EQ(e.o.sampling.temperature, 1.5f);
  EXPECT_EQ(e.task.hi, 4);
  EXPECT_TRUE(e.task.longest);
  EXPECT_TRUE(e.process && e.per_position);
  EXPECT_EQ(e.reward_kind, rl::addition::Reward::Digits);
  GrpoArgs o = testutil::parsed_grpo_args({"--task", "extend", "--steps=7", "--temperature", "0.9", "--advantage", "outcome",
                       "--dynamic-sampling", "off", "--n=4"});
  EXPECT_EQ(o.steps, 7);
  EXPECT_FLOAT_EQ(o.o.sampling.temperature, 0.9f);
  EXPECT_FALSE(o.process);
  EXPECT_FALSE(o.o.dynamic_sampling);
  EXPECT_EQ(o.o.n, 4);
}

TEST(GrpoArgs, PpoHasItsOwnLrUnlessGivenAndPromptFilesTheirOwnDefaults) {
  EXPECT_DOUBLE_EQ(testutil::parsed_grpo_args({"--algorithm", "ppo"}).o.lr, kPpoLr);
  EXPECT_DOUBLE_EQ(testutil::parsed_grpo_args({"--algorithm", "ppo", "--lr", "3e-4"}).o.lr, 3e-4);
  EXPECT_FALSE(testutil::parsed_grpo_args({"--algorithm=dr-grpo"}).o.normalize_std);
  GrpoArgs f = testutil::parsed_grpo_args({"--prompts", "p.jsonl"});
  EXPECT_TRUE(f.from_file);
  EXPECT_FLOAT_EQ(f.o.sampling.temperature, 1.0f) << "a user's model samples at T 1 unless told";
  EXPECT_EQ(f.o.max_new_tokens, 256);
  EXPECT_EQ(f.file_reward, rl::FileReward::Exact);
  EXPECT_NE(testutil::grpo_args_error({"--task", "extend", "--prompts", "p.jsonl"}).find("--task sets the built-in addition task"),
            std::string::npos);
  GrpoArgs g = testutil::parsed_grpo_args({"--prompts", "p.jsonl", "--reward", "program:python3 score.py", "--reward-on-error", "stop"});
  EXPECT_EQ(g.file_reward, rl::FileReward::Program);
  EXPECT_EQ(g.program_cmd, "python3 score.py");
  EXPECT_TRUE(g.reward_stop);
}

TEST(GrpoArgs, RulesOverSeveralOptionsNameWhatIsWrong) {
  const std::vector<std::pair<std::vector<std::string>, std::string>> cases = {
      {{"--kl-coef", "0.1", "--reference", "off"}, "--kl-coef 0.1 needs the reference model"},
      {{"--min-digits", "5", "--max-digits", "4"}, "--min-digits 5 and --max-digits 4"},
      {{"--mini-batches", "20", "--prompts-per-step", "16"}, "--mini-batches 20 > --prompts-per-step 16"},
      {{"--tis-level", "sequence"}, "--tis-level chooses the level of truncated importance sampling"},
      {{"--prompts", "p.jsonl", "--max-digits", "3"}, "--max-digits sets the built-in addition task"},
      {{"--loss", "gspo", "--tp", "2"}, "--loss gspo under --tp 2"},
      {{"--baseline", "sft"}, "--baseline sft needs --sft-seconds"},
      {{"--critic-lr", "1e-3"}, "set the critic of --algorithm ppo"},
      {{"--max-steps", "2000"}, "--max-steps 2000; need 1..--steps (1500)"},
      {{"--eval-prompts", "e.jsonl"}, "--eval-prompts needs --prompts"},
      {{"--max-new-tokens", "8"}, "--max-new-tokens sets the response length of --prompts"},
      {{"--reward", "math"}, "--reward math scores the responses to a prompt file"},
      {{"--n", "1"}, "--n 1; need >= 2"},
      {{"--stpes", "3"}, "unknown option --stpes; did you mean --steps?"},
      {{"--true-on-policy", "--task", "extend"}, "--true-on-policy needs --temperature 1 (got 1.5)"},
  };
  for (const auto& [args, want] : cases) {
    const std::string got = testutil::grpo_args_error(args);
    EXPECT_NE(got.find(want), std::string::npos) << args[0] << ": " << got;
  }
}

// Under --true-on-policy the rollout's log-probs are the trainer's: the mismatch corrections are dropped (with a
// log line), which also lets the on-policy update skip its old-log-prob forward.
TEST(GrpoArgs, TrueOnPolicyDropsTheMismatchCorrections) {
  const GrpoArgs with = testutil::parsed_grpo_args({"--true-on-policy", "--tis-cap", "2", "--token-mask", "0.5,2"});
  EXPECT_TRUE(with.true_on_policy);
  EXPECT_EQ(with.o.mismatch.tis_cap, 0);
  EXPECT_EQ(with.o.mismatch.token_mask_high, 0);
  const GrpoArgs without = testutil::parsed_grpo_args({"--tis-cap", "2", "--token-mask", "0.5,2"});
  EXPECT_EQ(without.o.mismatch.tis_cap, 2);
  EXPECT_EQ(without.o.mismatch.token_mask_high, 2);
}

TEST(GrpoArgs, HelpShowsTheTaskPresetsDefaults) {
  GrpoArgs a;
  std::string help;
  EXPECT_FALSE(parse_grpo_args({"--task", "extend", "--help"}, a, &help));
  EXPECT_NE(help.find("RL steps (default 500; >= 1)"), std::string::npos) << help;
  EXPECT_NE(help.find("(default 1.5;"), std::string::npos) << "extend's temperature: " << help;
}

TEST(GrpoArgs, LoraAndRecomputeOptions) {
  const GrpoArgs plain = testutil::parsed_grpo_args({});
  EXPECT_EQ(plain.lora.rank, 0);
  EXPECT_EQ(plain.recompute, "none");
  const GrpoArgs a = testutil::parsed_grpo_args({"--lora-rank=8", "--lora-alpha", "4", "--lora-targets", "attn,router", "--recompute", "full"});
  EXPECT_EQ(a.lora.rank, 8);
  EXPECT_DOUBLE_EQ(a.lora.scale(), 0.5);
  EXPECT_TRUE(a.lora[LoraTarget::Router]);
  EXPECT_FALSE(a.lora[LoraTarget::ExpertsGateUp]);
  EXPECT_EQ(a.recompute, "full");
  EXPECT_NE(testutil::grpo_args_error({"--lora-rank", "4", "--lora-targets", "attn,qq"}).find("unknown target 'qq'"), std::string::npos);
  EXPECT_NE(testutil::grpo_args_error({"--lora-rank", "4", "--algorithm", "ppo"}).find("the critic has no LoRA form"), std::string::npos);
  EXPECT_NE(testutil::grpo_args_error({"--recompute", "some"}).find("--recompute"), std::string::npos);
  EXPECT_NE(testutil::grpo_args_error({"--lora-rank", "-1"}).find("--lora-rank"), std::string::npos);
}
