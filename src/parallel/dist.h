// One rank's view of a distributed run: who it is (from the launcher's environment), the rendezvous
// store, the world communicator and the communicators of the mesh axes it needs, and the watchdog.
// A single process (WORLD_SIZE unset or 1) gets world size 1 and no communicators at all.
#pragma once
#include <memory>
#include <string>
#include <vector>

#include "comm/communicator.h"
#include "comm/store.h"
#include "parallel/mesh.h"

namespace mt {

struct DistOptions {
  MeshSpec mesh;
  comm::CommOptions comm;
};

class DistContext {
 public:
  // Reads the environment (moetrain launch, torchrun, Slurm, OpenMPI), selects the GPU of the local
  // rank and binds to its NUMA node (CUDA), rendezvouses and builds the communicators.
  static std::unique_ptr<DistContext> create(Device device, const DistOptions& opt);
  ~DistContext();

  int rank() const { return rank_; }
  int world_size() const { return world_; }
  int local_rank() const { return local_rank_; }
  bool distributed() const { return world_ > 1; }
  const DeviceMesh& mesh() const { return mesh_; }
  comm::Store& store() { return *store_; }
  // Null in a single process. dp: dp_replicate × dp_shard (the ranks that see different data).
  comm::Communicator* world() { return world_comm_.get(); }
  comm::Communicator* dp_shard() { return shard_.get(); }
  comm::Communicator* dp_replicate() { return replicate_.get(); }
  comm::Communicator* dp() { return dp_.get(); }
  // Expert parallelism (ep > 1): the ranks that split the experts, and the ranks of this rank's
  // dp_replicate replica that hold the same experts (expert data parallelism within the replica, over
  // which expert units are sharded; all expert_dp ranks without HSDP). Under HSDP the same expert shard's
  // replicas are the dp_replicate group (mesh.h). Null when ep = 1.
  comm::Communicator* ep() { return ep_.get(); }
  comm::Communicator* expert_shard() { return expert_shard_.get(); }
  // Second communicators over the same ranks as dp_shard and expert_shard, for FSDP's gradient
  // reductions: on CUDA each communicator has its own stream, so the reduce-scatters of one block
  // run beside the next block's weight all-gathers instead of queueing behind them.
  comm::Communicator* dp_shard_reduce() { return shard_reduce_.get(); }
  comm::Communicator* expert_shard_reduce() { return expert_shard_reduce_.get(); }
  // Takes ownership of a communicator made from this context's (e.g. the tensor-parallel groups, built
  // by parallel/tensor_parallel.h from the model's shape): the watchdog watches it and check_schedules
  // covers it. Returns it.
  comm::Communicator* adopt(std::unique_ptr<comm::Communicator> c);
  // Sequence parallelism (sp > 1): the sp group (rank order is chunk order), the ranks that see
  // different tokens (dp × sp: dp_rank × sp + sp coordinate), and the group dense parameters are
  // sharded over (dp_shard × sp: every rank of it sees different tokens), with its reduction twin.
  // With sp = 1: sp() is null and the others are dp(), dp_shard() and dp_shard_reduce().
  comm::Communicator* sp() { return sp_.get(); }
  comm::Communicator* dp_sp() { return dp_sp_ ? dp_sp_.get() : dp_.get(); }
  comm::Communicator* dense_shard() { return shard_sp_ ? shard_sp_.get() : shard_.get(); }
  comm::Communicator* dense_shard_reduce() { return shard_sp_ ? shard_sp_reduce_.get() : shard_reduce_.get(); }
  int sp_rank() const { return mesh_.coord(Axis::Sp, rank_); }
  int dp_rank() const;
  int dp_size() const;
  // A clean end of a run: a barrier of every rank through the store, so that rank 0 (which serves
  // the store) leaves last. Not called on errors: a failing rank exits at once and the launcher
  // stops the others.
  void finish();
  // Compares every communicator's collective schedule across its ranks (collective).
  void check_schedules();
  // The stop signal (core/interrupt.h) every rank agrees on: the largest any rank received, 0 for none.
  // A loop that stops after a step calls it every step on every rank (one all-reduce of one int when
  // distributed), so that all ranks leave at the same step; `device` is where the communicators run.
  int agreed_stop_signal(Device device);
  std::string describe() const;

 private:
  DistContext(const MeshSpec& spec, int world);
  std::vector<comm::Communicator*> all_comms();  // every communicator this rank made (nulls included)
  int rank_ = 0, world_ = 1, local_rank_ = 0;
  DeviceMesh mesh_;
  std::unique_ptr<comm::Store> store_;
  std::unique_ptr<comm::Communicator> world_comm_, shard_, replicate_, dp_, ep_, expert_shard_, shard_reduce_,
      expert_shard_reduce_;
  std::vector<std::unique_ptr<comm::Communicator>> adopted_;
  std::unique_ptr<comm::Communicator> sp_, dp_sp_, shard_sp_, shard_sp_reduce_;
  std::unique_ptr<comm::Watchdog> watchdog_;
};

}  // namespace mt
