// TrainConfig: defaults, JSON loading, command-line overrides, and the text of every error. The fields are
// options declared once (declare_train_options, core/options.h): the command line words its errors as
// every command does ("--lr 0; need > 0"), a config file and a config built in code name the key
// ("lr = -1; need > 0").
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <functional>
#include <memory>

#include "core/error.h"
#include "test_util.h"
#include "train/sft.h"
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

// The text with every run of whitespace as one space: the help wraps its lines.
std::string one_line(const std::string& text) {
  std::string out;
  for (char ch : text) {
    const bool space = ch == ' ' || ch == '\n';
    if (!space || (!out.empty() && out.back() != ' ')) out += space ? ' ' : ch;
  }
  return out;
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
  EXPECT_FALSE(c.optimizer_overlap);
  EXPECT_DOUBLE_EQ(c.lr, 7e-4);
  EXPECT_EQ(c.lr_schedule, "cosine");
  EXPECT_EQ(c.data, "synthetic:addition");
  EXPECT_EQ(metrics_path(c), "runs/demo/metrics.jsonl");
  c.metrics_file = "m.jsonl";
  EXPECT_EQ(metrics_path(c), "m.jsonl");
  EXPECT_EQ(train_config_keys().size(), 57u);
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
  EXPECT_NE(msg.find("cfg.json): lr = -1; need > 0"), std::string::npos) << msg;
  msg = json_error(R"({"device": "gpu"})");
  EXPECT_NE(msg.find("device = \"gpu\"; allowed: one of auto, cpu, cuda"), std::string::npos) << msg;
  msg = json_error(R"({"tensorboard": 2})");
  EXPECT_NE(msg.find("tensorboard = 2 (number) must be true or false (or 1 or 0)"), std::string::npos) << msg;
  msg = json_error(R"({"tensorboard": "on"})");
  EXPECT_NE(msg.find("tensorboard = \"on\" (string) must be true or false"), std::string::npos) << msg;
  msg = json_error(R"({"config": "other.json"})");
  EXPECT_NE(msg.find("unknown key 'config'"), std::string::npos) << "a config file names no other: " << msg;
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
  EXPECT_FALSE(c.tensorboard);
  EXPECT_TRUE(c.deterministic);
  EXPECT_FALSE(c.reshard_after_forward);
  EXPECT_TRUE(c.optimizer_overlap);
  apply_overrides(c, {"--tensorboard=1", "--deterministic", "0", "--optimizer-overlap", "--steps", "9"});
  EXPECT_TRUE(c.tensorboard);
  EXPECT_FALSE(c.deterministic);
  EXPECT_TRUE(c.optimizer_overlap);
  EXPECT_EQ(c.steps, 9);
  for (const auto& [word, on] : std::vector<std::pair<std::string, bool>>{
           {"on", true}, {"off", false}, {"true", true}, {"false", false}, {"1", true}, {"0", false}}) {
    TrainConfig d;
    d.tensorboard = !on;
    apply_overrides(d, {"--tensorboard", word});
    EXPECT_EQ(d.tensorboard, on) << word;
    apply_overrides(d, {"--tensorboard=" + std::string(on ? "off" : "on")});
    EXPECT_EQ(d.tensorboard, !on) << word;
  }
  apply_json(c, R"({"tensorboard": false, "deterministic": true})", "j");
  EXPECT_FALSE(c.tensorboard);
  EXPECT_TRUE(c.deterministic);
  // Every saved config wrote them 0/1; that reads back.
  apply_json(c, R"({"tensorboard": 1, "deterministic": 0})", "j");
  EXPECT_TRUE(c.tensorboard);
  EXPECT_FALSE(c.deterministic);
  expect_override_error({"--tensorboard=maybe"}, {"train: --tensorboard 'maybe' is not on or off"});
}

TEST(TrainConfig, OverrideErrorsNameFieldAndValue) {
  expect_override_error({"--micro-batch", "8"}, {"unknown option --micro-batch; did you mean", "--micro-batch-size"});
  expect_override_error({"--lrate", "1"}, {"unknown option --lrate; did you mean --lr"});
  expect_override_error({"--zzzzzz", "1"}, {"unknown option --zzzzzz (moetrain train --help lists every option)"});
  EXPECT_THROW(apply_json(*std::make_unique<TrainConfig>(), R"({"lrate": 1})", "f.json"), Error);
  expect_override_error({"--steps", "abc"}, {"train: --steps 'abc' is not a whole number"});
  expect_override_error({"--steps", "-5"}, {"train: --steps -5; need >= 0"});
  expect_override_error({"--lr", "0"}, {"train: --lr 0; need > 0"});
  expect_override_error({"--lr", "1e-3x"}, {"train: --lr '1e-3x' is not a number"});
  expect_override_error({"--lr", "nan"}, {"--lr 'nan' is not a number"});
  expect_override_error({"--min-lr", "0.01"}, {"min_lr = 0.01", "lr = 0.0007"});
  expect_override_error({"--beta1", "1"}, {"--beta1 1; need >= 0 and < 1"});
  expect_override_error({"--beta2=-0.1"}, {"--beta2 -0.1; need >= 0 and < 1"});
  expect_override_error({"--lr-schedule", "step"}, {"--lr-schedule 'step'; allowed: one of cosine, linear, constant"});
  expect_override_error({"--device", "gpu"}, {"--device 'gpu'; allowed: one of auto, cpu, cuda"});
  expect_override_error({"--recompute", "partial"},
                        {"--recompute 'partial'; allowed: one of none, full, selective, moe"});
  expect_override_error({"--model="}, {"--model ''; must not be empty"});
  expect_override_error({"--max-steps", "2501"}, {"max_steps = 2501", "steps = 2500"});
  expect_override_error({"--warmup-steps", "-1"}, {"--warmup-steps -1; need >= 0"});
  expect_override_error({"--seq-len", "1"}, {"--seq-len 1; need >= 2"});
  expect_override_error({"--seq-len", "10"}, {"seq_len = 10", "max_digits = 3", "14"});
  expect_override_error({"--max-digits", "1"}, {"eval_problems = 200", "max_digits = 1", "<= 10"});
  {
    TrainConfig c;
    EXPECT_NO_THROW(apply_overrides(c, {"--max-digits", "1", "--eval-problems", "10", "--data", "/some/shards"}));
    EXPECT_NO_THROW(apply_overrides(c, {"--eval-problems", "200"})) << "only synthetic data has the limit";
  }
  expect_override_error({"--max-digits", "12"}, {"--max-digits 12; need 1..9"});
  expect_override_error({"--data", "synthetic:mult"}, {"data = \"synthetic:mult\"", "synthetic:addition"});
  expect_override_error({"--grad-clip", "-1"}, {"--grad-clip -1; need >= 0; 0: off"});
  expect_override_error({"--micro-batch-size", "0"}, {"--micro-batch-size 0; need >= 1"});
  expect_override_error({"--log-every", "0"}, {"--log-every 0; need >= 1"});
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
  expect_override_error({"--warmup-steps", "-1"}, {"--warmup-steps -1; need >= 0"});
  // Checkpoint retention: the newest 2 by default.
  EXPECT_EQ(demo.keep_last, 2);
}

// to_json walks the declarations; what it writes is what every saved train_config.json and checkpoint's
// train_state.json holds (keys, order, the switches as 0/1), so resume and train_config_changes read old and
// new runs alike. This is the text the table-based reader wrote for the defaults.
TEST(TrainConfig, ToJsonOfTheDefaultsIsTheSavedFormat) {
  EXPECT_EQ(to_json(TrainConfig{}), R"({
  "model": "demo",
  "init_from": "",
  "device": "auto",
  "out_dir": "runs/demo",
  "steps": 2500,
  "micro_batch_size": 16,
  "grad_accum": 1,
  "seq_len": 64,
  "lr": 0.0007,
  "min_lr": 7e-05,
  "warmup_steps": 100,
  "lr_schedule": "cosine",
  "weight_decay": 0.1,
  "beta1": 0.9,
  "beta2": 0.95,
  "eps": 1e-08,
  "grad_clip": 1.0,
  "seed": 1234,
  "data": "synthetic:addition",
  "tokenizer": "",
  "data_format": "auto",
  "bad_lines": "skip",
  "max_digits": 3,
  "eval_problems": 200,
  "eval_every": 500,
  "log_every": 1,
  "save_every": 0,
  "keep_last": 2,
  "max_steps": 0,
  "stop_at_exact_match": 0.0,
  "resume": "",
  "recompute": "none",
  "score_before_experts": -1,
  "metrics_file": "",
  "tensorboard": 1,
  "router_z_loss_coef": 0.0,
  "router_bias_update_rate": 0.0,
  "threads": 0,
  "dp_shard": 0,
  "dp_replicate": 1,
  "grad_sync": "every",
  "load_mode": "auto",
  "moe_capacity_factor": 0.0,
  "ep": 1,
  "tp": 1,
  "etp": 1,
  "sp": 1,
  "optimizer_overlap": 0,
  "deterministic": 0,
  "reshard_after_forward": 1,
  "grad_reduce_dtype": "f32",
  "comm_timeout_s": 300,
  "schedule_check": "periodic",
  "schedule_check_every": 100
})");
  TrainConfig c;
  c.lr = 0.1 + 0.2;  // not what %g would print: the text must still read back to the same bits
  c.tensorboard = false;
  TrainConfig d;
  apply_json(d, to_json(c), "round trip");
  EXPECT_EQ(d.lr, c.lr);
  EXPECT_FALSE(d.tensorboard);
  EXPECT_NE(to_json(c).find("\"tensorboard\": 0,"), std::string::npos);
}

// train and sft parse with the options module: --key=value, '_' for '-', the --run-dir alias, on/off
// switches, "did you mean" for a typo, the command's name first in every error.
TEST(TrainConfig, TrainAndSftTakeEveryCommandsSyntax) {
  const TrainConfig t = train_config_from_args({"--steps=7", "--micro_batch_size", "4", "--run-dir=/tmp/r",
                                                "--tensorboard=off", "--deterministic", "--warmup-steps=2"});
  EXPECT_EQ(t.steps, 7);
  EXPECT_EQ(t.micro_batch_size, 4);
  EXPECT_EQ(t.out_dir, "/tmp/r");
  EXPECT_FALSE(t.tensorboard);
  EXPECT_TRUE(t.deterministic);
  EXPECT_TRUE(train_config_given(t, "out_dir")) << "the alias counts for its key";
  EXPECT_TRUE(train_config_given(t, "micro_batch_size"));
  EXPECT_FALSE(train_config_given(t, "lr"));
  const TrainConfig s = sft_config_from_args({"--model=tiny", "--data=x.jsonl", "--steps=7", "--lr=1e-4",
                                              "--tensorboard", "false", "--reshard_after_forward=0"});
  EXPECT_EQ(s.model, "tiny");
  EXPECT_EQ(s.steps, 7);
  EXPECT_DOUBLE_EQ(s.lr, 1e-4);
  EXPECT_FALSE(s.tensorboard);
  EXPECT_FALSE(s.reshard_after_forward);
  EXPECT_EQ(s.seq_len, 1024) << "sft's default where not given";
  EXPECT_EQ(error_of([] {
              train_config_from_args({"--lrr", "1e-3"});
            }),
            "train: unknown option --lrr; did you mean --lr? (moetrain train --help lists every option)");
  EXPECT_EQ(error_of([] {
              sft_config_from_args({"--model", "tiny", "--data", "x.jsonl", "--max-step=3"});
            }),
            "sft: unknown option --max-step; did you mean --max-steps? (moetrain sft --help lists every option)");
  EXPECT_EQ(error_of([] {
              sft_config_from_args({"--model", "tiny", "--data", "x.jsonl", "--lr=0"});
            }),
            "sft: --lr 0; need > 0");
  EXPECT_EQ(error_of([] { train_config_from_args({"--deterministic=2"}); }),
            "train: --deterministic '2' is not on or off (on/off, true/false, 1/0, yes/no)");
}

// A config file's values go through the same declarations as the command line's: any spelling of a key,
// the alias, 1e2 for an integer; the command line wins wherever --config stands; both count as given.
TEST(TrainConfig, ConfigFileGoesThroughTheDeclarations) {
  const std::string path = write_temp(
      "d.json",
      R"({"micro-batch-size": 1e2, "run_dir": "/tmp/from-file", "lr": 0.002, "warmup_steps": 3, "deterministic": true})");
  const TrainConfig c = train_config_from_args({"--lr", "0.001", "--config=" + path, "--steps", "50"});
  EXPECT_EQ(c.micro_batch_size, 100);
  EXPECT_EQ(c.out_dir, "/tmp/from-file");
  EXPECT_DOUBLE_EQ(c.lr, 0.001) << "the command line's, though --config came after it";
  EXPECT_EQ(c.steps, 50);
  EXPECT_TRUE(c.deterministic);
  for (const char* key : {"micro_batch_size", "out_dir", "lr", "warmup_steps", "deterministic", "steps"})
    EXPECT_TRUE(train_config_given(c, key)) << key;
  EXPECT_FALSE(train_config_given(c, "seq_len"));
  // A bad value in the file is an error even where the command line overrides it.
  const std::string bad = write_temp("e.json", R"({"lr": "fast"})");
  EXPECT_NE(error_of([&] {
              train_config_from_args({"--config", bad, "--lr", "0.1"});
            }).find("lr = \"fast\" (string) must be a number"),
            std::string::npos);
  const std::string sft = write_temp("f.json", R"({"model": "tiny", "data": "chats.jsonl", "stesp": 3})");
  EXPECT_NE(error_of([&] {
              sft_config_from_args({"--config", sft});
            }).find("unknown key 'stesp'; did you mean: steps?"),
            std::string::npos);
  // sft's required --model and --data may come from the file.
  const std::string ok = write_temp("g.json", R"({"model": "tiny", "data": "chats.jsonl"})");
  EXPECT_EQ(sft_config_from_args({"--config", ok}).data, "chats.jsonl");
  for (const std::string& p : {path, bad, sft, ok}) fs::remove(p);
}

// A config built in code is checked against the same declarations (validate_train_config), in the keys' words.
TEST(TrainConfig, ValidateChecksEveryFieldAgainstItsDeclaration) {
  auto err = [](const std::function<void(TrainConfig&)>& edit) {
    TrainConfig c;
    edit(c);
    return error_of([&] { validate_train_config(c); });
  };
  EXPECT_EQ(err([](TrainConfig& c) { c.lr = 0; }), "train config: lr = 0; need > 0");
  EXPECT_EQ(err([](TrainConfig& c) { c.device = "gpu"; }),
            "train config: device = \"gpu\"; allowed: one of auto, cpu, cuda");
  EXPECT_EQ(err([](TrainConfig& c) { c.model = ""; }), "train config: model = \"\"; must not be empty");
  EXPECT_EQ(err([](TrainConfig& c) { c.keep_last = -1; }),
            "train config: keep_last = -1; need >= 0; 0: keep all, those older than the newest 2 as weights only (HF "
            "config and safetensors, no training state)");
}

// The help is the options module's, generated from the declarations: groups, metavars, each default as the
// config holds it (sft's for sft) and the range.
TEST(TrainConfig, HelpIsGeneratedFromTheDeclarations) {
  const std::string train = one_line(train_config_help());
  for (const char* want :
       {"usage: moetrain train [--config FILE.json] [--key value ...]",
        "batch, schedule and optimizer:", "parallel layout (under moetrain launch):", "--out-dir, --run-dir DIR",
        "--lr X peak learning rate (default 0.0007; > 0)", "--tensorboard on|off",
        "--steps N optimizer steps: the length of the learning-rate schedule (default 2500; >= 0)",
        "--lr-schedule cosine|linear|constant"})
    EXPECT_NE(train.find(want), std::string::npos) << want << " in " << train;
  TrainConfig d = sft_defaults();
  const std::string sft = one_line(sft_options(d).help());
  for (const char* want :
       {"usage: moetrain sft --model DIR --data FILE.jsonl",
        "--steps N optimizer steps: the length of the learning-rate schedule (default 100; >= 0)",
        "(default 2e-05; > 0)",
        "--out-dir, --run-dir DIR the run directory: checkpoints, logs and metrics (default runs/sft)", "(required)"})
    EXPECT_NE(sft.find(want), std::string::npos) << want << " in " << sft;
}
