// Tensor: a typed, shaped view of memory on one device. Tensors are always contiguous row-major
// (the last dim varies fastest); views (reshape, a range of rows) share the storage and keep it
// alive. Storage is reference counted and may be owned (allocated here), borrowed from an arena,
// or mapped from a file; the tensor does not care which.
#pragma once
#include <cstdint>
#include <functional>
#include <initializer_list>
#include <memory>
#include <string>
#include <vector>

#include "core/dtype.h"
#include "core/error.h"

namespace mt {

using Shape = std::vector<int64_t>;

std::string shape_str(const Shape& s);  // "[2, 3, 4]"
int64_t shape_numel(const Shape& s);

class Tensor {
 public:
  Tensor() = default;
  // Wraps memory kept alive by `owner` (may be null for memory the caller keeps alive).
  Tensor(std::shared_ptr<void> owner, void* data, Shape shape, DType dtype, Device device);

  static Tensor empty(const Shape& shape, DType dtype = DType::F32, Device device = Device::CPU);
  // A CPU tensor in page-locked memory when the build has CUDA and a GPU is visible (plain memory otherwise):
  // the source or target of copy_from_async, whose transfers then run without staging or a host wait.
  static Tensor pinned(const Shape& shape, DType dtype = DType::F32);
  static Tensor zeros(const Shape& shape, DType dtype = DType::F32, Device device = Device::CPU);

  bool defined() const { return data_ != nullptr; }  // false for a default-constructed Tensor
  const std::shared_ptr<void>& owner() const { return owner_; }  // what keeps the memory alive (may be null)
  const Shape& shape() const { return shape_; }
  int64_t dim() const { return int64_t(shape_.size()); }
  int64_t size(int64_t d) const;  // negative d counts from the end
  int64_t numel() const { return shape_numel(shape_); }
  size_t nbytes() const { return size_t(numel()) * dtype_size(dtype_); }
  DType dtype() const { return dtype_; }
  Device device() const { return device_; }
  bool is_cpu() const { return device_ == Device::CPU; }

  void* raw() const { return data_; }
  template <class T>
  T* data() const;  // checks that T matches dtype

  // Same storage, new shape with the same number of elements; one dim may be -1.
  Tensor view(const Shape& shape) const;
  // Rows [start, start+len) along dim 0; shares storage.
  Tensor rows(int64_t start, int64_t len) const;
  // Deep copy (same device) and conversion (CPU only for non-f32 conversions).
  Tensor clone() const;
  Tensor to(DType dtype) const;
  Tensor to(Device device) const;
  void copy_from(const Tensor& src);  // same shape and dtype; any devices
  // copy_from queued on the CUDA compute stream, in order with the kernels, without waiting: neither tensor
  // may be touched by the host until that stream is synchronised (device_mem::synchronize). CPU to CPU
  // copies at once.
  void copy_from_async(const Tensor& src);
  void zero_();
  void fill_(float value);  // f32 only

  std::string desc() const;  // "f32[2, 3] cpu"

 private:
  std::shared_ptr<void> owner_;
  void* data_ = nullptr;
  Shape shape_;
  DType dtype_ = DType::F32;
  Device device_ = Device::CPU;
};

template <class T>
struct DTypeOf;
template <>
struct DTypeOf<float> { static constexpr DType value = DType::F32; };
template <>
struct DTypeOf<int32_t> { static constexpr DType value = DType::I32; };
template <>
struct DTypeOf<int64_t> { static constexpr DType value = DType::I64; };
template <>
struct DTypeOf<uint16_t> { static constexpr DType value = DType::BF16; };  // bf16 or f16 bits

template <class T>
T* Tensor::data() const {
  if constexpr (std::is_same_v<T, uint16_t>) {
    MT_CHECK(dtype_ == DType::BF16 || dtype_ == DType::F16, "16-bit access to ", desc());
  } else {
    MT_CHECK(dtype_ == DTypeOf<T>::value, "tensor ", desc(), " accessed as ", dtype_name(DTypeOf<T>::value));
  }
  return static_cast<T*>(data_);
}

// Host tensors of any dtype by value, for self-describing test data: element i = f(i) converted to
// dtype (integers by value, bf16/f16 rounded), and element i read back as a double.
Tensor host_tensor_from(DType dtype, int64_t n, const std::function<double(int64_t)>& f);
double host_value_at(const Tensor& t, int64_t i);

// Argument checks used by ops: shape, dtype, device, with the tensor's role in the message.
void check_shape(const Tensor& t, const Shape& want, const char* what);
void check_dtype(const Tensor& t, DType want, const char* what);
void check_same_device(std::initializer_list<const Tensor*> ts, const char* op);

// Device memory hooks: the CPU versions live in tensor.cpp; the CUDA versions are compiled from
// backend/cuda/memory.cu when the build has CUDA, or backend/cuda/memory_stub.cpp otherwise.
namespace device_mem {
void* alloc(Device d, size_t bytes);
void free(Device d, void* p);
void copy(void* dst, Device dst_dev, const void* src, Device src_dev, size_t bytes);
// `height` runs of `width` bytes on one device: run i goes from src + i spitch to dst + i dpitch (a
// strided gather or scatter of rows; on CUDA one cudaMemcpy2DAsync on the compute stream).
void copy_2d(void* dst, size_t dpitch, const void* src, size_t spitch, size_t width, size_t height, Device d);
void memset0(void* p, Device d, size_t bytes);
bool cuda_available();  // true when built with CUDA and a GPU is visible
int cuda_device_count();  // 0 without CUDA
// Makes GPU `index` this process's device (ranks use their local rank); the error names the index
// and how many GPUs are visible.
void set_cuda_device(int index);
std::string cuda_pci_bus_id(int index);  // "0000:1b:00.0"; "" without CUDA
void synchronize(Device d);  // waits for all work queued on the device (no-op on the CPU)
void copy_async(void* dst, Device dst_dev, const void* src, Device src_dev, size_t bytes);  // see copy_from_async
void* host_pinned_alloc(size_t bytes);  // page-locked when CUDA is usable, else plain; freed by host_pinned_free
void host_pinned_free(void* p);
// Bytes held by CUDA tensors and arenas now, and the most since the last reset (0 without CUDA).
size_t cuda_bytes_in_use();
size_t cuda_peak_bytes();
void cuda_reset_peak();
// The most device memory the allocator's pool has held since the last reset: the tensors' bytes plus
// what it keeps cached for reuse (0 without CUDA).
size_t cuda_reserved_peak_bytes();
// Free device memory as the driver reports it (cudaMemGetInfo; 0 without CUDA).
size_t cuda_free_bytes();
}  // namespace device_mem

}  // namespace mt
