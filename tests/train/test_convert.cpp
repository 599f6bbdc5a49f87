// `moetrain convert`: a training checkpoint to a Hugging Face directory — the files, the
// index, the dtype and values of every tensor, the tokenizer files, and the refusals. (The transformers
// load and the logits comparison are tools/check_hf_export.py's: CI has no torch.)
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "io/safetensors.h"
#include "model/hf_checkpoint.h"
#include "test_util.h"
#include "train/convert.h"
#include "train/trainer.h"
#include "train/trainer_test_util.h"

using namespace mt;
namespace fs = std::filesystem;

namespace {

// One tiny training run per test process: its final checkpoint (with a tokenizer beside the weights).
// The run directory goes when the process ends.
struct RunDir {
  std::string path;
  ~RunDir() {
    if (!path.empty()) fs::remove_all(path);
  }
} run_dir;

const std::string& trained_checkpoint() {
  static const std::string dir = [] {
    TrainConfig c = test::tiny_train_run("convert", "run", 0);
    run_dir.path = c.out_dir;
    c.steps = 2;
    c.tensorboard = 0;
    const TrainSummary s = run_training(c);
    std::ofstream(s.checkpoint_dir + "/tokenizer.json") << "{\"model\": {\"type\": \"BPE\"}}";
    std::ofstream(s.checkpoint_dir + "/tokenizer_config.json") << "{\"eos_token\": \"<|im_end|>\"}";
    return s.checkpoint_dir;
  }();
  return dir;
}

std::string fresh(const std::string& name) {
  const std::string d =
      (fs::temp_directory_path() / ("moetrain_convert_" + name + "_" + std::to_string(getpid()))).string();
  fs::remove_all(d);
  return d;
}

nlohmann::json read_json(const std::string& p) {
  return nlohmann::json::parse(std::ifstream(p));
}

}  // namespace

TEST(Convert, Bf16ShardsWithIndexConfigAndTokenizer) {
  const std::string& ckpt = trained_checkpoint();
  ConvertOptions o;
  o.from = ckpt;
  o.to = fresh("bf16");
  o.dtype = DType::BF16;
  o.max_shard_bytes = 100000;  // the tiny model is ~380 KB in bf16: several shards
  const ConvertReport r = convert_checkpoint(o);
  EXPECT_GT(r.shards, 2u);
  EXPECT_FALSE(fs::exists(o.to + ".tmp"));
  for (const char* f : {"config.json", "generation_config.json", "model.safetensors.index.json", "tokenizer.json",
                        "tokenizer_config.json"})
    EXPECT_TRUE(fs::is_regular_file(fs::path(o.to) / f)) << f;
  for (const char* f : {"manifest.json", "train_state.json", "train_state", "model.safetensors"})
    EXPECT_FALSE(fs::exists(fs::path(o.to) / f)) << f;
  EXPECT_EQ(read_json(o.to + "/config.json")["torch_dtype"], "bfloat16");
  // The index names every tensor once, each in a file that holds it; total_size is the bytes of the data.
  const nlohmann::json idx = read_json(o.to + "/model.safetensors.index.json");
  const CheckpointReader src(ckpt), out(o.to);
  EXPECT_EQ(out.names(), src.names());
  size_t total = 0;
  for (const std::string& n : src.names()) {
    ASSERT_TRUE(idx["weight_map"].contains(n)) << n;
    const SafetensorsFile f(o.to + "/" + idx["weight_map"][n].get<std::string>());
    ASSERT_TRUE(f.has(n)) << n;
    EXPECT_EQ(f.info(n).dtype, DType::BF16) << n;
    EXPECT_EQ(f.info(n).shape, src.info(n).shape) << n;
    total += f.info(n).end - f.info(n).begin;
    // bf16 values are the source's f32 values rounded to nearest even.
    EXPECT_TRUE(testutil::same_bits(out.view(n), src.read_f32(n).to(DType::BF16))) << n;
  }
  EXPECT_EQ(idx["metadata"]["total_size"].get<size_t>(), total);
  // Our loader reads the export back (the bf16 weights as f32).
  const ModelConfig mc = load_model_config(o.to);
  ParamTable t(mc);
  Tensor flat = Tensor::zeros({t.total()});
  EXPECT_EQ(load_hf_weights(o.to, mc, t, flat).tensors, src.names().size());
  fs::remove_all(o.to);
}

TEST(Convert, F32IsTheCheckpointsWeightsBitForBit) {
  const std::string& ckpt = trained_checkpoint();
  ConvertOptions o;
  o.from = ckpt;
  o.to = fresh("f32");
  o.dtype = DType::F32;
  const ConvertReport r = convert_checkpoint(o);
  EXPECT_EQ(r.shards, 1u);  // below 5 GB: model.safetensors
  EXPECT_EQ(read_json(o.to + "/config.json")["torch_dtype"], "float32");
  const CheckpointReader src(ckpt), out(o.to);
  for (const std::string& n : src.names()) EXPECT_TRUE(testutil::same_bits(out.view(n), src.view(n))) << n;
  fs::remove_all(o.to);
}

TEST(Convert, RefusesACorruptCheckpointAndAnOccupiedTarget) {
  const std::string& ckpt = trained_checkpoint();
  const std::string copy = fresh("corrupt_src");
  fs::copy(ckpt, copy, fs::copy_options::recursive);
  ConvertOptions o;
  o.from = copy;
  o.to = fresh("occupied");
  fs::create_directories(o.to);
  std::ofstream(o.to + "/keep.txt") << "user data";
  std::string e = testutil::error_of([&] { convert_checkpoint(o); });
  EXPECT_NE(e.find("exists and is not an empty directory"), std::string::npos) << e;
  EXPECT_TRUE(fs::exists(o.to + "/keep.txt"));
  fs::remove_all(o.to);
  fs::resize_file(copy + "/model.safetensors", 1000);
  e = testutil::error_of([&] { convert_checkpoint(o); });
  EXPECT_NE(e.find("does not verify against its manifest: model.safetensors has 1000 bytes"), std::string::npos) << e;
  EXPECT_FALSE(fs::exists(o.to));
  fs::remove_all(copy);
}
