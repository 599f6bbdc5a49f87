// Qwen3's chat template, statement by statement (the Jinja source is quoted in docs/tokenizer.md).
#include "data/chat_template.h"

#include <cstdio>

#include "core/error.h"

namespace mt {

namespace {

using ojson = nlohmann::ordered_json;

bool truthy(const ojson& j) {  // Jinja truthiness for the values the template tests
  if (j.is_null()) return false;
  if (j.is_boolean()) return j.get<bool>();
  if (j.is_string()) return !j.get_ref<const std::string&>().empty();
  if (j.is_array() || j.is_object()) return !j.empty();
  if (j.is_number()) return j.get<double>() != 0;
  return true;
}

const ojson* field(const ojson& m, const char* k) {
  if (!m.is_object()) return nullptr;
  auto it = m.find(k);
  return it == m.end() ? nullptr : &*it;
}

std::string role_of(const ojson& m, size_t i) {
  const ojson* r = field(m, "role");
  if (!r || !r->is_string()) MT_THROW("message ", i, " has no string \"role\"");
  return r->get<std::string>();
}

bool is_string_content(const ojson& m) {
  const ojson* c = field(m, "content");
  return c && c->is_string();
}

std::string content_of(const ojson& m) {
  return is_string_content(m) ? m["content"].get<std::string>() : "";
}

std::string rstrip_nl(std::string s) {
  while (!s.empty() && s.back() == '\n') s.pop_back();
  return s;
}
std::string lstrip_nl(const std::string& s) {
  size_t i = 0;
  while (i < s.size() && s[i] == '\n') ++i;
  return s.substr(i);
}

void dump_string(const std::string& s, std::string& out) {
  out.push_back('"');
  for (unsigned char c : s) {
    switch (c) {
      case '"':
        out += "\\\"";
        break;
      case '\\':
        out += "\\\\";
        break;
      case '\n':
        out += "\\n";
        break;
      case '\r':
        out += "\\r";
        break;
      case '\t':
        out += "\\t";
        break;
      case '\b':
        out += "\\b";
        break;
      case '\f':
        out += "\\f";
        break;
      default:
        if (c < 0x20) {
          char buf[8];
          std::snprintf(buf, sizeof buf, "\\u%04x", c);
          out += buf;
        } else {
          out.push_back(char(c));
        }
    }
  }
  out.push_back('"');
}

void dump(const ojson& x, std::string& out) {
  if (x.is_object()) {
    out.push_back('{');
    bool first = true;
    for (auto it = x.begin(); it != x.end(); ++it) {
      if (!first) out += ", ";
      first = false;
      dump_string(it.key(), out);
      out += ": ";
      dump(it.value(), out);
    }
    out.push_back('}');
  } else if (x.is_array()) {
    out.push_back('[');
    for (size_t i = 0; i < x.size(); ++i) {
      if (i) out += ", ";
      dump(x[i], out);
    }
    out.push_back(']');
  } else if (x.is_string()) {
    dump_string(x.get<std::string>(), out);
  } else if (x.is_null()) {
    out += "null";
  } else if (x.is_boolean()) {
    out += x.get<bool>() ? "true" : "false";
  } else {
    out += x.dump();
  }
}

}  // namespace

std::string python_json_dumps(const ojson& x) {
  std::string out;
  dump(x, out);
  return out;
}

std::string render_qwen3_chat(const ojson& messages, const ojson& tools, const ChatOptions& opt) {
  if (!messages.is_array()) MT_THROW("\"messages\" is ", messages.type_name(), ", not an array of messages");
  const size_t n = messages.size();
  for (size_t i = 0; i < n; ++i) role_of(messages[i], i);
  const bool first_is_system = n > 0 && role_of(messages[0], 0) == "system";
  auto system_content = [&] {
    if (!is_string_content(messages[0])) MT_THROW("message 0 (system) has no string \"content\"");
    return messages[0]["content"].get<std::string>();
  };
  std::string out;
  if (truthy(tools)) {
    if (!tools.is_array()) MT_THROW("\"tools\" is ", tools.type_name(), ", not an array");
    out += "<|im_start|>system\n";
    if (first_is_system) out += system_content() + "\n\n";
    out +=
        "# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with "
        "function signatures within <tools></tools> XML tags:\n<tools>";
    for (const ojson& t : tools) out += "\n" + python_json_dumps(t);
    out +=
        "\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
        "<tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": "
        "<args-json-object>}\n</tool_call><|im_end|>\n";
  } else if (first_is_system) {
    out += "<|im_start|>system\n" + system_content() + "<|im_end|>\n";
  }
  // The last real user query (not a wrapped tool response): reasoning is kept only after it.
  size_t last_query = n - 1;  // wraps for an empty list, where no message is looked at
  for (size_t k = n; k-- > 0;) {
    const ojson& m = messages[k];
    if (role_of(m, k) != "user" || !is_string_content(m)) continue;
    const std::string c = m["content"].get<std::string>();
    if (c.starts_with("<tool_response>") && c.ends_with("</tool_response>")) continue;
    last_query = k;
    break;
  }
  for (size_t i = 0; i < n; ++i) {
    const ojson& m = messages[i];
    const std::string role = role_of(m, i);
    std::string content = content_of(m);
    const bool last = i + 1 == n;
    if (role == "user" || (role == "system" && i != 0)) {
      out += "<|im_start|>" + role + "\n" + content + "<|im_end|>\n";
    } else if (role == "assistant") {
      std::string reasoning;
      const ojson* rc = field(m, "reasoning_content");
      if (rc && rc->is_string()) {
        reasoning = rc->get<std::string>();
      } else if (content.find("</think>") != std::string::npos) {
        std::string before = rstrip_nl(content.substr(0, content.find("</think>")));
        const size_t open = before.rfind("<think>");
        if (open != std::string::npos) before = before.substr(open + 7);
        reasoning = lstrip_nl(before);
        content = lstrip_nl(content.substr(content.rfind("</think>") + 8));
      }
      if (n > 0 && i > last_query && (last || !reasoning.empty())) {
        size_t a = 0, b = reasoning.size();
        while (a < b && reasoning[a] == '\n') ++a;
        while (b > a && reasoning[b - 1] == '\n') --b;
        out +=
            "<|im_start|>" + role + "\n<think>\n" + reasoning.substr(a, b - a) + "\n</think>\n\n" + lstrip_nl(content);
      } else {
        out += "<|im_start|>" + role + "\n" + content;
      }
      const ojson* calls = field(m, "tool_calls");
      if (calls && truthy(*calls)) {
        if (!calls->is_array()) MT_THROW("message ", i, ": \"tool_calls\" is not an array");
        for (size_t k = 0; k < calls->size(); ++k) {
          if ((k == 0 && !content.empty()) || k > 0) out += "\n";
          const ojson* tc = &(*calls)[k];
          if (const ojson* f = field(*tc, "function"); f && truthy(*f)) tc = f;
          const ojson* name = field(*tc, "name");
          const ojson* args = field(*tc, "arguments");
          if (!name || !name->is_string()) MT_THROW("message ", i, ": tool call ", k, " has no string \"name\"");
          out += "<tool_call>\n{\"name\": \"" + name->get<std::string>() + "\", \"arguments\": ";
          out += args && args->is_string() ? args->get<std::string>() : python_json_dumps(args ? *args : ojson());
          out += "}\n</tool_call>";
        }
      }
      out += "<|im_end|>\n";
    } else if (role == "tool") {
      if (i == 0 || role_of(messages[i - 1], i - 1) != "tool") out += "<|im_start|>user";
      out += "\n<tool_response>\n" + content + "\n</tool_response>";
      if (last || role_of(messages[i + 1], i + 1) != "tool") out += "<|im_end|>\n";
    }
  }
  if (opt.add_generation_prompt) {
    out += "<|im_start|>assistant\n";
    if (opt.enable_thinking.has_value() && !*opt.enable_thinking) out += "<think>\n\n</think>\n\n";
  }
  return out;
}

}  // namespace mt
