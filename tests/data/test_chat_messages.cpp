// Chat lines in OpenAI's form, validated wherever chats are read (the rollout prompt file, SFT data, `tokenize
// --chat`): a content that is not a string or a list of text parts, or a role outside system/user/assistant/tool,
// is refused with the file, the line, the value and what is allowed, never rendered as an empty turn; a list of
// text parts renders as the string it joins to. The chat template comes from the tokenizer's directory
// (tokenizer_config.json or chat_template.jinja), Qwen3's recognised and run by the built-in renderer, another run
// by the Jinja interpreter, and a fallback is logged with a warning naming the file and why.
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <sstream>

#include "data/chat_template.h"
#include "data/documents.h"
#include "data/tokenize_lines.h"
#include "data/tokenizer.h"
#include "rollout/prompts.h"
#include "test_util.h"

using namespace mt;
using mt::testutil::error_of;
using ojson = nlohmann::ordered_json;
namespace fs = std::filesystem;

namespace {

const std::string kAssets = std::string(MT_SOURCE_DIR) + "/tests/assets/tokenizer/";

const Tokenizer& tok() {
  static const Tokenizer t = Tokenizer::from_file(kAssets + "trained/tokenizer.json");
  return t;
}

std::string norm_error(const std::string& messages) {
  return error_of([&] { normalize_chat_messages(ojson::parse(messages)); });
}

std::string prompt_error(const std::string& lines) {
  std::istringstream in(lines);
  return error_of([&] { parse_prompts(in, "p.jsonl", int64_t(tok().vocab_size()), 4096, &tok()); });
}

// A fresh directory with the trained tokenizer and `files` (name -> text).
std::string tokenizer_dir(const std::string& name, const std::map<std::string, std::string>& files) {
  const fs::path d = fs::temp_directory_path() / ("mt_chat_" + std::to_string(::getpid()) + "_" + name);
  fs::remove_all(d);
  fs::create_directories(d);
  fs::copy_file(kAssets + "trained/tokenizer.json", d / "tokenizer.json");
  for (const auto& [f, text] : files) std::ofstream(d / f, std::ios::binary) << text;
  return d.string();
}

std::string read(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

}  // namespace

TEST(ChatMessages, RefusalsNameTheMessageTheValueAndWhatIsAllowed) {
  const std::string kContent = "allowed: a string or a list of {\"type\": \"text\", \"text\": \"...\"} parts";
  EXPECT_EQ(norm_error(R"([{"role": "user", "content": 42}])"), "message 0 (user): \"content\" is 42; " + kContent);
  EXPECT_EQ(norm_error(R"([{"role": "user", "content": "a"}, {"role": "user", "content": null}])"),
            "message 1 (user): \"content\" is null; " + kContent);
  EXPECT_EQ(norm_error(R"([{"role": "usr", "content": "hi"}])"),
            "message 0: \"role\" is \"usr\"; allowed: \"system\", \"user\", \"assistant\", \"tool\"");
  EXPECT_EQ(norm_error(R"([{"content": "hi"}])"),
            "message 0 has no \"role\"; allowed: \"system\", \"user\", \"assistant\", \"tool\"");
  EXPECT_EQ(norm_error(R"([{"role": "user"}])"), "message 0 (user) has no \"content\"; " + kContent);
  EXPECT_EQ(norm_error(R"([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}])"),
            "message 0 (user): content part 0 is {\"type\":\"image_url\",\"image_url\":{\"url\":\"x\"}}; allowed: "
            "{\"type\": \"text\", \"text\": a string} (only text parts)");
  EXPECT_EQ(norm_error(R"([{"role": "user", "content": ["not", "parts"]}])"),
            "message 0 (user): content part 0 is \"not\"; allowed: {\"type\": \"text\", \"text\": a string} (only "
            "text parts)");
  EXPECT_EQ(norm_error(R"([])"), "\"messages\" is an empty list; a chat needs at least one message");
  EXPECT_EQ(norm_error(R"({"role": "user"})"),
            "\"messages\" is {\"role\":\"user\"}; allowed: a list of {\"role\", \"content\"} messages");
  EXPECT_EQ(norm_error(R"([{"role": "assistant", "content": null, "tool_calls": [{"function": {"arguments": {}}}]}])"),
            "message 0: tool call 0 is {\"function\":{\"arguments\":{}}}; allowed: {\"function\": {\"name\": a "
            "non-empty string, \"arguments\": an object or a JSON string}}");
  EXPECT_EQ(norm_error(R"([{"role": "user", "content": "x", "reasoning_content": 3}])"),
            "message 0 (user): \"reasoning_content\" is 3; allowed: a string or null");
}

TEST(ChatMessages, TextPartsRenderAsTheJoinedStringAndToolCallsMayHaveNoContent) {
  const ojson parts = ojson::parse(R"([{"role": "system", "content": [{"type": "text", "text": "Be "},
      {"type": "text", "text": "brief."}]}, {"role": "user", "content": [{"type": "text", "text": "2+2?"}]}])");
  const ojson plain =
      ojson::parse(R"([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}])");
  EXPECT_EQ(normalize_chat_messages(parts), plain);
  ChatOptions o;
  o.add_generation_prompt = true;
  const ChatTemplate t = ChatTemplate::builtin();
  EXPECT_EQ(t.render(parts, ojson(), o), render_qwen3_chat(plain, ojson(), o));
  EXPECT_EQ(t.render(parts, ojson(), o),
            "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n");
  // OpenAI's assistant message with tool calls and null content.
  const ojson calls = ojson::parse(R"([{"role": "user", "content": "w?"}, {"role": "assistant", "content": null,
      "tool_calls": [{"type": "function", "function": {"name": "get", "arguments": "{\"a\": 1}"}}]}])");
  EXPECT_EQ(normalize_chat_messages(calls)[1]["content"], "");
}

TEST(ChatMessages, PromptFileRefusesWithTheLineNumber) {
  const std::string ok = "{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}]}\n";
  EXPECT_EQ(prompt_error(ok + "{\"messages\": [{\"role\": \"user\", \"content\": 42}]}\n"),
            "p.jsonl:2: message 0 (user): \"content\" is 42; allowed: a string or a list of {\"type\": \"text\", "
            "\"text\": \"...\"} parts");
  EXPECT_EQ(prompt_error(ok + ok + "{\"messages\": [{\"role\": \"usr\", \"content\": \"hi\"}]}\n"),
            "p.jsonl:3: message 0: \"role\" is \"usr\"; allowed: \"system\", \"user\", \"assistant\", \"tool\"");
  EXPECT_NE(prompt_error("{\"messages\": [{\"role\": \"user\", \"content\": null}]}\n")
                .find("p.jsonl:1: message 0 "
                      "(user): \"content\" is null"),
            std::string::npos);
  EXPECT_NE(prompt_error("\n{\"messages\": [{\"role\": \"user\", \"content\": [{\"type\": \"text\"}]}]}\n")
                .find("p.jsonl:2: message 0 (user): content part 0 is {\"type\":\"text\"}"),
            std::string::npos);
  EXPECT_EQ(prompt_error("{\"messages\": [{\"role\": \"user\", \"content\": \"x\"}], \"tools\": {\"a\": 1}}\n"),
            "p.jsonl:1: \"tools\" is {\"a\":1}; allowed: a list of tool (function) descriptions, or null");
  // A parts list gives the same prompt as the string.
  std::istringstream in(
      "{\"messages\": [{\"role\": \"user\", \"content\": [{\"type\": \"text\", \"text\": \"a\"}, {\"type\": \"text\", "
      "\"text\": \"b\"}]}]}\n{\"messages\": [{\"role\": \"user\", \"content\": \"ab\"}]}\n");
  const std::vector<Prompt> ps = parse_prompts(in, "p.jsonl", int64_t(tok().vocab_size()), 4096, &tok());
  ASSERT_EQ(ps.size(), 2u);
  EXPECT_EQ(ps[0].ids, ps[1].ids);
}

TEST(ChatMessages, PromptFileToolsReachTheTemplateInTheirKeyOrder) {
  std::istringstream in(
      "{\"messages\": [{\"role\": \"user\", \"content\": \"w?\"}], \"tools\": [{\"type\": \"function\", "
      "\"function\": {\"name\": \"get\", \"description\": \"d\"}}]}\n");
  const std::vector<Prompt> ps = parse_prompts(in, "p.jsonl", int64_t(tok().vocab_size()), 4096, &tok());
  ASSERT_EQ(ps.size(), 1u);
  const std::string text = tok().decode(std::vector<uint32_t>(ps[0].ids.begin(), ps[0].ids.end()));
  EXPECT_NE(text.find("<tools>\n{\"type\": \"function\", \"function\": {\"name\": \"get\", \"description\": "
                      "\"d\"}}\n</tools>"),
            std::string::npos)
      << text;
}

TEST(ChatMessages, SftDataCountsBadChatsAsMalformedLines) {
  const fs::path path = fs::temp_directory_path() / ("mt_chat_sft_" + std::to_string(::getpid()) + ".jsonl");
  std::ofstream(path) << "{\"messages\": [{\"role\": \"user\", \"content\": \"q\"}, {\"role\": \"assistant\", "
                         "\"content\": \"a\"}]}\n"
                         "{\"messages\": [{\"role\": \"user\", \"content\": 42}, {\"role\": \"assistant\", "
                         "\"content\": \"a\"}]}\n"
                         "{\"messages\": [{\"role\": \"usr\", \"content\": \"q\"}, {\"role\": \"assistant\", "
                         "\"content\": \"a\"}]}\n"
                         "{\"messages\": [{\"role\": \"user\", \"content\": [{\"type\": \"text\", \"text\": \"q\"}]}, "
                         "{\"role\": \"assistant\", \"content\": [{\"type\": \"text\", \"text\": \"a\"}]}]}\n";
  DocOptions o;
  const DocumentSet set = load_documents(path.string(), tok(), o);
  EXPECT_EQ(set.size(), 2);
  EXPECT_EQ(set.line, (std::vector<int64_t>{1, 4}));
  ASSERT_EQ(set.report.bad, 2);
  EXPECT_EQ(set.report.bad_examples[0],
            "line 2: message 0 (user): \"content\" is 42; allowed: a string or a list of {\"type\": \"text\", "
            "\"text\": \"...\"} parts");
  EXPECT_EQ(set.report.bad_examples[1],
            "line 3: message 0: \"role\" is \"usr\"; allowed: \"system\", \"user\", \"assistant\", \"tool\"");
  // The parts line trains on the same tokens as the string line.
  EXPECT_EQ(set.length(0), set.length(1));
  o.bad_lines = BadLines::Fail;
  const std::string e = error_of([&] { load_documents(path.string(), tok(), o); });
  EXPECT_NE(e.find(path.string() + " line 2: message 0 (user): \"content\" is 42"), std::string::npos) << e;
  fs::remove(path);
  // The example SFT file still loads whole.
  const DocumentSet ex = load_documents(std::string(MT_SOURCE_DIR) + "/examples/chat_small.jsonl", tok(), DocOptions{});
  EXPECT_GT(ex.size(), 0);
  EXPECT_EQ(ex.report.bad, 0);
}

TEST(ChatMessages, TokenizeChatRefusesWithTheLine) {
  std::istringstream in(
      "[{\"role\": \"user\", \"content\": \"ok\"}]\n{\"messages\": [{\"role\": \"bot\", \"content\": "
      "\"x\"}]}\n");
  TokenizeLinesOptions o;
  o.mode = LineMode::Chat;
  std::FILE* out = std::tmpfile();
  const std::string e = error_of([&] { tokenize_lines(tok(), in, out, o); });
  std::fclose(out);
  EXPECT_EQ(e, "stdin line 2: message 0: \"role\" is \"bot\"; allowed: \"system\", \"user\", \"assistant\", \"tool\"");
}

TEST(ChatTemplateChoice, Qwen3TemplateIsRecognisedWhateverItsIndentation) {
  const std::string qwen3 = read(kAssets + "qwen3_chat_template.jinja");
  EXPECT_EQ(normalize_template_whitespace(qwen3), normalize_template_whitespace(qwen3_chat_template_source()));
  std::string reindented;
  std::istringstream in(qwen3);
  for (std::string line; std::getline(in, line);) reindented += "\t" + line + "  \r\n\n";
  EXPECT_TRUE(ChatTemplate::from_source(reindented, "x").is_builtin());
  // One character of difference inside a string: not Qwen3's, run by the interpreter.
  std::string changed = qwen3;
  changed.replace(changed.find("<tools></tools> XML tags"), 5, "<TOOL");
  const ChatTemplate other = ChatTemplate::from_source(changed, "x");
  EXPECT_FALSE(other.is_builtin());
  EXPECT_NE(other.description().find("run by the Jinja interpreter"), std::string::npos);
}

TEST(ChatTemplateChoice, FromTheTokenizerDirectoryAndLogged) {
  const ojson msgs = ojson::parse(R"([{"role": "user", "content": "hi"}])");
  ChatOptions o;
  o.add_generation_prompt = true;
  const std::string chatml =
      "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}</s>{% endfor %}{% if add_generation_prompt %}"
      "<|assistant|>{% endif %}";

  // tokenizer_config.json's template, another than Qwen3's: the interpreter, logged once per directory.
  const std::string d1 =
      tokenizer_dir("config", {{"tokenizer_config.json", ojson({{"chat_template", chatml}}).dump()}});
  const Tokenizer t1 = Tokenizer::from_file(d1 + "/tokenizer.json");
  testing::internal::CaptureStderr();
  const std::string text = chat_template_of(t1).render(msgs, ojson(), o);
  chat_template_of(t1);
  const std::string log1 = testing::internal::GetCapturedStderr();
  EXPECT_EQ(text, "<|user|>hi</s><|assistant|>");
  EXPECT_NE(log1.find("chat template: " + d1 +
                      "/tokenizer_config.json chat_template (not Qwen3's template), run by "
                      "the Jinja interpreter"),
            std::string::npos)
      << log1;
  EXPECT_EQ(log1.find("chat template:"), log1.rfind("chat template:")) << log1;  // once

  // chat_template.jinja (transformers 5) wins over the config; Qwen3's text runs as the built-in renderer.
  const std::string d2 = tokenizer_dir("jinja", {{"tokenizer_config.json", ojson({{"chat_template", chatml}}).dump()},
                                                 {"chat_template.jinja", qwen3_chat_template_source()}});
  testing::internal::CaptureStderr();
  const ChatTemplate t2 = ChatTemplate::for_directory(d2);
  const std::string log2 = testing::internal::GetCapturedStderr();
  EXPECT_TRUE(t2.is_builtin());
  EXPECT_NE(log2.find("chat template: Qwen3's template from " + d2 +
                      "/chat_template.jinja, run by the built-in Qwen3 "
                      "renderer"),
            std::string::npos)
      << log2;

  // No template: the built-in renderer, said so.
  const std::string d3 = tokenizer_dir("none", {{"tokenizer_config.json", "{\"model_max_length\": 10}"}});
  testing::internal::CaptureStderr();
  EXPECT_TRUE(ChatTemplate::for_directory(d3).is_builtin());
  const std::string log3 = testing::internal::GetCapturedStderr();
  EXPECT_NE(log3.find("chat template: built-in Qwen3 renderer (" + d3 +
                      " has no chat_template.jinja and no "
                      "chat_template in tokenizer_config.json)"),
            std::string::npos)
      << log3;

  // A template the interpreter cannot run: the fallback with a warning naming the file, the construct and the line.
  const std::string d4 = tokenizer_dir("macro", {{"chat_template.jinja",
                                                  "{% for m in messages %}\n{% macro f() %}"
                                                  "{% endmacro %}{% endfor %}"}});
  testing::internal::CaptureStderr();
  const ChatTemplate t4 = ChatTemplate::for_directory(d4);
  const std::string log4 = testing::internal::GetCapturedStderr();
  EXPECT_TRUE(t4.is_builtin());
  EXPECT_NE(log4.find("chat template: built-in Qwen3 renderer (warning: the Jinja interpreter cannot run " + d4 +
                      "/chat_template.jinja: " + d4 + "/chat_template.jinja line 2: {% macro %} is not supported"),
            std::string::npos)
      << log4;

  // An unreadable config: the fallback, with the file in the warning.
  const std::string d5 = tokenizer_dir("broken", {{"tokenizer_config.json", "{not json"}});
  testing::internal::CaptureStderr();
  EXPECT_TRUE(ChatTemplate::for_directory(d5).is_builtin());
  const std::string log5 = testing::internal::GetCapturedStderr();
  EXPECT_NE(log5.find("chat template: built-in Qwen3 renderer (warning: " + d5 + "/tokenizer_config.json"),
            std::string::npos)
      << log5;
  for (const std::string& d : {d1, d2, d3, d4, d5}) fs::remove_all(d);
}
