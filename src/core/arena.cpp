#include "core/arena.h"

#include <algorithm>

#include "core/cuda_graph.h"

namespace mt {

Arena::Arena(size_t bytes, Device device) : device_(device) {
  if (bytes > 0) add_block(bytes);
}

void Arena::add_block(size_t bytes) {
  bytes = (bytes + kAlign - 1) / kAlign * kAlign;
  Device dev = device_;
  void* p = device_mem::alloc(dev, bytes);
  if (dev == Device::CUDA) cuda_graph::bump_epoch();  // graphs captured over the old blocks are stale
  blocks_.push_back({std::shared_ptr<void>(p, [dev](void* q) { device_mem::free(dev, q); }), bytes});
}

size_t Arena::capacity() const {
  size_t c = 0;
  for (const Block& b : blocks_) c += b.size;
  return c;
}

Tensor Arena::alloc(const Shape& shape, DType dtype) {
  size_t bytes = size_t(shape_numel(shape)) * dtype_size(dtype);
  size_t start = (offset_ + kAlign - 1) / kAlign * kAlign;
  if (blocks_.empty() || start + bytes > blocks_.back().size) {
    if (!blocks_.empty()) used_before_ += blocks_.back().size;
    add_block(std::max(bytes, blocks_.empty() ? size_t(1) << 20 : blocks_.back().size));
    start = 0;
  }
  offset_ = start + bytes;
  peak_ = std::max(peak_, used());
  Block& b = blocks_.back();
  return Tensor(b.mem, static_cast<char*>(b.mem.get()) + start, shape, dtype, device_);
}

Tensor Arena::zeros(const Shape& shape, DType dtype) {
  Tensor t = alloc(shape, dtype);
  t.zero_();
  return t;
}

void Arena::reset() {
  if (blocks_.size() > 1) {
    size_t held = 0;
    for (const Block& b : blocks_) held += b.mem.use_count() > 1 ? b.size : 0;
    held_at_merge_ = std::max(held_at_merge_, held);
    blocks_.clear();
    add_block(peak_);
  }
  offset_ = 0;
  used_before_ = 0;
}

}  // namespace mt
