// Options of `moetrain convert` and `moetrain sft` that once did not do what they said (the real binary,
// the tiny golden model; each run a second or less): each test fails on the code before its fix.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <sstream>

#include "parallel/launch_test_util.h"
#include "train/convert.h"

using namespace mt::test;
namespace fs = std::filesystem;

namespace {

std::string slurp(const std::string& path) {
  std::ifstream f(path);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

}  // namespace

// `--tokenizer FILE` (one tokenizer.json) once lost to the checkpoint's own tokenizer.json, copied over it
// afterwards, with the checkpoint's tokenizer_config.json beside it.
TEST(ConvertCli, AGivenTokenizerFileIsTheOneExported) {
  const std::string src = tmp_path("clioptions", "ckpt"), to = tmp_path("clioptions", "hf");
  fs::remove_all(src);
  fs::remove_all(to);
  fs::create_directories(src);
  for (const char* f : {"config.json", "model.safetensors"}) fs::copy_file(kGoldens + "/tiny/" + f, src + "/" + f);
  std::ofstream(src + "/tokenizer.json") << "{\"from\": \"the checkpoint\"}";
  std::ofstream(src + "/tokenizer_config.json") << "{\"from\": \"the checkpoint\"}";
  const std::string mine = tmp_path("clioptions", "my_tokenizer.json");
  std::ofstream(mine) << "{\"from\": \"--tokenizer\"}";
  const ShellRun r = sh(kMoetrainBin + " convert --from " + src + " --to " + to + " --tokenizer " + mine);
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_EQ(slurp(to + "/tokenizer.json"), "{\"from\": \"--tokenizer\"}");
  EXPECT_FALSE(fs::exists(to + "/tokenizer_config.json")) << "the checkpoint's, describing another tokenizer";
  EXPECT_NE(r.out.find("copied tokenizer.json\n"), std::string::npos) << r.out;
  // A directory still brings every tokenizer file it has.
  fs::remove_all(to);
  const ShellRun d = sh(kMoetrainBin + " convert --from " + src + " --to " + to + " --tokenizer " + src);
  ASSERT_EQ(d.code, 0) << d.out;
  EXPECT_EQ(slurp(to + "/tokenizer_config.json"), "{\"from\": \"the checkpoint\"}");
}

// `sft --help` listed every option with moetrain train's defaults (steps 2500, eval-problems 200, out-dir
// runs/demo, ...) under a summary line giving sft's own: each option's line now shows what sft uses.
TEST(SftCli, HelpShowsSftsOwnDefaults) {
  // The option's entry in a help text, its wrapped lines joined.
  auto entry_of = [](const std::string& help, const std::string& flag) {
    size_t b = help.find("\n  " + flag + " ");
    if (b == std::string::npos) b = help.find("\n  " + flag + ", ");  // an option with an alias
    if (b == std::string::npos) return std::string();
    std::string entry;
    for (char ch : help.substr(b + 1, help.find("\n  --", b + 1) - b - 1))
      if ((ch != ' ' && ch != '\n') || (!entry.empty() && entry.back() != ' ')) entry += ch == '\n' ? ' ' : ch;
    return entry;
  };
  const ShellRun r = sh(kMoetrainBin + " sft --help");
  ASSERT_EQ(r.code, 0) << r.out;
  for (const auto& [flag, want] : {std::pair<std::string, std::string>{"--steps", "(default 100;"},
                                   {"--eval-problems", "(default 0;"},
                                   {"--eval-every", "(default 0;"},
                                   {"--out-dir", "(default runs/sft)"},
                                   {"--lr", "(default 2e-05;"},
                                   {"--data-format", "(default messages)"},
                                   {"--model", "(required)"}}) {
    const std::string line = entry_of(r.out, flag);
    EXPECT_NE(line.find(want), std::string::npos) << flag << ": '" << line << "' in\n" << r.out;
  }
  // moetrain train's help keeps train's.
  const ShellRun t = sh(kMoetrainBin + " train --help");
  EXPECT_NE(entry_of(t.out, "--steps").find("(default 2500;"), std::string::npos) << t.out;
  EXPECT_NE(entry_of(t.out, "--model").find("(default demo)"), std::string::npos) << t.out;
}

// convert's help says the default --max-shard-size is 5GB, and the option reads GB as 10^9 bytes (as
// transformers' save_pretrained does); the default was 5 << 30 (5 GiB, 7% more).
TEST(ConvertCli, DefaultMaxShardSizeIsTheHelps5GB) {
  const ShellRun r = sh(kMoetrainBin + " convert --help");
  ASSERT_NE(r.out.find("(default 5GB)"), std::string::npos) << r.out;
  EXPECT_EQ(mt::ConvertOptions{}.max_shard_bytes, size_t(5) * 1000 * 1000 * 1000);
}

// MoE settings on a model without MoE layers (a dense Qwen3): score_before_experts once ran and did nothing,
// moe_capacity_factor stopped with "num_experts (0) must be at least 1"; both are refused as
// router_z_loss_coef already was, naming the setting.
TEST(TrainCli, MoeSettingsNeedMoeLayers) {
  const std::string base = kMoetrainBin + " train --device cpu --model " + kGoldens +
                           "/dense_qwen3 --steps 1 --warmup-steps 0 --eval-problems 0 --tensorboard 0 --out-dir " +
                           tmp_path("clioptions", "dense");
  for (const auto& [opts, want] :
       {std::pair<std::string, std::string>{"--score-before-experts 1", "score_before_experts = 1 needs MoE layers"},
        {"--moe-capacity-factor 1.25", "moe_capacity_factor = 1.25 needs MoE layers"}}) {
    const ShellRun r = sh(base + " " + opts);
    EXPECT_NE(r.code, 0) << opts << ": " << r.out;
    EXPECT_NE(r.out.find(want), std::string::npos) << opts << ": " << r.out;
  }
  const ShellRun ok = sh(base);
  EXPECT_EQ(ok.code, 0) << ok.out;
}

// synthetic:addition trains on its own character ids, yet a --tokenizer was copied into every checkpoint,
// which then decoded those ids as that vocabulary's: --tokenizer with synthetic data is refused. (A model
// directory's own tokenizer.json still travels with its checkpoints: it is the model's vocabulary.)
TEST(TrainCli, SyntheticDataTakesNoTokenizer) {
  const std::string model = tmp_path("clioptions", "tiny_with_tokenizer");
  fs::remove_all(model);
  fs::create_directories(model);
  for (const char* f : {"config.json", "model.safetensors"}) fs::copy_file(kGoldens + "/tiny/" + f, model + "/" + f);
  std::ofstream(model + "/tokenizer.json") << "{\"from\": \"the model directory\"}";
  const std::string base = kMoetrainBin + " train --device cpu --model " + model +
                           " --steps 1 --warmup-steps 0 --eval-problems 0 --tensorboard 0 --out-dir ";
  ShellRun r = sh(base + tmp_path("clioptions", "synth_tok") + " --tokenizer " + model + "/tokenizer.json");
  EXPECT_NE(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("tokenizer = \"" + model +
                       "/tokenizer.json\" is not allowed with data = "
                       "\"synthetic:addition\""),
            std::string::npos)
      << r.out;
  const std::string out = tmp_path("clioptions", "synth");
  r = sh(base + out);
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_TRUE(fs::exists(out + "/checkpoint-1/config.json")) << r.out;
  EXPECT_TRUE(fs::exists(out + "/checkpoint-1/tokenizer.json")) << "the model directory's own";
}

// sft read a second --config over the first without a word (train refuses it: which file wins is not
// something to guess).
TEST(SftCli, ConfigGivenTwiceIsAnError) {
  const std::string a = tmp_path("clioptions", "a.json"), b = tmp_path("clioptions", "b.json");
  std::ofstream(a) << "{\"steps\": 3}";
  std::ofstream(b) << "{\"steps\": 5}";
  const ShellRun r = sh(kMoetrainBin + " sft --model x --data y.jsonl --config " + a + " --config=" + b);
  EXPECT_NE(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("moetrain sft: error: --config given twice ('" + a + "' and '" + b + "')"), std::string::npos)
      << r.out;
}

// grads: a policy-loss value that is not a number names its flag (std::stod threw 'stod', or read "0.2abc" as
// 0.2), and a policy-loss option without --objective (cross-entropy's gradients, which it never touched) is an
// error; both before the model is read.
TEST(GradsCli, PolicyOptionsAreNumbersAndNeedAnObjective) {
  ShellRun r = sh(kMoetrainBin + " grads --model /nonexistent --batch b --out o --objective ppo --clip-low 0.2abc");
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.out.find("--clip-low '0.2abc' is not a number"), std::string::npos) << r.out;
  r = sh(kMoetrainBin + " grads --model /nonexistent --batch b --out o --kl-coef 0.1");
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.out.find("--kl-coef sets the RL policy loss; it needs --objective"), std::string::npos) << r.out;
}

// grads --temperature (every head on logits / T) is a positive finite number, checked before the model is read.
TEST(GradsCli, TemperatureIsPositive) {
  ShellRun r = sh(kMoetrainBin + " grads --model /nonexistent --batch b --out o --objective ppo --temperature 0");
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.out.find("moetrain grads: error: --temperature 0; need > 0"), std::string::npos) << r.out;
  r = sh(kMoetrainBin + " grads --model /nonexistent --batch b --out o --temperature warm");
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.out.find("--temperature 'warm' is not a number"), std::string::npos) << r.out;
}
