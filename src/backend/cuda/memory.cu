// CUDA device memory for Tensor: allocation, copies and memset, every call checked with its name.
#include <cuda_runtime.h>

#include "core/tensor.h"

#define MT_CUDA_CHECK(call)                                                                        \
  do {                                                                                             \
    cudaError_t err_ = (call);                                                                     \
    MT_CHECK(err_ == cudaSuccess, #call, " failed: ", cudaGetErrorName(err_), " (", cudaGetErrorString(err_), ")"); \
  } while (0)

namespace mt::device_mem {

void* cuda_alloc(size_t bytes) {
  void* p = nullptr;
  MT_CUDA_CHECK(cudaMalloc(&p, bytes));
  return p;
}

void cuda_free(void* p) { cudaFree(p); }

void cuda_copy(void* dst, Device dst_dev, const void* src, Device src_dev, size_t bytes) {
  cudaMemcpyKind kind = dst_dev == Device::CUDA
                            ? (src_dev == Device::CUDA ? cudaMemcpyDeviceToDevice : cudaMemcpyHostToDevice)
                            : cudaMemcpyDeviceToHost;
  MT_CUDA_CHECK(cudaMemcpy(dst, src, bytes, kind));
}

void cuda_memset0(void* p, size_t bytes) { MT_CUDA_CHECK(cudaMemset(p, 0, bytes)); }

void cuda_synchronize() { MT_CUDA_CHECK(cudaDeviceSynchronize()); }

bool cuda_available() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
}

}  // namespace mt::device_mem
