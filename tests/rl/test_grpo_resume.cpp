// `moetrain grpo --resume` (CPU, fp32, the real binary): N steps straight equal N/2 steps, a save, a new
// process and --resume to N: the same per-step metrics after the resume point and byte-identical final
// weights, for GRPO and for PPO (the critic's state too); a corrupt newest checkpoint is reported and the
// previous good one used; a changed reference model stops the resume; the cosine learning rate (--min-lr).
#include <gtest/gtest.h>

#include <csignal>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <regex>

#include "parallel/launch_test_util.h"
#include "process_test_util.h"

using namespace mt::test;
namespace fs = std::filesystem;

namespace {

std::string read_bytes(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  EXPECT_TRUE(f.good()) << path;
  return std::string(std::istreambuf_iterator<char>(f), {});
}

// Prompts and a reward program whose rewards differ between samples (the length of the request line),
// so the policy (and the critic) really move.
std::string setup(const std::string& tag) {
  const std::string d = tmp_path("grporesume", tag);
  fs::remove_all(d);  // a reused process id may have left an earlier run's directories here
  fs::create_directories(d);
  std::ofstream(d + "/p.jsonl") << "{\"prompt_ids\": [1, 2, 3]}\n{\"prompt_ids\": [5, 6, 7, 8]}\n"
                                   "{\"prompt_ids\": [9, 10]}\n{\"prompt_ids\": [11, 12, 13, 14, 15]}\n"
                                   "{\"prompt_ids\": [20, 21, 22]}\n";
  std::ofstream(d + "/score.sh") << "#!/bin/sh\nwhile IFS= read -r line; do echo $(( ${#line} * 7 % 11 )); done\n";
  fs::permissions(d + "/score.sh", fs::perms::owner_all);
  return d;
}

std::string grpo(const std::string& d, const std::string& run, const std::string& extra) {
  return kMoetrainBin + " grpo --device cpu --model " + kGoldens + "/tiny --prompts " + d +
         "/p.jsonl --reward program:" + d +
         "/score.sh --max-new-tokens 4 --steps 4 --prompts-per-step 2 --n 3 --lr 1e-2 --warmup-steps 2 "
         "--temperature 1.0 --kl-coef 0.01 --run-dir " +
         d + "/" + run + " " + extra;
}

// The step lines without their timings (the seconds and every phase's *_tokens_per_s).
std::vector<nlohmann::json> steps_of(const std::string& metrics) {
  std::vector<nlohmann::json> v = read_step_metrics(metrics);
  for (auto& j : v) {
    std::vector<std::string> timings = {"time_s", "elapsed_s"};
    for (const auto& [k, value] : j.items())
      if (k.ends_with("_tokens_per_s")) timings.push_back(k);
    for (const std::string& k : timings) j.erase(k);
  }
  return v;
}

void expect_same_run(const std::string& a, const std::string& b, int64_t steps, bool critic) {
  const auto sa = steps_of(a + "/metrics.jsonl"), sb = steps_of(b + "/metrics.jsonl");
  ASSERT_EQ(sa.size(), size_t(steps));
  ASSERT_EQ(sb.size(), size_t(steps));
  for (size_t i = 0; i < sa.size(); ++i) EXPECT_EQ(sa[i], sb[i]) << "step " << i + 1;
  bool moved = false;  // the test means something only when the policy trains
  for (const auto& j : sa) moved = moved || j.at("grad_norm").get<double>() > 0;
  EXPECT_TRUE(moved);
  const std::string ck = "/checkpoint-" + std::to_string(steps);
  std::vector<std::string> files = {"/model.safetensors", "/train_state/rank-0.safetensors"};
  if (critic) files.push_back("/critic/train_state/rank-0.safetensors");
  for (const std::string& f : files)
    EXPECT_TRUE(read_bytes(a + ck + f) == read_bytes(b + ck + f)) << a + ck + f << " and " << b + ck + f << " differ";
}

}  // namespace

TEST(GrpoResume, StraightEqualsSaveAndResume) {
  const std::string d = setup("grpo");
  ShellRun r = sh(grpo(d, "straight", ""));
  ASSERT_EQ(r.code, 0) << r.out;
  r = sh(grpo(d, "split", "--max-steps 2"));
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_TRUE(fs::exists(d + "/split/checkpoint-2/manifest.json"));
  r = sh(grpo(d, "split", "--resume"));
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("resume: step 2 from"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("prompt sampler position 6"), std::string::npos) << r.out;
  expect_same_run(d + "/straight", d + "/split", 4, false);
}

// --min-lr: train's schedule (train/lr_schedule.h): a linear warm-up (steps 1, 2 of --warmup-steps 2), then a cosine
// from --lr at the first step after the warm-up down to --min-lr at the last step, the same across a save and
// --resume; a bad value is refused before any work.
TEST(GrpoResume, CosineLearningRateFollowsItsScheduleAcrossAResume) {
  const std::string d = setup("cosine");
  ShellRun r = sh(grpo(d, "straight", "--min-lr 1e-3"));
  ASSERT_EQ(r.code, 0) << r.out;
  const auto steps = read_step_metrics(d + "/straight/metrics.jsonl");
  ASSERT_EQ(steps.size(), 4u);
  // lr 1e-2, warm-up 2 of 4 steps: 5e-3, 1e-2, then 1e-3 + 9e-3 (1 + cos(pi p)) / 2 at p = 0 and 1: 1e-2, 1e-3.
  const double want[4] = {5e-3, 1e-2, 1e-2, 1e-3};
  for (size_t i = 0; i < 4; ++i) EXPECT_NEAR(steps[i].at("lr").get<double>(), want[i], 1e-12) << "step " << i + 1;
  r = sh(grpo(d, "split", "--min-lr 1e-3 --max-steps 2"));
  ASSERT_EQ(r.code, 0) << r.out;
  r = sh(grpo(d, "split", "--min-lr 1e-3 --resume"));
  ASSERT_EQ(r.code, 0) << r.out;
  expect_same_run(d + "/straight", d + "/split", 4, false);
  r = sh(grpo(d, "bad", "--min-lr 0.5"));
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.out.find("--min-lr 0.5; need 0 <= min-lr <= --lr (0.01)"), std::string::npos) << r.out;
}

TEST(GrpoResume, PpoCriticStraightEqualsSaveAndResume) {
  const std::string d = setup("ppo");
  const std::string ppo = "--algorithm ppo --critic-lr 1e-2 --gamma 0.9";
  ShellRun r = sh(grpo(d, "straight", ppo));
  ASSERT_EQ(r.code, 0) << r.out;
  r = sh(grpo(d, "split", ppo + " --max-steps 2"));
  ASSERT_EQ(r.code, 0) << r.out;
  r = sh(grpo(d, "split", ppo + " --resume"));
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("policy and critic weights"), std::string::npos) << r.out;
  expect_same_run(d + "/straight", d + "/split", 4, true);
  bool critic_moved = false;
  for (const auto& j : steps_of(d + "/straight/metrics.jsonl")) critic_moved = critic_moved || j.at("value_loss") > 0;
  EXPECT_TRUE(critic_moved);
  // Resuming a ppo run without its critic, or a plain run with one, is refused.
  r = sh(grpo(d, "split", "--resume --steps 5"));
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.out.find("holds a critic: resume it with --algorithm ppo"), std::string::npos) << r.out;
}

TEST(GrpoResume, CorruptNewestCheckpointFallsBackToThePreviousGoodOne) {
  const std::string d = setup("corrupt");
  ShellRun r = sh(grpo(d, "straight", ""));
  ASSERT_EQ(r.code, 0) << r.out;
  r = sh(grpo(d, "split", "--save-every 1 --keep-last 2 --max-steps 3"));
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_FALSE(fs::exists(d + "/split/checkpoint-1")) << "keep-last 2";
  {  // one flipped byte in the newest checkpoint's weights
    std::fstream f(d + "/split/checkpoint-3/model.safetensors", std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(-5, std::ios::end);
    f.put('\x7f');
  }
  r = sh(grpo(d, "split", "--resume"));
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("resume: not using checkpoint-3"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("resume: step 2 from"), std::string::npos) << r.out;
  expect_same_run(d + "/straight", d + "/split", 4, false);
}

TEST(GrpoResume, AChangedReferenceModelStopsTheResume) {
  const std::string d = setup("ref");
  const std::string model = d + "/model";
  fs::create_directories(model);
  for (const char* f : {"config.json", "model.safetensors"}) fs::copy_file(kGoldens + "/tiny/" + f, model + "/" + f);
  const std::string cmd = kMoetrainBin + " grpo --device cpu --model " + model + " --prompts " + d +
                          "/p.jsonl --reward program:" + d +
                          "/score.sh --max-new-tokens 4 --steps 2 --prompts-per-step 2 --n 2 --run-dir " + d + "/run";
  ShellRun r = sh(cmd + " --max-steps 1");
  ASSERT_EQ(r.code, 0) << r.out;
  { std::ofstream(model + "/model.safetensors", std::ios::app) << "x"; }
  r = sh(cmd + " --resume");
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.out.find("changed since the run started (model.safetensors has"), std::string::npos) << r.out;
  // The built-in task resumes too (its problem draws are replayed).
  r = sh(
      kMoetrainBin + " grpo --device cpu --model " + kGoldens +
      "/tiny --steps 3 --prompts-per-step 2 --n 2 --max-digits 2 --eval-problems 4 --dynamic-sampling off --run-dir " +
      d + "/task --max-steps 2");
  ASSERT_EQ(r.code, 0) << r.out;
  r = sh(
      kMoetrainBin + " grpo --device cpu --model " + kGoldens +
      "/tiny --steps 3 --prompts-per-step 2 --n 2 --max-digits 2 --eval-problems 4 --dynamic-sampling off --run-dir " +
      d + "/task --resume");
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("4 task problems drawn"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("held-out problems"), std::string::npos) << r.out;
}

// Ctrl-C ends `moetrain grpo` after the step in progress: that step is saved as a checkpoint, the log says
// where and how to resume, the exit code is 130, and `--resume` continues it to the end, equal to the run
// that was never stopped. keep-last's default (2) leaves the two newest checkpoints.
TEST(GrpoResume, CtrlCSavesTheStepAndTheResumeFinishesTheRunAsIfUninterrupted) {
  const std::string d = setup("sigint");
  ShellRun r = sh(grpo(d, "straight", "--steps 40 --save-every 1"));
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_TRUE(fs::exists(d + "/straight/checkpoint-40")) << "the last";
  EXPECT_TRUE(fs::exists(d + "/straight/checkpoint-39")) << "and the one before";
  EXPECT_FALSE(fs::exists(d + "/straight/checkpoint-38")) << "keep-last 2 by default";
  const std::string log = tmp_path("grporesume", "sigint.log");
  const Interrupted run =
      interrupt_when(grpo(d, "split", "--steps 40 --save-every 1"), log, std::regex("grpo: step 2/40 "));
  ASSERT_TRUE(run.reached) << run.log;
  EXPECT_EQ(run.code, 130) << run.log;
  std::smatch m;
  const std::string& out = run.log;
  ASSERT_TRUE(std::regex_search(out, m,
                                std::regex("grpo: stopped by SIGINT after step ([0-9]+); saved (\\S+); resume "
                                           "with the same command and --resume")))
      << out;
  const int64_t n = std::stoll(m[1].str());
  EXPECT_LT(n, 40);
  EXPECT_EQ(m[2].str(), d + "/split/checkpoint-" + std::to_string(n));
  EXPECT_TRUE(fs::exists(m[2].str() + "/manifest.json"));
  r = sh(grpo(d, "split", "--steps 40 --save-every 1 --resume"));
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("resume: step " + std::to_string(n) + " from"), std::string::npos) << r.out;
  expect_same_run(d + "/straight", d + "/split", 40, false);
}
