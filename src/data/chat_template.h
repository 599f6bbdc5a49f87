// The Qwen3 chat template (the Jinja template of Qwen3's tokenizer_config.json, e.g. Qwen/Qwen3-30B-A3B) as fixed
// C++: `<|im_start|>role\n...<|im_end|>\n` turns, the system prompt first, tools in the system turn,
// assistant reasoning (<think>...</think>) kept only after the last user query, tool calls and tool responses,
// the generation prompt and enable_thinking. tests/data/test_chat_template.cpp holds it to transformers'
// apply_chat_template on the same messages (tools/make_tokenizer_goldens.py).
//
// ChatTemplate is the template a model's tokenizer files carry (tokenizer_config.json's "chat_template", or
// chat_template.jinja beside it): Qwen3's own (compared with its text, whitespace aside) runs as this fixed C++;
// another runs through the Jinja subset of data/jinja.h; none, or one the subset cannot run, falls back to the
// built-in Qwen3 renderer with a warning naming the file and why. Every chat reader validates its messages first
// (normalize_chat_messages): OpenAI's chat form, refused with what was wrong rather than rendered as empty text.
#pragma once
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>

namespace mt {

class Tokenizer;
namespace jinja {
class Template;
}

struct ChatOptions {
  bool add_generation_prompt = false;
  std::optional<bool> enable_thinking;  // unset: as the template's "not defined" (no empty think block)
};

// messages: [{"role": "system"|"user"|"assistant"|"tool", "content": "...", "reasoning_content"?: "...",
// "tool_calls"?: [{"function": {"name": ..., "arguments": {...} or "..."}}]}]; tools: an array (or null).
// Keys keep their order (ordered_json), as `tojson` writes them. Errors name the message and the field.
std::string render_qwen3_chat(const nlohmann::ordered_json& messages, const nlohmann::ordered_json& tools,
                              const ChatOptions& options);

// The messages of a chat line checked and put in the form the templates read: an array of objects, each with
// "role" one of system, user, assistant, tool, and "content" a string or a list of {"type": "text", "text": "..."}
// parts (joined in order, no separator, into one string); "content" null or absent only on an assistant message
// with "tool_calls" (then ""). "tool_calls": a list of {"function": {"name": string, "arguments": object or
// string}} (or {"name", "arguments"}); "reasoning_content": a string or null. Other keys are kept. An error says
// which message, the field, its value and what is allowed ("message 2: \"role\" is \"usr\"; allowed: ...").
nlohmann::ordered_json normalize_chat_messages(const nlohmann::ordered_json& messages);

class ChatTemplate {
 public:
  // The built-in Qwen3 renderer.
  static ChatTemplate builtin(const std::string& why = "built-in Qwen3 renderer");
  // A template's Jinja source (`origin` names it): Qwen3's runs as the built-in renderer, any other through the
  // Jinja subset; one the subset cannot parse throws mt::Error naming the construct and the line.
  // special_tokens: the tokenizer's bos_token, eos_token, ... given to the template as names.
  static ChatTemplate from_source(const std::string& source, const std::string& origin,
                                  const nlohmann::ordered_json& special_tokens = nlohmann::ordered_json::object());
  // The template of a tokenizer directory (chat_template.jinja first, as transformers 5 writes it, then
  // tokenizer_config.json's "chat_template"): the built-in renderer when there is none, or with a warning when it
  // cannot be read or run. Logs the choice ("chat template: ...").
  static ChatTemplate for_directory(const std::string& dir);

  // The messages validated (normalize_chat_messages), then rendered. Errors name the message or the template line.
  std::string render(const nlohmann::ordered_json& messages, const nlohmann::ordered_json& tools,
                     const ChatOptions& options) const;
  bool is_builtin() const { return jinja_ == nullptr; }
  const std::string& description() const { return description_; }  // what renders, for the log

 private:
  std::shared_ptr<const jinja::Template> jinja_;  // null: the built-in renderer
  nlohmann::ordered_json special_tokens_ = nlohmann::ordered_json::object();
  std::string description_;
};

// The chat template of a tokenizer: ChatTemplate::for_directory of the directory of its file, read (and logged)
// once per directory in the process.
const ChatTemplate& chat_template_of(const Tokenizer& tok);

// Qwen3's Jinja chat template as its tokenizer_config.json holds it (the text the detection compares with).
const std::string& qwen3_chat_template_source();
// A template's text with each line's leading and trailing whitespace and its blank lines removed (how Qwen3's
// template is recognised whatever its indentation or line endings).
std::string normalize_template_whitespace(const std::string& source);

// Python's json.dumps(x, ensure_ascii=False) (", " and ": " separators), which the template's tojson writes.
std::string python_json_dumps(const nlohmann::ordered_json& x);

}  // namespace mt
