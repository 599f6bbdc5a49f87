// Built when the toolchain has no CUDA: every CUDA request fails with a clear message.
#include "core/tensor.h"

namespace mt::device_mem {

[[noreturn]] static void no_cuda() { MT_THROW("this moetrain was built without CUDA; use --device cpu"); }
void* cuda_alloc(size_t) { no_cuda(); }
void cuda_free(void*) {}
void cuda_copy(void*, Device, const void*, Device, size_t) { no_cuda(); }
void cuda_memset0(void*, size_t) { no_cuda(); }
void cuda_copy_2d(void*, size_t, const void*, size_t, size_t, size_t) { no_cuda(); }
void cuda_synchronize() {}
void cuda_copy_async(void*, Device, const void*, Device, size_t) { no_cuda(); }
void* cuda_host_alloc(size_t) { return nullptr; }
void cuda_host_free(void*) {}
size_t cuda_bytes_in_use() { return 0; }
size_t cuda_peak_bytes() { return 0; }
size_t cuda_free_bytes() { return 0; }
void cuda_reset_peak() {}
size_t cuda_reserved_peak_bytes() { return 0; }
bool cuda_available() { return false; }
int cuda_device_count() { return 0; }
void set_cuda_device(int index) { MT_THROW("GPU ", index, " requested, but this moetrain was built without CUDA"); }
std::string cuda_pci_bus_id(int) { return ""; }

}  // namespace mt::device_mem
