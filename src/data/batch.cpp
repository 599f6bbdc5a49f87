// Batch helpers and the data factory (see batch.h).
#include "data/batch.h"

#include "core/log.h"
#include "data/char_tokenizer.h"
#include "data/documents.h"
#include "data/packing.h"
#include "data/synthetic.h"
#include "data/token_shards.h"

namespace mt {

int64_t count_target_tokens(const Tensor& labels_BS, const Tensor& segments_BS) {
  check_dtype(labels_BS, DType::I64, "labels");
  MT_CHECK(labels_BS.dim() == 2 && labels_BS.is_cpu(), "labels must be a CPU [B, S] tensor, got ", labels_BS.desc());
  int64_t B = labels_BS.size(0), S = labels_BS.size(1), n = 0;
  const int64_t* p = labels_BS.data<int64_t>();
  const int32_t* seg = nullptr;
  if (segments_BS.defined()) {
    check_dtype(segments_BS, DType::I32, "segments");
    MT_CHECK(segments_BS.shape() == labels_BS.shape() && segments_BS.is_cpu(), "segments must be a CPU tensor of the "
             "labels' shape ", shape_str(labels_BS.shape()), ", got ", segments_BS.desc());
    seg = segments_BS.data<int32_t>();
  }
  for (int64_t b = 0; b < B; ++b)
    for (int64_t s = 1; s < S; ++s)
      n += p[b * S + s] != kIgnoreIndex && (!seg || (seg[b * S + s] >= 0 && seg[b * S + s] == seg[b * S + s - 1]));
  return n;
}

int64_t count_real_tokens(const Tensor& ids_BS, const Tensor& segments_BS) {
  if (!segments_BS.defined()) return ids_BS.numel();
  check_dtype(segments_BS, DType::I32, "segments");
  const Tensor seg = segments_BS.to(Device::CPU);
  int64_t n = 0;
  for (int64_t i = 0; i < seg.numel(); ++i) n += seg.data<int32_t>()[i] >= 0;
  return n;
}

void BatchSource::set_position(int64_t index) {
  MT_CHECK(index >= 0, "batch index must be >= 0, got ", index);
  position_ = index;
}

std::unique_ptr<BatchSource> make_batch_source(const std::string& data, int64_t batch_size, int64_t seq_len,
                                               int64_t vocab_size, int max_digits, uint64_t seed,
                                               const DataOptions& options) {
  static const std::string kJsonl = ".jsonl";
  if (data.size() >= kJsonl.size() && data.compare(data.size() - kJsonl.size(), kJsonl.size(), kJsonl) == 0) {
    if (options.tokenizer.empty())
      MT_THROW("data = \"", data, "\" is JSONL text: set tokenizer to a tokenizer.json (moetrain sft takes the model "
               "directory's)");
    const Tokenizer tok = Tokenizer::from_file(options.tokenizer);
    DocOptions o;
    o.format = parse_doc_format(options.data_format);
    o.bad_lines = parse_bad_lines(options.bad_lines);
    o.eos_id = options.eos_id;
    o.vocab_size = vocab_size;
    auto docs = std::make_shared<DocumentSet>(load_documents(data, tok, o));
    log_line("data: " + docs->report.summary());
    return std::make_unique<PackedDataset>(docs, batch_size, seq_len, seed, 0, data);
  }
  static const std::string kSynthetic = "synthetic:";
  if (data.rfind(kSynthetic, 0) == 0) {
    std::string task = data.substr(kSynthetic.size());
    if (task != "addition") MT_THROW("data = \"", data, "\": unknown synthetic task '", task, "'; available: addition");
    if (vocab_size < CharTokenizer::kVocabSize)
      MT_THROW("data = \"", data, "\" needs a model vocab_size >= ", CharTokenizer::kVocabSize,
               " (the char tokenizer's), got ", vocab_size);
    return std::make_unique<SyntheticBatcher>(batch_size, seq_len, max_digits, seed);
  }
  return std::make_unique<TokenShardDataset>(list_token_shards(data), batch_size, seq_len, vocab_size, seed);
}

}  // namespace mt
