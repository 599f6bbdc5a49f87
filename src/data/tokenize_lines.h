// The line tools behind `moetrain tokenize` (docs/tokenizer.md): a stream of lines encoded to ids, ids decoded to text,
// or chat messages checked and rendered with the tokenizer's chat template (chat_template.h) and encoded, one output
// line per input line; and the tokenizer's encode speed on one thread. Errors name the input line ("stdin line 3: ...") and what was wrong in it.
#pragma once
#include <cstdio>
#include <istream>
#include <nlohmann/json.hpp>
#include <string>

#include "data/chat_template.h"
#include "data/tokenizer.h"

namespace mt {

enum class LineMode {
  Encode,  // a text per line (jsonl: a JSON string, so it can hold newlines and tabs) -> its ids, space-separated
  Decode,  // ids separated by spaces -> the text (jsonl: as a JSON string)
  Chat,    // {"messages": [...], "tools": [...]?} or a messages array -> the rendered chat's ids (or its text)
};

struct TokenizeLinesOptions {
  LineMode mode = LineMode::Encode;
  bool jsonl = false;            // Encode and Decode: lines are JSON strings
  bool skip_special = false;     // Decode: special tokens left out of the text
  bool text = false;             // Chat: print the rendered text as a JSON string instead of its ids
  ChatOptions chat;              // Chat: the template's switches
  std::string source = "stdin";  // how errors name the input
};

struct TokenizeLinesReport {
  size_t lines = 0, bytes = 0, tokens = 0;  // bytes of text read (Encode, Chat) or written (Decode)
  double seconds = 0;
};

// Reads `in` to its end and writes one line to `out` per line read (an empty text gives an empty line).
TokenizeLinesReport tokenize_lines(const Tokenizer& tok, std::istream& in, std::FILE* out,
                                   const TokenizeLinesOptions& o);

// Encode speed on one thread over `file`, one document per line (empty: a built-in mixed text of prose, code,
// numbers, CJK and emoji), `passes` passes with a fresh word cache (the first is cold): one JSON object
// (cold and warm seconds, MB/s, tokens/s).
nlohmann::json tokenize_bench(const Tokenizer& tok, const std::string& file, int passes);

}  // namespace mt
