// Real data from JSONL files: one JSON object per line, of one of three kinds.
//   {"text": "..."}                         pretraining: every token is a target; <eos> appended
//   {"messages": [...], "tools": [...]?}    SFT: checked (normalize_chat_messages) and rendered with the
//                                           tokenizer's chat template (chat_template.h); targets are the
//                                           assistant turns only (content and their <|im_end|>)
//   {"prompt": "..." | [messages], "answer": "..."}   RL prompts: kept as records, not tokenized here
// Malformed lines (not JSON, not an object, a missing or mistyped field, an empty document) are counted
// and reported with their line numbers; BadLines decides whether the first one stops the load
// (Fail, the error names the file, the line and why) or is skipped (Skip, the report names the first
// few). Blank lines are ignored.
//
// SFT targets: the rendered conversation is cut at each assistant turn's content start (right after
// "<|im_start|>assistant\n") and after its "<|im_end|>", and the pieces are tokenized separately and
// concatenated. The prompt part thus ends exactly as the generation prompt does at inference, and the
// answer's tokens are those the model would generate after it; the other cuts sit at special tokens,
// where the tokenizer splits anyway.
#pragma once
#include <cstdint>
#include <functional>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "data/chat_template.h"
#include "data/tokenizer.h"

namespace mt {

enum class BadLines { Skip, Fail };
BadLines parse_bad_lines(const std::string& s);  // "skip" | "fail"

enum class DocFormat { Auto, Text, Messages };     // Auto: from each line's keys ("messages" or "text")
DocFormat parse_doc_format(const std::string& s);  // "auto" | "text" | "messages"

struct JsonlReport {
  std::string path;
  int64_t lines = 0;                      // lines read, blank ones included
  int64_t records = 0;                    // lines that gave a record
  int64_t bad = 0;                        // malformed lines skipped
  std::vector<std::string> bad_examples;  // "line N: why", the first kMaxBadExamples
  static constexpr size_t kMaxBadExamples = 10;
  std::string summary() const;  // one line for the log: counts and the first bad lines
};

// Calls on_record(line_number, object) for each non-blank line that parses as a JSON object. A line that
// does not, or for which on_record throws mt::Error (its message says why), is a bad line: with Fail an
// error "FILE line N: why", with Skip counted in the report. A missing file is an error naming it.
JsonlReport read_jsonl(const std::string& path, BadLines bad,
                       const std::function<void(int64_t, const nlohmann::ordered_json&)>& on_record);

// One tokenized document: ids and, per token, whether it is a training target (its label is the id).
struct TokenizedDoc {
  std::vector<int32_t> ids;
  std::vector<uint8_t> target;
};

// Text: encode(text), then eos_id when >= 0; every token a target.
TokenizedDoc tokenize_text_doc(const Tokenizer& tok, const std::string& text, int64_t eos_id);
// Chat: see the file comment. Throws (naming the message) when the conversation has no assistant turn.
TokenizedDoc tokenize_chat_doc(const Tokenizer& tok, const nlohmann::ordered_json& messages,
                               const nlohmann::ordered_json& tools, const ChatOptions& options = {});

// Every document of a file, tokenized, in file order, stored flat.
struct DocumentSet {
  std::vector<int32_t> ids;      // all documents back to back
  std::vector<uint8_t> target;   // per token
  std::vector<int64_t> offsets;  // document d is [offsets[d], offsets[d + 1])
  std::vector<int64_t> line;     // the file line of each document (for messages that name one)
  JsonlReport report;
  int64_t size() const { return int64_t(line.size()); }
  int64_t length(int64_t d) const { return offsets[size_t(d) + 1] - offsets[size_t(d)]; }
  int64_t tokens() const { return int64_t(ids.size()); }
  int64_t target_tokens() const;
  void add(const TokenizedDoc& doc, int64_t line);
};

struct DocOptions {
  DocFormat format = DocFormat::Auto;
  BadLines bad_lines = BadLines::Skip;
  int64_t eos_id = -1;     // appended to text documents (-1: none)
  int64_t vocab_size = 0;  // > 0: a token id >= this is an error naming the line (model and tokenizer disagree)
  ChatOptions chat;
};

// Reads and tokenizes a JSONL file of text or messages lines. Logs progress every few seconds on large
// files. No document at all is an error naming the file and the report.
DocumentSet load_documents(const std::string& path, const Tokenizer& tok, const DocOptions& opt);

// RL prompts: {"prompt": "text" | [messages], "answer": "..."} ("answer" optional, a string or a number).
struct PromptRecord {
  int64_t line = 0;
  std::string prompt;               // a text prompt ("" when messages are given)
  nlohmann::ordered_json messages;  // a chat prompt (null when text is given)
  std::string answer;
};
std::vector<PromptRecord> load_prompts(const std::string& path, BadLines bad, JsonlReport* report = nullptr);

}  // namespace mt

namespace mt {

// `moetrain tokenize --out DIR`: the {"text": ...} lines of a JSONL file (other lines are bad lines),
// each encoded with eos_id appended (-1: none), concatenated and written as token shards
// (token_shards.h) DIR/shard-00000.bin, ... of about shard_tokens tokens each (a shard ends at the first
// document end past it), uint16 when every id of the tokenizer fits, else uint32. Each shard is written
// under a temporary name and renamed. A DIR that already holds *.bin files is an error (nothing is
// overwritten).
struct ShardWriteReport {
  JsonlReport jsonl;
  int64_t documents = 0, tokens = 0;
  std::vector<std::string> files;
  bool u16 = true;
};
ShardWriteReport jsonl_text_to_shards(const std::string& jsonl_path, const Tokenizer& tok, const std::string& out_dir,
                                      int64_t eos_id, int64_t shard_tokens, BadLines bad);

}  // namespace mt
