// Builds without CUDA have no GPU: the NUMA binding logs that and binds nothing.
#include "comm/numa.h"

namespace mt::comm {

std::string gpu_pci_bus_id(int) {
  return "";
}

}  // namespace mt::comm
