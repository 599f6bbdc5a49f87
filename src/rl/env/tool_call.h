// Tool calls in a model's turn and tool results going back, in Qwen3's format (its chat template,
// data/chat_template.h): the model writes
//
//   <tool_call>
//   {"name": "get_weather", "arguments": {"city": "Paris"}}
//   </tool_call>
//
// (several such blocks for several calls), and a tool's result comes back as a user turn of <tool_response> blocks.
#pragma once
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "data/chat_template.h"
#include "rl/env/environment.h"

namespace mt::rl {

// Every <tool_call>...</tool_call> block of a turn, in order. Each holds a JSON object with "name" (a non-empty
// string) and "arguments" (an object, or a JSON string holding one, as Qwen3 models sometimes write; absent: {}).
// When any block is malformed (a <tool_call> never closed, JSON that does not parse, no string name, arguments of
// another kind), returns no call and sets *error to what was wrong, naming the block and quoting its text
// (truncated). No block at all: no call and an empty *error. `error` may be null.
std::vector<ToolCall> parse_tool_calls(std::string_view turn_text, std::string* error);

// The turn's first call, under parse_tool_calls' rules (a malformed block anywhere: nullopt and *error set).
std::optional<ToolCall> parse_tool_call(std::string_view turn_text, std::string* error);

// The text that follows an assistant turn when the environment answers with `observations` (role "tool": a tool's
// result, or "user"), up to and including the next generation prompt: exactly what Qwen3's template renders
// after the assistant turn's "<|im_end|>\n" when the observations and the generation prompt are appended, e.g.
//
//   <|im_start|>user\n<tool_response>\n{"temp": 21}\n</tool_response><|im_end|>\n<|im_start|>assistant\n
//
// Consecutive tool observations share one user turn, as the template puts them. A sampled turn stops at its
// end-of-turn token <|im_end|>; the template's "\n" after it is not sampled, so a caller appending to sampled ids
// appends "\n" first (kAfterTurnEnd). Errors: a role other than "tool" or "user", or no observation.
std::string render_tool_response(const std::vector<EnvObservation>& observations, const ChatOptions& options);

// What the template writes after an assistant turn's <|im_end|> before the next turn.
inline constexpr std::string_view kAfterTurnEnd = "\n";

}  // namespace mt::rl
