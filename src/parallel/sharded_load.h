// Loading a Hugging Face checkpoint into this rank's shards when not every rank can read the files:
// rank `root` reads the flat layout in large buckets (one contiguous range of parameters at a time,
// `bucket_bytes` of f32) and broadcasts each; every rank keeps the parts of each bucket that fall in
// its own pieces. The number of broadcasts is total bytes / bucket size (a few dozen for a 30 B
// model at 1 GiB), never one per tensor. When every rank sees the files, load_hf_weights_ranges
// (each rank maps the files and reads only its slices) is the faster path.
#pragma once
#include <string>
#include <vector>

#include "comm/communicator.h"
#include "model/hf_checkpoint.h"

namespace mt {

struct BroadcastLoadReport {
  size_t buckets = 0;
  size_t bytes_broadcast = 0;  // f32 bytes of every bucket
  size_t bytes_read = 0;       // on the root: bytes read from the files
  double seconds = 0;
};

// Collective over `comm` (every rank calls it with its own pieces and destination).
BroadcastLoadReport load_hf_weights_broadcast(const std::string& dir, const ModelConfig& c, const ParamTable& table,
                                              const std::vector<FlatRange>& pieces, Tensor& dst,
                                              comm::Communicator& comm, int root = 0,
                                              size_t bucket_bytes = size_t(1) << 30);

// True on every rank when every rank can open `dir` (one all-gather of a flag over `comm`).
bool all_ranks_see(const std::string& dir, comm::Communicator& comm);

}  // namespace mt
