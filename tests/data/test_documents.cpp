// JSONL documents (data/documents.h) and their packing (data/packing.h): malformed lines reported with
// line numbers (skip) or fatal (fail), SFT targets exactly the assistant turns, the sampler's ranks
// sharing the stream and resuming, packed micro-batches that hold every document once per epoch with
// their boundaries, and a position that restores the stream.
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <iterator>
#include <set>

#include "data/batch.h"
#include "data/documents.h"
#include "data/packing.h"
#include "data/token_shards.h"
#include "test_util.h"

using namespace mt;
namespace fs = std::filesystem;

namespace {

const std::string kTokenizer = std::string(MT_SOURCE_DIR) + "/tests/assets/tokenizer/trained/tokenizer.json";
const std::string kChat = std::string(MT_SOURCE_DIR) + "/examples/chat_small.jsonl";

std::string write_tmp(const std::string& name, const std::string& text) {
  const fs::path p = fs::temp_directory_path() / ("moetrain_docs_" + std::to_string(getpid()) + "_" + name);
  std::ofstream(p) << text;
  return p.string();
}

const Tokenizer& tok() {
  static const Tokenizer t = Tokenizer::from_file(kTokenizer);
  return t;
}

}  // namespace

TEST(Documents, MalformedLinesAreCountedWithLineNumbersOrFatal) {
  const std::string path = write_tmp("bad.jsonl",
                                     "{\"text\": \"hello world\"}\n"
                                     "not json\n"
                                     "\n"
                                     "[1, 2]\n"
                                     "{\"text\": 5}\n"
                                     "{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}]}\n"
                                     "{\"other\": 1}\n"
                                     "{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}, "
                                     "{\"role\": \"assistant\", \"content\": \"hello\"}]}\n");
  DocOptions o;
  o.eos_id = 0;
  const DocumentSet set = load_documents(path, tok(), o);
  EXPECT_EQ(set.size(), 2);
  EXPECT_EQ(set.line, (std::vector<int64_t>{1, 8}));
  const JsonlReport& r = set.report;
  EXPECT_EQ(r.lines, 8);
  EXPECT_EQ(r.records, 2);
  EXPECT_EQ(r.bad, 5);
  ASSERT_EQ(r.bad_examples.size(), 5u);
  EXPECT_EQ(r.bad_examples[0].rfind("line 2: not valid JSON", 0), 0u) << r.bad_examples[0];
  EXPECT_EQ(r.bad_examples[1], "line 4: not a JSON object (a array)");
  EXPECT_EQ(r.bad_examples[2], "line 5: \"text\" is a number, not a string");
  EXPECT_EQ(r.bad_examples[3], "line 6: the conversation has no assistant message: nothing to train on");
  EXPECT_EQ(r.bad_examples[4], "line 7: neither a \"text\" nor a \"messages\" field");
  EXPECT_NE(r.summary().find("5 malformed line(s) skipped"), std::string::npos);

  o.bad_lines = BadLines::Fail;
  const std::string e = testutil::error_of([&] { load_documents(path, tok(), o); });
  EXPECT_NE(e.find("bad.jsonl line 2: not valid JSON"), std::string::npos) << e;
  o.bad_lines = BadLines::Skip;
  o.vocab_size = 100;  // the tokenizer has 3,007 ids
  const std::string v = testutil::error_of([&] { load_documents(path, tok(), o); });
  EXPECT_NE(v.find("has 3007 ids but the model's vocab_size is 100"), std::string::npos) << v;
  EXPECT_NE(testutil::error_of([&] { parse_bad_lines("ignore"); }).find("allowed: skip"), std::string::npos);
}

TEST(Documents, TextGetsEosAndEveryTokenIsATarget) {
  const TokenizedDoc d = tokenize_text_doc(tok(), "hello world", 0);
  ASSERT_GE(d.ids.size(), 2u);
  EXPECT_EQ(d.ids.back(), 0);
  for (uint8_t t : d.target) EXPECT_EQ(t, 1);
  std::vector<uint32_t> ids(d.ids.begin(), d.ids.end() - 1);
  EXPECT_EQ(tok().decode(ids), "hello world");
}

// The targets are exactly the assistant turns (content and <|im_end|>); the ids decode to the rendered
// conversation.
TEST(Documents, ChatTargetsAreTheAssistantTurns) {
  const auto msgs = nlohmann::ordered_json::parse(R"([
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is 2 + 3?"},
    {"role": "assistant", "content": "2 + 3 = 5."},
    {"role": "user", "content": "And 4 + 4?"},
    {"role": "assistant", "content": "4 + 4 = 8."}])");
  const TokenizedDoc d = tokenize_chat_doc(tok(), msgs, nullptr);
  std::vector<uint32_t> all(d.ids.begin(), d.ids.end());
  EXPECT_EQ(tok().decode(all), render_qwen3_chat(msgs, nullptr, {}));
  // Runs of target tokens, decoded.
  std::vector<std::string> runs;
  for (size_t i = 0; i < d.ids.size();) {
    if (!d.target[i]) {
      ++i;
      continue;
    }
    std::vector<uint32_t> run;
    while (i < d.ids.size() && d.target[i]) run.push_back(uint32_t(d.ids[i++]));
    runs.push_back(tok().decode(run));
  }
  // The template writes a think block (empty here) only for the assistant turn after the last user query.
  ASSERT_EQ(runs.size(), 2u);
  EXPECT_EQ(runs[0], "2 + 3 = 5.<|im_end|>");
  EXPECT_EQ(runs[1], "<think>\n\n</think>\n\n4 + 4 = 8.<|im_end|>");
  // The prompt side ends as the generation prompt does: "<|im_start|>assistant\n".
  size_t first = 0;
  while (!d.target[first]) ++first;
  std::vector<uint32_t> prompt(d.ids.begin(), d.ids.begin() + int64_t(first));
  const std::string p = tok().decode(prompt);
  EXPECT_EQ(p.substr(p.size() - 22), "<|im_start|>assistant\n");
}

TEST(Documents, PromptRecords) {
  const std::string path = write_tmp("prompts.jsonl",
                                     "{\"prompt\": \"2+2=\", \"answer\": \"4\"}\n"
                                     "{\"prompt\": [{\"role\": \"user\", \"content\": \"hi\"}], \"answer\": 7}\n"
                                     "{\"answer\": \"x\"}\n");
  JsonlReport r;
  const std::vector<PromptRecord> p = load_prompts(path, BadLines::Skip, &r);
  ASSERT_EQ(p.size(), 2u);
  EXPECT_EQ(p[0].prompt, "2+2=");
  EXPECT_EQ(p[0].answer, "4");
  EXPECT_TRUE(p[1].messages.is_array());
  EXPECT_EQ(p[1].answer, "7");
  EXPECT_EQ(p[1].line, 2);
  ASSERT_EQ(r.bad_examples.size(), 1u);
  EXPECT_EQ(r.bad_examples[0], "line 3: no \"prompt\" field");
}

TEST(DocumentSampler, RanksShareTheStreamAndResume) {
  const int64_t N = 10;
  const int world = 3;
  std::vector<DocumentSampler> ranks;
  for (int r = 0; r < world; ++r) ranks.emplace_back(N, 5, r, world);
  DocumentSampler whole(N, 5);
  // 30 global positions = 3 epochs: the ranks' draws interleave into the single stream.
  for (int64_t k = 0; k < 10; ++k)
    for (int r = 0; r < world; ++r) EXPECT_EQ(ranks[size_t(r)].next(), whole.next()) << k << " " << r;
  // Each epoch is a permutation, and a new one each epoch.
  std::set<int64_t> e0(whole.permutation(0).begin(), whole.permutation(0).end());
  EXPECT_EQ(e0.size(), size_t(N));
  const std::vector<int64_t> p0 = whole.permutation(0);  // a copy: permutation() returns its cache
  EXPECT_NE(p0, whole.permutation(1));
  // Restoring the position replays the rest.
  DocumentSampler a(N, 5, 1, world), b(N, 5, 1, world);
  for (int i = 0; i < 7; ++i) a.next();
  b.set_position(a.position());
  for (int i = 0; i < 12; ++i) EXPECT_EQ(a.next(), b.next());
  EXPECT_NE(testutil::error_of([] { DocumentSampler(4, 1, 3, 3); }).find("rank 3 of world 3"), std::string::npos);
}

TEST(PackedDataset, EveryDocumentOncePerEpochWithBoundaries) {
  DocOptions o;
  auto docs = std::make_shared<DocumentSet>(load_documents(kChat, tok(), o));
  const int64_t S = 160, B = 2;
  PackedDataset ds(docs, B, S, 9);
  // Walk the rows of epoch 0: each document once, in whole, with its targets.
  const int64_t rows = ds.rows_in_epoch(0);
  std::multiset<int64_t> seen;
  int64_t real = 0;
  for (int64_t r = 0; r < rows; ++r) {
    const std::vector<int64_t> row = ds.row_documents(r);
    int64_t used = 0;
    for (int64_t d : row) {
      seen.insert(d);
      used += docs->length(d);
    }
    EXPECT_LE(used, S);
    if (r + 1 < rows) {  // greedy: the next row's first document did not fit
      const int64_t next = ds.row_documents(r + 1).front();
      EXPECT_GT(used + docs->length(next), S);
    }
    real += used;
  }
  EXPECT_EQ(seen.size(), size_t(docs->size()));
  EXPECT_EQ(std::set<int64_t>(seen.begin(), seen.end()).size(), size_t(docs->size()));
  EXPECT_EQ(real, docs->tokens());

  // A micro-batch: ids, labels (targets only) and segments as the rows say.
  const Batch b = ds.batch(1);
  for (int64_t r = 0; r < B; ++r) {
    const std::vector<int64_t> row = ds.row_documents(B + r);
    int64_t s = 0;
    for (size_t k = 0; k < row.size(); ++k) {
      const int64_t d = row[k], off = docs->offsets[size_t(d)];
      for (int64_t i = 0; i < docs->length(d); ++i, ++s) {
        ASSERT_EQ(b.input_ids.data<int64_t>()[r * S + s], docs->ids[size_t(off + i)]);
        ASSERT_EQ(b.labels.data<int64_t>()[r * S + s],
                  docs->target[size_t(off + i)] ? docs->ids[size_t(off + i)] : -100);
        ASSERT_EQ(b.segments.data<int32_t>()[r * S + s], int32_t(k));
      }
    }
    for (; s < S; ++s) {
      EXPECT_EQ(b.segments.data<int32_t>()[r * S + s], -1);
      EXPECT_EQ(b.labels.data<int64_t>()[r * S + s], -100);
    }
  }
  // Pure in the index: another dataset, reading far ahead first (a resume), gives the same batches.
  PackedDataset again(docs, B, S, 9);
  const Batch late = again.batch(40);
  EXPECT_TRUE(testutil::same_bits(again.batch(1).input_ids, b.input_ids));
  EXPECT_TRUE(testutil::same_bits(ds.batch(40).segments, late.segments));
  again.set_position(40);
  EXPECT_TRUE(testutil::same_bits(again.next().labels, late.labels));
  // Another seed packs another order.
  EXPECT_FALSE(testutil::same_bits(PackedDataset(docs, B, S, 10).batch(0).input_ids, ds.batch(0).input_ids));
}

TEST(PackedDataset, LongDocumentsAreCut) {
  DocOptions o;
  auto docs = std::make_shared<DocumentSet>(load_documents(kChat, tok(), o));
  PackedDataset ds(docs, 1, 40, 3);
  int64_t longer = 0;
  for (int64_t d = 0; d < docs->size(); ++d) longer += docs->length(d) > 40;
  EXPECT_GT(longer, 0);
  EXPECT_EQ(ds.truncated(), longer);
  for (int64_t i = 0; i < 20; ++i) {
    const Batch b = ds.batch(i);
    EXPECT_GE(b.segments.data<int32_t>()[0], 0);  // no empty row
  }
}

TEST(PackedDataset, FactoryReadsJsonlWithATokenizer) {
  DataOptions o;
  const std::string e = testutil::error_of([&] { make_batch_source(kChat, 2, 64, 4096, 3, 1, o); });
  EXPECT_NE(e.find("set tokenizer"), std::string::npos) << e;
  o.tokenizer = kTokenizer;
  auto src = make_batch_source(kChat, 2, 64, 4096, 3, 1, o);
  EXPECT_NE(src->describe().find("packed documents"), std::string::npos);
  EXPECT_TRUE(src->next().segments.defined());
}

// `moetrain tokenize --out DIR` (the real binary, stdin): shards of {"text"} lines that the token-shard
// dataset reads back as the library's ids with <|endoftext|> after each document; a malformed line is
// reported with its number; an existing shard directory is refused.
TEST(TokenizeOut, JsonlTextLinesBecomeShards) {
  const std::string in = write_tmp("texts.jsonl",
                                   "{\"text\": \"hello world\"}\n"
                                   "{\"txt\": \"no\"}\n"
                                   "{\"text\": \"the café is open\\nall day\"}\n"
                                   "{\"text\": \"a third document, a little longer than the others\"}\n");
  const std::string dir =
      (fs::temp_directory_path() / ("moetrain_docs_" + std::to_string(getpid()) + "_shards")).string();
  fs::remove_all(dir);
  const std::string bin = std::string(MT_BINARY_DIR) + "/moetrain tokenize --tokenizer " + kTokenizer;
  const std::string log = dir + ".log";
  ASSERT_EQ(std::system((bin + " --out " + dir + " --shard-tokens 10 < " + in + " 2> " + log).c_str()), 0);
  std::ifstream lf(log);
  const std::string out((std::istreambuf_iterator<char>(lf)), std::istreambuf_iterator<char>());
  EXPECT_NE(out.find("line 2: no \"text\" field"), std::string::npos) << out;
  EXPECT_NE(out.find("3 documents"), std::string::npos) << out;
  std::vector<uint32_t> want;
  for (const char* t :
       {"hello world", "the café is open\nall day", "a third document, a little longer than the others"}) {
    tok().encode_append(t, want);
    want.push_back(0);  // <|endoftext|>
  }
  const std::vector<std::string> files = list_token_shards(dir);
  EXPECT_GE(files.size(), 2u);  // a shard closes at the first document end past 10 tokens
  std::vector<uint32_t> got;
  for (const std::string& f : files) {
    const std::vector<uint32_t> part = read_token_shard(f);
    got.insert(got.end(), part.begin(), part.end());
  }
  EXPECT_EQ(got, want);
  // Nothing is overwritten.
  EXPECT_NE(std::system((bin + " --out " + dir + " < " + in + " 2> " + log).c_str()), 0);
  std::ifstream lf2(log);
  const std::string err((std::istreambuf_iterator<char>(lf2)), std::istreambuf_iterator<char>());
  EXPECT_NE(err.find("already holds shard-0000"), std::string::npos) << err;
  fs::remove_all(dir);
}
