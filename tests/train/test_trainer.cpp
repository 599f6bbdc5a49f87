// The training loop end to end on the tiny model, and the optimizer's clipping and skip rules.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>
#include <unistd.h>

#include "model/hf_checkpoint.h"
#include "parallel/fsdp.h"
#include "train/optimizer.h"
#include "train/trainer.h"
#include "train/trainer_test_util.h"

using namespace mt;
namespace fs = std::filesystem;

namespace {

TrainConfig tiny_run(const std::string& name) { return test::tiny_train_run("trainer", name, 6); }


std::vector<nlohmann::json> read_jsonl(const std::string& path) {
  std::vector<nlohmann::json> out;
  std::ifstream f(path);
  std::string line;
  while (std::getline(f, line)) out.push_back(nlohmann::json::parse(line));
  return out;
}

}  // namespace

TEST(Trainer, RunsLogsMetricsAndSavesAReloadableCheckpoint) {
  TrainConfig c = tiny_run("basic");
  c.recompute = "full";
  TrainSummary s = run_training(c);
  EXPECT_EQ(s.steps, 4);
  EXPECT_EQ(s.skipped, 0);
  EXPECT_TRUE(std::isfinite(s.first_loss) && std::isfinite(s.last_loss));
  EXPECT_TRUE(s.evaluated);
  EXPECT_EQ(s.eval.problems, 6);
  EXPECT_NE(s.summary_line.find("tiny: loss "), std::string::npos) << s.summary_line;
  EXPECT_NE(s.summary_line.find("on 6 held-out problems"), std::string::npos) << s.summary_line;

  auto rows = read_jsonl(c.out_dir + "/metrics.jsonl");
  ASSERT_EQ(rows.size(), 5u);  // 4 steps + the final evaluation
  for (int i = 0; i < 4; ++i) {
    EXPECT_EQ(rows[size_t(i)]["step"], i + 1);
    for (const char* k : {"loss", "ce", "aux", "grad_norm", "lr", "tokens_per_s"})
      EXPECT_TRUE(rows[size_t(i)].contains(k)) << k;
    EXPECT_EQ(rows[size_t(i)]["tokens"], 2 * 2 * 32);
    EXPECT_GT(double(rows[size_t(i)]["time_s"]["backward"]), 0.0);
  }
  EXPECT_EQ(rows[4]["event"], "eval");
  // warmup 1 step, then cosine from lr to min_lr
  EXPECT_DOUBLE_EQ(double(rows[0]["lr"]), c.lr);
  EXPECT_NEAR(double(rows[3]["lr"]), c.min_lr, 1e-12);

  ASSERT_EQ(s.checkpoint_dir, c.out_dir + "/checkpoint-4");
  ModelConfig mc = load_model_config(s.checkpoint_dir);
  ParamTable t(mc);
  Tensor flat = Tensor::zeros({t.total()});
  LoadReport rep = load_hf_weights(s.checkpoint_dir, mc, t, flat);
  EXPECT_EQ(rep.layout, ExpertLayout::PerExpert);
  EXPECT_GT(rep.tensors, 10u);
  // The checkpoint holds the trained weights bit for bit, and they are not the initial ones.
  EXPECT_NE(s.checkpoint_digest, 0u);
  EXPECT_EQ(shard_digest(flat), s.checkpoint_digest);
  Tensor init = Tensor::zeros({t.total()});
  init_weights(mc, t, init, uint64_t(c.seed));
  EXPECT_NE(shard_digest(init), s.checkpoint_digest);
  fs::remove_all(c.out_dir);
}

// stop_at_exact_match ends the run at the first evaluation that reaches it, saving there (the start of
// `moetrain grpo`'s default task): the demo on its addition data, 1 right answer of 200 as the bar.
TEST(Trainer, StopAtExactMatchEndsAtTheFirstEvaluationThatReachesIt) {
  TrainConfig c = test::tiny_train_run("trainer", "stopat", 200);
  c.model = "demo";
  c.steps = 2500;  // the demo's schedule
  c.micro_batch_size = 16;
  c.grad_accum = 1;
  c.seq_len = 64;
  c.warmup_steps = 100;
  c.max_steps = 300;
  c.eval_every = 25;
  c.stop_at_exact_match = 0.5;
  c.log_every = 50;
  TrainSummary s = run_training(c);
  std::vector<std::pair<int64_t, double>> evals;
  for (const nlohmann::json& j : read_jsonl(c.out_dir + "/metrics.jsonl"))
    if (j.value("event", "") == "eval") evals.push_back({j["step"].get<int64_t>(), j["exact_match"].get<double>()});
  ASSERT_FALSE(evals.empty());
  // The demo gets a first answer right within 300 steps (100 on this machine); else the test says nothing.
  ASSERT_GE(evals.back().second, 0.5) << "no evaluation reached 0.5% in 300 steps";
  for (size_t i = 0; i + 1 < evals.size(); ++i) {
    EXPECT_LT(evals[i].second, 0.5) << "step " << evals[i].first;
    EXPECT_EQ(evals[i].first, int64_t(25 * (i + 1)));
  }
  EXPECT_LT(evals.back().first, 300);
  EXPECT_EQ(s.steps, evals.back().first);
  EXPECT_EQ(s.checkpoint_dir, c.out_dir + "/checkpoint-" + std::to_string(evals.back().first));
  EXPECT_TRUE(fs::exists(s.checkpoint_dir + "/model.safetensors"));
  EXPECT_NE(s.summary_line.find("exact-match"), std::string::npos) << s.summary_line;
  fs::remove_all(c.out_dir);

  // Only where an evaluation of held-out exact match runs.
  TrainConfig bad = test::tiny_train_run("trainer", "stopat_bad", 8);
  bad.stop_at_exact_match = 10;
  bad.eval_every = 0;
  try {
    validate_train_config(bad);
    ADD_FAILURE() << "eval_every 0 accepted";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("stop_at_exact_match = 10.0 is not allowed here"), std::string::npos)
        << e.what();
  }
  bad.stop_at_exact_match = 101;
  try {
    validate_train_config(bad);
    ADD_FAILURE() << "101 accepted";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("stop_at_exact_match"), std::string::npos) << e.what();
  }
}

TEST(Trainer, SameSeedSameLossCurve) {
  std::vector<double> curves[2];
  for (int r = 0; r < 2; ++r) {
    TrainConfig c = tiny_run("det" + std::to_string(r));
    c.eval_problems = 0;
    run_training(c);
    for (auto& row : read_jsonl(c.out_dir + "/metrics.jsonl"))
      if (row.contains("loss")) curves[r].push_back(row["loss"]);
    fs::remove_all(c.out_dir);
  }
  ASSERT_EQ(curves[0].size(), 4u);
  EXPECT_EQ(curves[0], curves[1]);
  EXPECT_LT(curves[0].back(), curves[0].front());
}

TEST(Trainer, RejectsCudaWithoutAGpu) {
  if (device_mem::cuda_available()) GTEST_SKIP() << "a GPU is visible";
  TrainConfig c = tiny_run("cuda");
  c.device = "cuda";
  try {
    run_training(c);
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("use --device cpu"), std::string::npos) << e.what();
  }
  fs::remove_all(c.out_dir);
}

TEST(Optimizer, NonFiniteGradNormSkipsTheStepAndLeavesStateUntouched) {
  AdamWConfig oc;
  AdamW opt(4, Device::CPU, oc);
  Tensor p = Tensor::empty({4}), g = Tensor::empty({4});
  for (int i = 0; i < 4; ++i) {
    p.data<float>()[i] = 0.5f * float(i);
    g.data<float>()[i] = 0.1f;
  }
  opt.step(p, g, 1e-2);
  Tensor p1 = p.clone(), m1 = opt.exp_avg().clone(), v1 = opt.exp_avg_sq().clone();
  for (float bad : {std::numeric_limits<float>::infinity(), std::numeric_limits<float>::quiet_NaN()}) {
    g.data<float>()[2] = bad;
    OptimStepResult r = opt.step(p, g, 1e-2);
    EXPECT_TRUE(r.skipped);
    EXPECT_FALSE(std::isfinite(r.grad_norm));
    EXPECT_EQ(std::memcmp(p.raw(), p1.raw(), 16), 0);
    EXPECT_EQ(std::memcmp(opt.exp_avg().raw(), m1.raw(), 16), 0);
    EXPECT_EQ(std::memcmp(opt.exp_avg_sq().raw(), v1.raw(), 16), 0);
  }
  EXPECT_EQ(opt.steps_skipped(), 2);
  EXPECT_EQ(opt.steps_taken(), 1);
  g.data<float>()[2] = 0.1f;
  EXPECT_FALSE(opt.step(p, g, 1e-2).skipped);
  EXPECT_EQ(opt.steps_taken(), 2);
}

TEST(Optimizer, ClipsToMaxNormLikeTorch) {
  EXPECT_EQ(clip_factor(0.5, 1.0), 1.0);
  EXPECT_NEAR(clip_factor(4.0, 1.0), 1.0 / (4.0 + 1e-6), 1e-7);
  EXPECT_EQ(clip_factor(100.0, 0.0), 1.0);  // clipping off
  AdamWConfig oc;
  oc.max_grad_norm = 1.0;
  AdamW opt(2, Device::CPU, oc);
  Tensor p = Tensor::zeros({2}), g = Tensor::empty({2});
  g.data<float>()[0] = 3.0f;
  g.data<float>()[1] = 4.0f;
  OptimStepResult r = opt.step(p, g, 1e-3);
  EXPECT_NEAR(r.grad_norm, 5.0, 1e-6);
  EXPECT_NEAR(r.clip_scale, 0.2, 1e-6);
  EXPECT_NEAR(opt.exp_avg().data<float>()[1], (1 - oc.beta1) * 4.0 * 0.2, 1e-6);  // moments see the clipped gradient
}

// The default warm-up (100 steps) in a 4-step run: the run warms up over its 4 steps, reaching the peak lr
// at the last one, and the checkpoint's schedule records the warm-up it ran.
TEST(Trainer, WarmupLongerThanTheRunSpansTheRun) {
  TrainConfig c = tiny_run("warmup");
  c.eval_problems = 0;
  c.warmup_steps = TrainConfig{}.warmup_steps;
  ASSERT_GT(c.warmup_steps, c.steps);
  run_training(c);
  auto rows = read_jsonl(c.out_dir + "/metrics.jsonl");
  ASSERT_EQ(rows.size(), 4u);
  for (int i = 0; i < 4; ++i) EXPECT_DOUBLE_EQ(double(rows[size_t(i)]["lr"]), c.lr * (i + 1) / 4) << "step " << i + 1;
  std::ifstream f(c.out_dir + "/checkpoint-4/train_state.json");
  EXPECT_EQ(nlohmann::json::parse(f)["lr_schedule"]["warmup_steps"], 4);
  fs::remove_all(c.out_dir);
}
