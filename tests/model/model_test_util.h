// Helpers for the in-process model tests: a random micro-batch whose labels are the ids with every
// `mask_every`-th position (at offset `mask_at`) set to -100, so the loss has ignored targets.
#pragma once
#include "core/rng.h"
#include "model/config.h"
#include "model/qwen3_moe.h"

namespace mt::test {

inline MicroBatch random_batch(const ModelConfig& c, int64_t B, int64_t S, uint64_t seed, int64_t mask_every = 5,
                               int64_t mask_at = 3) {
  Rng rng(seed);
  MicroBatch mb{Tensor::empty({B, S}, DType::I64), Tensor::empty({B, S}, DType::I64)};
  for (int64_t i = 0; i < B * S; ++i) {
    const int64_t id = rng.randint(0, c.vocab_size);
    mb.input_ids.data<int64_t>()[i] = id;
    mb.labels.data<int64_t>()[i] = i % mask_every == mask_at ? -100 : id;
  }
  return mb;
}

}  // namespace mt::test
