// Arena: one device allocation handed out as aligned tensors by bumping an offset. Activations of a
// step live in an arena that is reset between steps, so a step allocates nothing from the system
// after the first. Tensors from an arena keep the arena's block alive but are invalid after reset().
#pragma once
#include "core/tensor.h"

namespace mt {

class Arena {
 public:
  Arena(size_t bytes, Device device = Device::CPU);
  Tensor alloc(const Shape& shape, DType dtype = DType::F32);
  Tensor zeros(const Shape& shape, DType dtype = DType::F32);
  void reset() { offset_ = 0; }
  size_t used() const { return offset_; }
  size_t peak() const { return peak_; }
  size_t capacity() const { return capacity_; }
  Device device() const { return device_; }

 private:
  static constexpr size_t kAlign = 256;
  std::shared_ptr<void> block_;
  size_t capacity_ = 0, offset_ = 0, peak_ = 0;
  Device device_;
};

}  // namespace mt
