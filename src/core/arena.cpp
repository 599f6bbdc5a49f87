#include "core/arena.h"

namespace mt {

Arena::Arena(size_t bytes, Device device) : capacity_(bytes), device_(device) {
  void* p = device_mem::alloc(device, bytes == 0 ? 1 : bytes);
  block_ = std::shared_ptr<void>(p, [device](void* q) { device_mem::free(device, q); });
}

Tensor Arena::alloc(const Shape& shape, DType dtype) {
  size_t bytes = size_t(shape_numel(shape)) * dtype_size(dtype);
  size_t start = (offset_ + kAlign - 1) / kAlign * kAlign;
  if (start + bytes > capacity_)
    MT_THROW("arena out of memory: need ", bytes, " bytes at offset ", start, ", capacity ", capacity_,
             " bytes (", device_name(device_), ")");
  offset_ = start + bytes;
  if (offset_ > peak_) peak_ = offset_;
  return Tensor(block_, static_cast<char*>(block_.get()) + start, shape, dtype, device_);
}

Tensor Arena::zeros(const Shape& shape, DType dtype) {
  Tensor t = alloc(shape, dtype);
  t.zero_();
  return t;
}

}  // namespace mt
