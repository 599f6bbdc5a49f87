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
};

// The number of scored targets after the model's shift: labels[:, 1:] != -100. This is the
// denominator of the mean cross-entropy of the batch.
int64_t count_target_tokens(const Tensor& labels_BS);

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

// The data named by a train config's `data` value: "synthetic:addition" (the built-in task; needs
// vocab_size >= the char tokenizer's) or a path to a token shard file or directory of *.bin shards.
// An unknown "synthetic:" task is an error listing the available ones.
std::unique_ptr<BatchSource> make_batch_source(const std::string& data, int64_t batch_size, int64_t seq_len,
                                               int64_t vocab_size, int max_digits, uint64_t seed);

}  // namespace mt
