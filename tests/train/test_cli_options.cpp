// Options of `moetrain convert` and `moetrain sft` that once did not do what they said (the real binary,
// the tiny golden model; each run a second or less): each test fails on the code before its fix.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <sstream>

#include "parallel/launch_test_util.h"

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
