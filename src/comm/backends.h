// The communicator backends behind make_world(), for communicator.cpp and the backends themselves.
// Each factory takes the store given to make_world and the new communicator's key prefix in it.
#pragma once
#include <memory>
#include <string>

#include "comm/communicator.h"

namespace mt::comm::detail {

// CPU, size 1: every collective is a local copy (needs no Gloo).
std::unique_ptr<Communicator> make_self_comm(const std::string& name, Store& root, const std::string& prefix,
                                             CommOptions opt);
// CPU, any size: Gloo over TCP (gloo_comm.cpp), or an error naming what is missing
// (gloo_comm_absent.cpp, compiled when the build has no Gloo).
std::unique_ptr<Communicator> make_gloo_comm(int rank, int size, const std::string& name, Store& root,
                                             const std::string& prefix, CommOptions opt);
// CUDA: NCCL (nccl_comm.cu), or an error in builds without CUDA (nccl_comm_stub.cpp).
std::unique_ptr<Communicator> make_nccl_comm(int rank, int size, const std::string& name, Store& root,
                                             const std::string& prefix, CommOptions opt, int cuda_device);

// Checks shared by the backends' factories.
void check_world(int rank, int size, const char* what);

// Bytes of one element block and pointer arithmetic on raw tensor memory.
inline char* byte_ptr(const Tensor& t) {
  return static_cast<char*>(t.raw());
}

}  // namespace mt::comm::detail
