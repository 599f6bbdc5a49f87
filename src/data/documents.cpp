// JSONL records, text and chat documents, RL prompt records (see documents.h).
#include "data/documents.h"

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>

#include "core/error.h"
#include "core/log.h"
#include "data/token_shards.h"

namespace mt {

BadLines parse_bad_lines(const std::string& s) {
  if (s == "skip") return BadLines::Skip;
  if (s == "fail") return BadLines::Fail;
  MT_THROW("bad_lines '", s, "' is not supported; allowed: skip (count, report and skip malformed lines), fail");
}

DocFormat parse_doc_format(const std::string& s) {
  if (s == "auto") return DocFormat::Auto;
  if (s == "text") return DocFormat::Text;
  if (s == "messages") return DocFormat::Messages;
  MT_THROW("data_format '", s, "' is not supported; allowed: auto, text, messages");
}

std::string JsonlReport::summary() const {
  std::string s = str(path, ": ", lines, " lines, ", records, " records, ", bad, " malformed line(s) skipped");
  for (const std::string& b : bad_examples) s += "\n  " + b;
  if (bad > int64_t(bad_examples.size())) s += str("\n  ... and ", bad - int64_t(bad_examples.size()), " more");
  return s;
}

JsonlReport read_jsonl(const std::string& path, BadLines bad,
                       const std::function<void(int64_t, const nlohmann::ordered_json&)>& on_record) {
  std::ifstream f(path, std::ios::binary);
  if (!f) MT_THROW("cannot open JSONL file '", path, "': ", std::strerror(errno));
  JsonlReport rep;
  rep.path = path;
  std::string line;
  while (std::getline(f, line)) {
    const int64_t n = ++rep.lines;
    if (!line.empty() && line.back() == '\r') line.pop_back();
    if (line.find_first_not_of(" \t") == std::string::npos) continue;
    std::string why;
    try {
      nlohmann::ordered_json j = nlohmann::ordered_json::parse(line);
      if (!j.is_object()) MT_THROW("not a JSON object (a ", j.type_name(), ")");
      on_record(n, j);
      ++rep.records;
      continue;
    } catch (const nlohmann::json::exception& e) {
      why = str("not valid JSON: ", e.what());
    } catch (const Error& e) {
      why = e.what();
    }
    if (bad == BadLines::Fail)
      MT_THROW(path, " line ", n, ": ", why, " (bad_lines fail; use bad_lines skip to count and skip such lines)");
    ++rep.bad;
    if (rep.bad_examples.size() < JsonlReport::kMaxBadExamples) rep.bad_examples.push_back(str("line ", n, ": ", why));
  }
  if (f.bad()) MT_THROW("reading JSONL file '", path, "' failed at line ", rep.lines + 1);
  return rep;
}

TokenizedDoc tokenize_text_doc(const Tokenizer& tok, const std::string& text, int64_t eos_id) {
  TokenizedDoc d;
  for (uint32_t id : tok.encode(text)) d.ids.push_back(int32_t(id));
  if (eos_id >= 0) d.ids.push_back(int32_t(eos_id));
  d.target.assign(d.ids.size(), 1);
  return d;
}

TokenizedDoc tokenize_chat_doc(const Tokenizer& tok, const nlohmann::ordered_json& messages,
                               const nlohmann::ordered_json& tools, const ChatOptions& options) {
  ChatOptions o = options;
  o.add_generation_prompt = false;
  const std::string text = chat_template_of(tok).render(messages, tools, o);
  static const std::string kStart = "<|im_start|>assistant\n", kEnd = "<|im_end|>";
  TokenizedDoc d;
  std::vector<uint32_t> ids;
  auto add = [&](size_t from, size_t to, bool target) {
    if (to <= from) return;
    ids.clear();
    tok.encode_append(std::string_view(text).substr(from, to - from), ids);
    for (uint32_t id : ids) {
      d.ids.push_back(int32_t(id));
      d.target.push_back(target ? 1 : 0);
    }
  };
  size_t pos = 0, turns = 0;
  for (size_t at = text.find(kStart); at != std::string::npos; at = text.find(kStart, pos)) {
    const size_t content = at + kStart.size();
    size_t end = text.find(kEnd, content);
    end = end == std::string::npos ? text.size() : end + kEnd.size();
    add(pos, content, false);
    add(content, end, true);
    pos = end;
    ++turns;
  }
  add(pos, text.size(), false);
  if (turns == 0) MT_THROW("the conversation has no assistant message: nothing to train on");
  return d;
}

int64_t DocumentSet::target_tokens() const {
  int64_t n = 0;
  for (uint8_t t : target) n += t;
  return n;
}

void DocumentSet::add(const TokenizedDoc& doc, int64_t line_no) {
  if (offsets.empty()) offsets.push_back(0);
  ids.insert(ids.end(), doc.ids.begin(), doc.ids.end());
  target.insert(target.end(), doc.target.begin(), doc.target.end());
  offsets.push_back(int64_t(ids.size()));
  line.push_back(line_no);
}

namespace {

const nlohmann::ordered_json& field(const nlohmann::ordered_json& j, const char* key) {
  auto it = j.find(key);
  if (it == j.end()) MT_THROW("no \"", key, "\" field");
  return *it;
}

}  // namespace

DocumentSet load_documents(const std::string& path, const Tokenizer& tok, const DocOptions& opt) {
  // A tokenizer with more ids than the model's vocabulary belongs to another model: one error, before any
  // line (rather than every line a bad line).
  if (opt.vocab_size > 0 && int64_t(tok.vocab_size()) > opt.vocab_size)
    MT_THROW("tokenizer '", tok.source(), "' has ", tok.vocab_size(), " ids but the model's vocab_size is ",
             opt.vocab_size, ": the tokenizer does not belong to this model");
  if (opt.eos_id >= 0 && opt.vocab_size > 0 && opt.eos_id >= opt.vocab_size)
    MT_THROW("eos id ", opt.eos_id, " is outside the model's vocabulary (vocab_size ", opt.vocab_size, ")");
  DocumentSet set;
  set.offsets.push_back(0);
  using Clock = std::chrono::steady_clock;
  const auto t0 = Clock::now();
  auto last_log = t0;
  const nlohmann::ordered_json no_tools;
  set.report = read_jsonl(path, opt.bad_lines, [&](int64_t n, const nlohmann::ordered_json& j) {
    DocFormat kind = opt.format;
    if (kind == DocFormat::Auto) {
      if (j.contains("messages"))
        kind = DocFormat::Messages;
      else if (j.contains("text"))
        kind = DocFormat::Text;
      else
        MT_THROW("neither a \"text\" nor a \"messages\" field");
    }
    TokenizedDoc doc;
    if (kind == DocFormat::Text) {
      const auto& t = field(j, "text");
      if (!t.is_string()) MT_THROW("\"text\" is a ", t.type_name(), ", not a string");
      doc = tokenize_text_doc(tok, t.get<std::string>(), opt.eos_id);
    } else {
      const auto& m = field(j, "messages");
      auto tools = j.find("tools");
      doc = tokenize_chat_doc(tok, m, tools == j.end() ? no_tools : *tools, opt.chat);
    }
    if (doc.ids.empty()) MT_THROW("the document is empty (no tokens)");
    if (opt.vocab_size > 0)
      for (int32_t id : doc.ids)
        if (id >= opt.vocab_size)
          MT_THROW("token id ", id, " is outside the model's vocabulary (vocab_size ", opt.vocab_size,
                   "): the tokenizer does not belong to this model");
    set.add(doc, n);
    if (std::chrono::duration<double>(Clock::now() - last_log).count() > 10) {
      last_log = Clock::now();
      log_info("data: ", path, ": ", set.size(), " documents, ", set.tokens(), " tokens so far (line ", n, ")");
    }
  });
  if (set.size() == 0) MT_THROW("data file '", path, "' holds no usable document: ", set.report.summary());
  return set;
}

std::vector<PromptRecord> load_prompts(const std::string& path, BadLines bad, JsonlReport* report) {
  std::vector<PromptRecord> out;
  JsonlReport rep = read_jsonl(path, bad, [&](int64_t n, const nlohmann::ordered_json& j) {
    PromptRecord r;
    r.line = n;
    const auto& p = field(j, "prompt");
    if (p.is_string())
      r.prompt = p.get<std::string>();
    else if (p.is_array())
      r.messages = normalize_chat_messages(p);
    else
      MT_THROW("\"prompt\" must be a string or a non-empty messages array, got a ", p.type_name());
    auto a = j.find("answer");
    if (a != j.end()) {
      if (a->is_string())
        r.answer = a->get<std::string>();
      else if (a->is_number())
        r.answer = a->dump();
      else
        MT_THROW("\"answer\" must be a string or a number, got a ", a->type_name());
    }
    out.push_back(std::move(r));
  });
  if (report) *report = rep;
  return out;
}

}  // namespace mt

namespace mt {

ShardWriteReport jsonl_text_to_shards(const std::string& jsonl_path, const Tokenizer& tok, const std::string& out_dir,
                                      int64_t eos_id, int64_t shard_tokens, BadLines bad) {
  namespace fs = std::filesystem;
  if (shard_tokens < 1) MT_THROW("shard_tokens ", shard_tokens, " must be >= 1");
  std::error_code ec;
  fs::create_directories(out_dir, ec);
  if (ec) MT_THROW("cannot create the shard directory '", out_dir, "': ", ec.message());
  for (const auto& e : fs::directory_iterator(out_dir))
    if (e.path().extension() == ".bin")
      MT_THROW("shard directory '", out_dir, "' already holds ", e.path().filename().string(),
               "; give an empty or new directory (existing shards are never overwritten)");
  ShardWriteReport rep;
  rep.u16 = tok.vocab_size() <= 65536 && eos_id < 65536;
  std::vector<uint32_t> buf;
  auto flush = [&] {
    if (buf.empty()) return;
    char name[32];
    std::snprintf(name, sizeof name, "shard-%05zu.bin", rep.files.size());
    const fs::path final_path = fs::path(out_dir) / name, tmp = fs::path(out_dir) / (std::string(name) + ".tmp");
    write_token_shard(tmp.string(), buf, rep.u16);
    fs::rename(tmp, final_path);
    rep.files.push_back(final_path.string());
    buf.clear();
  };
  using Clock = std::chrono::steady_clock;
  auto last_log = Clock::now();
  rep.jsonl = read_jsonl(jsonl_path, bad, [&](int64_t n, const nlohmann::ordered_json& j) {
    const auto& t = field(j, "text");
    if (!t.is_string()) MT_THROW("\"text\" is a ", t.type_name(), ", not a string");
    const size_t before = buf.size();
    tok.encode_append(t.get_ref<const std::string&>(), buf);
    if (eos_id >= 0) buf.push_back(uint32_t(eos_id));
    if (buf.size() == before) MT_THROW("the document is empty (no tokens)");
    rep.tokens += int64_t(buf.size() - before);
    ++rep.documents;
    if (int64_t(buf.size()) >= shard_tokens) flush();
    if (std::chrono::duration<double>(Clock::now() - last_log).count() > 10) {
      last_log = Clock::now();
      log_info("tokenize: line ", n, ", ", rep.documents, " documents, ", rep.tokens, " tokens, ", rep.files.size(),
               " shards written");
    }
  });
  flush();
  return rep;
}

}  // namespace mt
