// `moetrain sft` end to end on the CPU: the tiny preset (vocabulary widened for the trained test
// tokenizer) on the built-in example chat file, packed, loss on the assistant turns: the loss falls;
// the checkpoint is a model directory (config, weights, tokenizer) that a second sft starts from.
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>

#include "test_util.h"
#include "train/sft.h"
#include "train/trainer.h"

using namespace mt;
namespace fs = std::filesystem;

namespace {
const std::string kSrc = MT_SOURCE_DIR;
std::vector<std::string> base_args(const std::string& out) {
  return {"--data",
          kSrc + "/examples/chat_small.jsonl",
          "--out-dir",
          out,
          "--device",
          "cpu",
          "--seq-len",
          "256",
          "--micro-batch-size",
          "4",
          "--log-every",
          "10",
          "--tensorboard",
          "0"};
}
}  // namespace

TEST(Sft, TinyModelLearnsTheExampleChats) {
  const std::string out = (fs::temp_directory_path() / ("moetrain_sft_" + std::to_string(getpid()))).string();
  fs::remove_all(out);
  std::vector<std::string> a = base_args(out);
  for (const char* s : {"--model", "tiny", "--steps", "30", "--lr", "3e-3", "--min-lr", "3e-4", "--warmup-steps", "3"})
    a.push_back(s);
  a.push_back("--tokenizer");
  a.push_back(kSrc + "/tests/assets/tokenizer/trained/tokenizer.json");
  const TrainConfig cfg = prepare_sft(sft_config_from_args(a));
  EXPECT_EQ(cfg.model, out + "/init-model");
  const TrainSummary s = run_training(cfg);
  EXPECT_LT(s.last_loss, 0.6 * s.first_loss) << s.first_loss << " -> " << s.last_loss;
  const std::string ck = out + "/checkpoint-30";
  for (const char* f : {"config.json", "model.safetensors", "tokenizer.json"})
    EXPECT_TRUE(fs::exists(ck + "/" + f)) << f;

  // The checkpoint is a model directory: sft starts from its weights and tokenizer.
  std::vector<std::string> b = base_args(out + "/again");
  for (const char* x :
       {"--model", ck.c_str(), "--steps", "2", "--warmup-steps", "1", "--lr", "1e-4", "--min-lr", "1e-5"})
    b.push_back(x);
  const TrainConfig c2 = prepare_sft(sft_config_from_args(b));
  EXPECT_EQ(c2.init_from, ck);
  EXPECT_EQ(c2.tokenizer, ck + "/tokenizer.json");
  const TrainSummary s2 = run_training(c2);
  EXPECT_LT(s2.first_loss, 0.7 * s.first_loss);  // starts where the first run ended, not from scratch
  fs::remove_all(out);
}

TEST(Sft, ArgumentErrorsNameWhatIsMissing) {
  EXPECT_NE(testutil::error_of([] {
              sft_config_from_args({"--data", "x.jsonl"});
            }).find("sft: --model is required\nusage: moetrain sft --model DIR --data FILE.jsonl"),
            std::string::npos);
  EXPECT_NE(testutil::error_of([] {
              sft_config_from_args({"--model", "tiny"});
            }).find("sft: --data is required\nusage: moetrain sft"),
            std::string::npos);
  EXPECT_NE(testutil::error_of([] {
              sft_config_from_args({"--model", "tiny", "--data", "x.bin"});
            }).find("is not a .jsonl file"),
            std::string::npos);
  const TrainConfig c = sft_config_from_args({"--model", "tiny", "--data", "x.jsonl"});
  EXPECT_NE(testutil::error_of([&] { prepare_sft(c); }).find("give its tokenizer with --tokenizer"), std::string::npos);
  TrainConfig d = c;
  d.model = "nope";
  EXPECT_NE(testutil::error_of([&] { prepare_sft(d); }).find("neither a directory nor a preset"), std::string::npos);
}

// The data position is the whole state of the packed data (a checkpoint saves it): an sft run stopped at step 3
// and resumed finishes exactly as the run that never stopped.
TEST(Sft, ResumedRunEqualsTheUninterruptedOne) {
  const std::string out = (fs::temp_directory_path() / ("moetrain_sft_resume_" + std::to_string(getpid()))).string();
  fs::remove_all(out);
  auto args = [&](const std::string& dir) {
    std::vector<std::string> a = base_args(dir);
    for (const char* s :
         {"--model", "tiny", "--steps", "6", "--save-every", "3", "--seq-len", "128", "--micro-batch-size", "2",
          "--grad-accum", "2", "--lr", "3e-3", "--min-lr", "3e-4", "--warmup-steps", "1"})
      a.push_back(s);
    a.push_back("--tokenizer");
    a.push_back(kSrc + "/tests/assets/tokenizer/trained/tokenizer.json");
    return a;
  };
  const TrainSummary whole = run_training(prepare_sft(sft_config_from_args(args(out + "/whole"))));
  TrainConfig first = prepare_sft(sft_config_from_args(args(out + "/parts")));
  first.max_steps = 3;
  run_training(first);
  TrainConfig second = prepare_sft(sft_config_from_args(args(out + "/parts")));
  second.resume = "latest";
  const TrainSummary rest = run_training(second);
  EXPECT_EQ(rest.last_loss, whole.last_loss);    // CPU, one process: bit for bit
  EXPECT_NE(rest.first_loss, whole.first_loss);  // it did start at step 4
  fs::remove_all(out);
}
