// Batch: one micro-batch of token ids and labels, as every dataset in src/data produces it.
//
// Labels follow Hugging Face semantics: labels[b, s] is the token at position s itself (normally
// equal to input_ids[b, s]) and the model shifts internally, so the logits at position s are
// scored against labels[b, s + 1]. -100 marks positions that are not scored.
#pragma once
#include <cstdint>
#include <memory>
#include <string>

#include "core/tensor.h"

namespace mt {

inline constexpr int64_t kIgnoreIndex = -100;

struct Batch {
  Tensor input_ids;  // i64 [B, S]
  Tensor labels;     // i64 [B, S]
  // Packed rows (data/packing.h, model/micro_batch.h): i32 [B, S], the document of each token in its
  // row (0, 1, ...; -1 on the padding that ends a row). Undefined: each row is one sequence.
  Tensor segments;
};

// The number of scored targets after the model's shift: labels[:, 1:] != -100, and with segments
// (i32 [B, S], see Batch) only where position s - 1 and s lie in the same document (a document's last
// token has no target). This is the denominator of the mean cross-entropy of the batch.
int64_t count_target_tokens(const Tensor& labels_BS, const Tensor& segments_BS = Tensor());
// Real (not padding) tokens: B × S, or with segments the tokens whose segment is >= 0.
int64_t count_real_tokens(const Tensor& ids_BS, const Tensor& segments_BS = Tensor());

// A source of micro-batches. batch(i) is a pure function of the source's seed and i, so resuming
// at step k, or giving data-parallel rank r the indices r, r + world, ..., needs only the index.
class BatchSource {
 public:
  virtual ~BatchSource() = default;
  virtual Batch batch(int64_t index) const = 0;
  Batch next() { return batch(position_++); }
  int64_t position() const { return position_; }
  void set_position(int64_t index);
  virtual int64_t batch_size() const = 0;
  virtual int64_t seq_len() const = 0;
  virtual std::string describe() const = 0;  // one line for the run log

 private:
  int64_t position_ = 0;
};

// How JSONL data is read (train config keys of the same names).
struct DataOptions {
  std::string tokenizer;             // tokenizer.json for JSONL data (required there)
  std::string data_format = "auto";  // auto | text | messages (data/documents.h)
  std::string bad_lines = "skip";    // skip | fail
  int64_t eos_id = -1;               // appended to text documents; -1: none
};

// The data named by a train config's `data` value: "synthetic:addition" (the built-in task; needs
// vocab_size >= the char tokenizer's), a *.jsonl file of text or messages lines (tokenized with
// DataOptions::tokenizer and packed with document boundaries: data/packing.h), or a path to a token
// shard file or directory of *.bin shards. An unknown "synthetic:" task is an error listing the
// available ones.
std::unique_ptr<BatchSource> make_batch_source(const std::string& data, int64_t batch_size, int64_t seq_len,
                                               int64_t vocab_size, int max_digits, uint64_t seed,
                                               const DataOptions& options = {});

}  // namespace mt
