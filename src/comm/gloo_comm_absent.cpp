// Compiled instead of gloo_comm.cpp when the build has no Gloo (the GPU machines): a CPU world of
// one rank still works (it needs no transport), a larger one is refused with what to install.
#include "comm/backends.h"

namespace mt::comm {
bool have_gloo() {
  return false;
}
}  // namespace mt::comm

namespace mt::comm::detail {

std::unique_ptr<Communicator> make_gloo_comm(int rank, int size, const std::string& name, Store& root,
                                             const std::string& prefix, CommOptions opt) {
  check_world(rank, size, "CPU communicator");
  if (size == 1) return make_self_comm(name, root, prefix, opt);
  MT_THROW("communicator '", name, "': a CPU world of ", size,
           " ranks needs Gloo, and this build has none; install libgloo-dev (scripts/install_deps.sh) and "
           "reconfigure, or run on CUDA (NCCL)");
}

}  // namespace mt::comm::detail
