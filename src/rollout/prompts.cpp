// JSONL prompt reader: see prompts.h for the format and what each error names.
#include "rollout/prompts.h"

#include <cerrno>
#include <cstring>
#include <fstream>
#include <limits>

#include "core/error.h"
#include "data/chat_template.h"
#include "data/tokenizer.h"

namespace mt {

namespace {

using json = nlohmann::json;

// A value for an error message: its JSON text, cut to a readable length.
std::string shown(const std::string& text) {
  constexpr size_t kMax = 120;
  return text.size() <= kMax ? text : text.substr(0, kMax) + "...";
}
std::string shown(const json& v) {
  return shown(v.dump());
}

bool blank(const std::string& s) {
  return s.find_first_not_of(" \t\r\n") == std::string::npos;
}

// The ids of a "prompt" (text) or "messages" (chat) value, through the tokenizer.
std::vector<int32_t> encode_text(const json& j, const std::string& line_text, const std::string& key,
                                 const std::string& where, const Tokenizer* tok) {
  const json& v = j[key];
  if (!tok)
    MT_THROW(where, ": \"", key,
             "\" needs a tokenizer, and the model directory has no tokenizer.json: give the "
             "token ids as \"prompt_ids\" or add the tokenizer (",
             shown(v), ")");
  std::string text;
  if (key == "prompt") {
    if (!v.is_string()) MT_THROW(where, ": \"prompt\" must be a string, got ", shown(v));
    text = v.get<std::string>();
  } else {
    if (!v.is_array()) MT_THROW(where, ": \"messages\" must be a list of {\"role\", \"content\"}, got ", shown(v));
    ChatOptions co;
    co.add_generation_prompt = true;
    if (auto it = j.find("enable_thinking"); it != j.end()) {
      if (!it->is_boolean()) MT_THROW(where, ": \"enable_thinking\" must be true or false, got ", shown(*it));
      co.enable_thinking = it->get<bool>();
    }
    // The line again with its keys in their order, as the template's tojson writes them (tools, arguments).
    const nlohmann::ordered_json ordered = nlohmann::ordered_json::parse(line_text);
    const nlohmann::ordered_json tools = ordered.value("tools", nlohmann::ordered_json());
    try {
      text = chat_template_of(*tok).render(ordered["messages"], tools, co);
    } catch (const std::exception& e) {
      MT_THROW(where, ": ", e.what());
    }
  }
  const std::vector<uint32_t> ids = tok->encode(text);
  return std::vector<int32_t>(ids.begin(), ids.end());
}

Prompt parse_line(const std::string& text, const std::string& where, int64_t line, int64_t vocab_size,
                  int64_t max_positions, const Tokenizer* tok) {
  json j;
  try {
    j = json::parse(text);
  } catch (const json::exception& e) {
    // nlohmann's text reads "[json.exception.parse_error.101] parse error at line 1, column 21: ..."; the
    // line is always 1 within one line of the file, so only the column is kept.
    std::string why = e.what();
    if (const size_t at = why.find("] "); at != std::string::npos) why.erase(0, at + 2);
    if (const size_t at = why.find("line 1, "); at != std::string::npos) why.erase(at, 8);
    MT_THROW(where, ": not valid JSON (", why, "): ", shown(text));
  }
  if (!j.is_object())
    MT_THROW(where, ": expected a JSON object with \"prompt_ids\", \"prompt\" or \"messages\", got ",
             j.type_name(), " ", shown(j));
  Prompt p;
  p.line = line;
  auto ids_it = j.find("prompt_ids");
  if (ids_it == j.end()) {
    for (const char* key : {"prompt", "messages"})
      if (j.contains(key)) {
        p.ids = encode_text(j, text, key, where, tok);
        if (p.ids.empty()) MT_THROW(where, ": \"", key, "\" encodes to no tokens; a prompt needs at least one");
        if (int64_t(p.ids.size()) > max_positions)
          MT_THROW(where, ": the prompt has ", p.ids.size(), " tokens, more than the maximum of ", max_positions,
                   " positions");
        for (size_t i = 0; i < p.ids.size(); ++i)
          if (p.ids[i] >= vocab_size)
            MT_THROW(where, ": the tokenizer gave id ", p.ids[i], " (token ", i, "), outside the model's vocabulary [0, ",
                     vocab_size, ")");
        p.meta = std::move(j);  // the text stays in the metadata (rewards read it)
        return p;
      }
    std::string keys;
    for (auto it = j.begin(); it != j.end(); ++it) keys += (keys.empty() ? "" : ", ") + json(it.key()).dump();
    MT_THROW(where, ": no \"prompt_ids\", \"prompt\" or \"messages\" (the line has ",
             keys.empty() ? std::string("no keys") : "keys " + keys, ")");
  }
  const json& ids = *ids_it;
  if (!ids.is_array()) MT_THROW(where, ": \"prompt_ids\" must be a list of token ids, got ", shown(ids));
  if (ids.empty()) MT_THROW(where, ": \"prompt_ids\" is empty; a prompt needs at least one token");
  if (int64_t(ids.size()) > max_positions)
    MT_THROW(where, ": the prompt has ", ids.size(), " tokens, more than the maximum of ", max_positions, " positions");
  p.ids.reserve(ids.size());
  for (size_t i = 0; i < ids.size(); ++i) {
    const json& v = ids[i];
    if (!v.is_number_integer()) MT_THROW(where, ": prompt_ids[", i, "] is ", shown(v), ", not an integer token id");
    const bool in_range = v.is_number_unsigned() ? v.get<uint64_t>() < uint64_t(vocab_size)
                                                 : v.get<int64_t>() >= 0 && v.get<int64_t>() < vocab_size;
    if (!in_range)
      MT_THROW(where, ": prompt_ids[", i, "] is ", shown(v), ", outside the vocabulary [0, ", vocab_size, ")");
    p.ids.push_back(int32_t(v.get<int64_t>()));
  }
  j.erase(ids_it);
  p.meta = std::move(j);
  return p;
}

}  // namespace

std::vector<Prompt> parse_prompts(std::istream& in, const std::string& origin, int64_t vocab_size,
                                  int64_t max_positions, const Tokenizer* tokenizer) {
  if (vocab_size < 1 || vocab_size > int64_t(std::numeric_limits<int32_t>::max()) + 1)
    MT_THROW(origin, ": vocabulary size (", vocab_size, ") must be in [1, 2^31]");
  if (max_positions < 1) MT_THROW(origin, ": max positions (", max_positions, ") must be >= 1");
  std::vector<Prompt> prompts;
  std::string text;
  for (int64_t line = 1; std::getline(in, text); ++line) {
    if (line == 1 && text.rfind("\xEF\xBB\xBF", 0) == 0) text.erase(0, 3);  // a UTF-8 byte order mark
    if (blank(text)) continue;
    prompts.push_back(parse_line(text, origin + ":" + std::to_string(line), line, vocab_size, max_positions, tokenizer));
  }
  if (in.bad()) MT_THROW(origin, ": read error after ", prompts.size(), " prompts");
  if (prompts.empty()) MT_THROW(origin, ": no prompts (the file is empty or holds only blank lines)");
  return prompts;
}

std::vector<Prompt> read_prompts(const std::string& path, int64_t vocab_size, int64_t max_positions,
                                 const Tokenizer* tokenizer) {
  std::ifstream f(path);
  if (!f) MT_THROW("cannot open the prompt file ", path, ": ", std::strerror(errno));
  return parse_prompts(f, path, vocab_size, max_positions, tokenizer);
}

}  // namespace mt
