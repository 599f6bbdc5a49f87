// Prompt files for the rollout engine: JSON Lines, one prompt per line, for example
//
//   {"prompt_ids": [151644, 872, 198], "answer": "42", "id": "gsm8k-17"}
//
// "prompt_ids" (required): a non-empty list of integer token ids in [0, vocab_size), at most
// max_positions of them. Every other key of the line is kept unchanged as the prompt's metadata, for
// the reward programs that read it later. A line with "prompt" (text) and no "prompt_ids" is refused:
// text prompts need a tokenizer from the model directory, which is not supported yet (with both keys,
// "prompt_ids" is used and "prompt" is kept as metadata). Blank lines are skipped; a file with no
// prompt at all is an error. Every error names the file, the line number and the offending value.
#pragma once
#include <cstdint>
#include <istream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

namespace mt {

struct Prompt {
  std::vector<int32_t> ids;  // token ids, each in [0, vocab_size)
  nlohmann::json meta;       // the line's other keys: always an object, possibly empty
  int64_t line = 0;          // 1-based line number in the file
};

std::vector<Prompt> read_prompts(const std::string& path, int64_t vocab_size, int64_t max_positions);

// The same from a stream; `origin` names it in errors (a path).
std::vector<Prompt> parse_prompts(std::istream& in, const std::string& origin, int64_t vocab_size,
                                  int64_t max_positions);

}  // namespace mt
