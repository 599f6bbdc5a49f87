// `moetrain grpo` end to end on a small model (the real binary, CPU): it evaluates, runs its steps with
// one metrics line each (every metric the issue lists), saves a checkpoint and ends with the summary
// line; bad options are errors before any work (none of these runs loads or trains a model).
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <fstream>

#include "parallel/launch_test_util.h"

using namespace mt::test;

TEST(GrpoCli, RunsStepsWritesMetricsAndTheSummaryLine) {
  const std::string out = tmp_path("grpocli", "run");
  ShellRun r =
      sh(kMoetrainBin + " grpo --device cpu --model " + kGoldens +
         "/tiny --steps 3 --prompts-per-step 2 --n 2 --min-digits 1 --max-digits 2 --eval-problems 8 --epochs 2 "
         "--mini-batches 2 --temperature 0.8 --kl-coef 0.01 --dynamic-sampling off --out-dir " +
         out);
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("grpo: exact-match "), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("% on 8 held-out problems"), std::string::npos) << r.out;
  std::ifstream f(out + "/metrics.jsonl");
  std::string line;
  int lines = 0;
  // Every metric the issue lists, on every step's line.
  const char* keys[] = {"\"reward_mean\"",
                        "\"reward_std\"",
                        "\"reward_max\"",
                        "\"groups_with_reward\"",
                        "\"groups_zero_variance\"",
                        "\"groups_correct\"",
                        "\"response_len_mean\"",
                        "\"response_len_min\"",
                        "\"response_len_max\"",
                        "\"response_len_terminated_mean\"",
                        "\"overlong_fraction\"",
                        "\"clip_low\"",
                        "\"clip_high\"",
                        "\"clip_region\"",
                        "\"clip_dual\"",
                        "\"approx_kl\"",
                        "\"ref_kl\"",
                        "\"ref_kl_update\"",
                        "\"entropy\"",
                        "\"policy_loss\"",
                        "\"kl_loss\"",
                        "\"grad_norm\"",
                        "\"advantage_mean\"",
                        "\"advantage_std\"",
                        "\"rollout_tokens_per_s\"",
                        "\"logprob_tokens_per_s\"",
                        "\"ref_logprob_tokens_per_s\"",
                        "\"train_tokens_per_s\"",
                        "\"critic_values_tokens_per_s\"",
                        "\"critic_update_tokens_per_s\"",
                        "\"generate\"",
                        "\"reward\"",
                        "\"logprob\"",
                        "\"update\"",
                        "\"weight_sync\"",
                        "\"logprob_diff_mean\"",
                        "\"logprob_diff_max\"",
                        "\"importance_weight_mean\"",
                        "\"importance_weight_min\"",
                        "\"importance_weight_max\"",
                        "\"generate_rounds\""};
  while (std::getline(f, line)) {
    if (line.find("\"reward_mean\"") == std::string::npos) continue;
    ++lines;
    for (const char* k : keys) EXPECT_NE(line.find(k), std::string::npos) << k << " in " << line;
    EXPECT_NE(line.find("\"updates\":4"), std::string::npos) << "2 epochs x 2 mini-batches: " << line;
  }
  EXPECT_EQ(lines, 3);
  // The step line carries the comparison set (no critic here: its throughput is left out).
  for (const char* part : {" (zero-std groups ", " | clip ", " entropy ", " len ", " clipped ", " kl(ref) ",
                           " |dlogp| ", " ratio ", " | tokens/s generate ", " logprob ", " ref ", " update "})
    EXPECT_NE(r.out.find(part), std::string::npos) << part << " in " << r.out;
  EXPECT_EQ(r.out.find(" critic values "), std::string::npos) << r.out;
  for (const nlohmann::json& j : read_step_metrics(out + "/metrics.jsonl")) {
    EXPECT_GT(j.at("ref_logprob_tokens_per_s").get<double>(), 0) << j;
    EXPECT_EQ(j.at("critic_values_tokens_per_s").get<double>(), 0) << j;
  }
  EXPECT_TRUE(std::filesystem::exists(out + "/checkpoint-3/config.json"));
}

// --algorithm ppo: the critic's metrics on every line, 2 critic steps a step (2 epochs).
TEST(GrpoCli, PpoRunsWithACriticAndReportsTheValueLoss) {
  const std::string out = tmp_path("grpocli", "ppo");
  ShellRun r =
      sh(kMoetrainBin + " grpo --device cpu --algorithm ppo --model " + kGoldens +
         "/tiny --steps 2 --prompts-per-step 2 --n 2 --min-digits 1 --max-digits 2 --eval-problems 8 "
         "--epochs 2 --critic-lr 1e-3 --gamma 0.99 --lam 0.9 --value-clip 0.5 --dynamic-sampling off --out-dir " +
         out);
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("PPO: critic lr"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find(" value loss "), std::string::npos) << r.out;
  std::ifstream f(out + "/metrics.jsonl");
  std::string line;
  int lines = 0;
  while (std::getline(f, line)) {
    if (line.find("\"reward_mean\"") == std::string::npos) continue;
    ++lines;
    for (const char* k : {"\"value_loss\"", "\"value_mean\"", "\"explained_variance\"", "\"value_clip_frac\"",
                          "\"critic_update\"", "\"critic_values_tokens_per_s\"", "\"critic_update_tokens_per_s\""})
      EXPECT_NE(line.find(k), std::string::npos) << k << " in " << line;
    // (The untrained tiny model earns no reward here: returns and values are 0, and so is the value loss.)
    EXPECT_NE(line.find("\"updates\":2"), std::string::npos) << "2 epochs: " << line;
  }
  EXPECT_EQ(lines, 2);
  EXPECT_NE(r.out.find(" critic values "), std::string::npos) << r.out;
  for (const nlohmann::json& j : read_step_metrics(out + "/metrics.jsonl")) {
    EXPECT_GT(j.at("critic_values_tokens_per_s").get<double>(), 0) << j;
    EXPECT_GT(j.at("critic_update_tokens_per_s").get<double>(), 0) << j;
  }
}

// --true-on-policy (the CPU's batch-invariant mode, docs/rl.md): the rollout/trainer log-prob mismatch the step
// measures is exactly 0 at every step; without it, the same run's is not (a few 1e-7).
TEST(GrpoCli, TrueOnPolicyMakesTheRolloutTrainerMismatchZero) {
  double without = 0;
  for (const bool on : {false, true}) {
    const std::string out = tmp_path("grpocli", on ? "top_on" : "top_off");
    const ShellRun r = sh(kMoetrainBin + " grpo --device cpu --model " + kGoldens +
                          "/tiny --steps 3 --prompts-per-step 2 --n 4 --min-digits 1 --max-digits 2 --eval-problems 4 "
                          "--dynamic-sampling off --temperature 1 --run-dir " +
                          out + (on ? " --true-on-policy" : ""));
    ASSERT_EQ(r.code, 0) << r.out;
    EXPECT_EQ(r.out.find("true on-policy (batch-invariant kernels)") != std::string::npos, on) << r.out;
    const std::vector<nlohmann::json> steps = read_step_metrics(out + "/metrics.jsonl");
    ASSERT_EQ(steps.size(), 3u);
    for (const nlohmann::json& j : steps) {
      if (on)
        EXPECT_EQ(j.at("logprob_diff_max").get<double>(), 0.0) << j;
      else
        without = std::max(without, j.at("logprob_diff_max").get<double>());
    }
  }
  EXPECT_GT(without, 0.0) << "the test needs the default mode to differ";
}

// Off-policy under the batch-invariant mode (two epochs of two mini-batches): the rollout's log-probs are the old
// ones and no forward runs before the update, and the run equals the one with that forward
// (--old-logprob-forward on) in every step's loss and gradient norm, bit for bit: the forward's log-probs were the
// rollout's. The entropy is still measured (during the first epoch), the mismatch is 0 in both.
TEST(GrpoCli, TrueOnPolicyOffPolicyUpdateTakesTheRolloutsLogprobs) {
  std::vector<std::vector<nlohmann::json>> runs;
  for (const bool forward : {false, true}) {
    const std::string out = tmp_path("grpocli", forward ? "top_fwd" : "top_skip");
    const ShellRun r = sh(kMoetrainBin + " grpo --device cpu --model " + kGoldens +
                          "/tiny --steps 3 --prompts-per-step 4 --n 4 --min-digits 1 --max-digits 2 --eval-problems 4 "
                          "--dynamic-sampling off --temperature 1 --epochs 2 --mini-batches 2 --true-on-policy "
                          "--old-logprob-forward " +
                          (forward ? "on" : "off") + " --run-dir " + out);
    ASSERT_EQ(r.code, 0) << r.out;
    runs.push_back(read_step_metrics(out + "/metrics.jsonl"));
    ASSERT_EQ(runs.back().size(), 3u);
  }
  for (size_t i = 0; i < 3; ++i) {
    const nlohmann::json &skip = runs[0][i], &fwd = runs[1][i];
    EXPECT_EQ(skip.at("loss").get<double>(), fwd.at("loss").get<double>()) << i;
    EXPECT_EQ(skip.at("grad_norm").get<double>(), fwd.at("grad_norm").get<double>()) << i;
    EXPECT_EQ(skip.at("logprob_tokens_per_s").get<double>(), 0.0) << "no forward before the update";
    EXPECT_GT(fwd.at("logprob_tokens_per_s").get<double>(), 0.0);
    EXPECT_EQ(skip.at("logprob_diff_max").get<double>(), 0.0);
    EXPECT_EQ(fwd.at("logprob_diff_max").get<double>(), 0.0);
    EXPECT_GT(skip.at("entropy").get<double>(), 0.0);
    EXPECT_NEAR(skip.at("entropy").get<double>(), fwd.at("entropy").get<double>(),
                0.05 * fwd.at("entropy").get<double>());
  }
}

// Each --advantage value reaches the loop as itself (`process` once ran as `position`: the default's
// per-position switch stayed on), and the run's first line names it; without it, the task's own (sharpen:
// outcome, extend: position).
TEST(GrpoCli, EachAdvantageModeRunsAsNamed) {
  for (const std::string mode : {"", "outcome", "process", "position", "extend"}) {
    const std::string out = tmp_path("grpocli", "adv" + mode);
    const std::string flag = mode.empty() ? "" : mode == "extend" ? " --task extend" : " --advantage " + mode;
    ShellRun r = sh(kMoetrainBin + " grpo --device cpu --model " + kGoldens +
                    "/tiny --steps 1 --prompts-per-step 2 --n 2 --min-digits 1 --max-digits 2 --eval-problems 4 "
                    "--dynamic-sampling off --out-dir " +
                    out + flag);
    ASSERT_EQ(r.code, 0) << r.out;
    const std::string named = mode.empty() ? "outcome" : mode == "extend" ? "position" : mode;
    EXPECT_NE(r.out.find(", advantages: " + named + ","), std::string::npos) << flag << ": " << r.out;
  }
}

// The task presets: sharpen (the default) and extend set the task, the reward, the temperature and the
// length of the run (ppo its own policy lr); an option given wins over the preset; --task is refused with
// --prompts.
TEST(GrpoCli, TaskPresetsSetTheRecipeAndOptionsWin) {
  struct Case {
    std::string flags, want;
  } cases[] = {
      {"", "operands of 1..2 digits; held-out"},  // sharpen: no "at least one of" (longest off)
      {"", "1500 steps of 2 prompts x 2 samples, lr 0.0002, temperature 1,"},
      {"--algorithm ppo", "1500 steps of 2 prompts x 2 samples, lr 0.0001, temperature 1,"},
      {"--algorithm ppo --lr 3e-4", "lr 0.0003,"},
      {"--task extend", "operands of 1..2 digits, at least one of 2"},
      {"--task extend", "500 steps of 2 prompts x 2 samples, lr 0.0002, temperature 1.5,"},
      {"--task extend --temperature 0.9 --steps 7", "7 steps of 2 prompts x 2 samples, lr 0.0002, temperature 0.9,"},
      {"--lr 1e-05 --longest on", "at least one of 2"},
  };
  for (const Case& c : cases) {
    const std::string out = tmp_path("grpocli", "task");
    ShellRun r = sh(kMoetrainBin + " grpo --device cpu --model " + kGoldens +
                    "/tiny --max-steps 1 --prompts-per-step 2 --n 2 --max-digits 2 --eval-problems 4 --out-dir " + out +
                    " " + c.flags);
    ASSERT_EQ(r.code, 0) << c.flags << ": " << r.out;
    EXPECT_NE(r.out.find(c.want), std::string::npos) << c.flags << ": " << r.out;
  }
  ShellRun r = sh(kMoetrainBin + " grpo --task fourth");
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.out.find("--task 'fourth' is unknown; use sharpen (the default) or extend"), std::string::npos) << r.out;
  r = sh(kMoetrainBin + " grpo --model " + kGoldens + "/tiny --task extend --prompts /nonexistent.jsonl");
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.out.find("--task sets the built-in addition task"), std::string::npos) << r.out;
}

TEST(GrpoCli, BadOptionsAreErrorsBeforeAnyWork) {
  ShellRun r = sh(kMoetrainBin + " grpo --device cpu --model " + kGoldens + "/tiny --n 1");
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.out.find("--n 1; need >= 2"), std::string::npos) << r.out;
  r = sh(kMoetrainBin + " grpo --algo grpo");
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.out.find("unknown option --algo; did you mean --algorithm?"), std::string::npos) << r.out;
  r = sh(kMoetrainBin + " grpo --algorithm ppo-critic");
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.out.find("--algorithm 'ppo-critic'; allowed: one of grpo, dr-grpo, ppo"), std::string::npos) << r.out;
  r = sh(kMoetrainBin + " grpo --critic-lr 1e-3");
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.out.find("set the critic of --algorithm ppo"), std::string::npos) << r.out;
  r = sh(kMoetrainBin + " grpo --algorithm ppo --lam 1.5");
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.out.find("--lam 1.5; need 0..1"), std::string::npos) << r.out;
  r = sh(kMoetrainBin + " grpo --temperature 0");
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.out.find("--temperature 0; need > 0"), std::string::npos) << r.out;
  r = sh(kMoetrainBin + " grpo --kl-estimator k9");
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.out.find("k9"), std::string::npos) << r.out;
  r = sh(kMoetrainBin + " grpo --epochs 0");
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.out.find("--epochs 0; need >= 1"), std::string::npos) << r.out;
  r = sh(kMoetrainBin + " grpo --mini-batches 20 --prompts-per-step 16");
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.out.find("--mini-batches 20 > --prompts-per-step 16"), std::string::npos) << r.out;
  r = sh(kMoetrainBin + " grpo --min-digits 5 --max-digits 4");
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.out.find("--min-digits 5 and --max-digits 4"), std::string::npos) << r.out;
  r = sh(kMoetrainBin + " grpo --kl-coef 0.1 --reference off");
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.out.find("needs the reference model"), std::string::npos) << r.out;
  r = sh(kMoetrainBin + " grpo --dynamic-sampling=maybe");
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.out.find("--dynamic-sampling 'maybe' is not on or off"), std::string::npos) << r.out;
  r = sh(kMoetrainBin + " grpo --overlong-penalty 1 --overlong-buffer 0");
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.out.find("overlong_buffer 0"), std::string::npos) << r.out;
  r = sh(kMoetrainBin + " grpo --reward partial");
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.out.find("--reward 'partial' is unknown; use digits, prefix or exact"), std::string::npos) << r.out;
  r = sh(kMoetrainBin + " grpo --baseline sft");
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.out.find("--baseline sft needs --sft-seconds"), std::string::npos) << r.out;
  r = sh(kMoetrainBin + " grpo --model /nonexistent/dir");
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.out.find("/nonexistent/dir has no config.json"), std::string::npos) << r.out;
}
