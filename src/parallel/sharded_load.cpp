#include "parallel/sharded_load.h"

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <memory>

namespace mt {

bool all_ranks_see(const std::string& dir, comm::Communicator& comm) {
  namespace fs = std::filesystem;
  std::error_code ec;
  const bool mine = fs::exists(fs::path(dir) / "config.json", ec) &&
                    (fs::exists(fs::path(dir) / "model.safetensors", ec) ||
                     fs::exists(fs::path(dir) / "model.safetensors.index.json", ec));
  Tensor flag = Tensor::empty({1}, DType::I32);
  flag.data<int32_t>()[0] = mine ? 1 : 0;
  Tensor d = flag.to(comm.device()), all = Tensor::empty({comm.size()}, DType::I32, comm.device());
  comm.all_gather(d, all)->wait();
  device_mem::synchronize(comm.device());
  Tensor h = all.to(Device::CPU);
  for (int r = 0; r < comm.size(); ++r)
    if (h.data<int32_t>()[r] == 0) return false;
  return true;
}

BroadcastLoadReport load_hf_weights_broadcast(const std::string& dir, const ModelConfig& c, const ParamTable& table,
                                              const std::vector<FlatRange>& pieces, Tensor& dst,
                                              comm::Communicator& comm, int root, size_t bucket_bytes) {
  auto t0 = std::chrono::steady_clock::now();
  MT_CHECK(dst.dtype() == DType::F32, "load destination must be f32, got ", dst.desc());
  const int64_t total = table.total();
  const int64_t bucket = std::max<int64_t>(1, int64_t(bucket_bytes / sizeof(float)));
  BroadcastLoadReport rep;
  Tensor host = Tensor::empty({std::min(bucket, total)});
  Tensor dev = comm.device() == Device::CPU ? host : Tensor::empty({std::min(bucket, total)}, DType::F32, comm.device());
  Tensor dst_host = dst.is_cpu() ? dst : Tensor::zeros({dst.numel()});
  std::unique_ptr<CheckpointReader> reader;  // the root opens (maps) the checkpoint once
  if (comm.rank() == root) reader = std::make_unique<CheckpointReader>(dir);
  for (int64_t b = 0; b < total; b += bucket) {
    const int64_t n = std::min(bucket, total - b);
    Tensor hb = host.rows(0, n), db = dev.rows(0, n);
    if (comm.rank() == root) {
      // The root reads (and validates) exactly this range of the flat layout.
      LoadReport r = load_hf_weights_ranges(*reader, c, table, {{b, b + n, 0}}, hb);
      rep.bytes_read += r.bytes_read;
      if (db.raw() != hb.raw()) db.copy_from(hb);
    }
    comm.broadcast(db, root)->wait();
    if (db.raw() != hb.raw()) {
      device_mem::synchronize(comm.device());
      hb.copy_from(db);
    }
    for (const FlatRange& p : pieces) {
      const int64_t lo = std::max(p.begin, b), hi = std::min(p.end, b + n);
      if (hi > lo) dst_host.rows(p.dst_offset + (lo - p.begin), hi - lo).copy_from(hb.rows(lo - b, hi - lo));
    }
    ++rep.buckets;
    rep.bytes_broadcast += size_t(n) * sizeof(float);
  }
  if (!dst.is_cpu()) dst.copy_from(dst_host);
  rep.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return rep;
}

}  // namespace mt
