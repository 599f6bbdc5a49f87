// Ctrl-C (SIGINT) and SIGTERM stop `moetrain train` and `sft` after the step in progress: that step is
// saved as a complete checkpoint, the log says where and gives the command that resumes it, the command
// exits 128 + the signal, and that command continues the run exactly. In-process (a hook raises the signal
// after a step), through the binary (SIGINT after its first step line), and under `moetrain launch` (every
// rank stops at the same step). Also the warm-up clamp under launch, the command that used to be refused.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <csignal>
#include <filesystem>
#include <fstream>
#include <regex>
#include <thread>

#include "cli/commands.h"
#include "core/interrupt.h"
#include "io/manifest.h"
#include "parallel/launch_test_util.h"
#include "process_test_util.h"
#include "train/checkpoint.h"
#include "train/sft.h"
#include "train/trainer.h"

using namespace mt;
using namespace mt::test;
namespace fs = std::filesystem;

namespace {

std::string fresh(const std::string& name) {
  const std::string d = tmp_path("stop", name);
  fs::remove_all(d);
  return d;
}

// The tiny model on the CPU, `steps` steps of 2 micro-batches of 2 x 32 tokens.
std::vector<std::string> tiny_args(const std::string& run_dir, int steps) {
  std::vector<std::string> a = {"--run-dir", run_dir, "--steps", std::to_string(steps)};
  for (const char* kv : {"--model=tiny", "--device=cpu", "--micro-batch-size=2", "--grad-accum=2", "--seq-len=32",
                         "--warmup-steps=1", "--eval-problems=0", "--tensorboard=0", "--threads=1"})
    a.push_back(kv);
  return a;
}

// A hook that raises `sig` after step `at`.
RunOptions raise_after(int64_t at, int sig) {
  RunOptions ro;
  ro.after_step = [at, sig](int64_t step) {
    if (step == at) std::raise(sig);
  };
  return ro;
}

// Runs f with stderr captured (the log), the stop flag cleared before and after.
template <class F>
std::string with_log(F&& f) {
  reset_stop_for_tests();
  testing::internal::CaptureStderr();
  f();
  std::string log = testing::internal::GetCapturedStderr();
  reset_stop_for_tests();
  return log;
}

}  // namespace

TEST(TrainStop, SigintFinishesTheStepSavesItAndItsResumeCommandContinuesExactly) {
  const std::string d = fresh("train");
  int rc = -1;
  std::string log = with_log([&] { rc = train_main(tiny_args(d, 6), raise_after(3, SIGINT)); });
  EXPECT_EQ(rc, 130);
  EXPECT_NE(log.find("train: stopped by SIGINT after step 3; saved " + d +
                     "/checkpoint-3; resume with: moetrain train "
                     "--config " +
                     d + "/train_config.json --resume latest"),
            std::string::npos)
      << log;
  // The step in progress was finished and saved, complete; nothing after it ran.
  EXPECT_EQ(list_checkpoints(d), std::vector<int64_t>{3});
  EXPECT_EQ(verify_manifest(d + "/checkpoint-3"), "");
  const nlohmann::json st = read_train_state(d + "/checkpoint-3");
  EXPECT_EQ(st["step"], 3);
  EXPECT_EQ(st["optimizer_steps"], 3);
  EXPECT_EQ(read_step_metrics(d + "/metrics.jsonl").size(), 3u);

  // The resume command's flags continue to the end: the weights of the run that was never stopped.
  TrainSummary rest;
  log = with_log([&] {
    rest = run_training(train_config_from_args({"--config", d + "/train_config.json", "--resume", "latest"}));
  });
  EXPECT_NE(log.find("resume: step 3 from " + d + "/checkpoint-3"), std::string::npos) << log;
  EXPECT_EQ(rest.steps, 6);
  EXPECT_EQ(rest.stop_signal, 0);
  const std::string w = fresh("train_whole");
  TrainSummary whole;
  with_log([&] { whole = run_training(train_config_from_args(tiny_args(w, 6))); });
  EXPECT_NE(whole.checkpoint_digest, 0u);
  EXPECT_EQ(rest.checkpoint_digest, whole.checkpoint_digest);

  // SIGTERM too (128 + 15); after the last step there is nothing to resume and the log says so.
  const std::string t = fresh("term");
  log = with_log([&] { rc = train_main(tiny_args(t, 2), raise_after(2, SIGTERM)); });
  EXPECT_EQ(rc, 128 + SIGTERM);
  EXPECT_NE(log.find("train: stopped by SIGTERM after the last step (2); saved " + t + "/checkpoint-2"),
            std::string::npos)
      << log;
  EXPECT_EQ(verify_manifest(t + "/checkpoint-2"), "");
  for (const std::string& x : {d, w, t}) fs::remove_all(x);
}

// sft runs the trainer: the same stop, its line and resume command name sft, and the resumed run ends
// with the weights of the run that was never stopped.
TEST(TrainStop, SftStopsSavesAndResumesByItsOwnCommand) {
  const std::string src = MT_SOURCE_DIR;
  auto args = [&](const std::string& dir) {
    return std::vector<std::string>{"--model",
                                    "tiny",
                                    "--tokenizer",
                                    src + "/tests/assets/tokenizer/trained/tokenizer.json",
                                    "--data",
                                    src + "/examples/chat_small.jsonl",
                                    "--out-dir",
                                    dir,
                                    "--device",
                                    "cpu",
                                    "--steps",
                                    "4",
                                    "--seq-len",
                                    "128",
                                    "--micro-batch-size",
                                    "2",
                                    "--warmup-steps",
                                    "1",
                                    "--lr",
                                    "3e-3",
                                    "--min-lr",
                                    "3e-4",
                                    "--tensorboard",
                                    "0",
                                    "--threads",
                                    "1"};
  };
  const std::string d = fresh("sft");
  int rc = -1;
  std::string log = with_log([&] { rc = sft_main(args(d), raise_after(2, SIGINT)); });
  EXPECT_EQ(rc, 130);
  EXPECT_NE(log.find("sft: stopped by SIGINT after step 2; saved " + d +
                     "/checkpoint-2; resume with: moetrain sft "
                     "--config " +
                     d + "/train_config.json --resume latest"),
            std::string::npos)
      << log;
  EXPECT_EQ(verify_manifest(d + "/checkpoint-2"), "");
  log = with_log([&] { rc = sft_main({"--config", d + "/train_config.json", "--resume", "latest"}); });
  EXPECT_EQ(rc, 0) << log;
  EXPECT_NE(log.find("resume: step 2 from " + d + "/checkpoint-2"), std::string::npos) << log;
  const std::string w = fresh("sft_whole");
  with_log([&] { rc = sft_main(args(w)); });
  EXPECT_EQ(rc, 0);
  EXPECT_EQ(read_text(d + "/checkpoint-4/model.safetensors"), read_text(w + "/checkpoint-4/model.safetensors"));
  fs::remove_all(d);
  fs::remove_all(w);
}

// The binary, as a user runs it: Ctrl-C after the first step line; the printed command resumes it.
TEST(TrainStop, CtrlCOnTheBinaryExits130WithACheckpointAndTheResumeCommand) {
  const std::string d = fresh("bin"), log = tmp_path("stop", "bin.log");
  std::string cmd = kMoetrainBin + " train";
  for (const std::string& a : tiny_args(d, 200)) cmd += " " + a;
  const Interrupted run = interrupt_when(cmd, log, std::regex("step 1/200 \\|"));
  ASSERT_TRUE(run.reached) << run.log;
  EXPECT_EQ(run.code, 130) << run.log;
  const std::string& out = run.log;
  std::smatch m;
  ASSERT_TRUE(std::regex_search(out, m,
                                std::regex("train: stopped by SIGINT after step ([0-9]+); saved (\\S+); resume "
                                           "with: (moetrain train --config \\S+ --resume latest)\n")))
      << out;
  const int64_t n = std::stoll(m[1].str());
  EXPECT_LT(n, 200);
  EXPECT_EQ(m[2].str(), d + "/checkpoint-" + std::to_string(n));
  EXPECT_EQ(verify_manifest(m[2].str()), "");
  EXPECT_EQ(read_train_state(m[2].str())["step"], n);
  const ShellRun r =
      sh(kMoetrainBin + m[3].str().substr(std::string("moetrain").size()) + " --max-steps " + std::to_string(n + 2));
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("resume: step " + std::to_string(n) + " from " + m[2].str()), std::string::npos) << r.out;
  EXPECT_EQ(read_train_state(d + "/checkpoint-" + std::to_string(n + 2))["step"], n + 2);
  fs::remove_all(d);
}

// Under `moetrain launch` the launcher forwards the signal to every rank; they agree on the step (one
// all-reduce per step), each saves its shard of it and exits 130, and so does the launcher.
TEST(TrainStop, UnderLaunchEveryRankStopsAtTheSameStepAndSavesIt) {
  MT_SKIP_WITHOUT_GLOO();
  const std::string d = fresh("launch"), log = tmp_path("stop", "launch.log");
  std::string cmd = kMoetrainBin + " launch --nproc-per-node 2 --grace-s 60 -- train --dp-shard 2";
  for (const std::string& a : tiny_args(d, 2000)) cmd += " " + a;
  const Interrupted run = interrupt_when(cmd, log, std::regex("\\[rank 0\\].*step 1/2000 \\|"));
  ASSERT_TRUE(run.reached) << run.log;
  EXPECT_EQ(run.code, 130) << run.log;
  const std::string& out = run.log;
  std::smatch m;
  ASSERT_TRUE(std::regex_search(out, m,
                                std::regex("train: stopped by SIGINT after step ([0-9]+); saved (\\S+); resume "
                                           "with: moetrain launch --nproc-per-node 2 -- train --config \\S+ "
                                           "--resume latest\n")))
      << out;
  for (int r = 0; r < 2; ++r)
    EXPECT_TRUE(
        std::regex_search(out, std::regex("rank " + std::to_string(r) + " \\(pid [0-9]+\\) exited with code 130")))
        << out;
  const std::string ckpt = m[2].str();
  EXPECT_EQ(verify_manifest(ckpt), "");
  EXPECT_EQ(read_train_state(ckpt)["step"], std::stoll(m[1].str()));
  for (int r = 0; r < 2; ++r)
    EXPECT_TRUE(fs::exists(ckpt + "/train_state/rank-" + std::to_string(r) + ".safetensors")) << r;
  fs::remove_all(d);
}

// The command that was refused (the default warm-up of 100 over 20 steps) runs, warming up over all 20.
TEST(TrainStop, WarmupLongerThanTheRunIsClampedUnderLaunch) {
  MT_SKIP_WITHOUT_GLOO();
  const std::string d = fresh("warmup");
  const ShellRun r = sh(kMoetrainBin +
                        " launch --nproc-per-node 2 -- train --dp-shard 2 --steps 20 --eval-problems 20"
                        " --threads 1 --tensorboard 0 --run-dir " +
                        d);
  ASSERT_EQ(r.code, 0) << r.out;
  const std::string note = "train: warmup_steps 100 > steps 20; warming up over all 20 steps";
  const size_t at = r.out.find(note);
  EXPECT_NE(at, std::string::npos) << r.out;
  EXPECT_EQ(r.out.find(note, at + 1), std::string::npos) << "rank 0 says it once";
  const std::vector<nlohmann::json> steps = read_step_metrics(d + "/metrics.jsonl");
  ASSERT_EQ(steps.size(), 20u);
  EXPECT_DOUBLE_EQ(steps[0]["lr"].get<double>(), 7e-4 / 20);  // warming up over 20 steps, to the peak
  EXPECT_DOUBLE_EQ(steps[19]["lr"].get<double>(), 7e-4);
  EXPECT_EQ(read_train_state(d + "/checkpoint-20")["lr_schedule"]["warmup_steps"], 20);
  fs::remove_all(d);
}
