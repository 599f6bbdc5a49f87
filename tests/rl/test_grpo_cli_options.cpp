// `moetrain grpo` options that once did not do what they said (the real binary, the tiny golden model, one
// step each, well under a second): each test fails on the code before its fix.
#include <gtest/gtest.h>

#include <cctype>
#include <filesystem>
#include <string>

#include "parallel/launch_test_util.h"

using namespace mt::test;

namespace {

// One step on the built-in task with `extra` options.
ShellRun grpo(const std::string& tag, const std::string& extra) {
  return sh(kMoetrainBin + " grpo --device cpu --model " + kGoldens +
            "/tiny --steps 1 --prompts-per-step 2 --n 2 --min-digits 1 --max-digits 2 --eval-problems 4 "
            "--dynamic-sampling off --out-dir " +
            tmp_path("grpoclioptions", tag) + " " + extra);
}

}  // namespace

// The soft overlong penalty is added to the sample's reward, which per-token advantages (position, the extend
// task's default, and process) never read: it once ran and changed nothing but the reward metrics.
TEST(GrpoCliOptions, OverlongPenaltyNeedsOutcomeAdvantages) {
  for (const std::string adv : {"--task extend", "--advantage position", "--advantage process"}) {
    const ShellRun r = grpo("overlong", "--overlong-penalty 1 --overlong-buffer 2 " + adv);
    EXPECT_NE(r.code, 0) << adv << ": " << r.out;
    EXPECT_NE(r.out.find("--overlong-penalty 1 shapes the sample's reward, which --advantage "), std::string::npos)
        << adv << ": " << r.out;
    EXPECT_EQ(r.out.find("grpo: step 1/1"), std::string::npos) << "refused before any work: " << r.out;
  }
  for (const std::string adv : {"", "--advantage outcome", "--task extend --advantage outcome"}) {
    const ShellRun ok = grpo("overlong_outcome", "--overlong-penalty 1 --overlong-buffer 2 " + adv);
    EXPECT_EQ(ok.code, 0) << adv << ": " << ok.out;
  }
}

// --algorithm given twice: the last one runs (grpo or dr-grpo after ppo once still ran PPO with a critic).
TEST(GrpoCliOptions, TheLastAlgorithmGivenIsTheOneThatRuns) {
  ShellRun r = grpo("algo_last_grpo", "--algorithm ppo --algorithm grpo");
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_EQ(r.out.find("PPO: critic"), std::string::npos) << r.out;
  EXPECT_EQ(r.out.find(" value loss "), std::string::npos) << r.out;
  r = grpo("algo_last_dr", "--algorithm ppo --algorithm dr-grpo --critic-lr 1e-3");
  EXPECT_NE(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("set the critic of --algorithm ppo"), std::string::npos) << r.out;
  r = grpo("algo_last_ppo", "--algorithm grpo --algorithm ppo");
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("PPO: critic"), std::string::npos) << r.out;
}

// Under ppo the advantages are GAE's over the critic's values: --advantage position and process (group
// estimators) both ran as the same per-token rewards into GAE, and the first line named the estimator that
// did not run. They are refused there; the first line says what runs.
TEST(GrpoCliOptions, PpoNamesItsAdvantagesAndRefusesTheGroupEstimators) {
  for (const std::string adv : {"position", "process"}) {
    const ShellRun r = grpo("ppo_adv", "--algorithm ppo --advantage " + adv);
    EXPECT_NE(r.code, 0) << adv << ": " << r.out;
    EXPECT_NE(r.out.find("--advantage " + adv + " is a group estimator; under --algorithm ppo"), std::string::npos)
        << r.out;
  }
  ShellRun r = grpo("ppo_default", "--algorithm ppo");  // sharpen: one reward per sample
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find(", advantages: GAE on the outcome reward,"), std::string::npos) << r.out;
  r = grpo("ppo_extend", "--algorithm ppo --task extend");  // extend: a reward per answer digit
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find(", advantages: GAE on per-token rewards,"), std::string::npos) << r.out;
  r = grpo("ppo_outcome", "--algorithm ppo --advantage outcome");
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find(", advantages: GAE on the outcome reward,"), std::string::npos) << r.out;
}

// Options that refine another option, given without it, once ran and did nothing; each is now an error that
// names the option it needs.
TEST(GrpoCliOptions, AnOptionWithoutTheOneItRefinesIsAnError) {
  const std::pair<std::string, std::string> cases[] = {
      {"--reward-timeout 5", "--reward-timeout sets the reward program's"},
      {"--reward-on-error stop", "--reward-on-error sets the reward program's"},
      {"--tis-level sequence", "--tis-level chooses the level of truncated importance sampling"},
      {"--overlong-buffer 2", "--overlong-buffer is the soft overlong penalty's buffer"},
      {"--max-generate-rounds 8", "--max-generate-rounds caps dynamic sampling's generate rounds"},
      {"--loss pg --clip-low 0.1", "--clip-low clips the policy ratio; --loss pg"},
      {"--loss pg --clip-high 0.5", "--clip-high clips the policy ratio; --loss pg"},
      {"--loss pg --dual-clip 3", "--dual-clip clips the policy ratio; --loss pg"},
  };
  for (const auto& [opts, want] : cases) {
    const ShellRun r = grpo("refine", opts);  // dynamic sampling is off in grpo()
    EXPECT_NE(r.code, 0) << opts << ": " << r.out;
    EXPECT_NE(r.out.find(want), std::string::npos) << opts << ": " << r.out;
  }
  // With the option each refines, they run.
  for (const std::string opts :
       {"--tis-cap 2 --tis-level sequence", "--dynamic-sampling on --max-generate-rounds 2",
        "--advantage outcome --overlong-penalty 1 --overlong-buffer 2", "--loss gspo --clip-low 0.1 --dual-clip 3"}) {
    const ShellRun r = grpo("refine_ok", opts);
    EXPECT_EQ(r.code, 0) << opts << ": " << r.out;
  }
}

// --loss gspo once stopped at the first update ("the micro-batch carries 4 token values; this loss needs 5"):
// the loop never gave the objective each token's sample, which GSPO's sequence ratio groups by.
TEST(GrpoCliOptions, GspoLossRunsItsUpdates) {
  for (const std::string adv : {"--advantage outcome", "--advantage position --reference off"}) {
    const ShellRun r = grpo("gspo", "--loss gspo --epochs 2 " + adv);
    EXPECT_EQ(r.code, 0) << adv << ": " << r.out;
    EXPECT_NE(r.out.find("grpo: step 1/1 "), std::string::npos) << adv << ": " << r.out;
  }
}

// --kl-estimator picks how the KL to the reference is measured (the metric, the loss term, the reward term);
// with --reference off there is none, and it once ran ignored.
TEST(GrpoCliOptions, KlEstimatorNeedsTheReference) {
  ShellRun r = grpo("klest", "--reference off --kl-estimator k1");
  EXPECT_NE(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("--kl-estimator measures the KL to the reference model, which --reference off drops"),
            std::string::npos)
      << r.out;
  r = grpo("klest_ok", "--kl-estimator k1");
  EXPECT_EQ(r.code, 0) << r.out;
}

// A mask band whose HIGH is 0 or below once turned the mask off without a word (the loop reads high <= 0 as
// "off"), whatever LOW said.
TEST(GrpoCliOptions, AMaskBandNeedsLowBelowHigh) {
  for (const std::string opts : {"--token-mask 0.5,0", "--seq-mask 0.5,-1", "--token-mask 2,0.5"}) {
    const ShellRun r = grpo("mask", opts);
    EXPECT_NE(r.code, 0) << opts << ": " << r.out;
    EXPECT_NE(r.out.find("; need 0 <= LOW < HIGH"), std::string::npos) << opts << ": " << r.out;
  }
  const ShellRun ok = grpo("mask_ok", "--token-mask 0.5,2 --seq-mask 0.8,1.25");
  EXPECT_EQ(ok.code, 0) << ok.out;
}

// A resume may leave --model out (the run's model directory is recorded and checked on its own), but the
// recorded command line still held it, so such a resume warned that the options differed.
TEST(GrpoCliOptions, AResumeWithoutModelDoesNotWarnOfChangedOptions) {
  const std::string dir = tmp_path("grpoclioptions", "resume");
  std::filesystem::remove_all(dir);  // a reused process id may have left an earlier run's checkpoints here
  const std::string opts =
      " grpo --device cpu --steps 3 --prompts-per-step 2 --n 2 --min-digits 1 --max-digits 2 --eval-problems 4 "
      "--dynamic-sampling off --run-dir " +
      dir;
  ShellRun r = sh(kMoetrainBin + opts + " --model " + kGoldens + "/tiny --max-steps 1");
  ASSERT_EQ(r.code, 0) << r.out;
  r = sh(kMoetrainBin + opts + " --max-steps 2 --resume");
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("grpo: resume: step 1 from "), std::string::npos) << r.out;
  EXPECT_EQ(r.out.find("options differ"), std::string::npos) << r.out;
  // A changed option still warns.
  r = sh(kMoetrainBin + opts + " --resume --lr 1e-3");
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("grpo: resume: warning: the options differ"), std::string::npos) << r.out;
}

// On a model without MoE layers (a dense Qwen3) there are no routers: --freeze-router on and
// --router-z-loss-coef once ran and did nothing (train already refused router_z_loss_coef there).
TEST(GrpoCliOptions, RouterOptionsNeedMoeLayers) {
  const std::string base = kMoetrainBin + " grpo --device cpu --model " + kGoldens +
                           "/dense_qwen3 --steps 1 --prompts-per-step 2 --n 2 --min-digits 1 --max-digits 2 "
                           "--eval-problems 4 --dynamic-sampling off --out-dir " +
                           tmp_path("grpoclioptions", "dense");
  for (const std::string opts : {"--freeze-router on", "--router-z-loss-coef 0.1"}) {
    const ShellRun r = sh(base + " " + opts);
    EXPECT_NE(r.code, 0) << opts << ": " << r.out;
    EXPECT_NE(r.out.find("has no MoE layers, so no routers"), std::string::npos) << opts << ": " << r.out;
  }
  const ShellRun ok = sh(base + " --freeze-router off");
  EXPECT_EQ(ok.code, 0) << ok.out;
}

// The built-in task's --reward (digits, prefix, exact) reaches the advantages only under --advantage outcome:
// position and process (extend's default) train on the per-token rewards, so there it changes only the
// reward metrics. The help said what each reward scores, not that (docs/rl.md did).
TEST(GrpoCliOptions, HelpSaysTheTaskRewardTrainsOnlyUnderOutcome) {
  const ShellRun r = sh(kMoetrainBin + " grpo --help");
  ASSERT_EQ(r.code, 0) << r.out;
  // The help is wrapped to its width: compare with the whitespace collapsed.
  std::string flat;
  for (char c : r.out)
    if (!(std::isspace(static_cast<unsigned char>(c)) && (flat.empty() || flat.back() == ' ')))
      flat += std::isspace(static_cast<unsigned char>(c)) ? ' ' : c;
  EXPECT_NE(flat.find("the advantages use it under --advantage outcome only, else it is a metric"), std::string::npos)
      << r.out;
}

// GSPO's objective is a mean over sequences: --loss gspo once trained under token-mean (each sequence weighed by
// its length) unless --aggregation said otherwise; it defaults to seq-mean-token-mean now, the run's first line
// names the aggregation, and a given --aggregation still wins. Under --tp or --sp (a rank holds part of each
// sample) it is refused before any work, not at the first update.
TEST(GrpoCliOptions, GspoDefaultsToSequenceMeanAndIsRefusedUnderTpOrSp) {
  ShellRun r = grpo("gspo_agg", "--loss gspo");
  EXPECT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find(", aggregation seq-mean-token-mean"), std::string::npos) << r.out;
  r = grpo("gspo_agg_given", "--loss gspo --aggregation token-mean");
  EXPECT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find(", aggregation token-mean"), std::string::npos) << r.out;
  r = grpo("ppo_agg", "");
  EXPECT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find(", aggregation token-mean"), std::string::npos) << r.out;
  for (const std::string layout : {"--tp 2", "--sp 2"}) {
    r = grpo("gspo_tp", "--loss gspo " + layout);
    EXPECT_NE(r.code, 0) << layout << ": " << r.out;
    EXPECT_NE(r.out.find("its sequence ratio needs each sample's tokens on one rank"), std::string::npos)
        << layout << ": " << r.out;
  }
}
