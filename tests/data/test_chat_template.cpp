// The Qwen3 chat template: equal to transformers' apply_chat_template with Qwen3's Jinja template
// (tests/assets/tokenizer/chat.json, made by tools/make_tokenizer_goldens.py) on system prompts, thinking on/off,
// reasoning kept or dropped around the last user query, tools, tool calls and responses; the rendered text's ids
// equal the library's; errors name the message.
#include <gtest/gtest.h>

#include <fstream>
#include <nlohmann/json.hpp>

#include "data/chat_template.h"
#include "data/tokenizer.h"
#include "test_util.h"

using namespace mt;
using mt::testutil::error_of;
using ojson = nlohmann::ordered_json;

namespace {
const std::string kAssets = std::string(MT_SOURCE_DIR) + "/tests/assets/tokenizer/";
}

TEST(ChatTemplate, Qwen3MatchesTransformers) {
  std::ifstream f(kAssets + "chat.json");
  const ojson g = ojson::parse(f);
  const Tokenizer tok = Tokenizer::from_file(kAssets + "qwen/tokenizer.json");
  ASSERT_GE(g["cases"].size(), 10u);
  for (const ojson& c : g["cases"]) {
    ChatOptions o;
    o.add_generation_prompt = c.value("add_generation_prompt", false);
    if (c.contains("enable_thinking")) o.enable_thinking = c["enable_thinking"].get<bool>();
    const std::string text = render_qwen3_chat(c["messages"], c.value("tools", ojson()), o);
    EXPECT_EQ(text, c["text"].get<std::string>()) << c["messages"].dump();
    EXPECT_EQ(tok.encode(text), c["ids"].get<std::vector<uint32_t>>()) << c["messages"].dump();
  }
}

TEST(ChatTemplate, PythonJsonDumps) {
  const ojson x = ojson::parse(R"({"b": [1, 2.5, true, null], "a": "q\"\\\n\u0001é"})");
  EXPECT_EQ(python_json_dumps(x), "{\"b\": [1, 2.5, true, null], \"a\": \"q\\\"\\\\\\n\\u0001é\"}");
}

TEST(ChatTemplate, ErrorsNameTheMessage) {
  EXPECT_NE(error_of([] {
              render_qwen3_chat(ojson::parse(R"([{"content": "x"}])"), ojson(), {});
            }).find("message 0 has no string \"role\""),
            std::string::npos);
  EXPECT_NE(error_of([] {
              render_qwen3_chat(ojson::parse(R"({"role": "user"})"), ojson(), {});
            }).find("\"messages\" is object, not an array"),
            std::string::npos);
}
