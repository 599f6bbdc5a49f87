// The Jinja subset (data/jinja.h): templates rendered by transformers' apply_chat_template (tests/assets/tokenizer/
// jinja.json, tools/make_jinja_goldens.py) give the same text here; Qwen3's own template through the interpreter
// gives transformers' text on the chat goldens and equals the built-in renderer; what the subset cannot run is an
// error naming the construct and the template line.
#include <gtest/gtest.h>

#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "data/chat_template.h"
#include "data/jinja.h"
#include "test_util.h"

using namespace mt;
using mt::testutil::error_of;
using ojson = nlohmann::ordered_json;

namespace {

const std::string kAssets = std::string(MT_SOURCE_DIR) + "/tests/assets/tokenizer/";

std::string read(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

std::string render(const std::string& tpl, const ojson& ctx = ojson::object()) {
  return jinja::Template(tpl, "test template").render(ctx);
}

}  // namespace

TEST(Jinja, MatchesTransformersOnGoldens) {
  const ojson g = ojson::parse(read(kAssets + "jinja.json"));
  ASSERT_GE(g["cases"].size(), 8u);
  for (const ojson& c : g["cases"]) {
    ojson ctx = c["kwargs"];
    ctx["messages"] = c["messages"];
    EXPECT_EQ(render(c["template"].get<std::string>(), ctx), c["text"].get<std::string>()) << c["name"];
  }
}

TEST(Jinja, RaiseExceptionNamesTheTemplateLine) {
  const ojson g = ojson::parse(read(kAssets + "jinja.json"));
  for (const ojson& c : g["cases"]) {
    if (c["name"] != "bos_roles") continue;
    ojson ctx = c["kwargs"];
    ctx["messages"] = ojson::parse(R"([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])");
    const std::string e = error_of([&] { render(c["template"].get<std::string>(), ctx); });
    EXPECT_EQ(e,
              "test template line 15: the template raised an error: Conversation roles must alternate "
              "user/assistant/user/assistant/...");
    return;
  }
  FAIL() << "no bos_roles case in jinja.json";
}

TEST(Jinja, Qwen3TemplateMatchesTransformersAndTheBuiltInRenderer) {
  const std::string tpl = read(kAssets + "qwen3_chat_template.jinja");
  ASSERT_FALSE(tpl.empty());
  const jinja::Template t(tpl, "qwen3_chat_template.jinja");
  const ojson g = ojson::parse(read(kAssets + "chat.json"));
  ASSERT_GE(g["cases"].size(), 10u);
  for (const ojson& c : g["cases"]) {
    ojson ctx = ojson::object();
    ctx["messages"] = c["messages"];
    ctx["tools"] = c.value("tools", ojson());
    ctx["add_generation_prompt"] = c.value("add_generation_prompt", false);
    ChatOptions o;
    o.add_generation_prompt = c.value("add_generation_prompt", false);
    if (c.contains("enable_thinking")) {
      ctx["enable_thinking"] = c["enable_thinking"];
      o.enable_thinking = c["enable_thinking"].get<bool>();
    }
    const std::string text = t.render(ctx);
    EXPECT_EQ(text, c["text"].get<std::string>()) << c["messages"].dump();
    EXPECT_EQ(text, render_qwen3_chat(c["messages"], c.value("tools", ojson()), o)) << c["messages"].dump();
  }
}

TEST(Jinja, PlainChatMLTemplate) {
  const std::string tpl =
      "{%- for message in messages %}\n"
      "    {{- '<|im_start|>' + message.role + '\\n' + message.content | trim + '<|im_end|>\\n' }}\n"
      "{%- endfor %}\n"
      "{%- if add_generation_prompt %}\n"
      "    {{- '<|im_start|>assistant\\n' }}\n"
      "{%- endif %}\n";
  const ojson ctx = ojson::parse(
      R"({"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": " 2+2? "}],
          "add_generation_prompt": true})");
  EXPECT_EQ(render(tpl, ctx),
            "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n");
}

TEST(Jinja, ScopingLoopControlAndUndefined) {
  // A set inside a loop stays in its iteration; a namespace carries values out.
  EXPECT_EQ(render("{% set x = 1 %}{% for i in [1, 2] %}{% set x = i %}{% endfor %}{{ x }}"), "1");
  EXPECT_EQ(render("{% set ns = namespace(x=1) %}{% for i in [1, 2] %}{% set ns.x = i %}{% endfor %}{{ ns.x }}"), "2");
  EXPECT_EQ(render("{% for i in [1, 2, 3] %}{% if i == 2 %}{% break %}{% endif %}{{ i }}{% endfor %}"), "1");
  EXPECT_EQ(render("{{ nothing }}|{{ nothing is defined }}|{{ 'a' if nothing }}"), "|False|");
  EXPECT_EQ(render("{% generation %}kept{% endgeneration %}"), "kept");
  EXPECT_EQ(render("{% for i in [1, 2] %}{{ loop.previtem is defined }}{{ loop.nextitem }};{% endfor %}"),
            "False2;True;");
}

TEST(Jinja, ErrorsNameTheConstructAndTheLine) {
  std::string e = error_of([] { render("line one\n{% if x %}\n{% macro m() %}{% endmacro %}\n{% endif %}"); });
  EXPECT_NE(e.find("test template line 3: {% macro %} is not supported"), std::string::npos) << e;
  e = error_of([] { jinja::Template("a\n\n{{ x | wordcount }}", "t"); });  // at parse time, whatever the data
  EXPECT_NE(e.find("t line 3: the filter 'wordcount' is not supported"), std::string::npos) << e;
  e = error_of([] { render("{% if x %}\nno end"); });
  EXPECT_NE(e.find("line 1: the block opened here is never closed: expected {% elif %} or {% else %} or {% endif %}"),
            std::string::npos)
      << e;
  e = error_of([] {
    render("{% for m in messages %}\n{{ raise_exception('Only user and assistant roles') }}{% endfor %}",
           ojson::parse(R"({"messages": [1]})"));
  });
  EXPECT_NE(e.find("line 2: the template raised an error: Only user and assistant roles"), std::string::npos) << e;
  e = error_of([] { render("{{ a.b.c }}", ojson::parse(R"({"a": {}})")); });
  EXPECT_NE(e.find("line 1: '.c' on undefined (dict has no attribute 'b')"), std::string::npos) << e;
  e = error_of([] { render("{{ 'a' + 1 }}"); });
  EXPECT_NE(e.find("line 1: '+' between string and integer"), std::string::npos) << e;
  e = error_of([] { jinja::Template("{{ x is divisibleby }}", "t"); });
  EXPECT_NE(e.find("the test 'is divisibleby' is not supported"), std::string::npos) << e;
  e = error_of([] { render("{{ 'abc' "); });
  EXPECT_NE(e.find("line 1: a tag opened here is never closed"), std::string::npos) << e;
}
