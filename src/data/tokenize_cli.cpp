// moetrain tokenize --tokenizer FILE [--jsonl] [--decode [--skip-special]] [--chat ...] [--bench [--file F]]
//   encode (default): each stdin line is one text (--jsonl: a JSON string, so it can hold newlines and tabs);
//     prints each text's ids space-separated on one line (an empty text gives an empty line).
//   --decode: each stdin line is ids separated by spaces; prints each text on one line (--jsonl: as a JSON string).
//   --chat: each stdin line is a JSON object {"messages": [...], "tools": [...]?} or a messages array, rendered
//     with the Qwen3 chat template (chat_template.h) and encoded; --text prints the rendered text as a JSON string.
//   --bench: times encode on one thread over --file (default: a built-in mixed text), one document per line, and
//     prints one JSON line.
//   --out DIR: the {"text": ...} lines of --file (default stdin) become token shards DIR/shard-NNNNN.bin
//     (data/token_shards.h), each document followed by --eos (auto: <|endoftext|> when the tokenizer has it),
//     about --shard-tokens tokens per shard; malformed lines skipped and reported (--bad-lines fail: fatal).
// Errors name the stdin line and what was wrong in it; a summary goes to stderr at the end.
#include "data/tokenize_cli.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>
#include <vector>

#include "core/cli_args.h"
#include "core/error.h"
#include "data/chat_template.h"
#include "data/documents.h"
#include "data/tokenizer.h"

namespace mt {

namespace {

const char* kUsage =
    "usage: moetrain tokenize --tokenizer FILE [--jsonl] < texts          ids of each line (one text per line)\n"
    "       moetrain tokenize --tokenizer FILE --decode [--jsonl] [--skip-special] < ids\n"
    "       moetrain tokenize --tokenizer FILE --chat [--add-generation-prompt] [--enable-thinking true|false]\n"
    "                         [--text] < messages.jsonl      Qwen3 chat template, then ids (--text: the text)\n"
    "       moetrain tokenize --tokenizer FILE --bench [--file TEXT] [--passes N]   encode speed, one thread\n"
    "       moetrain tokenize --tokenizer FILE --out DIR [--file TEXTS.jsonl] [--eos auto|none|ID]\n"
    "                         [--shard-tokens N] [--bad-lines skip|fail]   {\"text\"} lines -> token shards for training";

using Clock = std::chrono::steady_clock;
double since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

void write_ids(std::string& out, const std::vector<uint32_t>& ids) {
  char buf[16];
  for (size_t i = 0; i < ids.size(); ++i) {
    if (i) out.push_back(' ');
    const int n = std::snprintf(buf, sizeof buf, "%u", ids[i]);
    out.append(buf, size_t(n));
  }
  out.push_back('\n');
}

void flush(std::string& out, bool force = false) {
  if (out.size() > (1u << 20) || force) {
    std::fwrite(out.data(), 1, out.size(), stdout);
    out.clear();
  }
}

// A deterministic mixed text when no --file is given: English prose, code, numbers, CJK and emoji.
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

int bench(const Tokenizer& proto, const std::string& file, int passes) {
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
    const double s = since(t0);
    if (p == 0)
      cold = s;
    else
      best = std::min(best, s);
  }
  if (passes == 1) best = cold;
  const double mb = double(text.size()) / 1e6;
  nlohmann::json j = {{"bench", "tokenize"},
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
  std::printf("%s\n", j.dump().c_str());
  return 0;
}

}  // namespace

int tokenize_main(const std::vector<std::string>& args) {
  std::string tokenizer_path, file;
  bool jsonl = false, decode = false, skip_special = false, do_bench = false, chat = false, text_out = false;
  ChatOptions chat_opts;
  int passes = 3;
  std::string out_dir, eos = "auto", bad_lines = "skip";
  int64_t shard_tokens = 100'000'000;
  std::set<std::string> given;  // the options on the command line
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& a = args[i];
    given.insert(a);
    auto value = [&]() -> std::string {
      if (i + 1 >= args.size()) MT_THROW(a, " needs a value\n", kUsage);
      return args[++i];
    };
    if (a == "--tokenizer")
      tokenizer_path = value();
    else if (a == "--jsonl")
      jsonl = true;
    else if (a == "--decode")
      decode = true;
    else if (a == "--skip-special")
      skip_special = true;
    else if (a == "--bench")
      do_bench = true;
    else if (a == "--file")
      file = value();
    else if (a == "--passes")
      passes = parse_flag_number<int>(a, value());
    else if (a == "--chat")
      chat = true;
    else if (a == "--out")
      out_dir = value();
    else if (a == "--eos")
      eos = value();
    else if (a == "--shard-tokens")
      shard_tokens = parse_flag_number<int64_t>(a, value());
    else if (a == "--bad-lines")
      bad_lines = value();
    else if (a == "--text")
      text_out = true;
    else if (a == "--add-generation-prompt")
      chat_opts.add_generation_prompt = true;
    else if (a == "--enable-thinking") {
      const std::string v = value();
      if (v != "true" && v != "false") MT_THROW("--enable-thinking '", v, "' must be true or false");
      chat_opts.enable_thinking = v == "true";
    } else if (a == "--help" || a == "-h") {
      std::printf("%s\n", kUsage);
      return 0;
    } else {
      MT_THROW("unknown option '", a, "'\n", kUsage);
    }
  }
  if (tokenizer_path.empty()) MT_THROW("--tokenizer FILE (a Hugging Face tokenizer.json) is required\n", kUsage);
  if (passes < 1) MT_THROW("--passes ", passes, " must be at least 1");
  if (int(decode) + int(chat) + int(do_bench) > 1) MT_THROW("--decode, --chat and --bench are exclusive");
  if (do_bench && !out_dir.empty()) MT_THROW("--bench and --out are exclusive");
  // Each option is read by some modes only; given to another, it would be ignored.
  const std::string mode = do_bench           ? "--bench"
                           : !out_dir.empty() ? "--out"
                           : decode           ? "--decode"
                           : chat             ? "--chat"
                                              : "encode";
  const std::pair<const char*, std::vector<std::string>> kReadBy[] = {{"--jsonl", {"encode", "--decode"}},
                                                                      {"--skip-special", {"--decode"}},
                                                                      {"--text", {"--chat"}},
                                                                      {"--add-generation-prompt", {"--chat"}},
                                                                      {"--enable-thinking", {"--chat"}},
                                                                      {"--passes", {"--bench"}},
                                                                      {"--file", {"--bench", "--out"}},
                                                                      {"--eos", {"--out"}},
                                                                      {"--shard-tokens", {"--out"}},
                                                                      {"--bad-lines", {"--out"}}};
  for (const auto& [flag, modes] : kReadBy) {
    if (!given.count(flag) || std::find(modes.begin(), modes.end(), mode) != modes.end()) continue;
    auto name = [](const std::string& m) { return m == "encode" ? std::string("when encoding") : "with " + m; };
    std::string allowed = name(modes[0]);  // "when encoding or with --decode", "with --bench or --out"
    if (modes.size() > 1) allowed += " or " + (modes[0] == "encode" ? name(modes[1]) : modes[1]);
    MT_THROW(flag, " is read only ", allowed, "; this run ", mode == "encode" ? "encodes stdin" : "is " + mode,
             ", which would ignore it\n", kUsage);
  }
  const Tokenizer tok = Tokenizer::from_file(tokenizer_path);
  if (do_bench) return bench(tok, file, passes);
  if (!out_dir.empty()) {
    if (decode || chat) MT_THROW("--out writes shards from {\"text\"} lines; it does not combine with --decode or --chat");
    int64_t eos_id = -1;
    if (eos == "auto") eos_id = tok.token_to_id("<|endoftext|>");
    else if (eos != "none") {
      eos_id = parse_flag_number<int64_t>("--eos", eos);
      if (eos_id < 0 || eos_id >= int64_t(tok.vocab_size()))
        MT_THROW("--eos ", eos_id, " is not an id of the tokenizer (0 .. ", tok.vocab_size() - 1, "); or auto, none");
    }
    const auto t0 = Clock::now();
    const ShardWriteReport r = jsonl_text_to_shards(file.empty() ? "/dev/stdin" : file, tok, out_dir, eos_id,
                                                    shard_tokens, parse_bad_lines(bad_lines));
    std::fprintf(stderr, "%s\ntokenize: %lld documents, %lld tokens (eos %lld) in %zu %s shard(s) under %s, %.2f s\n",
                 r.jsonl.summary().c_str(), (long long)r.documents, (long long)r.tokens, (long long)eos_id,
                 r.files.size(), r.u16 ? "uint16" : "uint32", out_dir.c_str(), since(t0));
    return 0;
  }

  const auto t0 = Clock::now();
  std::string line, out;
  std::vector<uint32_t> ids;
  size_t n = 0, bytes = 0, tokens = 0;
  for (size_t lineno = 1; std::getline(std::cin, line); ++lineno) {
    ++n;
    if (decode) {
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
          MT_THROW("stdin line ", lineno, ": '", w, "' is not a token id (a number in [0, ", tok.vocab_size(), "))");
        ids.push_back(uint32_t(v));
      }
      std::string s;
      try {
        s = tok.decode(ids, skip_special);
      } catch (const Error& e) {
        MT_THROW("stdin line ", lineno, ": ", e.what());
      }
      tokens += ids.size();
      bytes += s.size();
      out += jsonl ? nlohmann::json(s).dump() : s;
      out.push_back('\n');
    } else {
      std::string text;
      if (chat) {
        nlohmann::ordered_json j;
        try {
          j = nlohmann::ordered_json::parse(line);
        } catch (const nlohmann::json::exception& e) {
          MT_THROW("stdin line ", lineno, ": not JSON (", e.what(), ")");
        }
        try {
          text = j.is_array()
                     ? render_qwen3_chat(j, nlohmann::ordered_json(), chat_opts)
                     : render_qwen3_chat(j.at("messages"), j.value("tools", nlohmann::ordered_json()), chat_opts);
        } catch (const std::exception& e) {
          MT_THROW("stdin line ", lineno, ": ", e.what());
        }
        if (text_out) {
          out += nlohmann::json(text).dump();
          out.push_back('\n');
          flush(out);
          continue;
        }
      } else if (jsonl) {
        nlohmann::json j;
        try {
          j = nlohmann::json::parse(line);
        } catch (const nlohmann::json::exception& e) {
          MT_THROW("stdin line ", lineno, ": not a JSON string (", e.what(), ")");
        }
        if (!j.is_string()) MT_THROW("stdin line ", lineno, ": expected a JSON string, got ", j.type_name());
        text = j.get<std::string>();
      } else {
        text = std::move(line);
      }
      ids.clear();
      tok.encode_append(text, ids);
      bytes += text.size();
      tokens += ids.size();
      write_ids(out, ids);
    }
    flush(out);
  }
  flush(out, true);
  std::fflush(stdout);
  const double s = since(t0);
  std::fprintf(stderr, "tokenize: %zu lines, %zu bytes, %zu tokens in %.2f s\n", n, bytes, tokens, s);
  return 0;
}

}  // namespace mt
