// Between an episode's tokens and the text an Environment (rl/env/environment.h) speaks: a model turn's ids
// decoded for EnvTurn::text (its end-of-turn token left out), an observation's messages tokenised into the
// ids the engine appends before the next turn, and the tool-call parser (optional). One codec per model:
// the demo's char vocabulary here (DemoCodec); a tokenizer-based one for HF models.
#pragma once
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "data/tokenizer.h"
#include "rl/env/environment.h"

namespace mt::rl {

struct TurnCodec {
  // A model turn's ids (its end-of-turn token already removed) as text.
  std::function<std::string(const std::vector<int32_t>&)> decode;
  // The observations an environment step returned, as the tokens appended after the model's turn. Errors
  // (a character the vocabulary lacks) name the observation and the character.
  std::function<std::vector<int32_t>(const std::vector<EnvObservation>&)> encode;
  // Tokens that end a turn (the stop tokens): left out of the turn's text when they end it.
  std::vector<int32_t> end_of_turn;
  // Parses a tool call out of a turn's text; null: turns carry none. On a malformed call it returns nothing
  // and says what was wrong in *error.
  std::function<std::optional<ToolCall>(const std::string&, std::string*)> parse_tool_call;
};

// The demo model's codec (data/char_tokenizer.h: <pad> 0, <bos> 1, <eos> 2, then the characters): text holds
// the special tokens by their names ("<bos>", "<eos>", "<pad>"; an id past the char vocabulary "<id N>"), which
// encode turns back into their ids (not <id N>); the
// observations' contents are concatenated (roles carry no tokens: the demo has no chat format). <eos> ends a
// turn. No tool-call parser (the built-in environments read the turn's text).
TurnCodec demo_codec();

// An HF model's codec for Qwen3 chat prompts: turns decoded by the tokenizer (special tokens dropped), tool
// calls parsed (rl/env/tool_call.h), observations rendered as the chat template continues after the
// assistant's <|im_end|> (the "\n" after it, the user / <tool_response> turn, the next assistant header) and
// tokenised. end_of_turn: the stop tokens (the EOS and the template's end tokens).
TurnCodec chat_codec(const Tokenizer& tok, std::vector<int32_t> end_of_turn);

}  // namespace mt::rl
