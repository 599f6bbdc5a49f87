// Qwen3 tool calls parsed from a turn (each malformation named, with the bad text quoted) and the text a tool's or a
// user's answer appends after an assistant turn, equal to what the Qwen3 template renders for the longer
// conversation past the shorter one.
#include <gtest/gtest.h>

#include "data/chat_template.h"
#include "rl/env/tool_call.h"

using namespace mt;
using namespace mt::rl;
using ojson = nlohmann::ordered_json;

TEST(ToolCall, ParsesQwen3Calls) {
  std::string err = "stale";
  auto c = parse_tool_call(
      "I'll check.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\", \"days\": 3}}\n"
      "</tool_call>",
      &err);
  ASSERT_TRUE(c.has_value()) << err;
  EXPECT_EQ(err, "");
  EXPECT_EQ(c->name, "get_weather");
  EXPECT_EQ(c->arguments, nlohmann::json::parse(R"({"city": "Paris", "days": 3})"));

  // Arguments as a JSON string holding an object, as Qwen3 models sometimes write them.
  c = parse_tool_call("<tool_call>{\"name\": \"f\", \"arguments\": \"{\\\"x\\\": 1}\"}</tool_call>", &err);
  ASSERT_TRUE(c.has_value()) << err;
  EXPECT_EQ(c->arguments, nlohmann::json::parse(R"({"x": 1})"));

  // Absent arguments: an empty object.
  c = parse_tool_call("<tool_call>{\"name\": \"now\"}</tool_call>", &err);
  ASSERT_TRUE(c.has_value()) << err;
  EXPECT_EQ(c->arguments, nlohmann::json::object());

  // Several calls in one turn.
  const std::vector<ToolCall> all = parse_tool_calls(
      "<tool_call>\n{\"name\": \"a\", \"arguments\": {}}\n</tool_call>\n<tool_call>\n{\"name\": \"b\", \"arguments\": "
      "{\"k\": [1]}}\n</tool_call>",
      &err);
  ASSERT_EQ(all.size(), 2u) << err;
  EXPECT_EQ(all[0].name, "a");
  EXPECT_EQ(all[1].name, "b");
  EXPECT_EQ(all[1].arguments["k"][0], 1);
}

TEST(ToolCall, NoTagsIsNoCallAndNoError) {
  std::string err = "stale";
  EXPECT_FALSE(parse_tool_call("The answer is 42.", &err).has_value());
  EXPECT_EQ(err, "");
  EXPECT_TRUE(parse_tool_calls("", nullptr).empty());
}

TEST(ToolCall, MalformedCallsSayWhatWasWrong) {
  auto error_for = [](const std::string& text) {
    std::string err;
    EXPECT_FALSE(parse_tool_call(text, &err).has_value()) << text;
    return err;
  };
  std::string e = error_for("<tool_call>\n{\"name\": \"f\", \"arguments\": {\"x\": }\n</tool_call>");
  EXPECT_NE(e.find("tool call 1: not valid JSON"), std::string::npos) << e;
  EXPECT_NE(e.find("\"{\\\"name\\\": \\\"f\\\", \\\"arguments\\\": {\\\"x\\\": }\""), std::string::npos) << e;
  e = error_for("<tool_call>{\"arguments\": {}}</tool_call>");
  EXPECT_NE(e.find("tool call 1: no \"name\""), std::string::npos) << e;
  e = error_for("<tool_call>{\"name\": 7, \"arguments\": {}}</tool_call>");
  EXPECT_NE(e.find("\"name\" is \"7\", not a non-empty string"), std::string::npos) << e;
  e = error_for("<tool_call>{\"name\": \"f\", \"arguments\": [1, 2]}</tool_call>");
  EXPECT_NE(e.find("\"arguments\" of f is \"[1,2]\"; allowed: an object (or a JSON string holding one)"),
            std::string::npos)
      << e;
  e = error_for("<tool_call>{\"name\": \"f\", \"arguments\": \"not json\"}</tool_call>");
  EXPECT_NE(e.find("\"arguments\" of f is a string that is not a JSON object"), std::string::npos) << e;
  e = error_for("<tool_call>[\"f\"]</tool_call>");
  EXPECT_NE(e.find("expected a JSON object"), std::string::npos) << e;
  e = error_for("<tool_call>\n{\"name\": \"f\", \"arguments\": {}}");
  EXPECT_NE(e.find("tool call 1: <tool_call> without </tool_call>"), std::string::npos) << e;
  // The second of two calls is bad: no call, and the error names it.
  e = error_for("<tool_call>{\"name\": \"a\"}</tool_call><tool_call>{\"name\": \"b\", \"arguments\": 1}</tool_call>");
  EXPECT_NE(e.find("tool call 2: \"arguments\" of b is \"1\""), std::string::npos) << e;
  // Long bad text is quoted truncated.
  e = error_for("<tool_call>{" + std::string(500, 'x') + "</tool_call>");
  EXPECT_LT(e.size(), 300u) << e;
  EXPECT_NE(e.find("..."), std::string::npos) << e;
}

namespace {

// The Qwen3 rendering of `before` + `after` with the generation prompt, past the rendering of `before`.
std::string appended(const ojson& before, const ojson& after, const ChatOptions& o) {
  ojson longer = before;
  for (const ojson& m : after) longer.push_back(m);
  ChatOptions gen = o;
  gen.add_generation_prompt = true;
  const std::string shorter = render_qwen3_chat(before, ojson(), ChatOptions{});
  const std::string full = render_qwen3_chat(longer, ojson(), gen);
  EXPECT_EQ(full.substr(0, shorter.size()), shorter) << "not a prefix";
  return full.substr(shorter.size());
}

}  // namespace

TEST(ToolCall, ToolResponseIsWhatTheTemplateAppends) {
  // An assistant turn with reasoning and a tool call, then one or two tool results: the longer conversation
  // renders as the shorter one plus exactly this text.
  const ojson before = ojson::parse(R"([
    {"role": "user", "content": "Weather in Paris and Lyon?"},
    {"role": "assistant", "content": "<think>\nI should call the tool.\n</think>\n\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>"}])");
  const std::string one = render_tool_response({{"tool", "{\"temp\": 21}"}}, {});
  EXPECT_EQ(one,
            "<|im_start|>user\n<tool_response>\n{\"temp\": 21}\n</tool_response><|im_end|>\n<|im_start|>assistant\n");
  EXPECT_EQ(one, appended(before, ojson::parse(R"([{"role": "tool", "content": "{\"temp\": 21}"}])"), {}));
  const std::string two = render_tool_response({{"tool", "21"}, {"tool", "19"}}, {});
  EXPECT_EQ(
      two,
      appended(before, ojson::parse(R"([{"role": "tool", "content": "21"}, {"role": "tool", "content": "19"}])"), {}));
  EXPECT_NE(two.find("</tool_response>\n<tool_response>"), std::string::npos) << two;  // one user turn
  ChatOptions no_think;
  no_think.enable_thinking = false;
  EXPECT_EQ(render_tool_response({{"tool", "x"}}, no_think),
            appended(before, ojson::parse(R"([{"role": "tool", "content": "x"}])"), no_think));
  EXPECT_TRUE(render_tool_response({{"tool", "x"}}, no_think).ends_with("<think>\n\n</think>\n\n"));
}

TEST(ToolCall, UserObservationIsWhatFollowsTheAssistantTurn) {
  // A user answer makes the template drop the earlier turn's reasoning, so the longer rendering is not an
  // extension of the shorter; the text after the assistant turn's <|im_end|>\n is still exactly this.
  const std::string text = render_tool_response({{"user", "Try again."}}, {});
  EXPECT_EQ(text, "<|im_start|>user\nTry again.<|im_end|>\n<|im_start|>assistant\n");
  const ojson before = ojson::parse(R"([{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}])");
  ChatOptions gen;
  gen.add_generation_prompt = true;
  ojson longer = before;
  longer.push_back({{"role", "user"}, {"content", "Try again."}});
  const std::string full = render_qwen3_chat(longer, ojson(), gen);
  const std::string turn = "a<|im_end|>\n";
  EXPECT_EQ(full.substr(full.find(turn) + turn.size()), text);
  // Mixed: tool results then a user message.
  EXPECT_EQ(render_tool_response({{"tool", "r"}, {"user", "u"}}, {}),
            "<|im_start|>user\n<tool_response>\nr\n</tool_response><|im_end|>\n<|im_start|>user\nu<|im_end|>\n"
            "<|im_start|>assistant\n");
}

TEST(ToolCall, ToolResponseRefusesOtherRoles) {
  try {
    render_tool_response({{"assistant", "x"}}, {});
    FAIL() << "expected an error";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("observation 0: role \"assistant\" is not allowed after an assistant turn"),
              std::string::npos)
        << e.what();
  }
}
