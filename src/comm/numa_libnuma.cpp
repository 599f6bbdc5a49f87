// NumaOps over libnuma's integer API (built when CMake finds libnuma; numa_nolibnuma.cpp otherwise).
#include "comm/numa.h"

#include <numa.h>

namespace mt::comm {

namespace {

class LibNuma : public NumaOps {
 public:
  bool have_library() const override { return true; }
  bool available() override { return numa_available() != -1; }
  int max_node() override { return numa_max_node(); }
  bool run_on_node(int node) override { return numa_run_on_node(node) == 0; }
  void set_preferred(int node) override { numa_set_preferred(node); }
};

}  // namespace

NumaOps& system_numa_ops() {
  static LibNuma ops;
  return ops;
}

}  // namespace mt::comm
