// The line tools of `moetrain tokenize` (tokenize_lines.h).
#include "data/tokenize_lines.h"

#include <algorithm>
#include <chrono>
#include <fstream>
#include <sstream>
#include <string_view>
#include <vector>

#include "core/clock.h"
#include "core/error.h"

namespace mt {

namespace {

void write_ids(std::string& out, const std::vector<uint32_t>& ids) {
  char buf[16];
  for (size_t i = 0; i < ids.size(); ++i) {
    if (i) out.push_back(' ');
    const int n = std::snprintf(buf, sizeof buf, "%u", ids[i]);
    out.append(buf, size_t(n));
  }
  out.push_back('\n');
}

void flush(std::string& out, std::FILE* f, bool force = false) {
  if (out.size() > (1u << 20) || force) {
    std::fwrite(out.data(), 1, out.size(), f);
    out.clear();
  }
}

// A deterministic mixed text when no file is given: English prose, code, numbers, CJK and emoji.
std::string builtin_text() {
  const char* words[] = {"the",      "model",   "learns",    "experts", "router", "tokens", "gradient",
                         "training", "data",    "of",        "and",     "with",   "a",      "in",
                         "language", "mixture", "attention", "layer",   "to",     "is"};
  const char* extras[] = {"int main() {\n",
                          "  return x + y;\n",
                          "}\n",
                          "3.14159",
                          "2024",
                          "你好，世界。",
                          "混合专家模型",
                          "東京",
                          "😀",
                          "don't",
                          "I'LL",
                          "\t",
                          "  ",
                          "{\"k\": [1, 2]}"};
  std::string s;
  uint64_t x = 42;
  auto next = [&] { return x = x * 6364136223846793005ull + 1442695040888963407ull, uint32_t(x >> 33); };
  while (s.size() < (4u << 20)) {
    const int n = 5 + int(next() % 40);
    for (int i = 0; i < n; ++i) {
      s += next() % 8 == 0 ? extras[next() % 14] : words[next() % 20];
      s += next() % 10 == 0 ? ", " : " ";
    }
    s += ".\n";
  }
  return s;
}

}  // namespace

nlohmann::json tokenize_bench(const Tokenizer& proto, const std::string& file, int passes) {
  if (passes < 1) MT_THROW("tokenize_bench: passes ", passes, " must be at least 1");
  std::string text;
  if (file.empty()) {
    text = builtin_text();
  } else {
    std::ifstream f(file, std::ios::binary);
    if (!f) MT_THROW("--file ", file, ": cannot open it");
    std::stringstream ss;
    ss << f.rdbuf();
    text = ss.str();
  }
  std::vector<std::string_view> lines;
  for (size_t i = 0; i < text.size();) {
    size_t e = text.find('\n', i);
    if (e == std::string::npos) e = text.size();
    lines.push_back(std::string_view(text).substr(i, e - i));
    i = e + 1;
  }
  Tokenizer tok = proto;  // a fresh word cache: the first pass is cold
  std::vector<uint32_t> ids;
  double cold = 0, best = 1e30;
  size_t tokens = 0;
  for (int p = 0; p < passes; ++p) {
    const auto t0 = Clock::now();
    tokens = 0;
    for (std::string_view l : lines) {
      ids.clear();
      tok.encode_append(l, ids);
      tokens += ids.size();
    }
    const double s = seconds_since(t0);
    if (p == 0)
      cold = s;
    else
      best = std::min(best, s);
  }
  if (passes == 1) best = cold;
  const double mb = double(text.size()) / 1e6;
  return {{"bench", "tokenize"},
          {"tokenizer", proto.source()},
          {"file", file.empty() ? "builtin" : file},
          {"bytes", text.size()},
          {"lines", lines.size()},
          {"tokens", tokens},
          {"threads", 1},
          {"passes", passes},
          {"cold_s", cold},
          {"cold_mb_per_s", mb / cold},
          {"warm_s", best},
          {"mb_per_s", mb / best},
          {"tokens_per_s", double(tokens) / best}};
}

TokenizeLinesReport tokenize_lines(const Tokenizer& tok, std::istream& in, std::FILE* outf,
                                   const TokenizeLinesOptions& o) {
  const auto t0 = Clock::now();
  TokenizeLinesReport rep;
  std::string line, out;
  std::vector<uint32_t> ids;
  for (size_t lineno = 1; std::getline(in, line); ++lineno) {
    ++rep.lines;
    if (o.mode == LineMode::Decode) {
      ids.clear();
      std::istringstream is(line);
      std::string w;
      while (is >> w) {
        size_t used = 0;
        long long v = -1;
        try {
          v = std::stoll(w, &used);
        } catch (const std::exception&) {
        }
        if (used != w.size() || v < 0 || v >= (1ll << 32))
          MT_THROW(o.source, " line ", lineno, ": '", w, "' is not a token id (a number in [0, ", tok.vocab_size(),
                   "))");
        ids.push_back(uint32_t(v));
      }
      std::string s;
      try {
        s = tok.decode(ids, o.skip_special);
      } catch (const Error& e) {
        MT_THROW(o.source, " line ", lineno, ": ", e.what());
      }
      rep.tokens += ids.size();
      rep.bytes += s.size();
      out += o.jsonl ? nlohmann::json(s).dump() : s;
      out.push_back('\n');
    } else {
      std::string text;
      if (o.mode == LineMode::Chat) {
        nlohmann::ordered_json j;
        try {
          j = nlohmann::ordered_json::parse(line);
        } catch (const nlohmann::json::exception& e) {
          MT_THROW(o.source, " line ", lineno, ": not JSON (", e.what(), ")");
        }
        try {
          const ChatTemplate& tpl = chat_template_of(tok);
          if (!j.is_array() && !j.is_object())
            MT_THROW("expected {\"messages\": [...]} or a messages list, got ", j.type_name());
          if (j.is_object() && !j.contains("messages"))
            MT_THROW("no \"messages\" (expected {\"messages\": [...], \"tools\": [...]?} or a messages list)");
          text = j.is_array() ? tpl.render(j, nlohmann::ordered_json(), o.chat)
                              : tpl.render(j["messages"], j.value("tools", nlohmann::ordered_json()), o.chat);
        } catch (const std::exception& e) {
          MT_THROW(o.source, " line ", lineno, ": ", e.what());
        }
        if (o.text) {
          out += nlohmann::json(text).dump();
          out.push_back('\n');
          flush(out, outf);
          continue;
        }
      } else if (o.jsonl) {
        nlohmann::json j;
        try {
          j = nlohmann::json::parse(line);
        } catch (const nlohmann::json::exception& e) {
          MT_THROW(o.source, " line ", lineno, ": not a JSON string (", e.what(), ")");
        }
        if (!j.is_string()) MT_THROW(o.source, " line ", lineno, ": expected a JSON string, got ", j.type_name());
        text = j.get<std::string>();
      } else {
        text = std::move(line);
      }
      ids.clear();
      tok.encode_append(text, ids);
      rep.bytes += text.size();
      rep.tokens += ids.size();
      write_ids(out, ids);
    }
    flush(out, outf);
  }
  flush(out, outf, true);
  std::fflush(outf);
  rep.seconds = seconds_since(t0);
  return rep;
}

}  // namespace mt
