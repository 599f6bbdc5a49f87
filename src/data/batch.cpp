// Batch helpers and the data factory (see batch.h).
#include "data/batch.h"

#include "data/char_tokenizer.h"
#include "data/synthetic.h"
#include "data/token_shards.h"

namespace mt {

int64_t count_target_tokens(const Tensor& labels_BS) {
  check_dtype(labels_BS, DType::I64, "labels");
  MT_CHECK(labels_BS.dim() == 2 && labels_BS.is_cpu(), "labels must be a CPU [B, S] tensor, got ", labels_BS.desc());
  int64_t B = labels_BS.size(0), S = labels_BS.size(1), n = 0;
  const int64_t* p = labels_BS.data<int64_t>();
  for (int64_t b = 0; b < B; ++b)
    for (int64_t s = 1; s < S; ++s) n += p[b * S + s] != kIgnoreIndex;
  return n;
}

void BatchSource::set_position(int64_t index) {
  MT_CHECK(index >= 0, "batch index must be >= 0, got ", index);
  position_ = index;
}

std::unique_ptr<BatchSource> make_batch_source(const std::string& data, int64_t batch_size, int64_t seq_len,
                                               int64_t vocab_size, int max_digits, uint64_t seed) {
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
