// The MoE routing record of one sample, stored compactly: the expert ids each sparse layer chose for
// every token the model read, one byte per id when the model has at most 256 experts, two bytes up to
// 65,536 (Qwen3-30B-A3B: top-8 of 128 experts in 48 layers is 1.5 KB per token at i32, 384 bytes here). RL
// keeps the record of every sample of a step until its update replays it (the R3 routing replay);
// tensors() gives MicroBatch::routing's form.
#pragma once
#include <cstdint>
#include <vector>

#include "core/tensor.h"

namespace mt {

class RoutingRecord {
 public:
  RoutingRecord() = default;
  RoutingRecord(int64_t layers, int64_t top_k, int64_t num_experts);
  // Appends rows [first, first + n) of each layer's ids (i32 [T, K] per sparse layer, host); ids must be
  // in [0, num_experts).
  void append(const std::vector<Tensor>& ids_TK, int64_t first, int64_t n);
  int64_t tokens() const { return tokens_; }
  int64_t layers() const { return layers_; }
  int64_t bytes_per_id() const { return width_; }
  int64_t bytes() const { return tokens_ * K_ * layers_ * width_; }
  bool empty() const { return layers_ == 0; }
  // i32 [count, K] per layer for tokens [begin, begin + count) (default: all), as MicroBatch::routing takes.
  std::vector<Tensor> tensors(int64_t begin = 0, int64_t count = -1) const;

 private:
  int64_t layers_ = 0, K_ = 0, E_ = 0, width_ = 1, tokens_ = 0;
  std::vector<std::vector<uint8_t>> per_layer_;  // per layer: tokens × K ids of width_ bytes (little-endian)
};

// The share of router decisions that differ between two routings of the same tokens (i32 [T, K] per
// sparse layer each, as RoutingRecord::tensors and Qwen3MoeModel::last_routing give them): per token and
// layer, the experts of `a` missing from `b`'s set of K, over all T × K × layers choices. The R3 paper's
// metric of engine/trainer routing mismatch (about 10% without replay in its runs).
double routing_mismatch(const std::vector<Tensor>& a, const std::vector<Tensor>& b);

}  // namespace mt
