// Prompt files for the rollout engine: JSON Lines, one prompt per line, for example
//
//   {"prompt_ids": [151644, 872, 198], "answer": "42", "id": "gsm8k-17"}
//
// A prompt is one of: "prompt_ids", a non-empty list of integer token ids in [0, vocab_size); "prompt",
// text, encoded with the model directory's tokenizer.json as it is (no template); "messages", a chat in
// OpenAI's form (checked by data/chat_template.h's normalize_chat_messages: roles system/user/assistant/tool,
// content a string or a list of text parts; anything else is an error naming the line), rendered with the
// tokenizer directory's chat template and the generation prompt ("enable_thinking": true/false on the line sets
// the template's switch; "tools", a list, goes to the template too). At most max_positions tokens. The first
// of the three keys present, in that order, is used; every other key of the line is kept unchanged as the
// prompt's metadata, for the reward programs that read it later (so "answer", "prompt" beside "prompt_ids", ...). Text
// and chats need a tokenizer; without one they are refused. Blank lines are skipped; a file with no prompt at all is an
// error. Every error names the file, the line number and the offending value.
#pragma once
#include <cstdint>
#include <istream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

namespace mt {

class Tokenizer;

struct Prompt {
  std::vector<int32_t> ids;  // token ids, each in [0, vocab_size)
  nlohmann::json meta;       // the line's other keys: always an object, possibly empty
  int64_t line = 0;          // 1-based line number in the file
};

// tokenizer: for "prompt" and "messages" lines (null: such lines are errors).
std::vector<Prompt> read_prompts(const std::string& path, int64_t vocab_size, int64_t max_positions,
                                 const Tokenizer* tokenizer = nullptr);

// The same from a stream; `origin` names it in errors (a path).
std::vector<Prompt> parse_prompts(std::istream& in, const std::string& origin, int64_t vocab_size,
                                  int64_t max_positions, const Tokenizer* tokenizer = nullptr);

}  // namespace mt
