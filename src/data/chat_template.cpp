// Qwen3's chat template, statement by statement (its Jinja source is kQwen3Template below); the validation of chat
// messages every reader applies; the choice of a tokenizer directory's template (chat_template.h).
#include "data/chat_template.h"

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <mutex>
#include <sstream>

#include "core/error.h"
#include "core/log.h"
#include "data/jinja.h"
#include "data/tokenizer.h"

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

namespace {

// Qwen3's template, byte for byte as in the tokenizer_config.json of the Qwen3 models (e.g. Qwen/Qwen3-30B-A3B;
// tests/assets/tokenizer/qwen3_chat_template.jinja holds the same text).
const char* const kQwen3Template = R"TPL({%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\n\n' }}
    {%- endif %}
    {{- "# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and message.content is string and not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.content is string %}
        {%- set content = message.content %}
    {%- else %}
        {%- set content = '' %}
    {%- endif %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\n' + content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- else %}
            {%- if '</think>' in content %}
                {%- set reasoning_content = content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') %}
                {%- set content = content.split('</think>')[-1].lstrip('\n') %}
            {%- endif %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {%- if loop.last or (not loop.last and reasoning_content) %}
                {{- '<|im_start|>' + message.role + '\n<think>\n' + reasoning_content.strip('\n') + '\n</think>\n\n' + content.lstrip('\n') }}
            {%- else %}
                {{- '<|im_start|>' + message.role + '\n' + content }}
            {%- endif %}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\n' + content }}
        {%- endif %}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and content) or (not loop.first) %}
                    {{- '\n' }}
                {%- endif %}
                {%- if tool_call.function %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {{- '<tool_call>\n{"name": "' }}
                {{- tool_call.name }}
                {{- '", "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- endif %}
{%- endif %})TPL";

const char* const kRoles = "\"system\", \"user\", \"assistant\", \"tool\"";
const char* const kContentForms = "a string or a list of {\"type\": \"text\", \"text\": \"...\"} parts";

std::string shown(const ojson& v) {
  const std::string s = v.dump();
  return s.size() <= 120 ? s : s.substr(0, 120) + "...";
}

std::string read_file(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) MT_THROW("cannot open ", path);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

}  // namespace

const std::string& qwen3_chat_template_source() {
  static const std::string s = kQwen3Template;
  return s;
}

std::string normalize_template_whitespace(const std::string& source) {
  std::string out, line;
  std::istringstream in(source);
  while (std::getline(in, line)) {
    size_t a = 0, b = line.size();
    while (a < b && std::isspace((unsigned char)line[a])) ++a;
    while (b > a && std::isspace((unsigned char)line[b - 1])) --b;
    if (b == a) continue;
    out.append(line, a, b - a);
    out.push_back('\n');
  }
  return out;
}

ojson normalize_chat_messages(const ojson& messages) {
  if (!messages.is_array())
    MT_THROW("\"messages\" is ", shown(messages), "; allowed: a list of {\"role\", \"content\"} messages");
  if (messages.empty()) MT_THROW("\"messages\" is an empty list; a chat needs at least one message");
  ojson out = ojson::array();
  for (size_t i = 0; i < messages.size(); ++i) {
    const ojson& m = messages[i];
    if (!m.is_object())
      MT_THROW("message ", i, " is ", shown(m), "; allowed: an object {\"role\": ..., \"content\": ...}");
    const ojson* role = field(m, "role");
    if (!role) MT_THROW("message ", i, " has no \"role\"; allowed: ", kRoles);
    if (!role->is_string()) MT_THROW("message ", i, ": \"role\" is ", shown(*role), "; allowed: ", kRoles);
    const std::string r = role->get<std::string>();
    if (r != "system" && r != "user" && r != "assistant" && r != "tool")
      MT_THROW("message ", i, ": \"role\" is ", shown(*role), "; allowed: ", kRoles);
    ojson n = m;
    const ojson* calls = field(m, "tool_calls");
    const bool has_calls = calls && !calls->is_null() && !(calls->is_array() && calls->empty());
    if (calls && !calls->is_null()) {
      if (r != "assistant")
        MT_THROW("message ", i, " (", r, "): \"tool_calls\" is allowed only on an assistant message");
      if (!calls->is_array())
        MT_THROW("message ", i, ": \"tool_calls\" is ", shown(*calls),
                 "; allowed: a list of {\"function\": {\"name\": ..., \"arguments\": {...}}}");
      for (size_t k = 0; k < calls->size(); ++k) {
        const ojson& c = (*calls)[k];
        const ojson* f = field(c, "function");
        const ojson& fn = f && f->is_object() ? *f : c;
        const ojson* name = field(fn, "name");
        if (!name || !name->is_string() || name->get_ref<const std::string&>().empty())
          MT_THROW("message ", i, ": tool call ", k, " is ", shown(c),
                   "; allowed: {\"function\": {\"name\": a non-empty string, \"arguments\": an object or a JSON "
                   "string}}");
        const ojson* args = field(fn, "arguments");
        if (args && !args->is_object() && !args->is_string())
          MT_THROW("message ", i, ": tool call ", k, " (", name->get<std::string>(), "): \"arguments\" is ",
                   shown(*args), "; allowed: an object or a JSON string");
      }
    }
    if (const ojson* rc = field(m, "reasoning_content"); rc && !rc->is_null() && !rc->is_string())
      MT_THROW("message ", i, " (", r, "): \"reasoning_content\" is ", shown(*rc), "; allowed: a string or null");
    const ojson* c = field(m, "content");
    if (c && c->is_string()) {
      // as it is
    } else if (c && c->is_array()) {
      std::string text;
      for (size_t k = 0; k < c->size(); ++k) {
        const ojson& part = (*c)[k];
        const ojson* type = field(part, "type");
        const ojson* t = field(part, "text");
        if (!type || *type != "text" || !t || !t->is_string())
          MT_THROW("message ", i, " (", r, "): content part ", k, " is ", shown(part),
                   "; allowed: {\"type\": \"text\", \"text\": a string} (only text parts)");
        text += t->get<std::string>();
      }
      n["content"] = text;
    } else if ((!c || c->is_null()) && r == "assistant" && has_calls) {
      n["content"] = "";
    } else if (!c) {
      MT_THROW("message ", i, " (", r, ") has no \"content\"; allowed: ", kContentForms,
               r == "assistant" ? " (or null with \"tool_calls\")" : "");
    } else {
      MT_THROW("message ", i, " (", r, "): \"content\" is ", shown(*c), "; allowed: ", kContentForms,
               r == "assistant" ? " (or null with \"tool_calls\")" : "");
    }
    out.push_back(std::move(n));
  }
  return out;
}

ChatTemplate ChatTemplate::builtin(const std::string& why) {
  ChatTemplate t;
  t.description_ = why;
  return t;
}

ChatTemplate ChatTemplate::from_source(const std::string& source, const std::string& origin,
                                       const ojson& special_tokens) {
  if (normalize_template_whitespace(source) == normalize_template_whitespace(qwen3_chat_template_source()))
    return builtin("Qwen3's template from " + origin + ", run by the built-in Qwen3 renderer");
  ChatTemplate t;
  t.jinja_ = std::make_shared<const jinja::Template>(source, origin);
  t.special_tokens_ = special_tokens;
  t.description_ = origin + " (not Qwen3's template), run by the Jinja interpreter";
  return t;
}

namespace {

// tokenizer_config.json's special tokens that templates read (bos_token, eos_token, ...): a string, or an
// AddedToken object with "content".
ojson special_tokens_of(const ojson& config) {
  ojson out = ojson::object();
  for (const char* k : {"bos_token", "eos_token", "pad_token", "unk_token"}) {
    const ojson* v = field(config, k);
    if (v && v->is_string())
      out[k] = *v;
    else if (v && v->is_object() && field(*v, "content") && (*v)["content"].is_string())
      out[k] = (*v)["content"];
  }
  return out;
}

}  // namespace

ChatTemplate ChatTemplate::for_directory(const std::string& dir) {
  namespace fs = std::filesystem;
  const std::string jinja_path = (fs::path(dir) / "chat_template.jinja").string();
  const std::string config_path = (fs::path(dir) / "tokenizer_config.json").string();
  ChatTemplate t = builtin();
  std::string source, origin, problem;
  ojson specials = ojson::object();
  try {
    if (fs::is_regular_file(config_path)) {
      ojson config;
      try {
        config = ojson::parse(read_file(config_path));
      } catch (const nlohmann::json::exception& e) {
        MT_THROW(config_path, ": not valid JSON (", e.what(), ")");
      }
      specials = special_tokens_of(config);
      const ojson* ct = field(config, "chat_template");
      if (ct && ct->is_string()) {
        source = ct->get<std::string>();
        origin = config_path + " chat_template";
      } else if (ct && ct->is_array()) {
        // Named templates ([{"name": "default", "template": ...}, ...]): the default one.
        for (const ojson& e : *ct)
          if (field(e, "name") && e["name"] == "default" && field(e, "template") && e["template"].is_string()) {
            source = e["template"].get<std::string>();
            origin = config_path + " chat_template \"default\"";
          }
        if (source.empty()) problem = config_path + ": \"chat_template\" is a list without a \"default\" template";
      } else if (ct && !ct->is_null()) {
        problem = str(config_path, ": \"chat_template\" is ", shown(*ct), ", not a string");
      }
    }
    if (fs::is_regular_file(jinja_path)) {  // transformers 5 writes the template here; it wins over the config's
      source = read_file(jinja_path);
      origin = jinja_path;
      problem.clear();
    }
  } catch (const std::exception& e) {
    problem = e.what();
  }
  if (!problem.empty()) {
    t.description_ = "built-in Qwen3 renderer (warning: " + problem + ")";
  } else if (source.empty()) {
    t.description_ = "built-in Qwen3 renderer (" + dir +
                     " has no chat_template.jinja and no chat_template in "
                     "tokenizer_config.json)";
  } else {
    try {
      t = from_source(source, origin, specials);
    } catch (const std::exception& e) {
      t = builtin();
      t.description_ =
          str("built-in Qwen3 renderer (warning: the Jinja interpreter cannot run ", origin, ": ", e.what(),
              "; chats are rendered as Qwen3's template does, which may differ from this model's)");
    }
  }
  log_info("chat template: ", t.description_);
  return t;
}

std::string ChatTemplate::render(const ojson& messages, const ojson& tools, const ChatOptions& options) const {
  const ojson m = normalize_chat_messages(messages);
  if (!tools.is_null() && !tools.is_array())
    MT_THROW("\"tools\" is ", shown(tools), "; allowed: a list of tool (function) descriptions, or null");
  if (!jinja_) return render_qwen3_chat(m, tools, options);
  ojson ctx = special_tokens_;
  ctx["messages"] = m;
  ctx["tools"] = tools;
  ctx["add_generation_prompt"] = options.add_generation_prompt;
  if (options.enable_thinking) ctx["enable_thinking"] = *options.enable_thinking;
  return jinja_->render(ctx);
}

const ChatTemplate& chat_template_of(const Tokenizer& tok) {
  static std::mutex mu;
  static std::map<std::string, std::unique_ptr<ChatTemplate>> by_dir;
  std::filesystem::path p(tok.source());
  const std::string dir = p.has_parent_path() ? p.parent_path().string() : std::string(".");
  std::lock_guard<std::mutex> lock(mu);
  auto it = by_dir.find(dir);
  if (it == by_dir.end())
    it = by_dir.emplace(dir, std::make_unique<ChatTemplate>(ChatTemplate::for_directory(dir))).first;
  return *it->second;
}

}  // namespace mt
