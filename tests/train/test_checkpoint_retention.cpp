// Checkpoint retention (retain_checkpoints, train/checkpoint.h): keep_last 2 by default leaves the two
// newest; keep_last 0 keeps every checkpoint but only the newest two with their training state, the older
// ones reduced to weights that still verify and load as a Hugging Face model; a resume skips those (and an
// explicit one is an error that says what to do instead), and `--resume latest` continues exactly.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>

#include "io/manifest.h"
#include "model/hf_checkpoint.h"
#include "parallel/fsdp.h"
#include "test_util.h"
#include "train/checkpoint.h"
#include "train/trainer.h"
#include "train/trainer_test_util.h"

using namespace mt;
namespace fs = std::filesystem;

namespace {

// The tiny model, 6 steps (the schedule spans them), a checkpoint after every step.
TrainConfig tiny_saving_every_step(const std::string& name) {
  TrainConfig c = test::tiny_train_run("retain", name, 0);
  c.steps = 6;
  c.save_every = 1;
  c.tensorboard = 0;
  c.threads = 1;
  return c;
}

bool holds_training_state(const std::string& dir) {
  return fs::exists(dir + "/" + kTrainStateFile) && fs::is_directory(dir + "/" + kTrainStateDir);
}

void flip_byte(const std::string& path, size_t at) {
  std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
  f.seekg(std::streamoff(at));
  char b = 0;
  f.read(&b, 1);
  b = char(b ^ 1);
  f.seekp(std::streamoff(at));
  f.write(&b, 1);
}

}  // namespace

TEST(Retention, KeepLastTwoByDefaultLeavesExactlyTheTwoNewest) {
  TrainConfig c = tiny_saving_every_step("keep2");
  c.max_steps = 5;
  ASSERT_EQ(c.keep_last, 2);  // the default
  run_training(c);
  EXPECT_EQ(list_checkpoints(c.out_dir), (std::vector<int64_t>{5, 4}));
  for (int64_t s : {5, 4}) {
    const std::string dir = checkpoint_dir(c.out_dir, s);
    EXPECT_EQ(verify_manifest(dir), "") << s;
    EXPECT_TRUE(holds_training_state(dir)) << s;
    EXPECT_FALSE(is_weights_only(dir)) << s;
  }
  fs::remove_all(c.out_dir);
}

TEST(Retention, KeepAllReducesTheOlderOnesToWeightsAndResumeLatestContinuesExactly) {
  TrainConfig c = tiny_saving_every_step("keepall");
  c.keep_last = 0;
  c.max_steps = 4;
  run_training(c);
  const std::string& d = c.out_dir;
  ASSERT_EQ(list_checkpoints(d), (std::vector<int64_t>{4, 3, 2, 1}));
  for (int64_t s : {4, 3}) EXPECT_TRUE(holds_training_state(checkpoint_dir(d, s))) << s;
  for (int64_t s : {2, 1}) {
    const std::string dir = checkpoint_dir(d, s);
    EXPECT_TRUE(is_weights_only(dir)) << s;
    EXPECT_FALSE(fs::exists(dir + "/" + kTrainStateFile)) << s;
    EXPECT_FALSE(fs::exists(dir + "/" + kTrainStateDir)) << s;
    EXPECT_EQ(verify_manifest(dir, /*check_hashes=*/true), "") << s;  // the rewritten manifest vouches for what is left
    // A Hugging Face model directory still: config and weights load.
    const ModelConfig mc = load_model_config(dir);
    ParamTable t(mc);
    Tensor flat = Tensor::zeros({t.total()});
    EXPECT_GT(load_hf_weights(dir, mc, t, flat).tensors, 10u) << s;
  }
  // Naming a weights-only checkpoint is an error that says why and what to do instead.
  const std::string two = checkpoint_dir(d, 2);
  const std::string want = two +
                           " holds weights only (its training state was dropped as an older checkpoint); resume from " +
                           checkpoint_dir(d, 4) + " or start a new run with --init-from " + two;
  EXPECT_EQ(testutil::error_of([&] { find_resume_checkpoint(d, two); }), want);
  TrainConfig named = c;
  named.resume = two;
  EXPECT_EQ(testutil::error_of([&] { run_training(named); }), want);

  // --resume latest: from checkpoint-4 to the end, the weights of the run that never stopped.
  TrainConfig rest = c;
  rest.max_steps = 0;
  rest.resume = "latest";
  const TrainSummary resumed = run_training(rest);
  TrainConfig whole = tiny_saving_every_step("keepall_whole");
  const TrainSummary straight = run_training(whole);
  EXPECT_NE(straight.checkpoint_digest, 0u);
  EXPECT_EQ(resumed.checkpoint_digest, straight.checkpoint_digest);
  ASSERT_EQ(list_checkpoints(d), (std::vector<int64_t>{6, 5, 4, 3, 2, 1}));
  for (int64_t s : {6, 5}) EXPECT_TRUE(holds_training_state(checkpoint_dir(d, s))) << s;
  for (int64_t s : {4, 3, 2, 1}) EXPECT_TRUE(is_weights_only(checkpoint_dir(d, s))) << s;

  // A resume that meets weights-only checkpoints skips them, saying why (here the newest two are corrupt).
  flip_byte(checkpoint_dir(d, 6) + "/train_state/rank-0.safetensors", 5000);
  flip_byte(checkpoint_dir(d, 5) + "/train_state/rank-0.safetensors", 5000);
  const ResumePoint rp = find_resume_checkpoint(d, "latest");
  EXPECT_EQ(rp.dir, "");
  ASSERT_EQ(rp.rejected.size(), 6u);
  EXPECT_EQ(rp.rejected[2], "checkpoint-4: holds weights only (its training state was dropped as an older checkpoint)");
  fs::remove_all(d);
  fs::remove_all(whole.out_dir);
}

// The function grpo calls too: what it returns, a reduction cut short finished later, keep_last > 0 deletes.
TEST(Retention, RetainCheckpointsSaysWhatItDidAndFinishesACutShortReduction) {
  TrainConfig c = tiny_saving_every_step("direct");
  c.keep_last = 0;
  c.max_steps = 3;
  run_training(c);
  const std::string& d = c.out_dir;
  EXPECT_TRUE(retain_checkpoints(d, 0).empty());  // already as wanted: 3 and 2 whole, 1 weights only
  EXPECT_EQ(retain_checkpoints(d, 0, /*keep_full=*/1),
            std::vector<std::string>{"reduced " + checkpoint_dir(d, 2) + " to its weights (training state dropped)"});
  EXPECT_TRUE(holds_training_state(checkpoint_dir(d, 3)));
  // A process killed between the manifest's rewrite and the deletions: the next call deletes the rest.
  fs::create_directories(checkpoint_dir(d, 2) + "/train_state");
  std::ofstream(checkpoint_dir(d, 2) + "/train_state.json") << "{}";
  EXPECT_TRUE(retain_checkpoints(d, 0, 1).empty());
  EXPECT_FALSE(fs::exists(checkpoint_dir(d, 2) + "/train_state"));
  EXPECT_FALSE(fs::exists(checkpoint_dir(d, 2) + "/train_state.json"));
  EXPECT_EQ(verify_manifest(checkpoint_dir(d, 2)), "");
  // keep_last 1: the older ones go, whole or weights only.
  EXPECT_EQ(retain_checkpoints(d, 1),
            (std::vector<std::string>{"removed " + checkpoint_dir(d, 2), "removed " + checkpoint_dir(d, 1)}));
  EXPECT_EQ(list_checkpoints(d), std::vector<int64_t>{3});
  fs::remove_all(d);
}
