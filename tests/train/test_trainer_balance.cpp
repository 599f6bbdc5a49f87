// The load-balancing options in the training loop: the metrics carry the z-loss, the per-expert load
// and the bias range, the reported loss adds coef * z, the bias file beside the checkpoint is read
// back by init_from, and the options are rejected with a dense model and with negative values.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "train/trainer.h"
#include "train/trainer_test_util.h"

using namespace mt;
namespace fs = std::filesystem;

namespace {

TrainConfig tiny_run(const std::string& name) { return test::tiny_train_run("lb", name, 0); }


std::vector<nlohmann::json> read_steps(const std::string& path) {
  std::vector<nlohmann::json> out;
  std::ifstream f(path);
  std::string line;
  while (std::getline(f, line)) {
    auto j = nlohmann::json::parse(line);
    if (j.contains("loss")) out.push_back(j);
  }
  return out;
}

}  // namespace

TEST(TrainerBalance, MetricsCarryZLossExpertLoadAndBias) {
  TrainConfig c = tiny_run("metrics");
  c.router_z_loss_coef = 0.01;
  c.router_bias_update_rate = 1e-3;
  run_training(c);
  auto rows = read_steps(c.out_dir + "/metrics.jsonl");
  ASSERT_EQ(rows.size(), 4u);
  for (size_t i = 0; i < rows.size(); ++i) {
    const auto& j = rows[i];
    const double z = j["z_loss"].get<double>();
    EXPECT_GT(z, 0.0);
    // tiny has no aux loss: loss = ce + coef * z.
    EXPECT_NEAR(j["loss"].get<double>(), j["ce"].get<double>() + 0.01 * z, 1e-9);
    const auto& x = j["experts"];
    EXPECT_EQ(x["layers"].get<int>(), 2);
    EXPECT_EQ(x["mean"].get<double>(), 2.0 * 2 * 32 * 2 / 8);  // tokens x top-2 / 8 experts
    EXPECT_LE(x["min"].get<double>(), x["mean"].get<double>());
    EXPECT_GE(x["max"].get<double>(), x["mean"].get<double>());
    EXPECT_DOUBLE_EQ(x["imbalance"].get<double>(), x["max"].get<double>() / x["mean"].get<double>());
    EXPECT_EQ(x["imbalance_per_layer"].size(), 2u);
    // After step i + 1 every bias is a multiple of the rate within (i + 1) steps of 0.
    EXPECT_LE(j["router_bias"]["max"].get<double>(), 1e-3 * double(i + 1) + 1e-9);
    EXPECT_GE(j["router_bias"]["min"].get<double>(), -1e-3 * double(i + 1) - 1e-9);
  }
  EXPECT_GT(rows.back()["router_bias"]["max"].get<double>() - rows.back()["router_bias"]["min"].get<double>(), 0.0);
  ASSERT_TRUE(fs::exists(c.out_dir + "/checkpoint-4/router_bias.safetensors"));

  // init_from reads the bias back: the first step starts from it, so its range already exceeds what
  // one step from zero could reach (2 x rate).
  const double saved_range =
      rows.back()["router_bias"]["max"].get<double>() - rows.back()["router_bias"]["min"].get<double>();
  TrainConfig d = tiny_run("resume");
  d.init_from = c.out_dir + "/checkpoint-4";
  d.router_bias_update_rate = 1e-3;
  d.steps = 1;
  d.warmup_steps = 0;
  run_training(d);
  auto again = read_steps(d.out_dir + "/metrics.jsonl");
  ASSERT_EQ(again.size(), 1u);
  ASSERT_GT(saved_range, 2.5e-3) << "the premise: four steps moved the saved biases apart by more than 2 x rate";
  EXPECT_GT(again[0]["router_bias"]["max"].get<double>() - again[0]["router_bias"]["min"].get<double>(), 2.5e-3);
  fs::remove_all(c.out_dir);
  fs::remove_all(d.out_dir);
}

TEST(TrainerBalance, OffByDefaultWithoutBiasFileAndStepLineUnchangedInMeaning) {
  TrainConfig c = tiny_run("off");
  c.steps = 2;
  run_training(c);
  auto rows = read_steps(c.out_dir + "/metrics.jsonl");
  ASSERT_EQ(rows.size(), 2u);
  EXPECT_FALSE(rows[0].contains("router_bias"));
  EXPECT_TRUE(rows[0].contains("experts"));  // the load is always reported for MoE models
  EXPECT_EQ(rows[0]["loss"].get<double>(), rows[0]["ce"].get<double>());
  EXPECT_FALSE(fs::exists(c.out_dir + "/checkpoint-2/router_bias.safetensors"));
  fs::remove_all(c.out_dir);
}

TEST(TrainerBalance, OptionsNeedMoeLayersAndNonNegativeValues) {
  TrainConfig c = tiny_run("dense");
  c.model = std::string(MT_SOURCE_DIR) + "/tests/assets/goldens/dense_qwen3";
  c.data = "synthetic:addition";
  c.router_z_loss_coef = 1e-3;
  try {
    run_training(c);
    FAIL() << "a dense model with router_z_loss_coef must be rejected";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("router_z_loss_coef"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("needs MoE layers"), std::string::npos) << e.what();
  }
  TrainConfig d;
  try {
    set_train_config_field(d, "router-bias-update-rate", "-1");
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("router_bias_update_rate"), std::string::npos) << e.what();
  }
  fs::remove_all(c.out_dir);
}
