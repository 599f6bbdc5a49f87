// The Qwen3 chat template (the Jinja template of Qwen3's tokenizer_config.json, e.g. Qwen/Qwen3-30B-A3B) as fixed
// C++: `<|im_start|>role\n...<|im_end|>\n` turns, the system prompt first, tools in the system turn,
// assistant reasoning (<think>...</think>) kept only after the last user query, tool calls and tool responses,
// the generation prompt and enable_thinking. tests/data/test_chat_template.cpp holds it to transformers'
// apply_chat_template on the same messages (tools/make_tokenizer_goldens.py).
#pragma once
#include <nlohmann/json.hpp>
#include <optional>
#include <string>

namespace mt {

struct ChatOptions {
  bool add_generation_prompt = false;
  std::optional<bool> enable_thinking;  // unset: as the template's "not defined" (no empty think block)
};

// messages: [{"role": "system"|"user"|"assistant"|"tool", "content": "...", "reasoning_content"?: "...",
// "tool_calls"?: [{"function": {"name": ..., "arguments": {...} or "..."}}]}]; tools: an array (or null).
// Keys keep their order (ordered_json), as `tojson` writes them. Errors name the message and the field.
std::string render_qwen3_chat(const nlohmann::ordered_json& messages, const nlohmann::ordered_json& tools,
                              const ChatOptions& options);

// Python's json.dumps(x, ensure_ascii=False) (", " and ": " separators), which the template's tojson writes.
std::string python_json_dumps(const nlohmann::ordered_json& x);

}  // namespace mt
