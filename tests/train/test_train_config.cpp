// TrainConfig: defaults, JSON loading, command-line overrides, and the text of every error.
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <memory>

#include "core/error.h"
#include "test_util.h"
#include "train/train_config.h"

using namespace mt;
using mt::testutil::error_of;
namespace fs = std::filesystem;

namespace {

// The error of applying `args` to a default config; the text must hold every string in `want`.
void expect_override_error(const std::vector<std::string>& args, const std::vector<std::string>& want) {
  TrainConfig c;
  std::string msg = error_of([&] { apply_overrides(c, args); });
  for (const auto& w : want) EXPECT_NE(msg.find(w), std::string::npos) << "'" << w << "' not in: " << msg;
}

std::string write_temp(const std::string& name, const std::string& text) {
  fs::path p = fs::temp_directory_path() / ("mt_train_config_" + std::to_string(::getpid()) + "_" + name);
  std::ofstream(p) << text;
  return p.string();
}

}  // namespace

TEST(TrainConfig, DefaultsAreValid) {
  TrainConfig c;
  EXPECT_NO_THROW(validate_train_config(c));
  EXPECT_EQ(c.model, "demo");
  EXPECT_EQ(c.steps, 2500);
  EXPECT_EQ(c.micro_batch_size, 16);
  EXPECT_EQ(c.optimizer_overlap, 0);
  EXPECT_DOUBLE_EQ(c.lr, 7e-4);
  EXPECT_EQ(c.lr_schedule, "cosine");
  EXPECT_EQ(c.data, "synthetic:addition");
  EXPECT_EQ(metrics_path(c), "runs/demo/metrics.jsonl");
  c.metrics_file = "m.jsonl";
  EXPECT_EQ(metrics_path(c), "m.jsonl");
  EXPECT_EQ(train_config_keys().size(), 54u);
  EXPECT_EQ(c.stop_at_exact_match, 0.0);  // off: a run ends at steps (or max_steps)
  std::string help = train_config_help();
  EXPECT_NE(help.find("--micro-batch-size"), std::string::npos);
  EXPECT_NE(help.find("default 16"), std::string::npos);
}

TEST(TrainConfig, EtpMustBeOneOrTp) {
  TrainConfig c;
  c.tp = 2;
  c.etp = 2;
  EXPECT_NO_THROW(validate_train_config(c));
  c.etp = 3;
  try {
    validate_train_config(c);
    ADD_FAILURE() << "etp 3 with tp 2 was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("must be 1 or tp (2)"), std::string::npos) << e.what();
  }
}

TEST(TrainConfig, JsonLoadAndRoundTrip) {
  std::string path = write_temp("a.json", R"({"model": "tiny", "steps": 50, "lr": 0.01, "min_lr": 1e-3,
      "warmup_steps": 5, "lr_schedule": "linear", "seq_len": 32, "micro_batch_size": 1e1, "device": "cpu"})");
  TrainConfig c = load_train_config(path);
  fs::remove(path);
  EXPECT_EQ(c.model, "tiny");
  EXPECT_EQ(c.steps, 50);
  EXPECT_DOUBLE_EQ(c.lr, 0.01);
  EXPECT_DOUBLE_EQ(c.min_lr, 1e-3);
  EXPECT_EQ(c.lr_schedule, "linear");
  EXPECT_EQ(c.micro_batch_size, 10);
  EXPECT_EQ(c.device, "cpu");
  EXPECT_EQ(c.grad_accum, 1) << "absent keys keep their defaults";

  // to_json writes every field and reads back to the same config.
  std::string json = to_json(c);
  EXPECT_NE(json.find("\"model\": \"tiny\""), std::string::npos) << json;
  EXPECT_NE(json.find("\"metrics_file\": \"\""), std::string::npos) << json;
  TrainConfig d;
  apply_json(d, json, "round trip");
  EXPECT_EQ(to_json(d), json);
  EXPECT_DOUBLE_EQ(d.eps, 1e-8);
}

TEST(TrainConfig, JsonErrors) {
  auto json_error = [](const std::string& text) {
    TrainConfig c;
    return error_of([&] { apply_json(c, text, "cfg.json"); });
  };
  std::string msg = json_error(R"({"stesp": 10})");
  EXPECT_NE(msg.find("cfg.json"), std::string::npos) << msg;
  EXPECT_NE(msg.find("unknown key 'stesp'"), std::string::npos) << msg;
  EXPECT_NE(msg.find("did you mean: steps"), std::string::npos) << msg;
  msg = json_error(R"({"steps": "ten"})");
  EXPECT_NE(msg.find("steps = \"ten\""), std::string::npos) << msg;
  EXPECT_NE(msg.find("must be an integer"), std::string::npos) << msg;
  msg = json_error(R"({"steps": 2.5})");
  EXPECT_NE(msg.find("steps = 2.5"), std::string::npos) << msg;
  msg = json_error(R"({"lr": "fast"})");
  EXPECT_NE(msg.find("lr = \"fast\""), std::string::npos) << msg;
  EXPECT_NE(msg.find("must be a number"), std::string::npos) << msg;
  msg = json_error(R"({"model": 3})");
  EXPECT_NE(msg.find("must be a string"), std::string::npos) << msg;
  msg = json_error(R"({"lr": -1})");
  EXPECT_NE(msg.find("lr = -1"), std::string::npos) << msg;
  EXPECT_NE(msg.find("must be > 0"), std::string::npos) << msg;
  msg = json_error(R"({"steps": 1,)");
  EXPECT_NE(msg.find("not valid JSON"), std::string::npos) << msg;
  msg = json_error(R"([1, 2])");
  EXPECT_NE(msg.find("JSON object"), std::string::npos) << msg;
  msg = error_of([] { load_train_config("/nonexistent/cfg.json"); });
  EXPECT_NE(msg.find("/nonexistent/cfg.json"), std::string::npos) << msg;
  // Cross-field rules are checked after loading a file.
  std::string path = write_temp("b.json", R"({"steps": 10, "max_steps": 20})");
  msg = error_of([&] { load_train_config(path); });
  fs::remove(path);
  EXPECT_NE(msg.find("max_steps = 20"), std::string::npos) << msg;
  EXPECT_NE(msg.find("steps = 10"), std::string::npos) << msg;
}

TEST(TrainConfig, OverridesBothSpellings) {
  TrainConfig c;
  apply_overrides(c, {"--micro-batch-size", "8", "--grad_accum=4", "--lr", "1e-3", "--min-lr=0", "--device", "cuda",
                      "--lr-schedule", "constant", "--recompute=full", "--out-dir", "runs/x", "--init-from=", "--data",
                      "/data/shards"});
  EXPECT_EQ(c.micro_batch_size, 8);
  EXPECT_EQ(c.grad_accum, 4);
  EXPECT_DOUBLE_EQ(c.lr, 1e-3);
  EXPECT_DOUBLE_EQ(c.min_lr, 0.0);
  EXPECT_EQ(c.device, "cuda");
  EXPECT_EQ(c.lr_schedule, "constant");
  EXPECT_EQ(c.recompute, "full");
  EXPECT_EQ(c.out_dir, "runs/x");
  EXPECT_EQ(c.init_from, "");
  EXPECT_EQ(c.data, "/data/shards");
  set_train_config_field(c, "eval-every", "25");
  EXPECT_EQ(c.eval_every, 25);
  // A rejected override leaves the config as it was, including the fields before the bad one.
  EXPECT_THROW(apply_overrides(c, {"--steps", "7", "--min-lr", "5"}), Error);
  EXPECT_THROW(apply_overrides(c, {"--steps", "7", "--device", "gpu"}), Error);
  EXPECT_THROW(apply_json(c, R"({"steps": 7, "beta1": 2})", "j"), Error);
  EXPECT_THROW(set_train_config_field(c, "steps", "-7"), Error);
  EXPECT_EQ(c.steps, 2500);
  EXPECT_DOUBLE_EQ(c.min_lr, 0.0);
  EXPECT_EQ(c.device, "cuda");
  EXPECT_DOUBLE_EQ(c.beta1, 0.9);
}

// The on/off settings take every command's boolean words, bare means on, and a JSON file may say true/false.
TEST(TrainConfig, SwitchesTakeOnOffTrueFalseYesNoAndBare) {
  TrainConfig c;
  apply_overrides(
      c, {"--tensorboard", "off", "--deterministic", "--reshard-after-forward=false", "--optimizer-overlap", "YES"});
  EXPECT_EQ(c.tensorboard, 0);
  EXPECT_EQ(c.deterministic, 1);
  EXPECT_EQ(c.reshard_after_forward, 0);
  EXPECT_EQ(c.optimizer_overlap, 1);
  apply_overrides(c, {"--tensorboard=1", "--deterministic", "0", "--optimizer-overlap", "--steps", "9"});
  EXPECT_EQ(c.tensorboard, 1);
  EXPECT_EQ(c.deterministic, 0);
  EXPECT_EQ(c.optimizer_overlap, 1);
  EXPECT_EQ(c.steps, 9);
  apply_json(c, R"({"tensorboard": false, "deterministic": true})", "j");
  EXPECT_EQ(c.tensorboard, 0);
  EXPECT_EQ(c.deterministic, 1);
  expect_override_error({"--tensorboard=maybe"}, {"tensorboard = \"maybe\" is not on or off"});
}

TEST(TrainConfig, OverrideErrorsNameFieldAndValue) {
  expect_override_error({"--micro-batch", "8"}, {"unknown option --micro-batch; did you mean", "--micro-batch-size"});
  expect_override_error({"--lrate", "1"}, {"unknown option --lrate; did you mean --lr"});
  expect_override_error({"--zzzzzz", "1"}, {"unknown option --zzzzzz (--help lists every option)"});
  EXPECT_THROW(apply_json(*std::make_unique<TrainConfig>(), R"({"lrate": 1})", "f.json"), Error);
  expect_override_error({"--steps", "abc"}, {"--steps", "steps = \"abc\"", "not an integer"});
  expect_override_error({"--steps", "-5"}, {"steps = -5", "must be >= 0"});
  expect_override_error({"--lr", "0"}, {"lr = 0", "must be > 0"});
  expect_override_error({"--lr", "1e-3x"}, {"lr = \"1e-3x\"", "not a finite number"});
  expect_override_error({"--lr", "nan"}, {"lr = \"nan\""});
  expect_override_error({"--min-lr", "0.01"}, {"min_lr = 0.01", "lr = 0.0007"});
  expect_override_error({"--beta1", "1"}, {"beta1 = 1", "[0, 1)"});
  expect_override_error({"--beta2=-0.1"}, {"beta2 = -0.1", "[0, 1)"});
  expect_override_error({"--lr-schedule", "step"}, {"lr_schedule = \"step\"", "cosine, linear, constant"});
  expect_override_error({"--device", "gpu"}, {"device = \"gpu\"", "cpu, cuda, auto"});
  expect_override_error({"--recompute", "partial"}, {"recompute = \"partial\"", "none, full, selective, moe"});
  expect_override_error({"--max-steps", "2501"}, {"max_steps = 2501", "steps = 2500"});
  expect_override_error({"--warmup-steps", "-1"}, {"warmup_steps = -1", "must be >= 0"});
  expect_override_error({"--seq-len", "1"}, {"seq_len = 1", "must be >= 2"});
  expect_override_error({"--seq-len", "10"}, {"seq_len = 10", "max_digits = 3", "14"});
  expect_override_error({"--max-digits", "1"}, {"eval_problems = 200", "max_digits = 1", "<= 10"});
  {
    TrainConfig c;
    EXPECT_NO_THROW(apply_overrides(c, {"--max-digits", "1", "--eval-problems", "10", "--data", "/some/shards"}));
    EXPECT_NO_THROW(apply_overrides(c, {"--eval-problems", "200"})) << "only synthetic data has the limit";
  }
  expect_override_error({"--max-digits", "12"}, {"max_digits = 12", "1..9"});
  expect_override_error({"--data", "synthetic:mult"}, {"data = \"synthetic:mult\"", "synthetic:addition"});
  expect_override_error({"--grad-clip", "-1"}, {"grad_clip = -1", ">= 0"});
  expect_override_error({"--micro-batch-size", "0"}, {"micro_batch_size = 0", ">= 1"});
  expect_override_error({"--log-every", "0"}, {"log_every = 0", ">= 1"});
  expect_override_error({"--steps"}, {"--steps needs a value"});
  expect_override_error({"--steps", "--lr", "1"}, {"--steps needs a value"});
  expect_override_error({"steps", "5"}, {"unexpected argument 'steps'"});
  expect_override_error({"--config", "x.json"}, {"--config"});
}

TEST(TrainConfig, FromArgsReadsConfigThenOverrides) {
  std::string path = write_temp("c.json", R"({"steps": 10, "max_steps": 20, "lr": 0.5})");
  // The file alone breaks max_steps <= steps; the override fixes it, and validation runs once at the end.
  TrainConfig c = train_config_from_args({"--steps", "100", "--config", path, "--lr=0.25"});
  EXPECT_EQ(c.steps, 100);
  EXPECT_EQ(c.max_steps, 20);
  EXPECT_DOUBLE_EQ(c.lr, 0.25);
  TrainConfig d = train_config_from_args({"--config=" + path, "--steps=20"});
  EXPECT_DOUBLE_EQ(d.lr, 0.5);
  std::string msg = error_of([&] { train_config_from_args({"--config", path}); });
  EXPECT_NE(msg.find("max_steps = 20"), std::string::npos) << msg;
  msg = error_of([&] { train_config_from_args({"--config", path, "--config", path}); });
  EXPECT_NE(msg.find("--config given twice"), std::string::npos) << msg;
  fs::remove(path);
  EXPECT_EQ(train_config_from_args({}).steps, 2500);
}

// A warm-up longer than the run is clamped to it, not refused (the default 100 under --steps 20), and the
// note says whether the value was the user's; a negative one is still an error. The demo (100 of 2500) and
// keep_last's default are unchanged by this.
TEST(TrainConfig, WarmupLongerThanStepsIsClampedNotRefused) {
  const TrainConfig def = train_config_from_args({"--steps", "20"});
  EXPECT_EQ(def.warmup_steps, 100);  // the setting stays as given; the run uses the clamped value
  EXPECT_EQ(effective_warmup_steps(def), 20);
  EXPECT_EQ(warmup_clamp_note(def), "warmup_steps 100 > steps 20; warming up over all 20 steps");
  for (const std::vector<std::string>& args :
       {std::vector<std::string>{"--steps", "20", "--warmup-steps", "500"}, {"--steps=20", "--warmup_steps=500"}}) {
    const TrainConfig mine = train_config_from_args(args);
    EXPECT_EQ(effective_warmup_steps(mine), 20);
    EXPECT_EQ(warmup_clamp_note(mine), "warmup_steps 500 (your setting) > steps 20; warming up over all 20 steps");
  }
  // The default's own value, given explicitly, is the user's too; so is a config file's.
  EXPECT_NE(
      warmup_clamp_note(train_config_from_args({"--steps", "20", "--warmup-steps", "100"})).find("(your setting)"),
      std::string::npos);
  TrainConfig file;
  apply_json(file, "{\"steps\": 5, \"warmup_steps\": 8}", "x.json");
  EXPECT_EQ(warmup_clamp_note(file), "warmup_steps 8 (your setting) > steps 5; warming up over all 5 steps");
  // Not clamped: no note.
  const TrainConfig demo;
  EXPECT_EQ(effective_warmup_steps(demo), 100);
  EXPECT_EQ(warmup_clamp_note(demo), "");
  EXPECT_EQ(warmup_clamp_note(train_config_from_args({"--steps", "20", "--warmup-steps", "20"})), "");
  expect_override_error({"--warmup-steps", "-1"}, {"warmup_steps = -1 is not allowed: must be >= 0"});
  // Checkpoint retention: the newest 2 by default.
  EXPECT_EQ(demo.keep_last, 2);
}
