// Qwen3 tool calls parsed from a turn, tool results rendered back (tool_call.h).
#include "rl/env/tool_call.h"

#include "core/error.h"

namespace mt::rl {

namespace {

using json = nlohmann::json;

constexpr std::string_view kOpen = "<tool_call>", kClose = "</tool_call>";

// Text for an error message: at most 120 bytes (not cutting a UTF-8 sequence), quoted as JSON.
std::string quoted(std::string_view s) {
  constexpr size_t kMax = 120;
  if (s.size() <= kMax) return json(std::string(s)).dump();
  size_t n = kMax;
  while (n > 0 && (static_cast<unsigned char>(s[n]) & 0xC0) == 0x80) --n;
  return json(std::string(s.substr(0, n))).dump() + "...";
}

std::string_view trimmed(std::string_view s) {
  const size_t a = s.find_first_not_of(" \t\r\n");
  if (a == std::string_view::npos) return {};
  return s.substr(a, s.find_last_not_of(" \t\r\n") - a + 1);
}

// One block's inside: the call, or what was wrong in *why.
std::optional<ToolCall> parse_block(std::string_view body, std::string* why) {
  const std::string_view text = trimmed(body);
  json j;
  try {
    j = json::parse(text);
  } catch (const json::exception& e) {
    std::string what = e.what();
    if (const size_t at = what.find("] "); at != std::string::npos) what.erase(0, at + 2);
    *why = str("not valid JSON (", what, "): ", quoted(text));
    return std::nullopt;
  }
  if (!j.is_object()) {
    *why = str("expected a JSON object {\"name\": ..., \"arguments\": {...}}, got ", quoted(text));
    return std::nullopt;
  }
  auto name = j.find("name");
  if (name == j.end()) {
    *why = str("no \"name\": ", quoted(text));
    return std::nullopt;
  }
  if (!name->is_string() || name->get_ref<const std::string&>().empty()) {
    *why = str("\"name\" is ", quoted(name->dump()), ", not a non-empty string");
    return std::nullopt;
  }
  ToolCall call;
  call.name = name->get<std::string>();
  auto args = j.find("arguments");
  if (args == j.end() || args->is_object()) {
    if (args != j.end()) call.arguments = *args;
    return call;
  }
  if (args->is_string()) {  // a JSON string holding the object
    json inner;
    try {
      inner = json::parse(args->get_ref<const std::string&>());
    } catch (const json::exception&) {
      *why = str("\"arguments\" of ", call.name, " is a string that is not a JSON object: ", quoted(args->dump()));
      return std::nullopt;
    }
    if (!inner.is_object()) {
      *why = str("\"arguments\" of ", call.name, " is a string that is not a JSON object: ", quoted(args->dump()));
      return std::nullopt;
    }
    call.arguments = std::move(inner);
    return call;
  }
  *why = str("\"arguments\" of ", call.name, " is ", quoted(args->dump()),
             "; allowed: an object (or a JSON string "
             "holding one)");
  return std::nullopt;
}

}  // namespace

std::vector<ToolCall> parse_tool_calls(std::string_view text, std::string* error) {
  std::string local;
  std::string& err = error ? *error : local;
  err.clear();
  std::vector<ToolCall> calls;
  size_t block = 0;
  for (size_t at = text.find(kOpen); at != std::string_view::npos; at = text.find(kOpen, at)) {
    ++block;
    const size_t body = at + kOpen.size();
    const size_t close = text.find(kClose, body);
    const size_t next_open = text.find(kOpen, body);
    if (close == std::string_view::npos || (next_open != std::string_view::npos && next_open < close)) {
      err = str("tool call ", block, ": <tool_call> without </tool_call>: ", quoted(text.substr(at)));
      return {};
    }
    std::string why;
    std::optional<ToolCall> c = parse_block(text.substr(body, close - body), &why);
    if (!c) {
      err = str("tool call ", block, ": ", why);
      return {};
    }
    calls.push_back(std::move(*c));
    at = close + kClose.size();
  }
  if (calls.empty()) {
    if (const size_t stray = text.find(kClose); stray != std::string_view::npos) {
      err = str("</tool_call> without <tool_call>: ", quoted(text.substr(0, stray + kClose.size())));
    }
  }
  return calls;
}

std::optional<ToolCall> parse_tool_call(std::string_view text, std::string* error) {
  std::vector<ToolCall> calls = parse_tool_calls(text, error);
  if (calls.empty()) return std::nullopt;
  return std::move(calls.front());
}

std::string render_tool_response(const std::vector<EnvObservation>& observations, const ChatOptions& options) {
  if (observations.empty()) MT_THROW("render_tool_response: no observation to render");
  // The template itself decides the text: a fixed conversation, then the observations and the generation
  // prompt; what follows the fixed part is the answer (the fixed part renders the same with or without them:
  // its assistant turn has no reasoning to keep or drop).
  using ojson = nlohmann::ordered_json;
  ojson messages = ojson::array({{{"role", "user"}, {"content", "q"}}, {{"role", "assistant"}, {"content", "a"}}});
  const std::string prefix = "<|im_start|>user\nq<|im_end|>\n<|im_start|>assistant\na<|im_end|>\n";
  for (size_t i = 0; i < observations.size(); ++i) {
    const EnvObservation& o = observations[i];
    if (o.role != "tool" && o.role != "user")
      MT_THROW("observation ", i, ": role \"", o.role,
               "\" is not allowed after an assistant turn; allowed: \"tool\" "
               "(a tool's result), \"user\"");
    messages.push_back({{"role", o.role}, {"content", o.content}});
  }
  ChatOptions opt = options;
  opt.add_generation_prompt = true;
  const std::string full = render_qwen3_chat(messages, ojson(), opt);
  MT_CHECK(full.rfind(prefix, 0) == 0, "the Qwen3 template rendered an unexpected prefix: ", full.substr(0, 120));
  return full.substr(prefix.size());
}

}  // namespace mt::rl
