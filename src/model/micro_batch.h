// The model's input: a micro-batch, and under sequence parallelism (Ulysses) its sequence chunk,
// what the model needs to know about the whole sequence to run on its chunk of it, planned before
// the forward from the full micro-batch (shard_micro_batch, below) and passed in, so that nothing
// inside the model (recompute included) issues a collective to learn positions, labels or validity.
// Below the model and the exchanges: the model, the Ulysses exchange and the trainer all include it.
//
// Layout: every sequence of the micro-batch (B rows, real length S) is padded to S' = a multiple of
// sp, and rank r of the sp group holds positions [r C, (r + 1) C) of each (C = S' / sp), so the
// model's local tokens are [B, C], row-major. Padding (positions >= S) has token id 0 and label
// -100; it sits at the end of each sequence, so under causal attention no real query sees it, and
// the model keeps it out of every statistic (router counts, probability sums, z-loss, expert load).
#pragma once
#include <cstdint>
#include <memory>
#include <utility>

#include "core/tensor.h"

namespace mt {

struct SeqShard {
  int sp = 1;              // ranks of the sequence-parallel group
  int rank = 0;            // this rank's chunk
  int64_t seq_len = 0;     // S: the real length of every sequence
  int64_t padded_len = 0;  // S' = ceil(S / sp) × sp, or more sp steps until B × C divides by tp
  int64_t chunk = 0;       // C = S' / sp: local tokens per sequence
  // Real (not padding) tokens at the start of each local sequence chunk: clamp(S − rank C, 0, C).
  // Padding is always a suffix of a chunk, so this count is the whole validity mask.
  int64_t valid = 0;
  Tensor positions;       // i32 [B C] (host): the global position of each local token
  Tensor shifted_labels;  // i64 [B C] (host): the target of each local token (HF shift done over
                          // the whole sequence); -100 for padding; undefined without labels
};

struct MicroBatch {
  MicroBatch() = default;
  MicroBatch(Tensor ids, Tensor labels_, std::shared_ptr<const SeqShard> shard_ = nullptr)
      : input_ids(std::move(ids)), labels(std::move(labels_)), shard(std::move(shard_)) {}
  Tensor input_ids;  // i64 (B, S)
  Tensor labels;     // i64 (B, S), HF semantics (shifted inside), -100 = ignore; may be undefined for forward()
  // Sequence parallelism: input_ids are this rank's chunk [B, C] of each sequence and the shard
  // carries positions and shifted labels (labels unused); made by shard_micro_batch. Null: the
  // micro-batch is whole sequences.
  std::shared_ptr<const SeqShard> shard;
};

// This rank's piece of a micro-batch (ids, labels: i64 [B, S], HF semantics) for sequence chunk
// sp_rank of sp (see SeqShard). labels may be undefined (forward only). sp = 1 returns the batch
// as it is (no shard). row_multiple (tp): the sequences are padded further, by whole sp steps, until
// the chunk's B × C rows divide by it. Host computation only: no collective.
MicroBatch shard_micro_batch(const Tensor& ids_BS, const Tensor& labels_BS, int sp, int sp_rank, int row_multiple = 1);

}  // namespace mt
