#include "core/tensor.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>

namespace mt {

std::string shape_str(const Shape& s) {
  std::string out = "[";
  for (size_t i = 0; i < s.size(); ++i) out += (i ? ", " : "") + std::to_string(s[i]);
  return out + "]";
}

int64_t shape_numel(const Shape& s) {
  int64_t n = 1;
  for (int64_t d : s) n *= d;
  return n;
}

Tensor::Tensor(std::shared_ptr<void> owner, void* data, Shape shape, DType dtype, Device device)
    : owner_(std::move(owner)), data_(data), shape_(std::move(shape)), dtype_(dtype), device_(device) {
  for (int64_t d : shape_) MT_CHECK(d >= 0, "negative dim in shape ", shape_str(shape_));
}

Tensor Tensor::empty(const Shape& shape, DType dtype, Device device) {
  size_t bytes = size_t(shape_numel(shape)) * dtype_size(dtype);
  void* p = device_mem::alloc(device, bytes == 0 ? 1 : bytes);
  std::shared_ptr<void> owner(p, [device](void* q) { device_mem::free(device, q); });
  return Tensor(owner, p, shape, dtype, device);
}

Tensor Tensor::zeros(const Shape& shape, DType dtype, Device device) {
  Tensor t = empty(shape, dtype, device);
  t.zero_();
  return t;
}

int64_t Tensor::size(int64_t d) const {
  int64_t n = dim();
  if (d < 0) d += n;
  MT_CHECK(d >= 0 && d < n, "dim ", d, " out of range for ", desc());
  return shape_[size_t(d)];
}

Tensor Tensor::view(const Shape& shape) const {
  Shape s = shape;
  int64_t known = 1, infer = -1;
  for (size_t i = 0; i < s.size(); ++i) {
    if (s[i] == -1) {
      MT_CHECK(infer < 0, "view ", shape_str(shape), " has two -1 dims");
      infer = int64_t(i);
    } else {
      known *= s[i];
    }
  }
  if (infer >= 0) {
    MT_CHECK(known > 0 && numel() % known == 0, "cannot view ", desc(), " as ", shape_str(shape));
    s[size_t(infer)] = numel() / known;
  }
  MT_CHECK(shape_numel(s) == numel(), "cannot view ", desc(), " as ", shape_str(shape));
  return Tensor(owner_, data_, s, dtype_, device_);
}

Tensor Tensor::rows(int64_t start, int64_t len) const {
  MT_CHECK(dim() >= 1 && start >= 0 && len >= 0 && start + len <= shape_[0], "rows(", start, ", ", len,
           ") out of range for ", desc());
  Shape s = shape_;
  s[0] = len;
  size_t row_bytes = shape_[0] == 0 ? 0 : nbytes() / size_t(shape_[0]);
  return Tensor(owner_, static_cast<char*>(data_) + size_t(start) * row_bytes, s, dtype_, device_);
}

Tensor Tensor::clone() const {
  Tensor t = empty(shape_, dtype_, device_);
  t.copy_from(*this);
  return t;
}

Tensor Tensor::to(Device device) const {
  if (device == device_) return *this;
  Tensor t = empty(shape_, dtype_, device);
  t.copy_from(*this);
  return t;
}

Tensor Tensor::to(DType dtype) const {
  if (dtype == dtype_) return *this;
  MT_CHECK(is_cpu(), "dtype conversion of ", desc(), " is CPU-only here");
  Tensor out = empty(shape_, dtype, Device::CPU);
  const int64_t n = numel();
  dispatch_dtype(dtype_, [&](auto src_tag) {
    using S = typename decltype(src_tag)::type;
    dispatch_dtype(dtype, [&](auto dst_tag) {
      using D = typename decltype(dst_tag)::type;
      const S* src = static_cast<const S*>(data_);
      D* dst = static_cast<D*>(out.raw());
      for (int64_t i = 0; i < n; ++i) dst[i] = from_double<D>(to_double(src[i]));
    });
  });
  return out;
}

void Tensor::copy_from(const Tensor& src) {
  MT_CHECK(src.shape_ == shape_ && src.dtype_ == dtype_, "copy_from ", src.desc(), " into ", desc());
  device_mem::copy(data_, device_, src.data_, src.device_, nbytes());
}

void Tensor::copy_from_async(const Tensor& src) {
  MT_CHECK(src.shape_ == shape_ && src.dtype_ == dtype_, "copy_from_async ", src.desc(), " into ", desc());
  device_mem::copy_async(data_, device_, src.data_, src.device_, nbytes());
}

Tensor Tensor::pinned(const Shape& shape, DType dtype) {
  const size_t bytes = std::max<size_t>(1, size_t(shape_numel(shape)) * dtype_size(dtype));
  void* p = device_mem::host_pinned_alloc(bytes);
  return Tensor(std::shared_ptr<void>(p, [](void* q) { device_mem::host_pinned_free(q); }), p, shape, dtype,
                Device::CPU);
}

void Tensor::zero_() { device_mem::memset0(data_, device_, nbytes()); }

void Tensor::fill_(float value) {
  MT_CHECK(is_cpu() && dtype_ == DType::F32, "fill_ needs a CPU f32 tensor, got ", desc());
  float* p = data<float>();
  for (int64_t i = 0, n = numel(); i < n; ++i) p[i] = value;
}

std::string Tensor::desc() const {
  return str(dtype_name(dtype_), shape_str(shape_), " ", device_name(device_));
}

Tensor host_tensor_from(DType dtype, int64_t n, const std::function<double(int64_t)>& f) {
  Tensor t = Tensor::empty({n}, dtype);
  dispatch_dtype(dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    T* p = static_cast<T*>(t.raw());
    for (int64_t i = 0; i < n; ++i) p[i] = from_double<T>(f(i));
  });
  return t;
}

double host_value_at(const Tensor& t, int64_t i) {
  MT_CHECK(t.is_cpu() && i >= 0 && i < t.numel(), "host_value_at(", i, ") of ", t.desc());
  return dispatch_dtype(t.dtype(), [&](auto tag) {
    using T = typename decltype(tag)::type;
    return to_double(static_cast<const T*>(t.raw())[i]);
  });
}

void check_shape(const Tensor& t, const Shape& want, const char* what) {
  MT_CHECK(t.shape() == want, what, " has shape ", shape_str(t.shape()), ", expected ", shape_str(want));
}

void check_dtype(const Tensor& t, DType want, const char* what) {
  MT_CHECK(t.dtype() == want, what, " has dtype ", dtype_name(t.dtype()), ", expected ", dtype_name(want));
}

void check_same_device(std::initializer_list<const Tensor*> ts, const char* op) {
  const Tensor* first = nullptr;
  for (const Tensor* t : ts) {
    if (!t || !t->defined() || t->numel() == 0) continue;  // (an undefined tensor: an absent optional output)
    if (!first) first = t;
    MT_CHECK(t->device() == first->device(), op, ": tensors on different devices: ", first->desc(), " and ",
             t->desc());
  }
}

namespace device_mem {
void* cuda_alloc(size_t bytes);
void cuda_free(void* p);
void cuda_copy(void* dst, Device dst_dev, const void* src, Device src_dev, size_t bytes);
void cuda_memset0(void* p, size_t bytes);
void cuda_synchronize();
void cuda_copy_2d(void* dst, size_t dpitch, const void* src, size_t spitch, size_t width, size_t height);
void cuda_copy_async(void* dst, Device dst_dev, const void* src, Device src_dev, size_t bytes);
void* cuda_host_alloc(size_t bytes);  // null when no GPU is usable
void cuda_host_free(void* p);

void* alloc(Device d, size_t bytes) {
  if (d == Device::CUDA) return cuda_alloc(bytes);
  void* p = std::aligned_alloc(256, (bytes + 255) / 256 * 256);
  MT_CHECK(p != nullptr, "out of host memory allocating ", bytes, " bytes");
  return p;
}

void free(Device d, void* p) {
  if (d == Device::CUDA) return cuda_free(p);
  std::free(p);
}

void copy(void* dst, Device dst_dev, const void* src, Device src_dev, size_t bytes) {
  if (bytes == 0) return;
  if (dst_dev == Device::CPU && src_dev == Device::CPU) {
    std::memmove(dst, src, bytes);
    return;
  }
  cuda_copy(dst, dst_dev, src, src_dev, bytes);
}

void copy_async(void* dst, Device dst_dev, const void* src, Device src_dev, size_t bytes) {
  if (bytes == 0) return;
  if (dst_dev == Device::CPU && src_dev == Device::CPU) {
    std::memmove(dst, src, bytes);
    return;
  }
  cuda_copy_async(dst, dst_dev, src, src_dev, bytes);
}

// Page-locked blocks carry a one-word header saying how they were allocated (the GPU may be absent).
void* host_pinned_alloc(size_t bytes) {
  const size_t total = bytes + 256;
  void* base = cuda_available() ? cuda_host_alloc(total) : nullptr;
  const bool pinned = base != nullptr;
  if (!pinned) base = std::aligned_alloc(256, (total + 255) / 256 * 256);
  MT_CHECK(base != nullptr, "out of host memory allocating ", bytes, " bytes");
  *static_cast<uint64_t*>(base) = pinned ? 1 : 0;
  return static_cast<char*>(base) + 256;
}

void host_pinned_free(void* p) {
  if (!p) return;
  void* base = static_cast<char*>(p) - 256;
  if (*static_cast<uint64_t*>(base) == 1) cuda_host_free(base);
  else std::free(base);
}

void copy_2d(void* dst, size_t dpitch, const void* src, size_t spitch, size_t width, size_t height, Device d) {
  if (width == 0 || height == 0) return;
  MT_CHECK(dpitch >= width && spitch >= width, "copy_2d: pitches ", dpitch, " and ", spitch, " below width ", width);
  if (d == Device::CUDA) return cuda_copy_2d(dst, dpitch, src, spitch, width, height);
  for (size_t i = 0; i < height; ++i)
    std::memcpy(static_cast<char*>(dst) + i * dpitch, static_cast<const char*>(src) + i * spitch, width);
}

void synchronize(Device d) {
  if (d == Device::CUDA) cuda_synchronize();
}

void memset0(void* p, Device d, size_t bytes) {
  if (bytes == 0) return;
  if (d == Device::CUDA) return cuda_memset0(p, bytes);
  std::memset(p, 0, bytes);
}
}  // namespace device_mem

}  // namespace mt
