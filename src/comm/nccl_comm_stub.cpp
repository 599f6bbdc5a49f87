// Compiled instead of nccl_comm.cu in builds without CUDA: a CUDA world is refused with the reason.
#include "comm/backends.h"

namespace mt::comm::detail {

std::unique_ptr<Communicator> make_nccl_comm(int rank, int size, const std::string& name, Store&, const std::string&,
                                             CommOptions, int cuda_device) {
  check_world(rank, size, "CUDA communicator");
  MT_THROW("communicator '", name, "' (rank ", rank, " of ", size, ", GPU ", cuda_device,
           "): this build has no CUDA, so no NCCL; rebuild with the CUDA toolkit present (MT_WITH_CUDA=ON) or use "
           "--device cpu");
}

}  // namespace mt::comm::detail
