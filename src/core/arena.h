// Arena: device memory handed out as aligned tensors by bumping an offset. Activations of a
// micro-batch live in an arena that is reset between micro-batches. When a request does not fit,
// the arena chains another block; reset() then replaces the chain by one block as large as the
// peak, so from the second micro-batch on a step allocates nothing from the system.
// Tensors from an arena keep their block alive but their contents are undefined after reset().
#pragma once
#include <vector>

#include "core/tensor.h"

namespace mt {

class Arena {
 public:
  explicit Arena(size_t bytes = 0, Device device = Device::CPU);
  Tensor alloc(const Shape& shape, DType dtype = DType::F32);
  Tensor zeros(const Shape& shape, DType dtype = DType::F32);
  void reset();
  size_t used() const { return used_before_ + offset_; }  // bytes handed out since reset
  size_t peak() const { return peak_; }                   // largest used() ever
  size_t capacity() const;                                // bytes held in blocks
  // The most bytes a merging reset() found still held by tensors (blocks it dropped that stay alive
  // beside the new one until those tensors go): what a caller forgot to release before resetting.
  size_t held_at_merge() const { return held_at_merge_; }
  Device device() const { return device_; }

 private:
  static constexpr size_t kAlign = 256;
  struct Block {
    std::shared_ptr<void> mem;
    size_t size;
  };
  void add_block(size_t bytes);
  std::vector<Block> blocks_;
  size_t offset_ = 0;       // within the last block
  size_t used_before_ = 0;  // bytes used in earlier blocks of the chain
  size_t peak_ = 0;
  size_t held_at_merge_ = 0;
  Device device_;
};

}  // namespace mt
