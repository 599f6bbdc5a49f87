#include "parallel/dist.h"

#include "comm/dist_env.h"
#include "comm/numa.h"
#include "core/interrupt.h"
#include "core/log.h"
#include "core/tensor.h"

namespace mt {

DistContext::DistContext(const MeshSpec& spec, int world) : world_(world), mesh_(spec, world) {}

DistContext::~DistContext() {
  // The watchdog goes first so that tearing the communicators down is not reported as a hang.
  watchdog_.reset();
  adopted_.clear();
  shard_sp_reduce_.reset();
  shard_sp_.reset();
  dp_sp_.reset();
  sp_.reset();
  expert_shard_reduce_.reset();
  shard_reduce_.reset();
  expert_shard_.reset();
  ep_.reset();
  dp_.reset();
  replicate_.reset();
  shard_.reset();
  world_comm_.reset();
  store_.reset();
}

std::unique_ptr<DistContext> DistContext::create(Device device, const DistOptions& opt) {
  comm::DistEnv env = comm::detect_dist_env();
  std::unique_ptr<DistContext> d(new DistContext(opt.mesh, env.world_size));
  d->rank_ = env.rank;
  d->local_rank_ = env.local_rank;
  if (env.world_size == 1) return d;
  set_log_rank(env.rank);
  if (device == Device::CUDA) {
    device_mem::set_cuda_device(env.local_rank);
    comm::bind_to_gpu_numa_node(env.rank, device_mem::cuda_pci_bus_id(env.local_rank));
  }
  d->store_ = comm::make_tcp_store(env.master_addr, env.master_port, env.rank == 0, opt.comm.timeout);
  d->world_comm_ = comm::make_world(device, env.rank, env.world_size, *d->store_, opt.comm, env.local_rank);
  const DeviceMesh& m = d->mesh_;
  const int r = env.rank;
  d->shard_ = d->world_comm_->split(m.group_color(Axis::DpShard, r), m.coord(Axis::DpShard, r), "dp_shard");
  d->replicate_ =
      d->world_comm_->split(m.group_color(Axis::DpReplicate, r), m.coord(Axis::DpReplicate, r), "dp_replicate");
  d->dp_ = d->world_comm_->split(m.dp_color(r), d->dp_rank(), "dp");
  if (m.size(Axis::Ep) > 1) {
    d->ep_ = d->world_comm_->split(m.group_color(Axis::Ep, r), m.coord(Axis::Ep, r), "ep");
    d->expert_shard_ =
        d->world_comm_->split(m.group_color(Axis::ExpertShard, r), m.coord(Axis::ExpertShard, r), "expert_shard");
    d->expert_shard_reduce_ = d->expert_shard_->split(0, d->expert_shard_->rank(), "expert_shard.reduce");
  }
  d->shard_reduce_ = d->shard_->split(0, d->shard_->rank(), "dp_shard.reduce");
  if (m.size(Axis::Sp) > 1) {
    using A = Axis;
    d->sp_ = d->world_comm_->split(m.group_color(A::Sp, r), m.coord(A::Sp, r), "sp");
    d->dp_sp_ = d->world_comm_->split(m.group_color({A::DpReplicate, A::DpShard, A::Sp}, r),
                                      m.group_coord({A::DpReplicate, A::DpShard, A::Sp}, r), "dp_sp");
    d->shard_sp_ = d->world_comm_->split(m.group_color({A::DpShard, A::Sp}, r), m.group_coord({A::DpShard, A::Sp}, r),
                                         "dp_shard_sp");
    d->shard_sp_reduce_ = d->shard_sp_->split(0, d->shard_sp_->rank(), "dp_shard_sp.reduce");
  }
  d->watchdog_ = std::make_unique<comm::Watchdog>(*d->store_, r, opt.comm.timeout);
  for (comm::Communicator* c : d->all_comms())
    if (c) d->watchdog_->watch(c);
  if (r == 0) log_info("dist: ", d->describe(), " (ranks from ", env.source, ")");
  return d;
}

comm::Communicator* DistContext::adopt(std::unique_ptr<comm::Communicator> c) {
  MT_CHECK(c != nullptr, "adopt(nullptr)");
  if (watchdog_) watchdog_->watch(c.get());
  adopted_.push_back(std::move(c));
  return adopted_.back().get();
}

int DistContext::dp_rank() const {
  return mesh_.coord(Axis::DpReplicate, rank_) * mesh_.size(Axis::DpShard) + mesh_.coord(Axis::DpShard, rank_);
}

int DistContext::dp_size() const {
  return mesh_.size(Axis::DpReplicate) * mesh_.size(Axis::DpShard);
}

void DistContext::finish() {
  if (!distributed()) return;
  check_schedules();
  store_->barrier("moetrain/finish", rank_, world_, std::chrono::minutes(5));
}

void DistContext::check_schedules() {
  for (comm::Communicator* c : all_comms())
    if (c) c->check_schedule();
}

std::vector<comm::Communicator*> DistContext::all_comms() {
  std::vector<comm::Communicator*> v{
      world_comm_.get(), shard_.get(),        replicate_.get(),    dp_.get(),
      ep_.get(),         expert_shard_.get(), shard_reduce_.get(), expert_shard_reduce_.get(),
      sp_.get(),         dp_sp_.get(),        shard_sp_.get(),     shard_sp_reduce_.get()};
  for (auto& c : adopted_) v.push_back(c.get());
  return v;
}

std::string DistContext::describe() const {
  return mesh_.describe();
}

int DistContext::agreed_stop_signal(Device device) {
  const int mine = stop_signal();
  if (!distributed()) return mine;
  Tensor f = Tensor::empty({1}, DType::I32);
  f.data<int32_t>()[0] = mine;
  Tensor d = f.to(device);
  world()->all_reduce(d, comm::ReduceOp::Max)->wait();
  device_mem::synchronize(device);
  return d.to(Device::CPU).data<int32_t>()[0];
}

}  // namespace mt
