// NumaOps for builds without libnuma: reports that it cannot bind (binding then logs
// "libnuma not found, not binding"; absence of NUMA is never an error).
#include "comm/numa.h"

namespace mt::comm {

namespace {

class NoNuma : public NumaOps {
 public:
  bool have_library() const override { return false; }
  bool available() override { return false; }
  int max_node() override { return -1; }
  bool run_on_node(int) override { return false; }
  void set_preferred(int) override {}
};

}  // namespace

NumaOps& system_numa_ops() {
  static NoNuma ops;
  return ops;
}

}  // namespace mt::comm
