// CUDA device memory for Tensor: allocation, copies and memset, every call checked with its name.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cctype>
#include <string>
#include <mutex>
#include <unordered_map>

#include "core/tensor.h"

namespace mt::cuda {
cudaStream_t stream();          // backend/cuda/common.cuh
cudaStream_t compute_stream();  // the compute stream, also inside a streams::SideScope (common.cu)
}

#define MT_CUDA_CHECK(call)                                                                        \
  do {                                                                                             \
    cudaError_t err_ = (call);                                                                     \
    MT_CHECK(err_ == cudaSuccess, #call, " failed: ", cudaGetErrorName(err_), " (", cudaGetErrorString(err_), ")"); \
  } while (0)

namespace mt::device_mem {

static size_t g_current = 0, g_peak = 0;
static std::unordered_map<void*, size_t> g_sizes;
static std::mutex g_mu;

// Tensors take their memory from CUDA's stream-ordered pool on the compute stream (cudaMallocAsync /
// cudaFreeAsync), which keeps freed memory for reuse (release threshold: never). A plain cudaFree
// waits for the whole device, every NCCL stream included, so a temporary freed in the middle of a
// layer used to stall the GPU behind the in-flight all-gathers and all-to-alls. Ordering: every
// kernel runs on the compute stream, the memcpy/memset calls on the legacy stream (which the
// blocking compute stream is ordered with), and a communicator's stream waits for the compute
// stream before each op and keeps the op's tensors alive until the op has completed; so memory
// freed here is reused only after its last use.
static cudaMemPool_t pool() {
  static cudaMemPool_t p = [] {
    int dev = 0;
    MT_CUDA_CHECK(cudaGetDevice(&dev));
    cudaMemPool_t mp = nullptr;
    MT_CUDA_CHECK(cudaDeviceGetDefaultMemPool(&mp, dev));
    uint64_t keep_all = UINT64_MAX;
    MT_CUDA_CHECK(cudaMemPoolSetAttribute(mp, cudaMemPoolAttrReleaseThreshold, &keep_all));
    return mp;
  }();
  return p;
}

void* cuda_alloc(size_t bytes) {
  void* p = nullptr;
  cudaMemPool_t mp = pool();
  cudaError_t err = cudaMallocFromPoolAsync(&p, bytes, mp, mt::cuda::compute_stream());
  if (err == cudaErrorMemoryAllocation) {  // the pool's free blocks may be too fragmented: give them back, retry
    cudaGetLastError();
    MT_CUDA_CHECK(cudaStreamSynchronize(mt::cuda::compute_stream()));
    MT_CUDA_CHECK(cudaMemPoolTrimTo(mp, 0));
    err = cudaMallocFromPoolAsync(&p, bytes, mp, mt::cuda::compute_stream());
  }
  if (err != cudaSuccess) {
    cudaGetLastError();
    size_t free_b = 0, total_b = 0;
    cudaMemGetInfo(&free_b, &total_b);
    MT_THROW("CUDA out of memory allocating ", bytes / 1048576.0, " MiB (", cudaGetErrorString(err), "); tensors hold ",
             g_current / 1048576.0, " MiB, the GPU has ", free_b / 1048576.0, " of ", total_b / 1048576.0,
             " MiB free");
  }
  std::lock_guard<std::mutex> lock(g_mu);
  g_sizes[p] = bytes;
  g_current += bytes;
  g_peak = std::max(g_peak, g_current);
  return p;
}

void cuda_free(void* p) {
  {
    std::lock_guard<std::mutex> lock(g_mu);
    auto it = g_sizes.find(p);
    if (it != g_sizes.end()) {
      g_current -= it->second;
      g_sizes.erase(it);
    }
  }
  cudaFreeAsync(p, mt::cuda::compute_stream());
}

size_t cuda_bytes_in_use() { return g_current; }
size_t cuda_peak_bytes() { return g_peak; }

size_t cuda_free_bytes() {
  size_t free_b = 0, total_b = 0;
  MT_CUDA_CHECK(cudaMemGetInfo(&free_b, &total_b));
  return free_b;
}
void cuda_reset_peak() {
  g_peak = g_current;
  uint64_t zero = 0;
  MT_CUDA_CHECK(cudaMemPoolSetAttribute(pool(), cudaMemPoolAttrReservedMemHigh, &zero));
}
size_t cuda_reserved_peak_bytes() {
  uint64_t high = 0;
  MT_CUDA_CHECK(cudaMemPoolGetAttribute(pool(), cudaMemPoolAttrReservedMemHigh, &high));
  return size_t(high);
}

void cuda_copy(void* dst, Device dst_dev, const void* src, Device src_dev, size_t bytes) {
  cudaMemcpyKind kind = dst_dev == Device::CUDA
                            ? (src_dev == Device::CUDA ? cudaMemcpyDeviceToDevice : cudaMemcpyHostToDevice)
                            : cudaMemcpyDeviceToHost;
  MT_CUDA_CHECK(cudaMemcpy(dst, src, bytes, kind));
}

// On the compute stream, not waited for (Tensor::copy_from_async).
void cuda_copy_async(void* dst, Device dst_dev, const void* src, Device src_dev, size_t bytes) {
  cudaMemcpyKind kind = dst_dev == Device::CUDA
                            ? (src_dev == Device::CUDA ? cudaMemcpyDeviceToDevice : cudaMemcpyHostToDevice)
                            : cudaMemcpyDeviceToHost;
  MT_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, kind, mt::cuda::stream()));
}

void* cuda_host_alloc(size_t bytes) {
  void* p = nullptr;
  if (cudaMallocHost(&p, bytes) != cudaSuccess) {
    cudaGetLastError();
    return nullptr;  // the caller falls back to plain memory
  }
  return p;
}

void cuda_host_free(void* p) { MT_CUDA_CHECK(cudaFreeHost(p)); }

// On the compute stream (a blocking stream, so ordered with the kernels and the legacy-stream copies).
void cuda_copy_2d(void* dst, size_t dpitch, const void* src, size_t spitch, size_t width, size_t height) {
  MT_CUDA_CHECK(cudaMemcpy2DAsync(dst, dpitch, src, spitch, width, height, cudaMemcpyDeviceToDevice, mt::cuda::stream()));
}

void cuda_memset0(void* p, size_t bytes) { MT_CUDA_CHECK(cudaMemset(p, 0, bytes)); }

void cuda_synchronize() { MT_CUDA_CHECK(cudaDeviceSynchronize()); }

bool cuda_available() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
}

int cuda_device_count() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess ? n : 0;
}

void set_cuda_device(int index) {
  const int n = cuda_device_count();
  if (index < 0 || index >= n) MT_THROW("GPU ", index, " requested (local rank), but ", n, " GPU(s) are visible");
  MT_CUDA_CHECK(cudaSetDevice(index));
}

std::string cuda_pci_bus_id(int index) {
  char id[32] = {0};
  MT_CUDA_CHECK(cudaDeviceGetPCIBusId(id, sizeof id, index));
  std::string s(id);
  std::transform(s.begin(), s.end(), s.begin(), [](unsigned char ch) { return char(std::tolower(ch)); });
  return s;
}

}  // namespace mt::device_mem
