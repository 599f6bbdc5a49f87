// NUMA binding: pin this rank's threads to the CPUs of its GPU's NUMA node and prefer that node's
// memory. The node comes from sysfs (<root>/bus/pci/devices/<pci bus id>/numa_node); the binding
// uses libnuma's integer API only (numa_available, numa_max_node, numa_run_on_node,
// numa_set_preferred), every node index is bounds-checked, and the absence of NUMA (no libnuma in
// the build, numa_node -1 or missing, NUMA unavailable) is logged and skipped, never an error.
// Exactly one log line per call says what was bound, e.g.
//   numa: rank 3 gpu 0000:1b:00.0 -> node 1 (cpus bound, memory preferred)
//   numa: rank 0: no NUMA node for gpu 0000:1b:00.0 (numa_node = -1), not binding
#pragma once
#include <string>

namespace mt::comm {

// The libnuma calls we make, behind an interface so that tests can stand in for the machine.
class NumaOps {
 public:
  virtual ~NumaOps() = default;
  virtual bool have_library() const = 0;   // false when the build has no libnuma
  virtual bool available() = 0;            // numa_available() != -1; must precede the others
  virtual int max_node() = 0;              // numa_max_node()
  virtual bool run_on_node(int node) = 0;  // numa_run_on_node(node) == 0
  virtual void set_preferred(int node) = 0;
};

NumaOps& system_numa_ops();  // libnuma (numa_libnuma.cpp) or none (numa_nolibnuma.cpp), per the build

struct NumaBinding {
  int node = -1;  // the GPU's node, -1 when none is known
  bool cpus_bound = false;
  bool memory_preferred = false;
  std::string line;  // the log line
};

// "0000:1B:00.0", "00000000:1b:00.0" (CUDA's forms) or "1b:00.0" -> "0000:1b:00.0" (sysfs' form).
// Throws mt::Error for anything else (it also keeps the sysfs path inside the devices directory).
std::string normalize_pci_bus_id(const std::string& id);

// Binds per the rules above and logs the line. An empty bus id (no GPU) logs and binds nothing.
// The caller passes device_mem::cuda_pci_bus_id(local GPU) (core/tensor.h; "" without CUDA).
NumaBinding bind_to_gpu_numa_node(int rank, const std::string& pci_bus_id, const std::string& sysfs_root = "/sys",
                                  NumaOps* ops = nullptr);

}  // namespace mt::comm
