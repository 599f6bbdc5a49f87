// The JSONL prompt reader: ids and metadata, blank lines, and every error naming the file, the line and
// the value.
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <sstream>

#include "data/tokenizer.h"
#include "rollout/prompts.h"
#include "test_util.h"

using namespace mt;
using mt::testutil::error_of;
namespace fs = std::filesystem;

namespace {

std::vector<Prompt> parse(const std::string& text, int64_t vocab = 512, int64_t max_positions = 8) {
  std::istringstream in(text);
  return parse_prompts(in, "p.jsonl", vocab, max_positions);
}

std::string parse_error(const std::string& text, int64_t vocab = 512, int64_t max_positions = 8) {
  return error_of([&] { parse(text, vocab, max_positions); });
}

}  // namespace

TEST(Prompts, ReadsIdsKeepsOtherKeysAndSkipsBlankLines) {
  const fs::path path = fs::temp_directory_path() / ("mt_prompts_" + std::to_string(::getpid()) + ".jsonl");
  {
    std::ofstream f(path);
    f << "{\"prompt_ids\": [1, 2, 3], \"answer\": \"42\", \"id\": 7}\n"
         "\n"
         "   \t\n"
         "{\"prompt_ids\": [511], \"prompt\": \"the text\"}\r\n"
         "{\"prompt_ids\": [0, 0, 0, 0, 0, 0, 0, 0]}";  // no final newline
  }
  const std::vector<Prompt> ps = read_prompts(path.string(), 512, 8);
  fs::remove(path);
  ASSERT_EQ(ps.size(), 3u);
  EXPECT_EQ(ps[0].ids, (std::vector<int32_t>{1, 2, 3}));
  EXPECT_EQ(ps[0].line, 1);
  EXPECT_EQ(ps[0].meta, (nlohmann::json{{"answer", "42"}, {"id", 7}}));
  EXPECT_EQ(ps[1].ids, (std::vector<int32_t>{511}));
  EXPECT_EQ(ps[1].line, 4);
  EXPECT_EQ(ps[1].meta, (nlohmann::json{{"prompt", "the text"}}));  // with ids, the text is metadata
  EXPECT_EQ(ps[2].ids.size(), 8u);                                  // exactly max positions
  EXPECT_EQ(ps[2].line, 5);
  EXPECT_TRUE(ps[2].meta.is_object());
  EXPECT_TRUE(ps[2].meta.empty());
  EXPECT_EQ(parse("\xEF\xBB\xBF{\"prompt_ids\": [5]}\n")[0].ids, (std::vector<int32_t>{5}));  // byte order mark
}

TEST(Prompts, MalformedJsonNamesFileLineAndText) {
  const std::string e = parse_error("{\"prompt_ids\": [1]}\n{\"prompt_ids\": [1, 2\n");
  EXPECT_EQ(e.rfind("p.jsonl:2: not valid JSON (parse error at column 21: ", 0), 0u) << e;
  EXPECT_NE(e.find("): {\"prompt_ids\": [1, 2"), std::string::npos) << e;
  EXPECT_EQ(parse_error("[1, 2]\n"),
            "p.jsonl:1: expected a JSON object with \"prompt_ids\", \"prompt\" or \"messages\", got array [1,2]");
}

TEST(Prompts, MissingPromptIdsNamesTheKeysOfTheLine) {
  EXPECT_EQ(parse_error("{\"prompt_ids\": [1]}\n{\"ids\": [1], \"x\": 2}\n"),
            "p.jsonl:2: no \"prompt_ids\", \"prompt\" or \"messages\" (the line has keys \"ids\", \"x\")");
  EXPECT_EQ(parse_error("{}\n"), "p.jsonl:1: no \"prompt_ids\", \"prompt\" or \"messages\" (the line has no keys)");
}

TEST(Prompts, TextPromptNeedsATokenizer) {
  EXPECT_EQ(parse_error("\n{\"prompt\": \"What is 2+2?\"}\n"),
            "p.jsonl:2: \"prompt\" needs a tokenizer, and the model directory has no tokenizer.json: give the token "
            "ids as \"prompt_ids\" or add the tokenizer (\"What is 2+2?\")");
  EXPECT_EQ(parse_error("{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}]}\n"),
            "p.jsonl:1: \"messages\" needs a tokenizer, and the model directory has no tokenizer.json: give the "
            "token ids as \"prompt_ids\" or add the tokenizer ([{\"content\":\"hi\",\"role\":\"user\"}])");
}

TEST(Prompts, TextAndChatPromptsThroughTheTokenizer) {
  const Tokenizer tok = Tokenizer::from_file(std::string(MT_SOURCE_DIR) + "/tests/assets/tokenizer/trained/tokenizer.json");
  const int64_t V = tok.vocab_size();
  auto ids32 = [](const std::vector<uint32_t>& v) { return std::vector<int32_t>(v.begin(), v.end()); };
  std::istringstream in(
      "{\"prompt\": \"What is 2+2?\", \"answer\": \"4\"}\n"
      "{\"messages\": [{\"role\": \"system\", \"content\": \"Be brief.\"}, {\"role\": \"user\", \"content\": "
      "\"Hi\"}], \"enable_thinking\": false}\n");
  const std::vector<Prompt> ps = parse_prompts(in, "p.jsonl", V, 4096, &tok);
  ASSERT_EQ(ps.size(), 2u);
  EXPECT_EQ(ps[0].ids, ids32(tok.encode("What is 2+2?")));
  EXPECT_EQ(ps[0].meta["answer"], "4");
  EXPECT_EQ(ps[0].meta["prompt"], "What is 2+2?");  // kept for the rewards
  const std::string chat =
      "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
      "<think>\n\n</think>\n\n";
  EXPECT_EQ(ps[1].ids, ids32(tok.encode(chat)));
  EXPECT_EQ(tok.decode(std::vector<uint32_t>(ps[1].ids.begin(), ps[1].ids.end())), chat);
  // Errors name the line: a non-string prompt, a prompt longer than the positions, ids past the model's
  // vocabulary (a tokenizer larger than the model).
  std::istringstream bad1("{\"prompt\": 5}\n");
  EXPECT_EQ(error_of([&] { parse_prompts(bad1, "p.jsonl", V, 4096, &tok); }),
            "p.jsonl:1: \"prompt\" must be a string, got 5");
  std::istringstream bad2("{\"prompt\": \"a b c d e f g h i j\"}\n");
  EXPECT_NE(error_of([&] { parse_prompts(bad2, "p.jsonl", V, 3, &tok); }).find("more than the maximum of 3"),
            std::string::npos);
  std::istringstream bad3("{\"prompt\": \"a longer text, surely past id 2\"}\n");
  EXPECT_NE(error_of([&] { parse_prompts(bad3, "p.jsonl", 2, 4096, &tok); }).find("outside the model's vocabulary [0, 2)"),
            std::string::npos);
}

TEST(Prompts, EmptyPromptIsAnError) {
  EXPECT_EQ(parse_error("{\"prompt_ids\": []}\n"),
            "p.jsonl:1: \"prompt_ids\" is empty; a prompt needs at least one token");
  EXPECT_EQ(parse_error("{\"prompt_ids\": \"1 2 3\"}\n"),
            "p.jsonl:1: \"prompt_ids\" must be a list of token ids, got \"1 2 3\"");
}

TEST(Prompts, NonIntegerIdNamesItsIndexAndValue) {
  EXPECT_EQ(parse_error("{\"prompt_ids\": [1, 2.5]}\n"), "p.jsonl:1: prompt_ids[1] is 2.5, not an integer token id");
  EXPECT_EQ(parse_error("{\"prompt_ids\": [1, 2]}\n{\"prompt_ids\": [\"7\"]}\n"),
            "p.jsonl:2: prompt_ids[0] is \"7\", not an integer token id");
  EXPECT_EQ(parse_error("{\"prompt_ids\": [3.0]}\n"), "p.jsonl:1: prompt_ids[0] is 3.0, not an integer token id");
  EXPECT_EQ(parse_error("{\"prompt_ids\": [true]}\n"), "p.jsonl:1: prompt_ids[0] is true, not an integer token id");
}

TEST(Prompts, IdOutsideTheVocabularyNamesItsValue) {
  EXPECT_EQ(parse_error("{\"prompt_ids\": [0, 512]}\n"),
            "p.jsonl:1: prompt_ids[1] is 512, outside the vocabulary [0, 512)");
  EXPECT_EQ(parse_error("{\"prompt_ids\": [-1]}\n"), "p.jsonl:1: prompt_ids[0] is -1, outside the vocabulary [0, 512)");
  EXPECT_EQ(parse_error("{\"prompt_ids\": [18446744073709551615]}\n"),
            "p.jsonl:1: prompt_ids[0] is 18446744073709551615, outside the vocabulary [0, 512)");
}

TEST(Prompts, PromptLongerThanMaxPositionsNamesBoth) {
  EXPECT_EQ(parse_error("{\"prompt_ids\": [1]}\n\n{\"prompt_ids\": [1, 2, 3, 4, 5, 6, 7, 8, 9]}\n"),
            "p.jsonl:3: the prompt has 9 tokens, more than the maximum of 8 positions");
}

TEST(Prompts, FileErrors) {
  EXPECT_EQ(error_of([] { read_prompts("/no/such/prompts.jsonl", 512, 8); }),
            "cannot open the prompt file /no/such/prompts.jsonl: No such file or directory");
  EXPECT_EQ(parse_error("\n  \n"), "p.jsonl: no prompts (the file is empty or holds only blank lines)");
  EXPECT_EQ(parse_error("{\"prompt_ids\": [1]}\n", 0), "p.jsonl: vocabulary size (0) must be in [1, 2^31]");
}
