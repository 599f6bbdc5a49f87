// `moetrain tokenize` as a user runs it (the real binary): ids of stdin lines equal the library's goldens, --jsonl
// carries newlines and tabs, --decode round-trips, --chat renders and encodes, --bench prints its JSON line, and bad
// input is an error naming the line.
#include <gtest/gtest.h>

#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "parallel/launch_test_util.h"

using namespace mt::test;
using json = nlohmann::json;

namespace {

const std::string kTok = std::string(MT_SOURCE_DIR) + "/tests/assets/tokenizer/qwen/tokenizer.json";

std::string write(const std::string& name, const std::string& text) {
  const std::string p = tmp_path("tokcli", name);
  std::ofstream(p, std::ios::binary) << text;
  return p;
}

std::string ids_line(const json& ids) {
  std::string s;
  for (size_t i = 0; i < ids.size(); ++i) s += (i ? " " : "") + std::to_string(ids[i].get<uint32_t>());
  return s;
}

}  // namespace

TEST(TokenizeCli, JsonlEncodeAndDecodeRoundTrip) {
  std::ifstream f(std::string(MT_SOURCE_DIR) + "/tests/assets/tokenizer/qwen/goldens.json");
  const json g = json::parse(f);
  std::string in, want;
  int n = 0;
  for (const json& c : g["cases"]) {
    if (!c.contains("text") || n >= 300) continue;
    in += c["text"].dump() + "\n";
    want += ids_line(c["ids"]) + "\n";
    ++n;
  }
  const std::string in_path = write("in.jsonl", in), ids_path = tmp_path("tokcli", "ids.txt");
  ShellRun r =
      sh("sh -c '" + kMoetrainBin + " tokenize --tokenizer " + kTok + " --jsonl < " + in_path + " > " + ids_path + "'");
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("tokenize: 300 lines"), std::string::npos) << r.out;
  std::ifstream ids_f(ids_path);
  std::stringstream got;
  got << ids_f.rdbuf();
  EXPECT_EQ(got.str(), want);
  // Decode back to JSON strings: the library's decode of each (the text itself unless NFC changed it).
  const std::string back = tmp_path("tokcli", "back.jsonl");
  r = sh("sh -c '" + kMoetrainBin + " tokenize --tokenizer " + kTok + " --decode --jsonl < " + ids_path + " > " + back +
         "'");
  ASSERT_EQ(r.code, 0) << r.out;
  std::ifstream bf(back);
  std::string line;
  size_t i = 0;
  for (const json& c : g["cases"]) {
    if (!c.contains("text") || i >= 300) continue;
    ASSERT_TRUE(std::getline(bf, line)) << i;
    EXPECT_EQ(json::parse(line).get<std::string>(), c["decoded"].get<std::string>()) << i;
    ++i;
  }
}

TEST(TokenizeCli, PlainLinesChatAndBench) {
  ShellRun r = sh("printf 'hello world\\n\\n<|im_start|>user\\n' | " + kMoetrainBin + " tokenize --tokenizer " + kTok);
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_EQ(r.out.substr(0, r.out.find("tokenize:")), "14990 1879\n\n151644 872\n");
  r = sh("echo '{\"messages\": [{\"role\": \"user\", \"content\": \"hello\"}]}' | " + kMoetrainBin +
         " tokenize --tokenizer " + kTok + " --chat --text --add-generation-prompt --enable-thinking false");
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find(R"("<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n")"),
            std::string::npos)
      << r.out;
  const std::string text = write("bench.txt", "hello world\nthe quick brown fox 123\n你好\n");
  r = sh(kMoetrainBin + " tokenize --tokenizer " + kTok + " --bench --passes 2 --file " + text);
  ASSERT_EQ(r.code, 0) << r.out;
  const json j = json::parse(r.out);
  EXPECT_EQ(j["bench"], "tokenize");
  EXPECT_EQ(j["lines"], 3);
  EXPECT_GT(j["tokens"].get<int>(), 8);
  EXPECT_GT(j["mb_per_s"].get<double>(), 0.0);
}

TEST(TokenizeCli, BadInputNamesTheLine) {
  ShellRun r = sh("printf '\"ok\"\\n[1, 2]\\n' | " + kMoetrainBin + " tokenize --tokenizer " + kTok + " --jsonl");
  EXPECT_EQ(r.code, 1);
  EXPECT_NE(r.out.find("stdin line 2: expected a JSON string, got array"), std::string::npos) << r.out;
  r = sh("printf '1 2\\n3 999999\\n' | " + kMoetrainBin + " tokenize --tokenizer " + kTok + " --decode");
  EXPECT_EQ(r.code, 1);
  EXPECT_NE(r.out.find("stdin line 2: "), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("id 999999 at position 1 is not in the vocabulary"), std::string::npos) << r.out;
  r = sh(kMoetrainBin + " tokenize < /dev/null");
  EXPECT_EQ(r.code, 1);
  EXPECT_NE(r.out.find("--tokenizer is required"), std::string::npos) << r.out;
  r = sh(kMoetrainBin + " tokenize --tokenizer /no/such.json < /dev/null");
  EXPECT_NE(r.out.find("/no/such.json: cannot open"), std::string::npos) << r.out;
}
