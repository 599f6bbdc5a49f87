// The PCI bus id of a CUDA device, for NUMA binding (numa.h). Failure is not an error: an empty id
// makes the binding log that it has no GPU to bind to.
#include <cuda_runtime.h>

#include "comm/numa.h"

namespace mt::comm {

std::string gpu_pci_bus_id(int device) {
  char buf[64] = {0};
  if (cudaDeviceGetPCIBusId(buf, sizeof(buf), device) != cudaSuccess) {
    cudaGetLastError();  // clear the (non-sticky) error so that later CUDA calls do not report it
    return "";
  }
  return buf;
}

}  // namespace mt::comm
