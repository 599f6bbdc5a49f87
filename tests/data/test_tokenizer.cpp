// Tokenizer: id-for-id equality with Hugging Face `tokenizers` on goldens it made (tools/make_tokenizer_goldens.py:
// a trained Qwen2-style tokenizer and the real Qwen vocabulary), decode, NFC against Python's unicodedata, and the
// errors a user sees for bad files.
#include <gtest/gtest.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "core/error.h"
#include "data/tokenizer.h"
#include "data/unicode_tables.h"
#include "test_util.h"

using namespace mt;
using mt::testutil::error_of;
using json = nlohmann::json;

namespace {

const std::string kAssets = std::string(MT_SOURCE_DIR) + "/tests/assets/tokenizer/";

json read_json(const std::string& path) {
  std::ifstream f(path);
  EXPECT_TRUE(f.good()) << path;
  return json::parse(f);
}

std::string from_hex(const std::string& h) {
  std::string out;
  for (size_t i = 0; i + 1 < h.size(); i += 2) out.push_back(char(std::stoi(h.substr(i, 2), nullptr, 16)));
  return out;
}

std::string show(const std::vector<uint32_t>& v) {
  std::ostringstream s;
  for (uint32_t x : v) s << x << ' ';
  return s.str();
}

// Every golden case: encode gives the library's ids, decode gives its text (with and without specials).
void check_goldens(const std::string& name) {
  const Tokenizer tok = Tokenizer::from_file(kAssets + name + "/tokenizer.json");
  const json g = read_json(kAssets + name + "/goldens.json");
  int n = 0, bad_encode = 0, bad_decode = 0;
  for (const json& c : g["cases"]) {
    const std::string text = c.contains("text") ? c["text"].get<std::string>() : from_hex(c["bytes_hex"]);
    const std::vector<uint32_t> want = c["ids"].get<std::vector<uint32_t>>();
    const std::vector<uint32_t> got = tok.encode(text);
    if (got != want && ++bad_encode <= 5)
      ADD_FAILURE() << name << ": encode(" << json(unicode::utf8_lossy(text)).dump() << ")\n  got  " << show(got)
                    << "\n  want " << show(want);
    if ((tok.decode(want) != c["decoded"].get<std::string>() ||
         tok.decode(want, /*skip_special=*/true) != c["decoded_skip"].get<std::string>()) &&
        ++bad_decode <= 5)
      ADD_FAILURE() << name << ": decode(" << show(want) << ") = " << json(tok.decode(want)).dump() << ", want "
                    << c["decoded"].dump();
    ++n;
  }
  for (const json& c : g["decode_cases"]) {
    const std::vector<uint32_t> ids = c["ids"].get<std::vector<uint32_t>>();
    if ((tok.decode(ids) != c["decoded"].get<std::string>() ||
         tok.decode(ids, true) != c["decoded_skip"].get<std::string>()) &&
        ++bad_decode <= 10)
      ADD_FAILURE() << name << ": decode(" << show(ids) << ") = " << json(tok.decode(ids)).dump() << ", want "
                    << c["decoded"].dump();
  }
  EXPECT_GT(n, 2000);
  EXPECT_EQ(bad_encode, 0) << "of " << n << " cases";
  EXPECT_EQ(bad_decode, 0);
}

std::string write_temp(const std::string& name, const std::string& text) {
  const std::string path = (std::filesystem::temp_directory_path() / ("mt_tok_" + name)).string();
  std::ofstream(path) << text;
  return path;
}

// A minimal valid file: bytes a, b, c, merges a+b then ab+c.
json tiny_file() {
  return json::parse(R"({"model": {"type": "BPE", "vocab": {"a": 0, "b": 1, "c": 2, "ab": 3, "abc": 4},
      "merges": ["a b", ["ab", "c"]]}, "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": false,
      "use_regex": true}, "decoder": {"type": "ByteLevel"},
      "added_tokens": [{"id": 5, "content": "<s>", "special": true, "normalized": false}]})");
}

}  // namespace

TEST(Tokenizer, TrainedQwen2StyleMatchesTokenizers) {
  check_goldens("trained");
}

TEST(Tokenizer, QwenVocabularyMatchesTokenizers) {
  check_goldens("qwen");
}

TEST(Tokenizer, NfcMatchesPythonUnicodedata) {
  const json g = read_json(kAssets + "nfc.json");
  int bad = 0;
  for (const json& c : g["cases"]) {
    const std::string in = c[0], want = c[1];
    if (unicode::nfc(in) != want && ++bad <= 5)
      ADD_FAILURE() << "nfc(" << json(in).dump() << ") = " << json(unicode::nfc(in)).dump() << ", want "
                    << json(want).dump();
  }
  EXPECT_EQ(bad, 0) << "of " << g["cases"].size();
  EXPECT_GT(g["cases"].size(), 500u);
}

TEST(Tokenizer, Utf8LossyReplacesMaximalSubparts) {
  // Python: b"a\xf0\x9f\x98b\xffc\xed\xa0\x80".decode("utf-8", "replace") == "a\ufffdb\ufffdc\ufffd\ufffd\ufffd"
  bool changed = false;
  EXPECT_EQ(unicode::utf8_lossy("a\xF0\x9F\x98"
                                "b\xFF"
                                "c\xED\xA0\x80",
                                &changed),
            "a\xEF\xBF\xBD"
            "b\xEF\xBF\xBD"
            "c\xEF\xBF\xBD\xEF\xBF\xBD\xEF\xBF\xBD");
  EXPECT_TRUE(changed);
  EXPECT_EQ(unicode::utf8_lossy("héllo", &changed), "héllo");
  EXPECT_FALSE(changed);
}

TEST(Tokenizer, TinyFileMergesByRankAndDecodes) {
  const Tokenizer tok = Tokenizer::from_json(tiny_file().dump(), "tiny");
  EXPECT_EQ(tok.encode("abc"), (std::vector<uint32_t>{4}));
  EXPECT_EQ(tok.encode("abca<s>b"), (std::vector<uint32_t>{4, 0, 5, 1}));
  EXPECT_EQ(tok.encode("xyz"), std::vector<uint32_t>{});  // bytes without a token are dropped, as in the library
  EXPECT_EQ(tok.decode(std::vector<uint32_t>{4, 5, 0}), "abc<s>a");
  EXPECT_EQ(tok.decode(std::vector<uint32_t>{4, 5, 0}, true), "abca");
  EXPECT_EQ(tok.vocab_size(), 6u);
  EXPECT_EQ(tok.token_to_id("<s>"), 5);
  EXPECT_EQ(tok.token_to_id("zz"), -1);
  // A copy has its own cache and gives the same ids.
  Tokenizer copy = tok;
  EXPECT_EQ(copy.encode("abcabc"), tok.encode("abcabc"));
}

TEST(Tokenizer, LongRunsDoNotExhaustTheRegexStack) {
  const Tokenizer tok = Tokenizer::from_file(kAssets + "qwen/tokenizer.json");
  const std::string spaces(200000, ' ');
  const std::vector<uint32_t> ids = tok.encode(spaces + "x");
  EXPECT_GT(ids.size(), 1u);
  EXPECT_EQ(tok.decode(ids), spaces + "x");
}

TEST(Tokenizer, ErrorsNameTheFileAndTheProblem) {
  EXPECT_NE(
      error_of([] { Tokenizer::from_file("/no/such/tokenizer.json"); }).find("/no/such/tokenizer.json: cannot open"),
      std::string::npos);
  const std::string bad_json = write_temp("bad.json", "{\"model\": {\"type\": \"BPE\",");
  std::string e = error_of([&] { Tokenizer::from_file(bad_json); });
  EXPECT_NE(e.find(bad_json), std::string::npos) << e;
  EXPECT_NE(e.find("not valid JSON"), std::string::npos) << e;

  json wp = tiny_file();
  wp["model"]["type"] = "WordPiece";
  const std::string wp_path = write_temp("wordpiece.json", wp.dump());
  e = error_of([&] { Tokenizer::from_file(wp_path); });
  EXPECT_NE(e.find(wp_path), std::string::npos) << e;
  EXPECT_NE(e.find("model type 'WordPiece' is not supported (supported: BPE)"), std::string::npos) << e;

  json m = tiny_file();
  m["model"]["merges"].push_back("b zz");
  e = error_of([&] { Tokenizer::from_json(m.dump(), "m.json"); });
  EXPECT_NE(e.find("m.json: merge 2 uses 'zz', which is not in the vocabulary"), std::string::npos) << e;

  json n = tiny_file();
  n["normalizer"] = json{{"type", "Lowercase"}};
  e = error_of([&] { Tokenizer::from_json(n.dump(), "n.json"); });
  EXPECT_NE(e.find("normalizer type 'Lowercase' is not supported"), std::string::npos) << e;

  json s = tiny_file();
  s["pre_tokenizer"] = json::parse(R"({"type": "Split", "pattern": {"Regex": "(["}, "behavior": "Isolated"})");
  e = error_of([&] { Tokenizer::from_json(s.dump(), "s.json"); });
  EXPECT_NE(e.find("split regex '([' does not compile"), std::string::npos) << e;

  const Tokenizer tok = Tokenizer::from_json(tiny_file().dump(), "tiny");
  e = error_of([&] { tok.decode(std::vector<uint32_t>{0, 99}); });
  EXPECT_NE(e.find("id 99 at position 1 is not in the vocabulary (6 ids)"), std::string::npos) << e;
  std::remove(bad_json.c_str());
  std::remove(wp_path.c_str());
}
